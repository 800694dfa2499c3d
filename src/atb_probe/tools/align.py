"""Aligning two dumps: processes, rounds, ops and tensors of GOLDEN with those of TARGET.

Ops are aligned level by level down the op tree. At each level the children of two matched ops
are paired by ID when their (ID, name) pairs agree — all of them, or all of one side's, which is
the case when one run was dumped with a narrower filter. Otherwise the two runs executed
different ops there (a cast only the bf16 run needs, a fused kernel) and the children are paired
by name, in execution order, with the longest common subsequence (difflib); what is left on
either side is reported as unmatched, with everything below it. Tensors of two matched ops are
paired by (input/output, index); failing that by (input/output, the index's leading number).

Two different implementations of one model (an ATB graph and its PyTorch golden run) share no
names: `WordEmbedding, Prefill_layer…, FinalNorm, LmHead` against `Embedding,
LlamaRotaryEmbedding, LlamaDecoderLayer…, LlamaRMSNorm, Linear`. So the layer-level ops (and only
they) are aligned by execution order and by the shapes of their outputs: the alignment keeps
the order of both sides and makes as many pairs as it can, a pair of equal names (or of names an
op map, `opmap.py`, declares equal) weighing more than a pair of equal output shapes; an op
present on one side only (the rotary embedding, computed inside ATB's layers) stays unmatched.
Shapes are compared without their size-1 dimensions (`1x4x32` is `4x32`). Below two layer-level
ops of different names, children are paired only by name or by the map. The tensors of two ops
of different names are paired by shape: outputs index to index (or as the map says), inputs in
call order, each with the first unused input of the other side of the same shape.

When the op map's conventions apply (its sides are known: `conventions.choose`), the map says
what differs and this module asks it: ops with no counterpart are left out of the pairing (and
listed as such); below two ops of different implementations, child modules pair by the last
part of their module paths (a fused module with the modules it computes, by the map's `fused`),
kernels are left out when the map says so, the rest pair by name; fused and `opaque` ops are not
looked inside; and the tensors of an op with a `tensors` entry are the pairs it lists, derived
tensors included (`opmap.resolve`).

Match methods (comparison.MatchMethod), as the `Match` column shows them: `id`, `name`, `map`
(the map made the pair, here or above), `order` (execution order and shapes made the pair, here
or above).

Rounds are paired by round number, or by the tokens they hold (tokenpairs.py) when every round
of both runs says which (tokens.json) and the two runs laid their tokens out differently
(batching, chunked prefill, padding, request order): then each pair of rounds is one request's
positions in both, a `RoundPair` with its `SlicePair`, and a round may be in several pairs. The
op alignment of two rounds is the same whichever way they were paired, and is made once per
pair of rounds.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .. import layout
from ..dtypes import DTYPES
from ..layout import Side
from ..statcsv import parse_shape
from ..tokens import TokenLayout
from . import StrEnum
from .comparison import MatchMethod, Role, Unmatched, UnmatchedKind
from .dumpreader import Dump, DumpLevel, Op, Process, Round, TensorRecord
from .opmap import OpMap, Tensor, resolve
from .tokenpairs import SlicePair, pair_by_tokens
from .tokens import LayoutError


@dataclass(slots=True)
class OpNode:
    """An op of a round's tree; `op` is None for an ancestor that has no tensors itself."""

    own_id: str
    name: str
    op_id: str                   # `2_1`
    path: str                    # `2_LlamaDecoderLayer/1_LlamaAttention`
    op: Op | None = None
    children: list[OpNode] = field(default_factory=list)
    module: str | None = None    # its module path, when the structure files give one

    @property
    def attr(self) -> str | None:
        """The last part of its module path (`q_proj`), None for a kernel."""
        return self.module.rsplit(".", 1)[-1] if self.module else None

    def count(self) -> int:
        """Ops in this subtree that have tensors."""
        return (self.op is not None) + sum(c.count() for c in self.children)


@dataclass(frozen=True, slots=True)
class NodePair:
    """Two sibling ops of the two sides paired, and how."""

    golden: OpNode
    target: OpNode
    method: MatchMethod
    group: tuple[OpNode, ...] = ()   # a fused pair: the ops of the map's right side it stands for


@dataclass(slots=True)
class TensorPair:
    golden: Tensor               # a recorded tensor, or one an op map derives (opmap.py)
    target: Tensor
    method: MatchMethod          # how the ops on the way were paired


