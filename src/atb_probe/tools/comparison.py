"""What a comparison of two dumps produces: one record per pair of tensors and the result as a
whole. Pure data: the pipeline (compare.py) fills these records, the renderers (resulttable.py
for the CSV and .xlsx, report.py for the HTML page) read them; none of them imports another.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .divergence import Finding, Thresholds
from .metrics import Stats, StatsDiff, TensorMetrics


class CompareError(Exception):
    """A user error: the message says what to give instead."""


@dataclass(slots=True)
class TensorRef:
    """What the comparison needs of one dumped tensor; small, so it crosses to a worker
    process cheaply (a `TensorRecord` drags its whole round along)."""

    data_name: str               # `2_LlamaDecoderLayer/1_LlamaAttention/output.0`
    process: str                 # `0_1234`
    round_index: int
    dtype: str
    shape: str                   # `1x4x32`
    stats: Stats | None          # from statistic.csv
    path: str | None             # the .bin, None when there is none
    order: int                   # position in its round, execution order
    layer: str                   # `2_LlamaDecoderLayer`
    io: str                      # input | output

    @classmethod
    def of(cls, record) -> "TensorRef":
        """The ref of a dumpreader.TensorRecord."""
        return cls(record.data_name, record.round.process.name, record.round.index,
                   record.dtype, record.shape, record.stats, record.path, record.order,
                   record.layer, record.io)


@dataclass(slots=True)
class PairResult:
    """The comparison of one pair of tensors: a row of the result table."""

    golden: TensorRef
    target: TensorRef
    match: str                   # how their ops were paired: id | name | map | order
    mode: str = "no data"        # tensor | statistics | no data
    metrics: TensorMetrics = field(default_factory=TensorMetrics)
    diffs: StatsDiff = field(default_factory=StatsDiff)
    golden_stats: Stats | None = None   # from the data when it was read, else from the csv
    target_stats: Stats | None = None
    diverged: bool | None = None        # None: nothing to judge by
    note: str = ""

    @property
    def order(self) -> int:
        return self.target.order

    @property
    def io(self) -> str:
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


@dataclass(slots=True)
class CompareResult:
    golden: str
    target: str
    mode: str
    thresholds: Thresholds
    rows: list[PairResult]                     # in execution order: round, then target order
    unmatched: list                            # align.Unmatched
    finding: Finding | None
    rounds: list[tuple[int, int]] = field(default_factory=list)   # (golden, target) round ids
    name_matched_ops: int = 0                  # op pairs made by name, map or order, not by ID
    scan: list = field(default_factory=list)   # scan.RoundScan of each side's rounds
    jobs: int = 1

    def counts(self) -> dict[str, int]:
        out = {"tensor": 0, "statistics": 0, "no data": 0, "crossing": 0}
        for r in self.rows:
            out[r.mode] += 1
            out["crossing"] += r.diverged is True
        return out

    def summary_lines(self) -> list[tuple[str, str]]:
        """(item, value) lines of the summary, for the console, the .xlsx and the report."""
        c = self.counts()
        return [("golden", self.golden), ("target", self.target),
                ("rounds compared", ", ".join(f"{g}~{t}" if g != t else str(g)
                                              for g, t in self.rounds) or "none"),
                ("tensors compared", str(len(self.rows))),
                ("tensor mode", str(c["tensor"])), ("statistics mode", str(c["statistics"])),
                ("no data", str(c["no data"])), ("crossing the thresholds", str(c["crossing"])),
                ("ops paired by name, map or order (structures differ)",
                 str(self.name_matched_ops)),
                ("unmatched entries", str(len(self.unmatched))),
                ("thresholds", self.thresholds.describe()),
                ("first divergence", self.finding.summary() if self.finding else "none")]
