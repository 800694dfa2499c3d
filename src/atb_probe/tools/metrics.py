"""The numbers of a comparison: tensor metrics and statistics differences (numpy only).

Definitions follow msprobe's ATB compare (`msprobe compare -m atb`) so that the two tools agree
on the same data:

* Cosine: cos of the angle between the flattened tensors; 1.0 when both are all zeros; N/A for
  tensors of fewer than two elements (the angle of two scalars says nothing).
* Euc Distance: L2 norm of target - golden.
* Max Absolute Err: max |target - golden|.
* Max Relative Err: max |target - golden| / |golden|, where a zero golden element is replaced
  (on both sides) by the dtype's epsilon; computed in float32 unless an input is float64/integer,
  as msprobe does.
* One/Five Thousandth Err Ratio: the share of elements whose relative error is below 0.001/0.005.

NaN/Inf: when both tensors have them at the same places those elements are set to 0 first;
when they do not, every metric is N/A and the pair is flagged (`nan_mismatch`), which the
divergence search counts as diverged.

Statistics mode: `<stat> Diff` = target - golden, `Relative Err of <stat>(%)` = |diff/golden|*100
(0 when equal, N/A when golden is 0) for Max, Min, Mean, Norm.
"""
from __future__ import annotations

import math

import numpy as np

TENSOR_METRICS = ("Cosine", "Euc Distance", "Max Absolute Err", "Max Relative Err",
                  "One Thousandth Err Ratio", "Five Thousandth Err Ratio")
STAT_NAMES = ("Max", "Min", "Mean", "Norm")
STAT_DIFFS = tuple(f"{s} Diff" for s in STAT_NAMES)
STAT_RELATIVE = tuple(f"Relative Err of {s}(%)" for s in STAT_NAMES)


def as_float(array: np.ndarray) -> np.ndarray:
    """A flat float64 copy of a dumped array (complex as interleaved real/imag parts)."""
    if np.iscomplexobj(array):
        array = np.ascontiguousarray(array).view(array.real.dtype)
    return np.asarray(array, dtype=np.float64).reshape(-1)


def tensor_metrics(golden: np.ndarray, target: np.ndarray) -> tuple[dict, str]:
    """(metrics, note) for two arrays of the same shape; absent metrics are None."""
    result = dict.fromkeys(TENSOR_METRICS)
    if golden.shape != target.shape:
        return result, f"shape differs: golden {golden.shape}, target {target.shape}"
    if golden.size == 0:
        return result, "empty tensor"
    g, t = as_float(golden), as_float(target)
    g_bad, t_bad = ~np.isfinite(g), ~np.isfinite(t)
    if g_bad.any() or t_bad.any():
        same = np.array_equal(g_bad, t_bad) and np.array_equal(np.isnan(g), np.isnan(t))
        if not same:
            return result, "nan_mismatch: NaN/Inf at different places"
        g, t = g.copy(), t.copy()
        g[g_bad] = 0.0
        t[t_bad] = 0.0
    diff = t - g
    result["Euc Distance"] = float(np.linalg.norm(diff))
    result["Max Absolute Err"] = float(np.max(np.abs(diff)))
    rel = relative_errors(golden, target, g, t)
    result["Max Relative Err"] = float(np.max(rel))
    result["One Thousandth Err Ratio"] = float(np.mean(rel < 0.001))
    result["Five Thousandth Err Ratio"] = float(np.mean(rel < 0.005))
    if g.size > 1:
        # Equal data is exactly similar; the division below could land a rounding off 1.
        result["Cosine"] = 1.0 if result["Max Absolute Err"] == 0 else cosine(g, t)
    return result, ""


def cosine(g: np.ndarray, t: np.ndarray) -> float | None:
    """Cosine similarity of two flat float64 arrays (1.0 for two zero vectors)."""
    eps = np.finfo(np.float64).eps
    gn, tn = float(np.linalg.norm(g)), float(np.linalg.norm(t))
    if gn <= eps and tn <= eps:
        return 1.0
    if gn <= eps or tn <= eps:
        return None
    return min(1.0, max(-1.0, float(np.dot(g, t) / (gn * tn))))


def relative_errors(golden: np.ndarray, target: np.ndarray, g: np.ndarray,
                    t: np.ndarray) -> np.ndarray:
    """|t - g| / |g| elementwise, zero golden elements nudged by epsilon (msprobe's rule)."""
    # msprobe works in the inputs' own float type (float32 for fp32/bf16/fp16 data), so its
    # epsilon and rounding are float32's; match it so both tools report the same numbers.
    kinds = {golden.dtype.kind, target.dtype.kind}
    wide = golden.dtype == np.float64 or target.dtype == np.float64 or not kinds <= {"f"}
    work = np.float64 if wide else np.float32
    gw, tw = g.astype(work), t.astype(work)
    zero = gw == 0
    if zero.any():
        eps = np.finfo(work).eps
        gw = gw.copy()
        tw = tw.copy()
        gw[zero] += eps
        tw[zero] += eps
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.abs((tw - gw) / gw).astype(np.float64)


def array_stats(array: np.ndarray) -> tuple[float, float, float, float] | None:
    """(max, min, mean, L2 norm) of an array, as the probe computes them; None when empty."""
    if array.size == 0:
        return None
    x = np.abs(array) if np.iscomplexobj(array) else array
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(x.max()), float(x.min()), float(x.mean()), float(np.linalg.norm(x))


def stats_metrics(golden: tuple | None, target: tuple | None) -> dict:
    """Differences and relative errors (%) of max/min/mean/norm; absent ones are None."""
    result = dict.fromkeys(STAT_DIFFS + STAT_RELATIVE)
    if golden is None or target is None:
        return result
    for name, g, t in zip(STAT_NAMES, golden, target):
        if not (math.isfinite(g) and math.isfinite(t)):
            continue
        diff = t - g
        result[f"{name} Diff"] = diff
        if diff == 0:
            result[f"Relative Err of {name}(%)"] = 0.0
        elif g != 0:
            result[f"Relative Err of {name}(%)"] = abs(diff / g * 100)
    return result