@dataclass(slots=True)
class OpPair:
    golden: Op
    target: Op
    method: MatchMethod
    tensors: list[TensorPair]


T = TypeVar("T")


@dataclass(slots=True)
class Paired(Generic[T]):
    """Two sides' things paired: the pairs, and what only one side has."""

    pairs: list[T] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)

    def add(self, other: Paired[T]) -> None:
        """Take in the pairs and the unmatched entries of `other`, after these."""
        self.pairs += other.pairs
        self.unmatched += other.unmatched


@dataclass(slots=True)
class RoundPair:
    golden: Round
    target: Round
    ops: list[OpPair]
    tokens: SlicePair[Round] | None = None   # paired by tokens: the request's tokens compared


class RoundMethod(StrEnum):
    """How the rounds of two processes were paired."""

    NUMBER = "by round number"
    TOKENS = "by tokens"


@dataclass(slots=True)
class RoundPairing:
    """How the rounds were paired, for the summary: `by tokens: 2 requests, 9 round slices`."""

    method: RoundMethod = RoundMethod.NUMBER
    requests: int = 0            # by tokens: requests both runs ran
    slices: int = 0              # by tokens: round slice pairs
    why: str = ""                # by number: why not by tokens, when one side could have been

    def text(self) -> str:
        if self.method == RoundMethod.TOKENS:
            return (f"{self.method}: {self.requests} request{'s' * (self.requests != 1)}, "
                    f"{self.slices} round slice{'s' * (self.slices != 1)}")
        return f"{self.method} ({self.why})" if self.why else str(self.method)

    def add(self, other: RoundPairing) -> None:
        """Take in another process pair's pairing (the method by tokens, if any was)."""
        if other.method == RoundMethod.TOKENS:
            self.method = RoundMethod.TOKENS
            self.why = ""
        elif self.method == RoundMethod.NUMBER:
            self.why = self.why or other.why
        self.requests += other.requests
        self.slices += other.slices


@dataclass(slots=True)
class RoundMatch:
    """Two rounds paired, and the request's tokens they were paired for (by tokens)."""

    golden: Round
    target: Round
    tokens: SlicePair[Round] | None = None


@dataclass(slots=True)
class Alignment:
    rounds: list[RoundPair]
    unmatched: list[Unmatched]
    pairing: RoundPairing = field(default_factory=RoundPairing)

    @property
    def name_matched(self) -> int:
        seen, count = set(), 0
        for r in self.rounds:
            if (id(r.golden), id(r.target)) not in seen:   # a pair of rounds counts once
                seen.add((id(r.golden), id(r.target)))
                count += sum(1 for o in r.ops if o.method != MatchMethod.ID)
        return count


def align_dumps(golden: Dump, target: Dump, opmap: OpMap | None = None,
                left: Role | None = None) -> Alignment:
    """Pair everything pairable in two dumps opened at the same level; `left`: which of them
    is the op map's left side, when its conventions apply (conventions.choose)."""
    rounds, pairing = pair_rounds(golden, target)
    unmatched = list(rounds.unmatched)
    pairs: list[RoundPair] = []
    aligned: dict[tuple[int, int], list[OpPair]] = {}
    for match in rounds.pairs:
        g, t = match.golden, match.target
        ops = aligned.get((id(g), id(t)))
        if ops is None:
            found = align_rounds(g, t, opmap, left)
            ops = aligned[(id(g), id(t))] = found.pairs
            unmatched += found.unmatched
        pairs.append(RoundPair(g, t, ops, match.tokens))
    return Alignment(pairs, _distinct(unmatched), pairing)


def _distinct(entries: list[Unmatched]) -> list[Unmatched]:
    """Each entry once: a round paired with slices of several rounds of the other side has its
    leftovers found once per pair."""
    seen = set()
    out = []
    for u in entries:
        key = (u.side, u.kind, u.where, u.what)
        if key not in seen:
            seen.add(key)
            out.append(u)
    return out


