"""The verdict of a comparison: where a precision problem starts, not where it shows.

A compared tensor *crosses* the thresholds when (tensor mode) its cosine similarity is below
`min_cosine` or its share of elements within 1‰ relative error is below `min_ratio`, or NaN/Inf
appear in one run only; (statistics mode) when the relative error of its L2 norm is above
`max_norm_err` percent. A tensor without metrics (no data, shapes that differ) is *unknown*:
neither crossing nor clean.

An error, once made, flows into everything computed after it, so the ops to look at are those
whose output crosses while none of their inputs does: the op itself turned good inputs into a bad
output. The first of them in execution order — ops ordered by the moment they finished, so a
child op comes before the layer that contains it — is *the first divergence*.

The verdict never guesses. The walk over the ops keeps the ops it could not judge (outputs
without metrics, or no counterpart in the golden run); a crossing op whose inputs are unknown
is named as such, with the input that could not be compared, and one whose inputs already
cross is traced back to the last op that could not be judged before it. "Before the first
dumped op" is said only of the first op of its round whose inputs cross.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..statcsv import is_empty_shape
from . import StrEnum
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


class InputState(StrEnum):
    """What the inputs of a crossing op say about where its error comes from."""

    CLEAN = "clean"              # all compared, none crosses: the op made the error
    UNKNOWN = "unknown"          # none crosses, but some could not be compared
    CROSSING = "crossing"        # some already cross: the error came in with them


@dataclass(frozen=True, slots=True)
class Unjudged:
    """An op whose outputs could not be compared: whether it went wrong is not known."""

    round_index: int
    op_path: str                 # the target's
    golden_op_path: str          # "" when the golden run has no counterpart
    why: str                     # `shape differs: golden (1, 4, 32), target (4, 32)`

    @property
    def paired(self) -> bool:
        """Whether the golden run has the op (its outputs have no metrics), rather than none
        (the op is also an unmatched entry)."""
        return bool(self.golden_op_path)

    def where(self) -> str:
        """`round 0, 3_LlamaDecoderLayer` (both sides' paths when they differ)."""
        return f"round {self.round_index}, {_both(self.op_path, self.golden_op_path)}"


class Metric(StrEnum):
    """The number that makes a row cross (`crossing`)."""

    COSINE = "cosine"
    RATIO = "one_thousandth_ratio"
    NORM_REL_PCT = "norm_rel_pct"
    NORM = "norm"                # the target's norm, where the golden's is 0 or not finite
    NAN_MISMATCH = "nan_mismatch"   # NaN/Inf in one run only: no value


@dataclass(frozen=True, slots=True)
class Crossing:
    metric: Metric
    value: float | None


def crossing(row: PairResult, th: Thresholds) -> Crossing | None:
    """Which number makes a row cross, and its value; None when it does not cross."""
    if not crosses(row, th):
        return None
    if row.mode == PairMode.TENSOR:
        cos = row.metrics.cosine
        if row.note.startswith("nan_mismatch"):
            return Crossing(Metric.NAN_MISMATCH, None)
        if cos is not None and cos < th.min_cosine:
            return Crossing(Metric.COSINE, cos)
        return Crossing(Metric.RATIO, row.metrics.one_thousandth_ratio)
    if row.diffs.norm_rel_pct is None or not math.isfinite(row.target_stats.norm) \
            or not math.isfinite(row.golden_stats.norm):
        return Crossing(Metric.NORM, row.target_stats.norm)
    return Crossing(Metric.NORM_REL_PCT, row.diffs.norm_rel_pct)


@dataclass(slots=True)
class Finding:
    """The op to look at first, with the row of its worst output."""

    round_index: int
    op_path: str                 # target's op path: `3_LlamaDecoderLayer/1_LlamaAttention/6_Linear`
    golden_op_path: str
    row: PairResult              # the first crossing output
    inputs: InputState
    order: int                   # position in the target round
    first_inside: str = ""       # the first crossing tensor within the op (a child's), if any
    unknown_input: PairResult | None = None    # UNKNOWN: the first input without metrics
    unjudged: Unjudged | None = None   # not CLEAN: the last op before it that was not judged
    unjudged_before: int = 0     # how many ops before it could not be judged
    first_op: bool = False       # no compared op of its round finished before it
    then_clean: Finding | None = None  # UNKNOWN: the first later crossing op, inputs clean
    request: str = ""            # rounds paired by tokens: the request whose tokens crossed
    positions: Positions | None = None   # ... and their positions

    @property
    def inputs_clean(self) -> bool:
        return self.inputs == InputState.CLEAN

    def where(self) -> str:
        """The op of both sides: `3_Prefill_layer ↔ 4_LlamaDecoderLayer` (target first), or the
        one path when both runs name it alike."""
        return _both(self.op_path, self.golden_op_path)

    def metric(self) -> str:
        """The numbers that make its output cross."""
        r = self.row
        m = r.metrics
        if r.mode == PairMode.TENSOR:
            cos = "N/A" if m.cosine is None else f"{m.cosine:.6f}"
            ratio = m.one_thousandth_ratio
            ratio_text = "N/A" if ratio is None else f"{ratio:.4f}"
            return f"cosine {cos}, 1‰-ratio {ratio_text}, max abs err {_number(m.max_abs_err)}"
        if r.diffs.norm_rel_pct is None and r.golden_stats and r.target_stats:
            return (f"norm {_number(r.target_stats.norm)} against the golden "
                    f"{_number(r.golden_stats.norm)}")
        return f"relative norm error {_number(r.diffs.norm_rel_pct)}%"

    def summary(self) -> str:
        """One line for the console and the report."""
        where = f"round {self.row.rounds_text()}, {self.where()} ({_own_name(self.row)})"
        if self.inputs == InputState.CLEAN:
            return f"first divergence: {where}: {self.metric()}; {self.caveat()}"
        return f"first crossing op: {where}: {self.metric()}; {self.caveat()}"

    def caveat(self) -> str:
        """What its inputs say about where the error starts (the part of the summary after
        the metric)."""
        if self.inputs == InputState.CLEAN:
            inside = (f"; inside it, {self.first_inside} is the first to differ"
                      if self.first_inside else "")
            return f"its inputs match{inside}"
        if self.inputs == InputState.UNKNOWN:
            u = self.unknown_input
            text = (f"its input {_own_name(u)} could not be compared ({why_unknown(u)}), "
                    "so the error may start here or earlier")
            if self.unjudged is not None:
                text += f", {self._unjudged_text()}"
            if self.then_clean is not None:
                c = self.then_clean
                text += (f"; the first later crossing op whose inputs all match is "
                         f"round {c.row.rounds_text()}, {c.where()}")
            return text
        text = "its inputs already differ"
        if self.unjudged is not None:
            return f"{text}: the error may start {self._unjudged_text()}"
        if self.first_op:
            return (f"{text}, so the error starts before the first dumped op of the round "
                    "(model inputs, or an op that was not dumped)")
        return (f"{text}, and no compared op before it crosses: the error comes from an op that "
                "was not dumped or not paired (see the unmatched entries), or the model inputs")

    def _unjudged_text(self) -> str:
        u = self.unjudged
        more = self.unjudged_before - 1
        others = (f" ({more} earlier op{'s' if more > 1 else ''} could not be judged either)"
                  if more > 0 else "")
        return (f"at or before {u.where()}, whose outputs could not be compared ({u.why})"
                f"{others}")


@dataclass(slots=True)
class OpRows:
    """A compared op pair with the rows of its inputs and outputs (judged: `diverged` set).
    An op of the target with no counterpart has no rows, its `golden_op_path` is "" and
    `done` says when it finished."""

    round_index: int
    op_path: str                 # the target's
    golden_op_path: str
    inputs: list[PairResult]
    outputs: list[PairResult]
    done: int | None = None      # its position, when it has no rows to tell it
    request: str = ""            # rounds paired by tokens: the request compared
    positions: Positions | None = None   # ... and its positions

    @property
    def finished(self) -> tuple[int, int]:
        """When the op finished, as (round, order): its first output's order, or its last
        input's when it has no outputs compared."""
        done = min((r.order for r in self.outputs), default=None)
        if done is None:
            done = max((r.order for r in self.inputs), default=self.done or 0)
        return self.round_index, done

    def uncompared(self) -> str:
        """Why its outputs could not be judged; "" when they could (or one crosses)."""
        if not self.golden_op_path:
            return "the golden run has no counterpart"
        if any(r.diverged for r in self.outputs):
            return ""
        unknown = next((r for r in self.outputs if is_unknown(r)), None)
        return "" if unknown is None else f"{_own_name(unknown)}: {why_unknown(unknown)}"

    def input_state(self) -> tuple[InputState, PairResult | None]:
        """What its inputs say, and the first of them without metrics."""
        unknown = next((r for r in self.inputs if is_unknown(r)), None)
        if any(r.diverged for r in self.inputs):
            return InputState.CROSSING, unknown
        return (InputState.CLEAN if unknown is None else InputState.UNKNOWN), unknown


@dataclass(slots=True)
class Verdict:
    """The first divergence, if any, and the ops that could not be judged."""

    finding: Finding | None
    unjudged: list[Unjudged]     # in execution order


def judge(ops: Iterable[OpRows]) -> Verdict:
    """Walk `ops` (in execution order: `OpRows.finished`) for the first op whose outputs cross
    while none of its inputs does. Its inputs are clean, or some could not be compared: then the
    finding names that input, the last op before it that could not be judged, and the first
    later crossing op whose inputs are clean. With no such op, the finding is the first crossing
    op, traced back to the last op before it that could not be judged.

    The found op's child ops and kernels come before it in that order and, with inputs of their
    own (a weight), may cross too without being the first divergence themselves; `first_inside`
    (filled by the caller) names the earliest of them."""
    unjudged: list[Unjudged] = []
    clean = unknown = crossing = None
    seen_rounds: set[int] = set()
    for op in ops:
        first_op = op.round_index not in seen_rounds
        seen_rounds.add(op.round_index)
        why = op.uncompared()
        if why:
            unjudged.append(Unjudged(op.round_index, op.op_path, op.golden_op_path, why))
            continue
        bad_out = [r for r in op.outputs if r.diverged]
        if not bad_out or clean is not None:
            continue
        state, unknown_input = op.input_state()
        if state == InputState.CLEAN:
            clean = Finding(op.round_index, op.op_path, op.golden_op_path, bad_out[0], state,
                            bad_out[0].order, request=op.request, positions=op.positions)
            continue
        if (unknown if state == InputState.UNKNOWN else crossing) is not None:
            continue
        finding = Finding(op.round_index, op.op_path, op.golden_op_path, bad_out[0], state,
                          bad_out[0].order, unknown_input=unknown_input,
                          unjudged=unjudged[-1] if unjudged else None,
                          unjudged_before=len(unjudged), first_op=first_op,
                          request=op.request, positions=op.positions)
        if state == InputState.UNKNOWN:
            unknown = finding
        else:
            crossing = finding
    if unknown is not None:
        if clean is not None:
            unknown.then_clean = clean
        return Verdict(unknown, unjudged)
    return Verdict(clean or crossing, unjudged)


def is_unknown(row: PairResult) -> bool:
    """Whether a row has nothing to judge it by (an empty tensor has nothing to judge)."""
    return row.diverged is None and not (is_empty_shape(row.golden.shape)
                                         and is_empty_shape(row.target.shape))


def why_unknown(row: PairResult) -> str:
    """Why a row has no metrics, as its note says."""
    return row.note or "no data to compare on both sides"


def _own_name(row: PairResult) -> str:
    """`output.0` of `3_LlamaDecoderLayer/output.0`."""
    return row.name.rsplit("/", 1)[-1]


def _both(op_path: str, golden_op_path: str) -> str:
    if not golden_op_path or golden_op_path == op_path:
        return op_path
    return f"{op_path} ↔ {golden_op_path}"


def _number(value) -> str:
    return "N/A" if value is None else f"{value:.6g}"
