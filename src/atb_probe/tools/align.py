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

Match methods, as the `Match` column shows them: `id`, `name`, `map` (the map made the pair, here
or above), `order` (execution order and shapes made the pair, here or above).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from .dumpreader import Dump, Op, Process, Round, TensorRecord
from .opmap import OpMap

_METHOD_RANK = {"id": 0, "name": 1, "map": 2, "order": 3}


@dataclass(slots=True)
class OpNode:
    """An op of a round's tree; `op` is None for an ancestor that has no tensors itself."""

    own_id: str
    name: str
    path: str                    # `2_LlamaDecoderLayer/1_LlamaAttention`
    op: Op | None = None
    children: list["OpNode"] = field(default_factory=list)

    def count(self) -> int:
        """Ops in this subtree that have tensors."""
        return (self.op is not None) + sum(c.count() for c in self.children)


@dataclass(slots=True)
class TensorPair:
    golden: TensorRecord
    target: TensorRecord
    method: str                  # id | name | map | order: how the ops on the way were paired


@dataclass(slots=True)
class OpPair:
    golden: Op
    target: Op
    method: str
    tensors: list[TensorPair]


@dataclass(slots=True)
class Unmatched:
    """Something only one side has: a process, a round, an op subtree or a tensor."""

    side: str                    # golden | target
    kind: str                    # process | round | op | tensor
    where: str                   # `0_1234/0`
    what: str                    # the op path or tensor name
    count: int = 1               # ops (or tensors) it stands for


@dataclass(slots=True)
class RoundPair:
    golden: Round
    target: Round
    ops: list[OpPair]


@dataclass(slots=True)
class Alignment:
    rounds: list[RoundPair]
    unmatched: list[Unmatched]

    @property
    def name_matched(self) -> int:
        return sum(1 for r in self.rounds for o in r.ops if o.method != "id")


def align_dumps(golden: Dump, target: Dump, opmap: OpMap | None = None) -> Alignment:
    """Pair everything pairable in two dumps opened at the same level."""
    unmatched: list[Unmatched] = []
    rounds: list[RoundPair] = []
    for g, t in pair_rounds(golden, target, unmatched):
        rounds.append(RoundPair(g, t, align_rounds(g, t, unmatched, opmap)))
    return Alignment(rounds, unmatched)


def pair_rounds(golden: Dump, target: Dump, unmatched: list[Unmatched]
                ) -> list[tuple[Round, Round]]:
    """The rounds of two dumps that correspond: same process (device), same round number."""
    pairs = []
    for gp, tp in _pair_processes(golden.processes, target.processes, unmatched):
        g_rounds = {r.index: r for r in gp.rounds}
        t_rounds = {r.index: r for r in tp.rounds}
        if golden.kind == "round" and target.kind == "round":
            # Two round folders given by hand: compare them whatever their numbers.
            g_rounds = {0: gp.rounds[0]}
            t_rounds = {0: tp.rounds[0]}
        for index in sorted(set(g_rounds) | set(t_rounds)):
            g, t = g_rounds.get(index), t_rounds.get(index)
            if g is None or t is None:
                side, r = ("golden", g) if t is None else ("target", t)
                unmatched.append(Unmatched(side, "round", f"{r.process.name}/{r.index}",
                                           f"round {r.index}", len(r.ops)))
                continue
            pairs.append((g, t))
    return pairs


def _pair_processes(golden: list[Process], target: list[Process],
                    unmatched: list[Unmatched]) -> list[tuple[Process, Process]]:
    """Pair by device ID (PIDs differ from run to run); a single pair is paired as is."""
    if len(golden) == 1 and len(target) == 1:
        return [(golden[0], target[0])]
    pairs = []
    by_device: dict[int, tuple[list[Process], list[Process]]] = {}
    for side, procs in ((0, golden), (1, target)):
        for p in procs:
            by_device.setdefault(p.device, ([], []))[side].append(p)
    for device in sorted(by_device):
        g_list, t_list = by_device[device]
        pairs.extend(zip(g_list, t_list))
        for side, rest in (("golden", g_list[len(t_list):]), ("target", t_list[len(g_list):])):
            for p in rest:
                unmatched.append(Unmatched(side, "process", p.name, f"process {p.name}",
                                           sum(len(r.ops) for r in p.rounds)))
    return pairs