def pair_rounds(golden: Dump, target: Dump) -> tuple[Paired[RoundMatch], RoundPairing]:
    """The rounds of two dumps that correspond, process (device) by process: by round number
    when the rounds of the same number hold the same tokens alike (or a side does not say
    which), else by the tokens they hold; and how they were paired."""
    processes = _pair_processes(golden.processes, target.processes)
    out: Paired[RoundMatch] = Paired(unmatched=processes.unmatched)
    pairing = RoundPairing()
    for gp, tp in processes.pairs:
        g_list, t_list = gp.rounds, tp.rounds
        by_hand = golden.kind == DumpLevel.ROUND and target.kind == DumpLevel.ROUND
        if by_hand:
            g_list, t_list = g_list[:1], t_list[:1]
        numbered = _by_number(g_list, t_list, by_hand)
        layouts, why = _layouts(g_list, t_list)
        if layouts is not None and not (numbered.pairs and all(
                _same_tokens(m.golden.tokens, m.target.tokens) for m in numbered.pairs)):
            tokens = pair_by_tokens(*layouts)
            out.pairs += [RoundMatch(p.golden.round, p.target.round, p) for p in tokens.pairs]
            out.unmatched += tokens.unmatched
            pairing.add(RoundPairing(RoundMethod.TOKENS, tokens.requests, len(tokens.pairs)))
            continue
        pairing.add(RoundPairing(why=why))
        out.add(numbered)
    return out, pairing


def _same_tokens(golden: TokenLayout, target: TokenLayout) -> bool:
    """Whether two rounds of the same number hold the same tokens alike: the same requests
    (by prompt) at the same positions and places along the same token dimension (the fast
    path: such rounds are paired by number, their tensors compared whole)."""
    def places(layout: TokenLayout) -> tuple:
        return (layout.arrangement, layout.tokens, layout.rows,
                tuple((r.row, r.start, r.stop, r.position, r.prompt.digest)
                      for r in layout.requests))
    return places(golden) == places(target)


def _layouts(golden: list[Round], target: list[Round]
             ) -> tuple[tuple[list, list] | None, str]:
    """Each side's rounds with their token layouts; None when a round has none (and why, when
    the other side has them: the rounds are then paired by number)."""
    sides: list[list[tuple[Round, TokenLayout]]] = []
    missing: list[str] = []
    for role, rounds in ((Role.GOLDEN, golden), (Role.TARGET, target)):
        found = []
        for rnd in rounds:
            try:
                found.append((rnd, rnd.tokens))
            except LayoutError as exc:
                return None, f"{role} round {rnd.where}: {exc}"
        lacking = [rnd for rnd, tokens in found if tokens is None]
        if lacking:
            missing.append(f"{role} round {lacking[0].where} has no token layout")
        sides.append(found)
    if missing:
        # No layout on either side (dumps made before token layouts, a model that is no token
        # model) is nothing to remark on; layouts on one side only, or on some rounds, are.
        has_some = any(t is not None for side in sides for _, t in side)
        return None, "; ".join(missing) if has_some else ""
    return (sides[0], sides[1]), ""


def _by_number(golden: list[Round], target: list[Round], by_hand: bool) -> Paired[RoundMatch]:
    """Rounds of the same number paired; `by_hand`: two round folders given as they are,
    compared whatever their numbers."""
    out: Paired[RoundMatch] = Paired()
    g_rounds = {r.index: r for r in golden}
    t_rounds = {r.index: r for r in target}
    if by_hand:
        g_rounds, t_rounds = {0: golden[0]}, {0: target[0]}
    for index in sorted(set(g_rounds) | set(t_rounds)):
        g, t = g_rounds.get(index), t_rounds.get(index)
        if g is None or t is None:
            side, r = (Role.GOLDEN, g) if t is None else (Role.TARGET, t)
            out.unmatched.append(Unmatched(side, UnmatchedKind.ROUND, r.where,
                                           f"round {r.index}", len(r.ops)))
            continue
        out.pairs.append(RoundMatch(g, t))
    return out


def _pair_processes(golden: list[Process], target: list[Process]
                    ) -> Paired[tuple[Process, Process]]:
    """Pair by device ID (PIDs differ from run to run); a single pair is paired as is."""
    if len(golden) == 1 and len(target) == 1:
        return Paired([(golden[0], target[0])])
    out: Paired[tuple[Process, Process]] = Paired()
    by_device: dict[int, tuple[list[Process], list[Process]]] = {}
    for side, procs in ((0, golden), (1, target)):
        for p in procs:
            by_device.setdefault(p.device, ([], []))[side].append(p)
    for device in sorted(by_device):
        g_list, t_list = by_device[device]
        out.pairs.extend(zip(g_list, t_list))
        for side, rest in ((Role.GOLDEN, g_list[len(t_list):]),
                           (Role.TARGET, t_list[len(g_list):])):
            for p in rest:
                out.unmatched.append(Unmatched(side, UnmatchedKind.PROCESS, p.name,
                                               f"process {p.name}",
                                               sum(len(r.ops) for r in p.rounds)))
    return out


