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

Speed: a pair is reduced in chunks of `CHUNK` elements, so the float64 copies and temporaries of
one chunk stay in the CPU cache and a job's memory does not grow with the tensor; every number of
both tensors (the metrics and each side's max/min/mean/norm) comes out of the same pass. Sums
and dot products are float64, so chunking changes results only in the last bits. The chunks'
copies and temporaries go into buffers made once per thread (`_Scratch`): a fresh array of a
chunk's size is above the allocator's mmap threshold, and its page faults cost ten times the
arithmetic.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 16   # elements per pass: two float64 chunks and their temporaries fit in L2

Stats = tuple[float, float, float, float]   # max, min, mean, L2 norm


@dataclass(slots=True)
class TensorMetrics:
    """msprobe's tensor-mode metrics of one pair; None where not defined."""

    cosine: float | None = None
    euc_distance: float | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    one_thousandth_ratio: float | None = None
    five_thousandth_ratio: float | None = None


@dataclass(slots=True)
class StatsDiff:
    """msprobe's statistics-mode columns: target - golden, and |diff / golden| in percent."""

    max_diff: float | None = None
    min_diff: float | None = None
    mean_diff: float | None = None
    norm_diff: float | None = None
    max_rel_pct: float | None = None
    min_rel_pct: float | None = None
    mean_rel_pct: float | None = None
    norm_rel_pct: float | None = None


def as_float(array: np.ndarray) -> np.ndarray:
    """A flat float64 copy of a dumped array (complex as interleaved real/imag parts)."""
    return np.asarray(_flat(array), dtype=np.float64)


def _flat(array: np.ndarray) -> np.ndarray:
    """The array flattened without a copy where possible; complex as real/imag parts."""
    if np.iscomplexobj(array):
        array = np.ascontiguousarray(array).view(array.real.dtype)
    return array.reshape(-1)


def tensor_metrics(golden: np.ndarray, target: np.ndarray) -> tuple[TensorMetrics, str]:
    """(metrics, note) for two arrays of the same shape."""
    metrics, note, _, _ = compare_arrays(golden, target)
    return metrics, note


def compare_arrays(golden: np.ndarray, target: np.ndarray, loose_shapes: bool = False
                   ) -> tuple[TensorMetrics, str, Stats | None, Stats | None]:
    """(metrics, note, golden stats, target stats) of two arrays of the same shape.

    With `loose_shapes`, arrays whose shapes differ only by dimensions of size 1 (`1x4x32` and
    `4x32`, as two frameworks lay out the same tensor) are compared element by element; other
    shape differences give no metrics and a note."""
    result = TensorMetrics()
    if golden.shape != target.shape and not (
            loose_shapes and _squeezed(golden.shape) == _squeezed(target.shape)):
        return result, (f"shape differs: golden {golden.shape}, target {target.shape}"), \
            array_stats(golden), array_stats(target)
    if golden.size == 0:
        return result, "empty tensor", None, None
    g, t = _flat(golden), _flat(target)
    kinds = {g.dtype.kind, t.dtype.kind}
    wide = g.dtype == np.float64 or t.dtype == np.float64 or not kinds <= {"f"}
    work = np.float64 if wide else np.float32
    eps = work(np.finfo(work).eps)
    n = g.size
    acc = _Acc()
    scratch = _scratch()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, n, CHUNK):
            gs, ts = g[start:start + CHUNK], t[start:start + CHUNK]
            m = gs.size
            gc, tc = scratch.golden[:m], scratch.target[:m]
            np.copyto(gc, gs, casting="unsafe")
            np.copyto(tc, ts, casting="unsafe")
            gg, tt = _dot(gc, gc), _dot(tc, tc)
            if not (math.isfinite(gg) and math.isfinite(tt)):
                g_bad, t_bad = ~np.isfinite(gc), ~np.isfinite(tc)
                if g_bad.any() or t_bad.any():
                    if not (np.array_equal(g_bad, t_bad)
                            and np.array_equal(np.isnan(gc), np.isnan(tc))):
                        return (TensorMetrics(), "nan_mismatch: NaN/Inf at different places",
                                array_stats(golden), array_stats(target))
                    acc.non_finite = True
                    gc[g_bad] = 0.0
                    tc[t_bad] = 0.0
                    gs, ts = gc, tc
                    gg, tt = _dot(gc, gc), _dot(tc, tc)
            diff = np.subtract(tc, gc, out=scratch.diff[:m])
            acc.dd += _dot(diff, diff)
            acc.max_abs = max(acc.max_abs, float(diff.max()), -float(diff.min()))
            acc.gg += gg
            acc.tt += tt
            acc.gt += _dot(gc, tc)
            acc.side(0, gc)
            acc.side(1, tc)
            # msprobe works in the inputs' own float type (float32 for fp32/bf16/fp16 data), so
            # its epsilon and rounding are float32's; match it so both tools report the same
            # numbers.
            gw = _as_work(gs, gc, work, scratch.golden32[:m])
            tw = _as_work(ts, tc, work, scratch.target32[:m])
            mask = scratch.mask[:m]
            zero = np.equal(gw, 0, out=mask)
            if zero.any():
                gw = np.where(zero, gw + eps, gw)
                tw = np.where(zero, tw + eps, tw)
            rel = scratch.rel64[:m] if work is np.float64 else scratch.rel32[:m]
            np.subtract(tw, gw, out=rel, dtype=work)
            np.divide(rel, gw, out=rel)
            np.abs(rel, out=rel)
            acc.max_rel = max(acc.max_rel, float(rel.max()))
            acc.below_1 += int(np.count_nonzero(np.less(rel, 0.001, out=mask)))
            acc.below_5 += int(np.count_nonzero(np.less(rel, 0.005, out=mask)))
    result.euc_distance = math.sqrt(acc.dd)
    result.max_abs_err = acc.max_abs
    result.max_rel_err = acc.max_rel
    result.one_thousandth_ratio = acc.below_1 / n
    result.five_thousandth_ratio = acc.below_5 / n
    if n > 1:
        # Equal data is exactly similar; the division below could land a rounding off 1.
        result.cosine = 1.0 if acc.max_abs == 0 else _cosine(acc.gg, acc.tt, acc.gt)
    if acc.non_finite:
        g_stats, t_stats = array_stats(golden), array_stats(target)
    else:
        g_stats, t_stats = acc.stats(0, n), acc.stats(1, n)
    return result, "", g_stats, t_stats