def build_tree(rnd: Round) -> OpNode:
    """The round's op tree, children in ID order (which is execution order)."""
    root = OpNode("", "", "")
    index: dict[tuple[str, ...], OpNode] = {(): root}
    for op in rnd.ops:
        ids, names = op.op_id.split("_"), op.op_name.split("/")
        node = root
        for depth in range(1, len(ids) + 1):
            key = tuple(ids[:depth])
            child = index.get(key)
            if child is None:
                own, name = ids[depth - 1], names[depth - 1]
                path = f"{node.path}/{own}_{name}" if node.path else f"{own}_{name}"
                child = OpNode(own, name, path)
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

    def of(self, side: str) -> str:
        return self.golden if side == "golden" else self.target


def align_rounds(golden: Round, target: Round, unmatched: list[Unmatched],
                 opmap: OpMap | None = None) -> list[OpPair]:
    """Pairs of ops of two rounds, in the target's execution order."""
    # Each side's entries name that side's process and round.
    where = Where(f"{golden.process.name}/{golden.index}", f"{target.process.name}/{target.index}")
    pairs: list[OpPair] = []
    _align_nodes(build_tree(golden), build_tree(target), "id", pairs, unmatched, where,
                 opmap or OpMap())
    pairs.sort(key=lambda p: p.target.tensors[0].order)
    return pairs


def _align_nodes(g: OpNode, t: OpNode, method: str, pairs: list[OpPair],
                 unmatched: list[Unmatched], where: Where, opmap: OpMap) -> None:
    if g.op is not None and t.op is not None:
        if g.name == t.name:
            tensors = _align_tensors(g.op, t.op, method, unmatched, where)
        else:
            tensors = _align_by_shape(g.op, t.op, method, unmatched, where, opmap)
        pairs.append(OpPair(g.op, t.op, method, tensors))
    elif g.op is not None or t.op is not None:
        side, node = ("golden", g) if g.op is not None else ("target", t)
        unmatched.append(Unmatched(side, "op", where.of(side), node.path + " (tensors)",
                                   len(node.op.tensors)))
    if g.path == "":
        matched = _pair_layers(g.children, t.children, opmap)
    else:
        matched = _pair_children(g.children, t.children, opmap)
    paired_g = {id(a) for a, _, _ in matched}
    paired_t = {id(b) for _, b, _ in matched}
    for a, b, level_method in matched:
        child_method = max(method, level_method, key=_METHOD_RANK.__getitem__)
        _align_nodes(a, b, child_method, pairs, unmatched, where, opmap)
    for side, nodes, paired in (("golden", g.children, paired_g),
                                ("target", t.children, paired_t)):
        for node in nodes:
            if id(node) not in paired and node.count():
                unmatched.append(Unmatched(side, "op", where.of(side), node.path, node.count()))


def _by_id(golden: list[OpNode], target: list[OpNode]):
    """Pairs by (ID, name) when one side's keys are all in the other's, else None."""
    g_keys = {(c.own_id, c.name): c for c in golden}
    t_keys = {(c.own_id, c.name): c for c in target}
    common = g_keys.keys() & t_keys.keys()
    if len(common) == len(g_keys) or len(common) == len(t_keys):
        ordered = [k for k in ((c.own_id, c.name) for c in target) if k in common]
        return [(g_keys[k], t_keys[k], "id") for k in ordered]
    return None