def build_tree(rnd: Round) -> OpNode:
    """The round's op tree, children in ID order (which is execution order)."""
    root = OpNode("", "", "", "")
    modules = rnd.modules.paths
    index: dict[tuple[str, ...], OpNode] = {(): root}
    for op in rnd.ops:
        ids, names = op.op_id.split("_"), op.op_name.split("/")
        node = root
        for depth in range(1, len(ids) + 1):
            key = tuple(ids[:depth])
            child = index.get(key)
            if child is None:
                own, name = ids[depth - 1], names[depth - 1]
                path = layout.child_op_dir(node.path, own, name) if node.path \
                    else layout.op_folder(own, name)
                child = OpNode(own, name, "_".join(key), path,
                               module=modules.get("_".join(key)))
                index[key] = child
                node.children.append(child)
            node = child
        node.op = op
    _sort(root)
    return root


def _sort(node: OpNode) -> None:
    node.children.sort(key=lambda c: (int(c.own_id) if c.own_id.isdigit() else 1 << 62,
                                      c.own_id))
    for c in node.children:
        _sort(c)


@dataclass(frozen=True, slots=True)
class Where:
    """The `<dev>_<pid>/<round>` of each side of a round pair."""

    golden: str
    target: str

    def of(self, side: Role) -> str:
        return self.golden if side == Role.GOLDEN else self.target


def align_rounds(golden: Round, target: Round, opmap: OpMap | None = None,
                 left: Role | None = None) -> Paired[OpPair]:
    """Pairs of ops of two rounds, in the target's execution order, and what only one side
    has (each side's entries name that side's process and round)."""
    aligner = _TreeAligner(Where(golden.where, target.where), opmap or OpMap(), left)
    out = aligner.subtrees(build_tree(golden), build_tree(target), MatchMethod.ID)
    out.pairs.sort(key=lambda p: p.target.tensors[0].order)
    return out


