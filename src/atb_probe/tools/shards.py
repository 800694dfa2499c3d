"""Tensor-parallel ranks as one side of a comparison: each tensor's pieces joined into the whole.

A run split over N ranks (torchrun, an engine's workers) writes one `<dev>_<pid>` folder per rank,
devices 0..N-1, with the same rounds and the same op IDs, since every rank runs the same code on
its part of the weights (ranks that run different ops, pipeline stages, are not joined). Compared against a golden run of fewer ranks (one), the ranks are one
side: the alignment pairs the golden's ops with rank 0's, and each paired tensor of rank 0 is
joined with the tensors of the same ID, side and index on the other ranks before the metrics.

How a tensor's pieces join is decided per tensor, from data, never from its values:

1. A `DTensor` says so itself: its placements are in the op's `op_param.json` (`dtensors`), and
   `PLACEMENTS` maps each to a join (`Shard(dim=d)`: concatenate along d; `Partial(sum)`: sum;
   `Replicate()`: take rank 0, check the others are equal).
2. Otherwise the shapes tell a slice: rank shapes that add up to the golden's shape along exactly
   one dimension, all others equal (heads, hidden features, vocabulary) are concatenated there.
3. A tensor of the golden's shape on every rank is all of it (replicated), except inside a
   layer that reduces partial results across the ranks (a row-parallel linear, a vocabulary-
   parallel embedding): there, from its first kernel up to its collective, each rank holds a
   partial sum. Which layers those are comes from the model's parallel plan, as data: the
   `transformers` tensor-parallel plan of the dumped model (module path patterns to styles: the
   model file's `tpPlan`, else its config class's `base_model_tp_plan`) and `PARTIAL_MODULES`
   (module classes that are row-parallel by name, as vLLM's are); `PARTIAL_STYLES` lists the
   styles that reduce.

What none of these decides is left out of the comparison with the reason (`JoinedRanks`), never
compared as if one rank's piece were the whole.

Statistics-mode rows join the ranks' statistics: a slice's max, min, mean (weighted by element
counts) and norm (the root of the sum of squares) are those of the whole; a replicated tensor's are
rank 0's; a partial sum's cannot be told from its pieces' statistics.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from functools import reduce

import numpy as np

from .. import layout
from ..statcsv import Stats, parse_shape
from . import StrEnum
from .arrays import load_values
from .comparison import DeriveKind, Join, Pieces, Role, TensorRef
from .dumpreader import Dump, Process, Round, TensorRecord

# DTensor placements as op_param.json writes them (their repr) -> the join, or None and why.
PLACEMENTS: tuple[tuple[re.Pattern, Join | None, str], ...] = (
    (re.compile(r"Shard\(dim=(-?\d+)\)"), Join.CONCAT, ""),
    (re.compile(r"Replicate\(\)"), Join.REPLICATED, ""),
    (re.compile(r"_MaskPartial\(.*"), None,
     "a masked partial lookup (vocabulary-parallel): each rank's rows outside its slice are "
     "zeroed after this op"),
    (re.compile(r"Partial\((reduce_op=)?sum\)"), Join.SUM, ""),
)

# Parallel styles (transformers' names) whose layer reduces partial results with a collective.
PARTIAL_STYLES = frozenset({"rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise",
                            "embedding_rowwise"})
# Module classes that are row-parallel whatever the plan says (vLLM's, and their imitators).
PARTIAL_MODULES = frozenset({"RowParallelLinear"})
# Kernels that reduce the ranks' partial results (op types, lower case, without `kernel`).
_REDUCING = re.compile(r"(all_?reduce|reduce_?scatter).*kernel", re.IGNORECASE)


@dataclass(slots=True)
class Undecided:
    """A tensor of the joined side left out: its name and why its pieces could not be joined."""

    name: str
    reason: str


@dataclass(slots=True)
class JoinedRanks:
    """What the summary says of a side whose ranks were joined."""

    role: Role
    ranks: int
    undecided: list[Undecided] = field(default_factory=list)

    def describe(self) -> str:
        """`2 ranks joined (tensor parallel)`."""
        return f"{self.ranks} ranks joined (tensor parallel)"


class Region(StrEnum):
    """Where a tensor lies relative to the layers that reduce partial results."""

    OUTSIDE = "outside"          # in no such layer (or at its boundary: its own inputs, outputs)
    PARTIAL = "partial"          # inside one, before its collective
    REDUCED = "reduced"          # inside one, from its collective on
    UNKNOWN = "unknown"          # inside one whose collective was not dumped


@dataclass(frozen=True, slots=True)
class Decision:
    """How one tensor's pieces join: `join` None when undecided (`reason` says why)."""

    join: Join | None
    dim: int = 0
    reason: str = ""


