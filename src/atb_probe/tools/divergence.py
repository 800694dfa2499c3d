"""The first diverging operator: where a precision problem starts, not where it shows.

A compared tensor *crosses* the thresholds when (tensor mode) its cosine similarity is below
`min_cosine` or its share of elements within 1‰ relative error is below `min_ratio`, or NaN/Inf
appear in one run only; (statistics mode) when the relative error of its L2 norm is above
`max_norm_err` percent. A tensor without data on both sides crosses nothing (unknown).

An error, once made, flows into everything computed after it, so the ops to look at are those
whose output crosses while none of their inputs does: the op itself turned good inputs into a bad
output. The first of them in execution order — ops ordered by the moment they finished, so a
child op comes before the layer that contains it — is *the first divergence*.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .comparison import PairMode, PairResult, Positions, Thresholds


def crosses(row: PairResult, th: Thresholds) -> bool | None:
    """Whether one compared pair crosses the thresholds; None: no data."""
    if row.mode == PairMode.TENSOR:
        if row.note.startswith("nan_mismatch"):
            return True
        cos, ratio = row.metrics.cosine, row.metrics.one_thousandth_ratio
        if cos is None and ratio is None:
            return None
        return (cos is not None and cos < th.min_cosine) or \
            (ratio is not None and ratio < th.min_ratio)
    if row.mode == PairMode.STATISTICS:
        if row.golden_stats is None or row.target_stats is None:
            return None
        g, t = row.golden_stats.norm, row.target_stats.norm
        if not math.isfinite(t) or not math.isfinite(g):
            return math.isfinite(g) != math.isfinite(t)
        rel = row.diffs.norm_rel_pct
        if rel is None:               # golden norm 0
            return t != 0
        return rel > th.max_norm_err
    return None


@dataclass(slots=True)
class Finding:
    """The op to look at first, with the row of its worst output."""

    round_index: int
    op_path: str                 # target's op path: `3_LlamaDecoderLayer/1_LlamaAttention/6_Linear`
    golden_op_path: str
    row: PairResult              # the first crossing output
    inputs_clean: bool           # False: no op had clean inputs; this is the first crossing one
    order: int                   # position in the target round
    first_inside: str = ""       # the first crossing tensor within the op (a child's), if any
    request: str = ""            # rounds paired by tokens: the request whose tokens crossed
    positions: Positions | None = None   # ... and their positions

    def where(self) -> str:
        """The op of both sides: `3_Prefill_layer ↔ 4_LlamaDecoderLayer` (target first), or the
        one path when both runs name it alike."""
        if self.golden_op_path == self.op_path:
            return self.op_path
        return f"{self.op_path} ↔ {self.golden_op_path}"

    def summary(self) -> str:
        """One line for the console and the report."""
        r = self.row
        m = r.metrics
        if r.mode == PairMode.TENSOR:
            cos = "N/A" if m.cosine is None else f"{m.cosine:.6f}"
            ratio = m.one_thousandth_ratio
            ratio_text = "N/A" if ratio is None else f"{ratio:.4f}"
            what = f"cosine {cos}, 1‰-ratio {ratio_text}, max abs err {_number(m.max_abs_err)}"
        elif r.diffs.norm_rel_pct is None and r.golden_stats and r.target_stats:
            what = (f"norm {_number(r.target_stats.norm)} against the golden "
                    f"{_number(r.golden_stats.norm)}")
        else:
            what = f"relative norm error {_number(r.diffs.norm_rel_pct)}%"
        where = f"round {r.rounds_text()}, {self.where()} ({r.name.rsplit('/', 1)[1]})"
        if self.inputs_clean:
            inside = (f"; inside it, {self.first_inside} is the first to differ"
                      if self.first_inside else "")
            return f"first divergence: {where}: {what}; its inputs match{inside}"
        return (f"first crossing op: {where}: {what}; its inputs already differ, so the error "
                "starts before the first dumped op (model inputs, or an op that was not dumped)")


@dataclass(slots=True)
class OpRows:
    """A compared op pair with the rows of its inputs and outputs (judged: `diverged` set)."""

    round_index: int
    op_path: str                 # the target's
    golden_op_path: str
    inputs: list[PairResult]
    outputs: list[PairResult]
    request: str = ""            # rounds paired by tokens: the request compared
    positions: Positions | None = None   # ... and its positions

    @property
    def finished(self) -> tuple[int, int]:
        """When the op finished, as (round, order): its first output's order, or its last
        input's when it has no outputs compared."""
        done = min((r.order for r in self.outputs), default=None)
        if done is None:
            done = max((r.order for r in self.inputs), default=0)
        return self.round_index, done


def first_divergence(ops: Iterable[OpRows], th: Thresholds) -> Finding | None:
    """The first op (of `ops`, in execution order: `OpRows.finished`) whose outputs cross while
    its inputs do not.

    Its child ops and kernels come before it in that order and, with inputs of their own (a
    weight), may cross too without being the first divergence themselves; `first_inside`
    (filled by the caller) names the earliest of them."""
    fallback = None
    for op in ops:
        bad_out = [r for r in op.outputs if r.diverged]
        if not bad_out:
            continue
        clean = not any(r.diverged for r in op.inputs)
        finding = Finding(op.round_index, op.op_path, op.golden_op_path, bad_out[0], clean,
                          bad_out[0].order, request=op.request, positions=op.positions)
        if clean:
            return finding
        fallback = fallback or finding
    return fallback


def _number(value) -> str:
    return "N/A" if value is None else f"{value:.6g}"