@dataclass(frozen=True, slots=True)
class _TreeAligner:
    """Aligns the op trees of one pair of rounds."""

    where: Where
    opmap: OpMap
    left: Role | None = None     # the side the op map's left names are on, when known

    def subtrees(self, g: OpNode, t: OpNode, method: MatchMethod,
                 group: tuple[OpNode, ...] = ()) -> Paired[OpPair]:
        """The op pairs of two matched nodes and of everything below them; `method`: how
        the two were paired; `group`: the right side's ops a fused pair stands for."""
        out: Paired[OpPair] = Paired()
        if g.op is not None and t.op is not None:
            tensors = self.tensors(g, t, method, group)
            out.pairs.append(OpPair(g.op, t.op, method, tensors.pairs))
            out.unmatched += tensors.unmatched
        elif g.op is not None or t.op is not None:
            side, node = (Role.GOLDEN, g) if g.op is not None else (Role.TARGET, t)
            out.unmatched.append(Unmatched(side, UnmatchedKind.OP, self.where.of(side),
                                           node.path + " (tensors)", len(node.op.tensors)))
        if group or (self.left is not None and {g.name, t.name} & self.opmap.opaque):
            # Below a fused op and the ops it fuses, or an op the map compares as a whole:
            # each side's own implementation.
            for side, nodes in ((Role.GOLDEN, [g]), (Role.TARGET, [t])):
                if side != self.left:
                    nodes = [n for n in group if n is not g and n is not t] + nodes
                out.unmatched += [self._expected(side, c) for n in nodes for c in n.children
                                  if c.count()]
            return out
        g_kids, t_kids = g.children, t.children
        if self.left is not None:
            (g_kids, t_kids), expected = self._without_counterpart(g, t, method)
            out.unmatched += expected
        if g.path == "":
            children = _pair_layers(g_kids, t_kids, self.opmap)
        elif self.left is not None and not method.same_code:
            children = self._by_module(g_kids, t_kids)
        else:
            children = _pair_children(g_kids, t_kids, self.opmap)
        for pair in children:
            out.add(self.subtrees(pair.golden, pair.target, method.looser(pair.method),
                                  pair.group))
        paired = {id(n) for p in children for n in (p.golden, p.target, *p.group)}
        for side, kids in ((Role.GOLDEN, g_kids), (Role.TARGET, t_kids)):
            for node in kids:
                if id(node) not in paired and node.count():
                    out.unmatched.append(Unmatched(side, UnmatchedKind.OP, self.where.of(side),
                                                   node.path, node.count()))
        return out

    def _expected(self, side: Role, node: OpNode) -> Unmatched:
        """An op subtree with no counterpart by the op map's conventions."""
        return Unmatched(side, UnmatchedKind.OP, self.where.of(side), node.path, node.count(),
                         expected=True)

    def _without_counterpart(self, g: OpNode, t: OpNode, method: MatchMethod):
        """The children of two paired ops that may have a counterpart, per side, and the
        others as expected entries: the ops the map's `none` names and, below two ops of
        different implementations when the map says `kernels: false`, the kernels."""
        kernels_too = self.opmap.kernels or method.same_code or g.path == ""
        kept, expected = [], []
        for side, parent in ((Role.GOLDEN, g), (Role.TARGET, t)):
            mine = []
            for c in parent.children:
                if self.opmap.has_none(c.name, c.module) or (
                        not kernels_too and c.module is None and c.name.endswith("Kernel")):
                    if c.count():
                        expected.append(self._expected(side, c))
                else:
                    mine.append(c)
            kept.append(mine)
        return kept, expected

    def _by_module(self, golden: list[OpNode], target: list[OpNode]) -> list[NodePair]:
        """The pairs of the children of two implementations of one op: modules by the last
        part of their module paths (a fused module of the left side with the right side's
        modules it computes, as the map's `fused` says), then the rest by name."""
        left, right = (golden, target) if self.left == Role.GOLDEN else (target, golden)
        by_attr = {c.attr: c for c in right if c.attr}
        pairs, used = [], set()
        for node in left:
            fused = self.opmap.fused.get(node.attr or "")
            group = tuple(by_attr.get(a) for a in fused) if fused else ()
            if group and all(n is not None and id(n) not in used for n in group):
                mate = group[0]
            else:
                group, mate = (), by_attr.get(node.attr) if node.attr else None
                if mate is None or id(mate) in used:
                    continue
            used.update(id(n) for n in (node, mate, *group))
            g, t = (node, mate) if self.left == Role.GOLDEN else (mate, node)
            pairs.append(NodePair(g, t, MatchMethod.MAP, group))
        rest = _pair_children([c for c in golden if id(c) not in used],
                              [c for c in target if id(c) not in used], self.opmap)
        return pairs + rest

    def tensors(self, g: OpNode, t: OpNode, method: MatchMethod,
                group: tuple[OpNode, ...] = ()) -> Paired[TensorPair]:
        """The tensors of two paired ops (nodes with tensors), in the target's order, and
        those left over."""
        rules = None
        if self.left is not None:
            left, right = (g, t) if self.left == Role.GOLDEN else (t, g)
            rules = self.opmap.rules(left.name, right.name)
        if rules is not None:
            modules = {n.attr: n.op for n in group if n.attr and n.op is not None}
            pairs = []
            for rule in rules:
                a = resolve(rule.left, left.op, {})
                b = resolve(rule.right, right.op, modules)
                if a is not None and b is not None:
                    pairs.append(TensorPair(a, b, method) if self.left == Role.GOLDEN
                                 else TensorPair(b, a, method))
            used = {id(x) for p in pairs for side in (p.golden, p.target)
                    for x in getattr(side, "parts", [side])}
            sides = [(Role.GOLDEN, g.op), (Role.TARGET, t.op)]
            sides += [(Role.GOLDEN if self.left == Role.TARGET else Role.TARGET, n.op)
                      for n in group if n.op is not None and n is not g and n is not t]
            pairs.sort(key=lambda p: p.target.order)
            return Paired(pairs, [Unmatched(side, UnmatchedKind.TENSOR, self.where.of(side),
                                            x.data_name, expected=True)
                                  for side, op in sides
                                  for x in op.tensors if id(x) not in used])
        if g.name == t.name:
            pairs = _pair_tensors(g.op, t.op, method)
        else:
            pairs = _pair_by_shape(g.op, t.op, method, self.opmap)
        pairs.sort(key=lambda p: p.target.order)
        used = {id(p.golden) for p in pairs} | {id(p.target) for p in pairs}
        return Paired(pairs, [Unmatched(side, UnmatchedKind.TENSOR, self.where.of(side),
                                        x.data_name)
                              for side, node in ((Role.GOLDEN, g), (Role.TARGET, t))
                              for x in node.op.tensors if id(x) not in used])


