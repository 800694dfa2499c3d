"""The records every stage of a comparison shares: a pair of tensors and its result, what could
not be paired (Unmatched), the thresholds, and the closed sets they are described by. Pure data,
at the bottom of the pipeline: alignment (align.py), conventions (opmap.py), the verdict
(divergence.py) and the scan (scan.py) import these records and none of them is imported here;
result.py gathers a whole comparison for the renderers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce

import numpy as np

from ..layout import Side
from ..statcsv import Stats
from . import StrEnum
from .metrics import StatsDiff, TensorMetrics


class CompareError(Exception):
    """A user error: the message says what to give instead."""


class CompareMode(StrEnum):
    """What `compare --mode` asks for (compare.py)."""

    AUTO = "auto"                # tensor metrics where both sides have the bytes, else statistics
    TENSOR = "tensor"            # tensor metrics only
    STATISTICS = "statistics"    # statistics differences, from the csv where it has them


class PairMode(StrEnum):
    """How one pair of tensors was compared: the Compare Mode column."""

    TENSOR = "tensor"
    STATISTICS = "statistics"
    NO_DATA = "no data"


class MatchMethod(StrEnum):
    """How the ops of a pair were paired, there or above (align.py): the Match column. Listed
    from the surest to the loosest."""

    ID = "id"
    NAME = "name"
    MAP = "map"                  # the op map named them
    ORDER = "order"              # execution order and output shapes

    def looser(self, other: MatchMethod) -> MatchMethod:
        """The looser of two methods: what a pair made by `other` below a pair made by this
        one was made by."""
        return max(self, other, key=_MATCH_RANK.__getitem__)

    @property
    def same_code(self) -> bool:
        """Whether the two ops are the same code (paired by ID or name), whose tensors have the
        same layout, rather than two implementations of one computation."""
        return self in (MatchMethod.ID, MatchMethod.NAME)


_MATCH_RANK = {method: rank for rank, method in enumerate(MatchMethod)}


class Role(StrEnum):
    """Which of the two dumps."""

    GOLDEN = "golden"            # the reference
    TARGET = "target"            # the dump to check

    def other(self) -> Role:
        return Role.TARGET if self == Role.GOLDEN else Role.GOLDEN


class CutDims(StrEnum):
    """Which dimensions of a tensor a `TokenSlice` cuts."""

    FLAT = "flat"                # dim 0 is the tokens: `[num_tokens, hidden]`
    BATCH = "batch"              # dim 0 the batch row, dim 1 its tokens: `[batch, seq, hidden]`
    ROW = "row"                  # dim 0 the request's row only: a tensor not per token


@dataclass(frozen=True, slots=True)
class TokenSlice:
    """The part of a dumped tensor one request's tokens hold: tokens `[start, stop)` along the
    token dimension (of batch row `row`). A cut row keeps its dimension (`1 x stop-start x
    hidden`), so it meets the tensor of a run that ran the request alone in the same shape."""

    dims: CutDims
    row: int = 0
    start: int = 0
    stop: int = 0

    def apply(self, array):
        """The slice of an array (numpy, or anything indexed alike) of the dumped shape."""
        if self.dims == CutDims.FLAT:
            return array[self.start:self.stop]
        if self.dims == CutDims.BATCH:
            return array[self.row:self.row + 1, self.start:self.stop]
        return array[self.row:self.row + 1]

    def shape(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the slice of a tensor of shape `dims`."""
        if self.dims == CutDims.FLAT:
            return (self.stop - self.start,) + dims[1:]
        if self.dims == CutDims.BATCH:
            return (1, self.stop - self.start) + dims[2:]
        return (1,) + dims[1:]


@dataclass(frozen=True, slots=True)
class Positions:
    """Positions `[start, stop)` of a request's sequence (0: its prompt's first token)."""

    start: int
    stop: int

    def __str__(self) -> str:
        """`0-6` (both ends included), or `7` for one token."""
        last = self.stop - 1
        return str(self.start) if last == self.start else f"{self.start}-{last}"


class DeriveKind(StrEnum):
    """How a derived tensor is computed from its parts."""

    SUM = "sum"
    CONCAT = "concat"
    SLICE = "slice"


