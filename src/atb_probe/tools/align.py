"""Aligning two dumps: processes, rounds, ops and tensors of GOLDEN with those of TARGET.

Ops are aligned level by level down the op tree. At each level the children of two matched ops
are paired by ID when their (ID, name) pairs agree — all of them, or all of one side's, which is
the case when one run was dumped with a narrower filter. Otherwise the two runs executed
different ops there (a cast only the bf16 run needs, a fused kernel) and the children are paired
by name, in execution order, with the longest common subsequence (difflib); what is left on
either side is reported as unmatched, with everything below it. Tensors of two matched ops are
paired by (input/output, index); failing that by (input/output, the index's leading number).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from .dumpreader import Dump, Op, Process, Round, TensorRecord


@dataclass
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


@dataclass
class TensorPair:
    golden: TensorRecord
    target: TensorRecord
    method: str                  # `id` or `name`: how the ops on the way were paired


@dataclass
class OpPair:
    golden: Op
    target: Op
    method: str
    tensors: list[TensorPair]


@dataclass
class Unmatched:
    """Something only one side has: a process, a round, an op subtree or a tensor."""

    side: str                    # golden | target
    kind: str                    # process | round | op | tensor
    where: str                   # `0_1234/0`
    what: str                    # the op path or tensor name
    count: int = 1               # ops (or tensors) it stands for


@dataclass
class RoundPair:
    golden: Round
    target: Round
    ops: list[OpPair]


@dataclass
class Alignment:
    rounds: list[RoundPair]
    unmatched: list[Unmatched]

    @property
    def name_matched(self) -> int:
        return sum(1 for r in self.rounds for o in r.ops if o.method == "name")


def align_dumps(golden: Dump, target: Dump) -> Alignment:
    """Pair everything pairable in two dumps opened at the same level."""
    unmatched: list[Unmatched] = []
    rounds: list[RoundPair] = []
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
            rounds.append(RoundPair(g, t, align_rounds(g, t, unmatched)))
    return Alignment(rounds, unmatched)


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


def align_rounds(golden: Round, target: Round, unmatched: list[Unmatched]) -> list[OpPair]:
    """Pairs of ops of two rounds, in the target's execution order."""
    where = f"{target.process.name}/{target.index}"
    pairs: list[OpPair] = []
    _align_nodes(build_tree(golden), build_tree(target), "id", pairs, unmatched, where)
    pairs.sort(key=lambda p: p.target.tensors[0].order)
    return pairs


def _align_nodes(g: OpNode, t: OpNode, method: str, pairs: list[OpPair],
                 unmatched: list[Unmatched], where: str) -> None:
    if g.op is not None and t.op is not None:
        pairs.append(OpPair(g.op, t.op, method, _align_tensors(g.op, t.op, method, unmatched,
                                                                where)))
    elif g.op is not None or t.op is not None:
        side, node = ("golden", g) if g.op is not None else ("target", t)
        unmatched.append(Unmatched(side, "op", where, node.path + " (tensors)",
                                   len(node.op.tensors)))
    matched, level_method = _pair_children(g.children, t.children)
    child_method = "name" if "name" in (method, level_method) else "id"
    paired_g = {id(a) for a, _ in matched}
    paired_t = {id(b) for _, b in matched}
    for a, b in matched:
        _align_nodes(a, b, child_method, pairs, unmatched, where)
    for side, nodes, paired in (("golden", g.children, paired_g),
                                ("target", t.children, paired_t)):
        for node in nodes:
            if id(node) not in paired and node.count():
                unmatched.append(Unmatched(side, "op", where, node.path, node.count()))


def _pair_children(golden: list[OpNode], target: list[OpNode]):
    """(pairs, method) for two lists of sibling ops."""
    g_keys = {(c.own_id, c.name): c for c in golden}
    t_keys = {(c.own_id, c.name): c for c in target}
    common = g_keys.keys() & t_keys.keys()
    if len(common) == len(g_keys) or len(common) == len(t_keys):
        ordered = [k for k in ((c.own_id, c.name) for c in target) if k in common]
        return [(g_keys[k], t_keys[k]) for k in ordered], "id"
    matcher = difflib.SequenceMatcher(None, [c.name for c in golden], [c.name for c in target],
                                      autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            pairs.append((golden[block.a + k], target[block.b + k]))
    return pairs, "name"


def _align_tensors(g: Op, t: Op, method: str, unmatched: list[Unmatched],
                   where: str) -> list[TensorPair]:
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
            unmatched.append(Unmatched(side, "tensor", where, x.data_name))
    pairs.sort(key=lambda p: p.target.order)
    return pairs