def decide(shapes: list[tuple[int, ...]], whole: tuple[int, ...] | None,
           placement: str | None, region: Region, layer: str = "") -> Decision:
    """The join of one tensor from its rank shapes, the golden's shape (`whole`), its DTensor
    placement (rank 0's, if it is one) and its region (`layer`: the reducing layer it is in)."""
    if placement is not None:
        for pattern, join, why in PLACEMENTS:
            match = pattern.fullmatch(placement)
            if match is None:
                continue
            if join is None:
                return Decision(None, reason=why)
            dim = int(match.group(1)) % max(1, len(shapes[0])) if join == Join.CONCAT else 0
            return Decision(join, dim, f"DTensor {placement}")
        return Decision(None, reason=f"DTensor placement {placement} is not one compare joins")
    if whole is None:
        return Decision(None, reason="the golden's shape is not known")
    if all(s == whole for s in shapes) or all(s == shapes[0] for s in shapes) and \
            _squeezed(shapes[0]) == _squeezed(whole):   # [1, vocab] against [1, 1, vocab]
        if region == Region.PARTIAL:
            return Decision(Join.SUM, reason=f"partial sums inside row-parallel {layer}")
        if region == Region.UNKNOWN:
            return Decision(None, reason=f"inside row-parallel {layer}, whose collective was not "
                                         "dumped: partial or reduced cannot be told")
        return Decision(Join.REPLICATED, reason="the golden's shape on every rank")
    dims = [d for d in range(len(whole))
            if all(len(s) == len(whole) for s in shapes)
            and sum(s[d] for s in shapes) == whole[d]
            and all(s[:d] + s[d + 1:] == whole[:d] + whole[d + 1:] for s in shapes)]
    if len(dims) == 1:
        return Decision(Join.CONCAT, dims[0], "rank shapes add up to the golden's")
    cells = ", ".join("x".join(map(str, s)) for s in shapes)
    return Decision(None, reason=f"rank shapes {cells} do not join into the golden's "
                                 f"{'x'.join(map(str, whole))}")


def joined_stats(join: Join | None, stats: list[Stats | None],
                 shapes: list[tuple[int, ...]]) -> Stats | None:
    """The statistics of the whole from those of its pieces; None where they cannot tell (a
    partial sum, a rank without statistics)."""
    if join is None or join == Join.SUM or any(s is None for s in stats):
        return None
    if join == Join.REPLICATED:
        return stats[0]
    counts = [math.prod(s) for s in shapes]
    total = sum(counts)
    mean = sum(s.mean * n for s, n in zip(stats, counts)) / total if total else 0.0
    return Stats(max(s.max for s in stats), min(s.min for s in stats), mean,
                 math.sqrt(sum(s.norm * s.norm for s in stats)))


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _fused(record) -> tuple[int, list[int]] | None:
    """(dimension, each part's size) of a concatenation an op map derives (a fused module's
    counterpart: q, k and v), None for another tensor."""
    derive = getattr(record, "derive", None)
    if derive is None or derive.kind != DeriveKind.CONCAT:
        return None
    try:
        shapes = [parse_shape(p.shape) for p in record.parts]
        return derive.dim, [s[derive.dim] for s in shapes]
    except (ValueError, IndexError):
        return None


def _fused_decision(shapes: list[tuple[int, ...]], whole: tuple[int, ...], dim: int,
                    sizes: list[int]) -> Decision:
    """The join of a fused module's pieces whose sizes do not add up to the whole's (a part
    replicated on every rank): a CONCAT along the parts' dimension, when every other dimension
    is the whole's."""
    dim %= len(whole)
    if all(len(s) == len(whole) and s[:dim] + s[dim + 1:] == whole[:dim] + whole[dim + 1:]
           for s in shapes):
        return Decision(Join.CONCAT, dim, "rank pieces of a fused module")
    return Decision(None, reason="rank shapes do not join into the fused parts' "
                                 f"{'x'.join(map(str, whole))}")