@dataclass(frozen=True, slots=True)
class Derivation:
    """What turns the parts' arrays into the derived tensor."""

    kind: DeriveKind
    dim: int = -1
    start: int | None = None
    stop: int | None = None

    def apply(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The derived array; ValueError when the parts do not fit together."""
        if self.kind == DeriveKind.SUM:
            shapes = {a.shape for a in arrays}
            if len(shapes) > 1:
                raise ValueError(f"cannot add tensors of shapes {sorted(shapes)}")
            return reduce(np.add, arrays)
        if self.kind == DeriveKind.CONCAT:
            return np.concatenate(arrays, axis=self.dim)
        (array,) = arrays
        index = [slice(None)] * array.ndim
        index[self.dim] = slice(self.start, self.stop)
        return array[tuple(index)]

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The derived tensor's shape from its parts' shapes."""
        first = list(shapes[0])
        if self.kind == DeriveKind.SUM or not first:
            return tuple(first)
        dim = self.dim % len(first)
        if self.kind == DeriveKind.CONCAT:
            first[dim] = sum(s[dim] for s in shapes)
        else:
            first[dim] = len(range(first[dim])[self.start:self.stop])
        return tuple(first)

    def stats(self, parts: list[Stats | None], sizes: list[int]) -> Stats | None:
        """The statistics of a concatenation from its parts'; None for the other kinds (the
        norm of a sum or of a slice is not known from the parts' statistics)."""
        if self.kind != DeriveKind.CONCAT or any(s is None for s in parts) or not sum(sizes):
            return None
        return Stats(max(s.max for s in parts), min(s.min for s in parts),
                     sum(s.mean * n for s, n in zip(parts, sizes)) / sum(sizes),
                     math.sqrt(sum(s.norm ** 2 for s in parts)))


class Join(StrEnum):
    """How the pieces of one tensor on the ranks of one run make the whole (shards.py)."""

    CONCAT = "concat"            # each rank holds a slice along one dimension
    SUM = "sum"                  # each rank holds a partial result
    REPLICATED = "replicated"    # each rank holds all of it


@dataclass(frozen=True, slots=True)
class Pieces:
    """A tensor held by the ranks of one run: every rank's file and how they join; `join` None
    when that could not be decided (`reason` says why; such a tensor is never compared)."""

    join: Join | None
    dim: int                     # the dimension of a CONCAT
    paths: tuple[str | None, ...]   # every rank's .bin, rank 0 first
    reason: str                  # what decided the join, or why none could be
    # A fused module's CONCAT (vLLM's QKVParallelLinear): each rank holds a slice of each part
    # one after the other; per part, its width on a rank and the ranks that share one slice
    # (a key/value head replicated over several ranks). None: plain pieces.
    fused: tuple[tuple[int, int], ...] | None = None


@dataclass(slots=True)
class TensorRef:
    """What the comparison needs of one dumped tensor; small, so it crosses to a worker
    process cheaply (a `TensorRecord` drags its whole round along)."""

    data_name: str               # `2_LlamaDecoderLayer/1_LlamaAttention/output.0`
    process: str                 # `0_1234`
    round_index: int
    dtype: str
    shape: str                   # the Shape cell: `1x4x32`
    stats: Stats | None          # from statistic.csv
    path: str | None             # the .bin, None when there is none
    order: int                   # position in its round, execution order
    layer: str                   # `2_LlamaDecoderLayer`
    io: Side
    parts: tuple[TensorRef, ...] = ()   # a derived tensor: the tensors it is computed from
    derive: Derivation | None = None    # and how (opmap.py)
    pieces: Pieces | None = None  # a tensor of several ranks: shape and stats are the whole's
    cut: TokenSlice | None = None   # the part compared, when not the whole tensor

    @classmethod
    def of(cls, record) -> TensorRef:
        """The ref of a dumpreader.TensorRecord or of an opmap.DerivedTensor."""
        parts = getattr(record, "parts", ())
        return cls(record.data_name, record.round.process.name, record.round.index,
                   record.dtype, record.shape, record.stats, record.path, record.order,
                   record.layer, record.io, parts=tuple(cls.of(p) for p in parts),
                   derive=getattr(record, "derive", None))


@dataclass(slots=True)
class RefPair:
    """A pair of tensors to compare, as it goes to a worker process."""

    golden: TensorRef
    target: TensorRef
    match: MatchMethod           # how their ops were paired


@dataclass(slots=True)
class PairResult:
    """The comparison of one pair of tensors: a row of the result table."""

    golden: TensorRef
    target: TensorRef
    match: MatchMethod
    mode: PairMode = PairMode.NO_DATA
    metrics: TensorMetrics = field(default_factory=TensorMetrics)
    diffs: StatsDiff = field(default_factory=StatsDiff)
    golden_stats: Stats | None = None   # from the data when it was read, else from the csv
    target_stats: Stats | None = None
    diverged: bool | None = None        # None: nothing to judge by
    note: str = ""
    request: str = ""                   # rounds paired by tokens: the request compared ("1")
    positions: Positions | None = None  # ... and its positions; None: the whole tensors

    def ref(self, role: Role) -> TensorRef:
        """The tensor of one side."""
        return self.golden if role == Role.GOLDEN else self.target

    def stats(self, role: Role) -> Stats | None:
        """The statistics of one side."""
        return self.golden_stats if role == Role.GOLDEN else self.target_stats

    def round_cell(self, role: Role) -> str:
        """The round of one side as the result table shows it: `3`, or `3[req 1, pos 0-6]`
        when that side's tensor was cut to the request's tokens."""
        ref = self.ref(role)
        if ref.cut is None or not self.request:
            return str(ref.round_index)
        return f"{ref.round_index}[req {self.request}, pos {self.positions}]"

    def rounds_text(self) -> str:
        """Where the pair was compared: the target's round, or both sides' rounds (golden
        first) with the request's tokens when rounds were paired by tokens."""
        if not self.request:
            return str(self.target.round_index)
        text = f"{self.round_cell(Role.GOLDEN)} ~ {self.round_cell(Role.TARGET)}"
        if self.golden.cut is None and self.target.cut is None:
            text += f" (req {self.request}, pos {self.positions})"
        return text

    @property
    def order(self) -> int:
        return self.target.order

    @property
    def io(self) -> Side:
        return self.target.io

    @property
    def layer(self) -> str:
        return self.target.layer

    @property
    def round_index(self) -> int:
        return self.target.round_index

    @property
    def name(self) -> str:
        """The target tensor's name: `<op path>/output.0`."""
        return self.target.data_name

    @property
    def op_path(self) -> str:
        return self.target.data_name.rsplit("/", 1)[0]

    @property
    def golden_op_path(self) -> str:
        return self.golden.data_name.rsplit("/", 1)[0]


@dataclass(frozen=True, slots=True)
class RoundNumbers:
    """The indexes of a pair of compared rounds."""

    golden: int
    target: int


class UnmatchedKind(StrEnum):
    """What an unmatched entry stands for."""

    PROCESS = "process"
    ROUND = "round"
    OP = "op"                    # an op and its subtree
    TENSOR = "tensor"
    REQUEST = "request"          # rounds paired by tokens: a request the other run never ran
    TOKENS = "tokens"            # ... positions of a request the other run never ran

    @property
    def reason(self) -> str:
        """Why an entry of this kind is left over, in words."""
        return _UNMATCHED_REASONS.get(self, "")


_UNMATCHED_REASONS = {
    UnmatchedKind.PROCESS: "the other dump has no process left on its device",
    UnmatchedKind.ROUND: "the other dump has no round of this number in the paired process",
    UnmatchedKind.OP: "no op of the other dump pairs with it (by ID, name, map, or order and "
                      "output shapes)",
    UnmatchedKind.TENSOR: "its op is paired, but no tensor of the other op pairs with it",
    UnmatchedKind.REQUEST: "the other run never ran a request of this prompt",
    UnmatchedKind.TOKENS: "the other run never ran these positions of the request, or the "
                          "request's prompt is not known",
}


@dataclass(slots=True)
class Unmatched:
    """Something only one side has, left over by the alignment (align.py): a process, a round,
    an op subtree or a tensor."""

    side: Role                   # the side that has it
    kind: UnmatchedKind
    where: str                   # `0_1234/0`
    what: str                    # the op path or tensor name
    count: int = 1               # ops (or tensors) it stands for
    expected: bool = False       # the op map says it has no counterpart (by convention)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a compared tensor crosses (divergence.crosses)."""

    min_cosine: float = 0.99
    min_ratio: float = 0.9       # One Thousandth Err Ratio
    max_norm_err: float = 1.0    # Relative Err of Norm(%), statistics mode

    def describe(self) -> str:
        return (f"cosine < {self.min_cosine:g} or 1‰-ratio < {self.min_ratio:g} (tensor mode); "
                f"relative norm error > {self.max_norm_err:g}% (statistics mode)")
