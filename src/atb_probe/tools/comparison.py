"""What a comparison of two dumps produces: one record per pair of tensors and the result as a
whole, and the closed sets they are described by. Pure data: the pipeline (compare.py) fills
these records, the renderers (resulttable.py for the CSV and .xlsx, report.py for the HTML page)
read them; none of them imports another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..layout import Side
from ..statcsv import Stats
from . import StrEnum
from .metrics import StatsDiff, TensorMetrics

if TYPE_CHECKING:
    from .align import Unmatched
    from .divergence import Finding, Thresholds
    from .opmap import Derivation
    from .scan import RoundScan


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

    @classmethod
    def of(cls, record) -> TensorRef:
        """The ref of a dumpreader.TensorRecord or of an opmap.DerivedTensor."""
        parts = getattr(record, "parts", ())
        return cls(record.data_name, record.round.process.name, record.round.index,
                   record.dtype, record.shape, record.stats, record.path, record.order,
                   record.layer, record.io, tuple(cls.of(p) for p in parts),
                   getattr(record, "derive", None))


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

    def ref(self, role: Role) -> TensorRef:
        """The tensor of one side."""
        return self.golden if role == Role.GOLDEN else self.target

    def stats(self, role: Role) -> Stats | None:
        """The statistics of one side."""
        return self.golden_stats if role == Role.GOLDEN else self.target_stats

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


@dataclass(slots=True)
class Counts:
    """How many rows were compared each way, and how many cross the thresholds."""

    tensor: int = 0
    statistics: int = 0
    no_data: int = 0
    crossing: int = 0


@dataclass(slots=True)
class CompareResult:
    golden: str
    target: str
    mode: CompareMode
    thresholds: Thresholds
    rows: list[PairResult]                     # in execution order: round, then target order
    unmatched: list[Unmatched]
    finding: Finding | None
    rounds: list[RoundNumbers] = field(default_factory=list)
    name_matched_ops: int = 0                  # op pairs made by name, map or order, not by ID
    scan: list[RoundScan] = field(default_factory=list)   # of each side's compared rounds
    jobs: int = 1
    conventions: str = ""                      # the op map in force: `vLLM against ... (built in)`

    def counts(self) -> Counts:
        counts = Counts()
        for r in self.rows:
            if r.mode == PairMode.TENSOR:
                counts.tensor += 1
            elif r.mode == PairMode.STATISTICS:
                counts.statistics += 1
            else:
                counts.no_data += 1
            counts.crossing += r.diverged is True
        return counts

    def summary_lines(self) -> list[tuple[str, str]]:
        """(item, value) lines of the summary, for the console, the .xlsx and the report."""
        c = self.counts()
        rounds = ", ".join(f"{r.golden}~{r.target}" if r.golden != r.target else str(r.golden)
                           for r in self.rounds)
        return [("golden", self.golden), ("target", self.target),
                ("rounds compared", rounds or "none"),
                ("tensors compared", str(len(self.rows))),
                ("tensor mode", str(c.tensor)), ("statistics mode", str(c.statistics)),
                ("no data", str(c.no_data)), ("crossing the thresholds", str(c.crossing)),
                ("ops paired by name, map or order (structures differ)",
                 str(self.name_matched_ops)),
                ("conventions", self.conventions or "none"),
                ("unmatched entries", str(sum(1 for u in self.unmatched if not u.expected))),
                ("no counterpart by convention",
                 str(sum(1 for u in self.unmatched if u.expected))),
                ("thresholds", self.thresholds.describe()),
                ("first divergence", self.finding.summary() if self.finding else "none")]