def _as_work(chunk: np.ndarray, wide: np.ndarray, work, buffer: np.ndarray) -> np.ndarray:
    """A chunk in the work dtype: itself, its float64 copy, or a float32 copy in `buffer`."""
    if chunk.dtype == work:
        return chunk
    if work is np.float64:
        return wide
    np.copyto(buffer, chunk, casting="unsafe")
    return buffer


class _Scratch:
    """The buffers of one chunk, made once per thread (see the module docstring)."""

    def __init__(self):
        self.golden, self.target, self.diff, self.rel64 = (np.empty(CHUNK) for _ in range(4))
        self.golden32, self.target32, self.rel32 = (np.empty(CHUNK, np.float32)
                                                    for _ in range(3))
        self.mask = np.empty(CHUNK, bool)


_SCRATCH = threading.local()  # one per thread: a thread compares one pair at a time


def _scratch() -> _Scratch:
    scratch = getattr(_SCRATCH, "buffers", None)
    if scratch is None:
        scratch = _SCRATCH.buffers = _Scratch()
    return scratch


class _Acc:
    """What the chunks of a pair add up to."""

    __slots__ = ("dd", "max_abs", "gg", "tt", "gt", "max_rel", "below_1", "below_5",
                 "non_finite", "hi", "lo", "sum")

    def __init__(self):
        self.dd = self.max_abs = self.gg = self.tt = self.gt = self.max_rel = 0.0
        self.below_1 = self.below_5 = 0
        self.non_finite = False
        self.hi = [-math.inf, -math.inf]
        self.lo = [math.inf, math.inf]
        self.sum = [0.0, 0.0]

    def side(self, i: int, chunk: np.ndarray) -> None:
        self.hi[i] = max(self.hi[i], float(chunk.max()))
        self.lo[i] = min(self.lo[i], float(chunk.min()))
        self.sum[i] += float(chunk.sum())

    def stats(self, i: int, n: int) -> Stats:
        squares = self.gg if i == 0 else self.tt
        return self.hi[i], self.lo[i], self.sum[i] / n, math.sqrt(squares)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """The float64 dot product of two flat chunks (the command line runs numpy's BLAS on one
    thread: cli.py)."""
    return float(np.dot(a, b))


def _squeezed(shape: tuple) -> tuple:
    return tuple(d for d in shape if d != 1)


def _cosine(gg: float, tt: float, gt: float) -> float | None:
    eps = np.finfo(np.float64).eps
    gn, tn = math.sqrt(gg), math.sqrt(tt)
    if gn <= eps and tn <= eps:
        return 1.0
    if gn <= eps or tn <= eps:
        return None
    return min(1.0, max(-1.0, gt / (gn * tn)))


def cosine(g: np.ndarray, t: np.ndarray) -> float | None:
    """Cosine similarity of two flat float64 arrays (1.0 for two zero vectors)."""
    return _cosine(_dot(g, g), _dot(t, t), _dot(g, t))


def array_stats(array: np.ndarray) -> Stats | None:
    """(max, min, mean, L2 norm) of an array, as the probe computes them; None when empty."""
    if array.size == 0:
        return None
    x = np.abs(array) if np.iscomplexobj(array) else array
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(x.max()), float(x.min()), float(x.mean()), math.sqrt(_dot(x, x))


def stats_metrics(golden: Stats | None, target: Stats | None) -> StatsDiff:
    """Differences and relative errors (%) of max/min/mean/norm; absent ones are None."""
    result = StatsDiff()
    if golden is None or target is None:
        return result
    diffs, rels = [None] * 4, [None] * 4
    for k, (g, t) in enumerate(zip(golden, target)):
        if not (math.isfinite(g) and math.isfinite(t)):
            continue
        diffs[k] = diff = t - g
        if diff == 0:
            rels[k] = 0.0
        elif g != 0:
            rels[k] = abs(diff / g * 100)
    result.max_diff, result.min_diff, result.mean_diff, result.norm_diff = diffs
    result.max_rel_pct, result.min_rel_pct, result.mean_rel_pct, result.norm_rel_pct = rels
    return result


def max_abs(stats: Stats | None) -> float | None:
    """The largest magnitude a tensor holds, from its statistics."""
    if stats is None:
        return None
    return max(abs(stats[0]), abs(stats[1]))


def finite(stats: Stats | None) -> bool | None:
    """Whether a tensor holds no NaN/Inf, from its statistics (None: not known)."""
    if stats is None:
        return None
    return all(math.isfinite(v) for v in stats)