def _pair_children(golden: list[OpNode], target: list[OpNode], opmap: OpMap):
    """(golden, target, method) pairs of two lists of sibling ops below the layer level."""
    by_id = _by_id(golden, target)
    if by_id is not None:
        return by_id
    matcher = difflib.SequenceMatcher(None, [opmap.canonical(c.name) for c in golden],
                                      [opmap.canonical(c.name) for c in target], autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            a, b = golden[block.a + k], target[block.b + k]
            pairs.append((a, b, "name" if a.name == b.name else "map"))
    return pairs


def _pair_layers(golden: list[OpNode], target: list[OpNode], opmap: OpMap):
    """(golden, target, method) pairs of two rounds' layer-level ops: by ID when they agree,
    else the order-keeping alignment of most weight (names first, then output shapes)."""
    by_id = _by_id(golden, target)
    if by_id is not None:
        return by_id
    g_keys = [(opmap.canonical(c.name), _out_shapes(c), opmap.names(c.name)) for c in golden]
    t_keys = [(opmap.canonical(c.name), _out_shapes(c), opmap.names(c.name)) for c in target]

    def weight(i: int, j: int) -> int:
        (gn, gs, g_named), (tn, ts, t_named) = g_keys[i], t_keys[j]
        if gn == tn:
            return 4 + (gs == ts)
        if gs is not None and gs == ts and not (g_named or t_named):
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
            method = "name" if a.name == b.name else ("map" if w >= 4 else "order")
            pairs.append((a, b, method))
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
    shapes = tuple(squeezed(t.shape) for t in node.op.tensors if t.io == "output")
    return shapes or None


def squeezed(shape: str) -> tuple[str, ...]:
    """A csv shape (`1x4x32`) without its size-1 dimensions: `('4', '32')`."""
    return tuple(d for d in shape.split("x") if d and d != "1")


def _align_tensors(g: Op, t: Op, method: str, unmatched: list[Unmatched],
                   where: Where) -> list[TensorPair]:
    g_by = {(x.io, x.index): x for x in g.tensors}
    pairs, left_t = [], []
    for x in t.tensors:
        y = g_by.pop((x.io, x.index), None)
        if y is None:
            left_t.append(x)
        else:
            pairs.append(TensorPair(y, x, method))
    if left_t and g_by:
        # Same position, other parameter name (`intensor0_x` vs `intensor0_input`).
        by_number = {(y.io, y.index.partition("_")[0]): key for key, y in g_by.items()}
        still = []
        for x in left_t:
            key = by_number.pop((x.io, x.index.partition("_")[0]), None)
            if key is None:
                still.append(x)
            else:
                pairs.append(TensorPair(g_by.pop(key), x, method))
        left_t = still
    for side, rest in (("golden", list(g_by.values())), ("target", left_t)):
        for x in rest:
            unmatched.append(Unmatched(side, "tensor", where.of(side), x.data_name))
    pairs.sort(key=lambda p: p.target.order)
    return pairs


def _align_by_shape(g: Op, t: Op, method: str, unmatched: list[Unmatched], where: Where,
                    opmap: OpMap) -> list[TensorPair]:
    """The tensors of two ops that are the same computation under different names."""
    pairs: list[TensorPair] = []
    g_out, t_out = g.outputs, t.outputs
    given = opmap.output_pairs(g.op_name.rsplit("/", 1)[-1], t.op_name.rsplit("/", 1)[-1])
    used_g, used_t = set(), set()
    if given is not None:
        for gi, ti in given.items():
            if gi < len(g_out) and ti < len(t_out):
                pairs.append(TensorPair(g_out[gi], t_out[ti], method))
                used_g.add(id(g_out[gi]))
                used_t.add(id(t_out[ti]))
    else:
        for x, y in zip(g_out, t_out):
            if squeezed(x.shape) == squeezed(y.shape):
                pairs.append(TensorPair(x, y, method))
                used_g.add(id(x))
                used_t.add(id(y))
    for g_list, t_list in ((g_out, t_out), (g.inputs, t.inputs)):
        if given is not None and g_list is g_out:
            continue
        for y in t_list:
            if id(y) in used_t:
                continue
            for x in g_list:
                if id(x) not in used_g and squeezed(x.shape) == squeezed(y.shape):
                    pairs.append(TensorPair(x, y, method))
                    used_g.add(id(x))
                    used_t.add(id(y))
                    break
    for side, tensors, used in (("golden", g.tensors, used_g), ("target", t.tensors, used_t)):
        for x in tensors:
            if id(x) not in used:
                unmatched.append(Unmatched(side, "tensor", where.of(side), x.data_name))
    pairs.sort(key=lambda p: p.target.order)
    return pairs
