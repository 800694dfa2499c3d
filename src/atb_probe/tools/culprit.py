"""`atb-probe compare GOLDEN TARGET --replay`: compare's first divergence, and the kernel that
made it (SPEC §10).

After compare, replay's culprit search (replay.py) runs on the target: its kernels, each rerun
from its own recorded inputs, paired with the golden's as compare paired them, in execution
order from compare's first divergence (from the start when nothing diverges) until the first
that introduced error beyond its dtype. What it found is one record, `CulpritSearch`, which
compare's renderers show beside the finding: the console line, the `replay` key of
`atb_compare_summary.json` (summary.py) and a box of the HTML report (report.py).

The search's verdict is the verdict of the kernel that decides it:

* `introduced here`: the culprit, the first kernel whose output is off its float64 reference;
* `inherited`: no kernel introduced error, and the first kernel whose output crosses against the
  golden computed what its inputs ask for: the input that carries the error is named (a changed
  weight shows up so);
* `within its dtype`: every kernel replayed agrees with its reference, and none crosses;
* `not replayed`: no kernel could be replayed (`why` says why: no kernels in the dump, a
  statistics dump, ...).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .conventions import choose, op_names
from .dumpreader import open_dump
from .opmap import OpMap
from .replay import (Bound, KernelResult, ReplaySettings, Verdict, kernel_jobs, replay_all,
                     start_at)
from .result import CompareResult

MAX_REASONS = 10             # (reason, detail) groups of "not replayed" listed


@dataclass(slots=True)
class CulpritSearch:
    """What replay's culprit search from compare's first divergence found."""

    started: str                          # where it began, as a line
    start: tuple[int, str] | None         # (round, target op path) it began at; None: the start
    bound: Bound
    results: list[KernelResult] = field(default_factory=list)
    why_none: str = ""                    # why no kernel was replayed at all
    golden_paired: bool = True            # False: kernels judged without the golden's tensors

    @property
    def culprit(self) -> KernelResult | None:
        return next((r for r in self.results if r.verdict == Verdict.INTRODUCED), None)

    @property
    def kernel(self) -> KernelResult | None:
        """The kernel that decides the verdict: the culprit, else the first that inherited."""
        return self.culprit or next((r for r in self.results if r.verdict == Verdict.INHERITED),
                                    None)

    @property
    def verdict(self) -> Verdict:
        kernel = self.kernel
        if kernel is not None:
            return kernel.verdict
        if self.why_none:
            return Verdict.SKIPPED
        return Verdict.CLEAN

    def counts(self) -> dict[Verdict, int]:
        found = Counter(r.verdict for r in self.results)
        return {v: found[v] for v in Verdict}

    def not_replayed(self) -> list[tuple[str, int, KernelResult]]:
        """(reason, how many, the first) of the kernels not replayed, grouped by reason and
        detail, most frequent first."""
        groups: dict[tuple[str, str], list[KernelResult]] = {}
        for r in self.results:
            if r.verdict == Verdict.SKIPPED:
                groups.setdefault((r.reason, r.detail), []).append(r)
        return sorted(((reason, len(g), g[0]) for (reason, _), g in groups.items()),
                      key=lambda item: -item[1])[:MAX_REASONS]

    def text(self) -> str:
        """The verdict in one line, for the console and the report."""
        kernel = self.kernel
        if self.verdict == Verdict.INTRODUCED:
            return f"culprit: {kernel.summary()}"
        if self.verdict == Verdict.INHERITED:
            return (f"no kernel introduced error beyond its dtype; the first to differ from the "
                    f"golden inherited it: {kernel.summary()}")
        if self.verdict == Verdict.SKIPPED:
            return f"no kernel could be replayed: {self.why_none}"
        return (f"no culprit: none of the {len(self.results)} kernels replayed introduced error "
                f"beyond its dtype")

    def as_dict(self) -> dict:
        """The `replay` object of atb_compare_summary.json (keys in docs/analysis.md)."""
        kernel = self.kernel
        doc = None
        if kernel is not None:
            doc = kernel.as_dict()
            doc["op_name"] = kernel.job.op_path.rsplit("/", 1)[-1].partition("_")[2]
        return {
            "verdict": str(self.verdict),
            "text": self.text(),
            "started_from": None if self.start is None else
            {"round": self.start[0], "target_op_path": self.start[1]},
            "start": self.started,
            "kernels": len(self.results),
            "verdicts": {str(v): n for v, n in self.counts().items()},
            "bound": {"margin": self.bound.margin, "ulps": self.bound.ulps,
                      "text": self.bound.describe()},
            "golden_paired": self.golden_paired,
            "kernel": doc,
            "why": self.why_none or None,
            "not_replayed": [{"reason": reason, "count": n, "first_op_path": first.job.op_path,
                              "detail": first.detail}
                             for reason, n, first in self.not_replayed()],
        }


def search(result: CompareResult, settings: ReplaySettings, jobs: int = 1,
           opmap: OpMap | None = None, conventions: bool = True) -> CulpritSearch:
    """Replay the target of `result` from its first divergence to the first kernel that
    introduced error, its kernels paired with the golden's as compare paired them (`opmap`,
    `conventions`: as compare was given them)."""
    target = open_dump(result.target)
    golden = open_dump(result.golden)
    # A side of joined ranks is one whole only in compare's loader: the kernels are then
    # judged without the golden's tensors.
    paired = result.ranks is None
    chosen = choose(op_names(golden), op_names(target), opmap, automatic=conventions)
    all_jobs = kernel_jobs(target, golden if paired else None, chosen and chosen.opmap,
                           chosen and chosen.left)
    finding = result.finding
    start = None if finding is None else (finding.round_index, finding.op_path)
    if not all_jobs:
        return CulpritSearch("", start, settings.bound, golden_paired=paired,
                             why_none="the target holds no kernel: dump it with save_child "
                                      "true and task tensor or all")
    todo, line = start_at(all_jobs, finding, target)
    found = CulpritSearch(line, start, settings.bound, golden_paired=paired)
    if not todo:
        found.why_none = line
        return found
    found.results = replay_all(todo, settings, jobs, stop_at_culprit=True)
    if all(r.verdict == Verdict.SKIPPED for r in found.results):
        found.why_none = f"none of the {len(found.results)} kernels could be replayed: " + \
            "; ".join(f"{reason} ({n}): {first.detail}"
                      for reason, n, first in found.not_replayed())
    return found