def _per_part(ranks: int, width: int, sizes: list[int]) -> tuple[tuple[int, int], ...] | None:
    """How a fused module's output of `width` per rank holds its parts of `sizes`: per part,
    its width on a rank and how many ranks share each slice; None when that cannot be told.

    Each part is split evenly over the ranks (vLLM's merged gate and up projections), or, in
    a fused q, k, v projection whose key and value have fewer heads than there are ranks, q is
    split evenly and k and v, of equal sizes, take what is left of the width: the same slice
    on several consecutive ranks (or all of k and v on every rank)."""
    if all(size % ranks == 0 for size in sizes) and sum(sizes) // ranks == width:
        widths = [size // ranks for size in sizes]
    elif len(sizes) == 3 and sizes[1] == sizes[2] and sizes[0] % ranks == 0 and \
            (width - sizes[0] // ranks) % 2 == 0:
        kv = (width - sizes[0] // ranks) // 2
        widths = [sizes[0] // ranks, kv, kv]
    else:
        return None
    out = []
    for part, size in zip(widths, sizes):
        if part <= 0 or size % part or ranks % (size // part):
            return None
        out.append((part, ranks // (size // part)))
    return tuple(out)


def _shape(record) -> tuple[int, ...] | None:
    """A record's shape; None when its Shape cell cannot be read."""
    try:
        return parse_shape(record.shape)
    except ValueError:
        return None


def load_joined(pieces: Pieces) -> tuple[np.ndarray, str]:
    """The whole tensor from its pieces' files, and a note (ranks that should agree and do
    not). Raises `NoData` as `load_values` does."""
    arrays = [load_values(path) for path in pieces.paths]
    if pieces.join == Join.CONCAT and pieces.fused:
        parts, start = [], 0
        for width, sharing in pieces.fused:
            cut = [slice(None)] * arrays[0].ndim
            cut[pieces.dim] = slice(start, start + width)
            parts += [a[tuple(cut)] for a in arrays[::sharing]]
            start += width
        return np.concatenate(parts, axis=pieces.dim), ""
    if pieces.join == Join.CONCAT:
        return np.concatenate(arrays, axis=pieces.dim), ""
    if pieces.join == Join.SUM:
        return reduce(np.add, arrays[1:], arrays[0].copy()), ""
    first, note = arrays[0], ""
    for rank, other in enumerate(arrays[1:], 1):
        if other.shape != first.shape or not np.array_equal(other, first, equal_nan=True):
            diff = np.abs(other.astype(np.float64) - first) if other.shape == first.shape \
                else None
            note = f"rank {rank} differs from rank 0" + (
                f" (max abs diff {float(np.nanmax(diff)):.6g})" if diff is not None else "")
            break
    return first, note


def joined_note(pieces: Pieces | None) -> str:
    """What a row must say of a joined tensor: why it was not compared, or why its statistics
    are missing (a partial sum without files to sum); "" when nothing."""
    if pieces is None:
        return ""
    if pieces.join is None:
        return f"ranks not joined: {pieces.reason}"
    if pieces.join == Join.SUM and None in pieces.paths:
        return "a partial sum on each rank: its statistics cannot be joined (dump tensors)"
    return ""


class RankGroup:
    """The processes of one side that are the ranks of one run, rank 0 first."""

    def __init__(self, role: Role, dump: Dump, plan: dict[str, str]):
        self.role = role
        self.dump = dump
        self.processes = sorted(dump.processes, key=lambda p: p.device)
        self.plan = plan
        self.summary = JoinedRanks(role, len(self.processes))
        self._records: dict[tuple[int, int], dict[tuple, TensorRecord]] = {}
        self._params: dict[tuple[int, str], dict] = {}
        self._nodes: dict[tuple, dict] | None = None  # rank 0's structure nodes by `_place`
        self._children: dict[int, dict[str, list[str]]] = {}   # by round, by parent op path
        self._reduce_at: dict[tuple[int, str], int | None] = {}

    def lead(self, golden: Dump, target: Dump) -> tuple[Dump, Dump]:
        """The two dumps as the alignment sees them: this side as its rank 0 alone."""
        lead = Dump(self.dump.path, self.dump.kind, self.processes[:1], self.dump.root)
        return (lead, target) if self.role == Role.GOLDEN else (golden, lead)

    def refs(self, golden: TensorRecord, target: TensorRecord,
             whole: tuple[int, ...] | None = None) -> tuple[TensorRef, TensorRef]:
        """The refs of a pair of tensors, this side's joined with its other ranks' pieces.
        `whole`: the shape of the whole in this side's token layout, when it is not the other
        tensor's (compare.py: the two sides lay their tokens out differently)."""
        if self.role == Role.GOLDEN:
            return self.ref(golden, whole or _shape(target), _fused(target)), \
                TensorRef.of(target)
        return TensorRef.of(golden), self.ref(target, whole or _shape(golden), _fused(golden))

    def ref(self, record: TensorRecord, whole: tuple[int, ...] | None,
            fused: tuple[int, list[int]] | None = None) -> TensorRef:
        """The ref of rank 0's `record` joined with its pieces on the other ranks; `whole` is
        the shape of the whole (that of the tensor it is compared with; None: not known);
        `fused`: that tensor is a concatenation of parts (the dimension, each part's size):
        a fused module's output, whose ranks each hold a slice of every part."""
        if getattr(record, "parts", None):
            return self._derived(record, whole)
        ref = TensorRef.of(record)
        pieces = [record]
        for rank in range(1, len(self.processes)):
            found = self._counterpart(rank, record)
            if found is None:
                return self._undecided(ref, record, f"rank {rank} has no such tensor")
            pieces.append(found)
        try:
            shapes = [parse_shape(p.shape) for p in pieces]
        except ValueError:
            return self._undecided(ref, record, "a rank's shape is not known")
        region, layer = self._region(record)
        decision = decide(shapes, whole, self._placement(record), region, layer)
        if decision.join is None and fused is not None and whole is not None:
            decision = _fused_decision(shapes, whole, *fused)
        if decision.join is None:
            return self._undecided(ref, record, decision.reason)
        per_part = None
        if decision.join == Join.CONCAT and fused is not None and \
                decision.dim == fused[0] % len(shapes[0]):
            per_part = _per_part(len(shapes), shapes[0][decision.dim], fused[1])
            if per_part is None:
                return self._undecided(ref, record, "a fused module's rank pieces do not split "
                                       f"into its {len(fused[1])} parts {fused[1]}")
        shape = record.shape
        if decision.join == Join.CONCAT:
            dims = list(shapes[0])
            dims[decision.dim] = sum(fused[1]) if per_part else \
                sum(s[decision.dim] for s in shapes)
            shape = "x".join(map(str, dims))
        stats = None if per_part else \
            joined_stats(decision.join, [p.stats for p in pieces], shapes)
        reason = decision.reason + (", a slice of each fused part per rank" if per_part else "")
        return replace(ref, shape=shape, stats=stats,
                       pieces=Pieces(decision.join, decision.dim, tuple(p.path for p in pieces),
                                     reason, per_part))

    def _derived(self, record, whole: tuple[int, ...] | None) -> TensorRef:
        """The ref of a tensor an op map derives from rank 0's tensors (opmap.DerivedTensor):
        each part joined with its pieces, then derived. A sum's parts have the whole's shape;
        the parts of another derivation are joined by their placements alone. Its statistics
        (measured on rank 0) stay only when every part is all there on rank 0."""
        if record.derive.kind != DeriveKind.SUM:
            whole = None
        parts = tuple(self.ref(part, whole) for part in record.parts)
        ref = replace(TensorRef.of(record), parts=parts)
        if all(p.pieces is None or p.pieces.join == Join.REPLICATED for p in parts):
            return ref
        return replace(ref, stats=None)

    def _undecided(self, ref: TensorRef, record: TensorRecord, reason: str) -> TensorRef:
        self.summary.undecided.append(Undecided(f"{record.round.where}/{record.data_name}",
                                                reason))
        return replace(ref, stats=None,
                       pieces=Pieces(None, 0, (record.path,), reason))

    def _counterpart(self, rank: int, record: TensorRecord) -> TensorRecord | None:
        """The tensor of the same round, op ID and name, side and index on `rank`."""
        key = (rank, record.round.index)
        index = self._records.get(key)
        if index is None:
            rnd = next((r for r in self.processes[rank].rounds
                        if r.index == record.round.index), None)
            index = {} if rnd is None else {(t.op_id, t.op_name, t.io, t.index): t
                                             for t in rnd.tensors}
            self._records[key] = index
        return index.get((record.op_id, record.op_name, record.io, record.index))

    def _placement(self, record: TensorRecord) -> str | None:
        """Rank 0's DTensor placement of the tensor, from its op's op_param.json (or its
        structure node's `param`)."""
        facts = self._facts(record.round, record.op_path)
        param = facts.get("param")
        shards = facts.get("dtensors", param.get("dtensors") if isinstance(param, dict) else None)
        if not isinstance(shards, dict):
            return None
        meta = shards.get(layout.tensor_name(record.io, record.index))
        if not isinstance(meta, dict) or not meta.get("placements"):
            return None
        placements = meta["placements"]
        return placements[0] if len(placements) == 1 else ", ".join(placements)

    def _region(self, record: TensorRecord) -> tuple[Region, str]:
        """Whether the tensor is inside a layer that reduces partial results, before or after
        its collective; and that layer's module path (or op path)."""
        parts = record.op_path.split("/")
        for depth in range(len(parts) - 1, 0, -1):  # the innermost enclosing op first
            ancestor = "/".join(parts[:depth])
            name = _op_type(parts[depth - 1])
            module = str(self._facts(record.round, ancestor).get("modulePath", ""))
            if name not in PARTIAL_MODULES and _style(self.plan, module) not in PARTIAL_STYLES:
                continue
            at = self._reduce_point(record.round, ancestor)
            where = module or ancestor
            if at is None:
                return Region.UNKNOWN, where
            return (Region.PARTIAL if record.order < at else Region.REDUCED), where
        return Region.OUTSIDE, ""

    def _op_param(self, rnd: Round, op_path: str) -> dict:
        """An op's op_param.json in a round of rank 0, {} when it has none."""
        key = (rnd.index, op_path)
        doc = self._params.get(key)
        if doc is None:
            try:
                with open(os.path.join(rnd.path, op_path, layout.OP_PARAM),
                          encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                doc = {}
            doc = self._params[key] = doc if isinstance(doc, dict) else {}
        return doc

    def _facts(self, rnd: Round, op_path: str) -> dict:
        """What the dump says of an op of rank 0 (`modulePath`, `dtensors`): its op_param.json
        in the round, else its node in the structure files (a statistics dump writes no
        op_param.json), {} when neither has it."""
        doc = self._op_param(rnd, op_path)
        if doc:
            return doc
        if self._nodes is None:
            self._nodes = {}
            lead = self.processes[0].name
            for path in self.dump.info_files("layer").get(lead, []):
                try:
                    with open(path, encoding="utf-8") as f:
                        _index_nodes(json.load(f), (), self._nodes)
                except (OSError, ValueError):
                    continue
        return self._nodes.get(self._place(rnd, op_path), {})

    def _place(self, rnd: Round, op_path: str) -> tuple:
        """An op's place in its layer, as stable across rounds as the module calls are: the
        layer-level folder, then at each depth the name and how many siblings of that name ran
        before it (op IDs count kernels too, which differ from prefill to decode)."""
        children = self._children.get(rnd.index)
        if children is None:
            children = self._children[rnd.index] = _children(rnd)
        parts = op_path.split("/")
        place = [parts[0]]
        for depth in range(1, len(parts)):
            siblings = children.get("/".join(parts[:depth]), [])
            name = _op_type(parts[depth])
            before = siblings[:siblings.index(parts[depth])] if parts[depth] in siblings \
                else siblings
            place.append((name, sum(_op_type(s) == name for s in before)))
        return tuple(place)

    def _reduce_point(self, rnd: Round, op_path: str) -> int | None:
        """The order of the first output of the first reducing kernel below `op_path`."""
        key = (rnd.index, op_path)
        if key not in self._reduce_at:
            prefix = op_path + "/"
            self._reduce_at[key] = next(
                (op.outputs[0].order for op in rnd.ops
                 if op.op_path.startswith(prefix) and op.outputs
                 and _REDUCING.fullmatch(op.op_name.rsplit("/", 1)[-1])), None)
        return self._reduce_at[key]


def find_ranks(golden: Dump, target: Dump) -> RankGroup | None:
    """The side whose processes are the ranks of one run compared against one process on the
    other side; None when neither is (one process each, or ranks paired rank by rank)."""
    for role, many, few in ((Role.TARGET, target, golden), (Role.GOLDEN, golden, target)):
        if len(few.processes) == 1 and _are_ranks(many.processes):
            return RankGroup(role, many, parallel_plan(many))
    return None


def _are_ranks(processes: list[Process]) -> bool:
    """Devices 0..N-1 (N > 1), one process each, with the same round numbers and the same ops
    in the first (pipeline stages run different ops: those are paired process by process)."""
    if len(processes) < 2:
        return False
    if sorted(p.device for p in processes) != list(range(len(processes))):
        return False
    if len({tuple(r.index for r in p.rounds) for p in processes}) != 1 or \
            not processes[0].rounds:
        return False
    ops = {frozenset((op.op_id, op.op_name) for op in p.rounds[0].ops) for p in processes}
    return len(ops) == 1


def parallel_plan(dump: Dump) -> dict[str, str]:
    """The tensor-parallel plan of the dumped model (module path pattern -> style): the plan
    the model file records (`tpPlan`), else the one the `transformers` config class of its
    `model_type` declares (`base_model_tp_plan`); empty when neither is known."""
    params = []
    for files in dump.info_files("model").values():
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("tpPlan"), dict) and doc["tpPlan"]:
                return {str(k): str(v) for k, v in doc["tpPlan"].items()}
            if isinstance(doc, dict) and isinstance(doc.get("param"), dict):
                params.append(doc["param"])
    for param in params:
        plan = _config_plan(param.get("model_type"))
        if isinstance(plan, dict) and plan:
            return {str(k): str(v) for k, v in plan.items()}
    return {}


def _config_plan(model_type) -> dict | None:
    """`base_model_tp_plan` of the transformers config class of `model_type`."""
    if not isinstance(model_type, str):
        return None
    try:
        from transformers import CONFIG_MAPPING
        return getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
    except Exception:  # transformers missing, or a model type it does not know
        return None


def _style(plan: dict[str, str], module_path: str) -> str | None:
    """The plan's style for a module path: a pattern (`layers.*.self_attn.o_proj`, `*` one
    part) matching its last parts (`model.layers.0.self_attn.o_proj`)."""
    if not module_path or not plan:
        return None
    parts = module_path.split(".")
    for pattern, style in plan.items():
        want = pattern.split(".")
        if len(want) <= len(parts) and all(
                w == "*" or w == p for w, p in zip(want, parts[len(parts) - len(want):])):
            return style
    return None


def _index_nodes(node, parent: tuple, into: dict[tuple, dict]) -> None:
    """Every node of a structure file by its place (`RankGroup._place`): `opName` is
    `<opType>_<full ID>`, children are in execution order."""
    if not isinstance(node, dict):
        return
    name, kind = str(node.get("opName", "")), str(node.get("opType", ""))
    if not parent:
        own_id = name[len(kind) + 1:] if name.startswith(kind + "_") else name
        place: tuple = (layout.op_folder(own_id, kind),)
    else:
        place = parent
    into[place] = node
    seen: dict[str, int] = {}
    for child in node.get("nodes") or ():
        if isinstance(child, dict):
            kind = str(child.get("opType", ""))
            _index_nodes(child, place + ((kind, seen.get(kind, 0)),), into)
            seen[kind] = seen.get(kind, 0) + 1


def _children(rnd: Round) -> dict[str, list[str]]:
    """The folders (`<own id>_<name>`) of the ops directly below each op of a round, in ID
    order (execution order), as far as the round's rows show them."""
    found: dict[str, set[str]] = {}
    for op in rnd.ops:
        parts = op.op_path.split("/")
        for depth in range(1, len(parts)):
            found.setdefault("/".join(parts[:depth]), set()).add(parts[depth])
    return {parent: sorted(names, key=lambda f: (int(f.partition("_")[0]), f))
            for parent, names in found.items()}


def _op_type(folder: str) -> str:
    """`RowParallelLinear` of `3_RowParallelLinear`."""
    return folder.partition("_")[2]
