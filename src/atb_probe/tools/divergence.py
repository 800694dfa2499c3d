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


@dataclass(frozen=True)
class Thresholds:
    min_cosine: float = 0.99
    min_ratio: float = 0.9       # One Thousandth Err Ratio
    max_norm_err: float = 1.0    # Relative Err of Norm(%), statistics mode

    def describe(self) -> str:
        return (f"cosine < {self.min_cosine:g} or 1‰-ratio < {self.min_ratio:g} (tensor mode); "
                f"relative norm error > {self.max_norm_err:g}% (statistics mode)")


def crosses(row: dict, th: Thresholds) -> bool | None:
    """Whether one compared tensor (a result row) crosses the thresholds; None: no data."""
    mode = row["Compare Mode"]
    if mode == "tensor":
        if row["Note"].startswith("nan_mismatch"):
            return True
        cos, ratio = row["Cosine"], row["One Thousandth Err Ratio"]
        if cos is None and ratio is None:
            return None
        return (cos is not None and cos < th.min_cosine) or \
            (ratio is not None and ratio < th.min_ratio)
    if mode == "statistics":
        g, t = row["Golden Norm"], row["Target Norm"]
        if g is None or t is None:
            return None
        if not math.isfinite(t) or not math.isfinite(g):
            return math.isfinite(g) != math.isfinite(t)
        rel = row["Relative Err of Norm(%)"]
        if rel is None:               # golden norm 0
            return t != 0
        return rel > th.max_norm_err
    return None


@dataclass
class Finding:
    """The op to look at first, with the row of its worst output."""

    round_index: int
    op_path: str                 # target's op path: `3_LlamaDecoderLayer/1_LlamaAttention/6_Linear`
    golden_op_path: str
    row: dict                    # the first crossing output row
    inputs_clean: bool           # False: no op had clean inputs; this is the first crossing one
    order: int                   # position in the target round
    first_inside: str = ""       # the first crossing tensor within the op (a child's), if any

    def summary(self) -> str:
        """One line for the console and the report."""
        r = self.row
        if r["Compare Mode"] == "tensor":
            cos = "N/A" if r["Cosine"] is None else f"{r['Cosine']:.6f}"
            ratio = r["One Thousandth Err Ratio"]
            ratio_text = "N/A" if ratio is None else f"{ratio:.4f}"
            what = (f"cosine {cos}, 1‰-ratio {ratio_text}, max abs err "
                    f"{_num(r['Max Absolute Err'])}")
        else:
            what = f"relative norm error {_num(r['Relative Err of Norm(%)'])}%"
        where = f"round {self.round_index}, {self.op_path} ({r['Target Data Name'].rsplit('/', 1)[1]})"
        if self.inputs_clean:
            inside = (f"; inside it, {self.first_inside} is the first to differ"
                      if self.first_inside else "")
            return f"first divergence: {where}: {what}; its inputs match{inside}"
        return (f"first crossing op: {where}: {what}; its inputs already differ, so the error "
                "starts before the first dumped op (model inputs, or an op that was not dumped)")


def first_divergence(ops, th: Thresholds) -> Finding | None:
    """The first op (iterable of (round_index, op_path, golden_op_path, in_rows, out_rows),
    in execution order) whose outputs cross while its inputs do not.

    Its child ops and kernels come before it in that order and, with inputs of their own (a
    weight), may cross too without being the first divergence themselves; `first_inside`
    (filled by the caller) names the earliest of them."""
    fallback = None
    for round_index, op_path, golden_path, in_rows, out_rows in ops:
        bad_out = [r for r in out_rows if r["Diverged"] == "yes"]
        if not bad_out:
            continue
        clean = not any(r["Diverged"] == "yes" for r in in_rows)
        finding = Finding(round_index, op_path, golden_path, bad_out[0], clean,
                          bad_out[0]["Order"])
        if clean:
            return finding
        fallback = fallback or finding
    return fallback


def _num(value) -> str:
    return "N/A" if value is None else f"{value:.6g}"
