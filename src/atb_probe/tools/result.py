"""What one run of compare hands to its renderers: the rows, the alignment's leftovers, the
verdict and the scan, with the counts and summary lines every renderer shows.

The stages each have their own module and this one takes their records: comparison.py (the
records all stages share), divergence.py (the verdict), scan.py (NaN/Inf and overflow),
triage.py (what was read). compare.py
assembles it; resulttable.py and report.py read it. Imports go one way: nothing below imports
this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .comparison import CompareMode, PairMode, PairResult, RoundNumbers, Thresholds, Unmatched
from .divergence import Finding, Unjudged
from .scan import RoundScan
from .shards import JoinedRanks
from .triage import TriageReport

if TYPE_CHECKING:
    from .culprit import CulpritSearch


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
    unjudged: list[Unjudged] = field(default_factory=list)   # ops whose outputs have no metrics
    pairing: str = "by round number"          # how rounds were paired (align.RoundPairing)
    conventions: str = ""                      # the op map in force: `vLLM against ... (built in)`
    ranks: JoinedRanks | None = None           # one side's ranks joined into one
    replay: CulpritSearch | None = None        # `--replay`: the culprit search (culprit.py)
    triage: TriageReport | None = None         # what the triage read; None: every pair (--full)

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
        lines = [("golden", self.golden), ("target", self.target)]
        if self.ranks is not None:
            lines += [(f"{self.ranks.role} ranks", self.ranks.describe()),
                      ("tensors whose ranks could not be joined",
                       str(len(self.ranks.undecided)))]
        return lines + [
            ("rounds compared", rounds or "none"),
            ("rounds paired", self.pairing),
            ("tensors compared", str(len(self.rows))),
            ("tensors read", self.triage.text() if self.triage else "all (full comparison)"),
            ("tensor mode", str(c.tensor)), ("statistics mode", str(c.statistics)),
            ("no data", str(c.no_data)), ("crossing the thresholds", str(c.crossing)),
            ("ops paired by name, map or order (structures differ)",
             str(self.name_matched_ops)),
            ("conventions", self.conventions or "none"),
            ("unmatched entries", str(sum(1 for u in self.unmatched if not u.expected))),
            ("no counterpart by convention", str(sum(1 for u in self.unmatched if u.expected))),
            ("thresholds", self.thresholds.describe()),
            ("ops that could not be judged", str(len(self.unjudged))),
            ("first divergence", self.verdict_text())]

    def verdict_text(self) -> str:
        """The verdict in one paragraph: the finding, or why there is none and what that
        leaves unsaid."""
        if self.finding is not None:
            return self.finding.summary()
        text = f"no divergence: no compared output crosses {self.thresholds.describe()}"
        unknown = self.without_metrics()
        if unknown:
            n = len(unknown)
            text += (f"; but {n} paired op{'s' if n > 1 else ''} could not be judged (outputs "
                     f"without metrics), the first: {unknown[0].where()} ({unknown[0].why})")
        return text

    def without_metrics(self) -> list[Unjudged]:
        """The ops that could not be judged although the golden run has them (those it has
        not are unmatched entries as well)."""
        return [u for u in self.unjudged if u.paired]