def _by_id(golden: list[OpNode], target: list[OpNode]) -> list[NodePair] | None:
    """Pairs by (ID, name) when one side's keys are all in the other's, else None."""
    g_keys = {(c.own_id, c.name): c for c in golden}
    t_keys = {(c.own_id, c.name): c for c in target}
    common = g_keys.keys() & t_keys.keys()
    if len(common) == len(g_keys) or len(common) == len(t_keys):
        ordered = [k for k in ((c.own_id, c.name) for c in target) if k in common]
        return [NodePair(g_keys[k], t_keys[k], MatchMethod.ID) for k in ordered]
    return None


def _pair_children(golden: list[OpNode], target: list[OpNode], opmap: OpMap
                   ) -> list[NodePair]:
    """The pairs of two lists of sibling ops below the layer level."""
    by_id = _by_id(golden, target)
    if by_id is not None:
        return by_id
    matcher = difflib.SequenceMatcher(None, [opmap.canonical(c.name) for c in golden],
                                      [opmap.canonical(c.name) for c in target], autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            a, b = golden[block.a + k], target[block.b + k]
            pairs.append(NodePair(a, b, _by_name(a, b, opmap)))
    return pairs


def _by_name(a: OpNode, b: OpNode, opmap: OpMap) -> MatchMethod:
    """How two ops paired by their names were paired: `name` when the names are equal and the
    map does not declare the name (a name it declares on both sides is two implementations)."""
    return MatchMethod.NAME if a.name == b.name and not opmap.names(a.name) \
        else MatchMethod.MAP


@dataclass(frozen=True, slots=True)
class _LayerKey:
    """What the alignment of layer-level ops weighs."""

    name: str                    # as the op map names it
    outputs: tuple | None        # the squeezed shapes of its outputs
    mapped: bool                 # the op map names it

    @classmethod
    def of(cls, node: OpNode, opmap: OpMap) -> _LayerKey:
        return cls(opmap.canonical(node.name), _out_shapes(node), opmap.names(node.name))


def _pair_layers(golden: list[OpNode], target: list[OpNode], opmap: OpMap) -> list[NodePair]:
    """The pairs of two rounds' layer-level ops: by ID when they agree, else the
    order-keeping alignment of most weight (names first, then output shapes)."""
    by_id = _by_id(golden, target)
    if by_id is not None:
        return by_id
    g_keys = [_LayerKey.of(c, opmap) for c in golden]
    t_keys = [_LayerKey.of(c, opmap) for c in target]

    def weight(i: int, j: int) -> int:
        g, t = g_keys[i], t_keys[j]
        if g.name == t.name:
            return 4 + (g.outputs == t.outputs)
        if g.outputs is not None and g.outputs == t.outputs and not (g.mapped or t.mapped):
            return 2
        return 0

    n, m = len(golden), len(target)
    # best[i][j]: the weight of the best alignment of golden[i:] with target[j:].
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = best[i], best[i + 1]
        for j in range(m - 1, -1, -1):
            w = weight(i, j)
            row[j] = max(below[j], row[j + 1], below[j + 1] + w if w else 0)
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        w = weight(i, j)
        if w and best[i][j] == best[i + 1][j + 1] + w:
            a, b = golden[i], target[j]
            method = _by_name(a, b, opmap) if w >= 4 else MatchMethod.ORDER
            pairs.append(NodePair(a, b, method))
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return pairs


def _out_shapes(node: OpNode) -> tuple | None:
    """The shapes of an op's outputs without size-1 dimensions; None when it has none."""
    if node.op is None:
        return None
    shapes = tuple(squeezed(t.shape) for t in node.op.outputs)
    return shapes or None


def squeezed(shape: str) -> tuple[int, ...] | str:
    """A Shape cell's dimensions without those of size 1 (`1x4x32` -> (4, 32)); text that is
    no shape (`?`) as it is, equal only to the same text."""
    try:
        return tuple(d for d in parse_shape(shape) if d != 1)
    except ValueError:
        return shape


def _pair_tensors(g: Op, t: Op, method: MatchMethod) -> list[TensorPair]:
    """The tensors of two ops of one name: by (side, index); what is left by (side, parameter
    name) and then by (side, the index's leading number). Inputs known only by their number
    whose counts differ (an attention mask passed only to a padded batch) are paired in call
    order by kind and rank instead (`_pair_in_order`)."""
    pairs: list[TensorPair] = []
    g_tensors, t_tensors = g.tensors, t.tensors
    g_in, t_in = g.inputs, t.inputs
    if len(g_in) != len(t_in) and all(x.index.isdigit() for x in g_in + t_in):
        pairs = _pair_in_order(g_in, t_in, method)
        g_tensors = [x for x in g_tensors if x.io != Side.INPUT]
        t_tensors = [x for x in t_tensors if x.io != Side.INPUT]
    g_by = {(x.io, x.index): x for x in g_tensors}
    left_t = []
    for x in t_tensors:
        y = g_by.pop((x.io, x.index), None)
        if y is None:
            left_t.append(x)
        else:
            pairs.append(TensorPair(y, x, method))
    for part in (_param_name, _leading_number):
        if not (left_t and g_by):
            break
        # Another position, same parameter name (`intensor3_position_ids` vs
        # `intensor4_position_ids`); then the same position, another parameter name
        # (`intensor0_x` vs `intensor0_input`).
        by_part = {(y.io, part(y.index)): key for key, y in g_by.items() if part(y.index)}
        rest = []
        for x in left_t:
            key = by_part.pop((x.io, part(x.index)), None) if part(x.index) else None
            if key is None:
                rest.append(x)
            else:
                pairs.append(TensorPair(g_by.pop(key), x, method))
        left_t = rest
    return pairs


def _param_name(index: str) -> str:
    return index.partition("_")[2]


def _leading_number(index: str) -> str:
    return index.partition("_")[0]


def _pair_in_order(golden: list[TensorRecord], target: list[TensorRecord],
                   method: MatchMethod) -> list[TensorPair]:
    """Two lists of tensors paired in order where their kinds (float, integer, bool) and ranks
    agree, as many as can be (the longest common subsequence)."""
    def keys(tensors: list[TensorRecord]) -> list[tuple]:
        out = []
        for x in tensors:
            try:
                rank = len(parse_shape(x.shape))
            except ValueError:
                rank = -1
            out.append((_KINDS.get(x.dtype, x.dtype), rank))
        return out
    matcher = difflib.SequenceMatcher(None, keys(golden), keys(target), autojunk=False)
    return [TensorPair(golden[block.a + k], target[block.b + k], method)
            for block in matcher.get_matching_blocks() for k in range(block.size)]


# A dtype's kind, by its csv name: `float` (every width, bf16 and fp8 included), `integer`,
# or the name itself (bool, complex).
_KINDS = {d.csv_name: "float" if "float" in d.torch_name else
          "integer" if "int" in d.torch_name else d.csv_name for d in DTYPES}


def _pair_by_shape(g: Op, t: Op, method: MatchMethod, opmap: OpMap) -> list[TensorPair]:
    """The tensors of two ops that are the same computation under different names."""
    pairs: list[TensorPair] = []
    g_out, t_out = g.outputs, t.outputs
    given = opmap.output_pairs(g.op_name.rsplit("/", 1)[-1], t.op_name.rsplit("/", 1)[-1])
    shape = {id(x): squeezed(x.shape) for x in g.tensors + t.tensors}
    used = set()
    if given is not None:
        for gi, ti in given.items():
            if gi < len(g_out) and ti < len(t_out):
                pairs.append(TensorPair(g_out[gi], t_out[ti], method))
                used.update((id(g_out[gi]), id(t_out[ti])))
    else:
        for x, y in zip(g_out, t_out):
            if shape[id(x)] == shape[id(y)]:
                pairs.append(TensorPair(x, y, method))
                used.update((id(x), id(y)))
    for g_list, t_list in ((g_out, t_out), (g.inputs, t.inputs)):
        if given is not None and g_list is g_out:
            continue
        for y in t_list:
            if id(y) in used:
                continue
            for x in g_list:
                if id(x) not in used and shape[id(x)] == shape[id(y)]:
                    pairs.append(TensorPair(x, y, method))
                    used.update((id(x), id(y)))
                    break
    return pairs
