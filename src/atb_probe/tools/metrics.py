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

from ..statcsv import Stats

CHUNK = 1 << 16   # elements per pass: two float64 chunks and their temporaries fit in L2


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


def _flat(array: np.ndarray) -> np.ndarray:
    """The array flattened without a copy where possible; complex as real/imag parts."""
    if np.iscomplexobj(array):
        array = np.ascontiguousarray(array).view(array.real.dtype)
    return array.reshape(-1)


@dataclass(slots=True)
class ArrayComparison:
    """What comparing two arrays gives."""

    metrics: TensorMetrics       # None where not defined
    note: str                    # why the metrics are missing, or "" when they are not
    golden_stats: Stats | None   # each side's statistics; None when empty
    target_stats: Stats | None


def compare_arrays(golden: np.ndarray, target: np.ndarray, loose_shapes: bool = False
                   ) -> ArrayComparison:
    """The metrics and statistics of two arrays of the same shape.

    With `loose_shapes`, arrays whose shapes differ only by dimensions of size 1 (`1x4x32` and
    `4x32`, as two frameworks lay out the same tensor) are compared element by element; other
    shape differences give no metrics and a note."""
    result = TensorMetrics()
    if golden.shape != target.shape and not (
            loose_shapes and _squeezed(golden.shape) == _squeezed(target.shape)):
        return ArrayComparison(result, f"shape differs: golden {golden.shape}, target "
                               f"{target.shape}", array_stats(golden), array_stats(target))
    if golden.size == 0:
        return ArrayComparison(result, "empty tensor", None, None)
    g, t = _flat(golden), _flat(target)
    kinds = {g.dtype.kind, t.dtype.kind}
    wide = g.dtype == np.float64 or t.dtype == np.float64 or not kinds <= {"f"}
    work = np.float64 if wide else np.float32
    eps = work(np.finfo(work).eps)
    n = g.size
    sums = _PairSums()
    scratch = _scratch()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, n, CHUNK):
            # gs, ts: the chunk as dumped; gc, tc: its float64 copy; gw, tw: in the work dtype
            gs, ts = g[start:start + CHUNK], t[start:start + CHUNK]
            m = gs.size
            gc, tc = scratch.golden[:m], scratch.target[:m]
            np.copyto(gc, gs, casting="unsafe")
            np.copyto(tc, ts, casting="unsafe")
            g_squares, t_squares = _dot(gc, gc), _dot(tc, tc)
            if not (math.isfinite(g_squares) and math.isfinite(t_squares)):
                g_bad, t_bad = ~np.isfinite(gc), ~np.isfinite(tc)
                if g_bad.any() or t_bad.any():
                    if not (np.array_equal(g_bad, t_bad)
                            and np.array_equal(np.isnan(gc), np.isnan(tc))):
                        return ArrayComparison(TensorMetrics(),
                                               "nan_mismatch: NaN/Inf at different places",
                                               array_stats(golden), array_stats(target))
                    sums.non_finite = True
                    gc[g_bad] = 0.0
                    tc[t_bad] = 0.0
                    gs, ts = gc, tc
                    g_squares, t_squares = _dot(gc, gc), _dot(tc, tc)
            diff = np.subtract(tc, gc, out=scratch.diff[:m])
            sums.diff_squares += _dot(diff, diff)
            sums.max_abs = max(sums.max_abs, float(diff.max()), -float(diff.min()))
            sums.golden.add(gc, g_squares)
            sums.target.add(tc, t_squares)
            sums.dot += _dot(gc, tc)
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
            sums.max_rel = max(sums.max_rel, float(rel.max()))
            sums.within_1 += int(np.count_nonzero(np.less(rel, 0.001, out=mask)))
            sums.within_5 += int(np.count_nonzero(np.less(rel, 0.005, out=mask)))
    result.euc_distance = math.sqrt(sums.diff_squares)
    result.max_abs_err = sums.max_abs
    result.max_rel_err = sums.max_rel
    result.one_thousandth_ratio = sums.within_1 / n
    result.five_thousandth_ratio = sums.within_5 / n
    if n > 1:
        # Equal data is exactly similar; the division below could land a rounding off 1.
        result.cosine = 1.0 if sums.max_abs == 0 else _cosine(
            sums.golden.squares, sums.target.squares, sums.dot)
    if sums.non_finite:
        return ArrayComparison(result, "", array_stats(golden), array_stats(target))
    return ArrayComparison(result, "", sums.golden.stats(n), sums.target.stats(n))


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


class _SideSums:
    """What the chunks of one side add up to: its statistics so far."""

    __slots__ = ("high", "low", "total", "squares")

    def __init__(self):
        self.high, self.low = -math.inf, math.inf
        self.total = self.squares = 0.0

    def add(self, chunk: np.ndarray, squares: float) -> None:
        """Take in a chunk (float64) and its sum of squares."""
        self.high = max(self.high, float(chunk.max()))
        self.low = min(self.low, float(chunk.min()))
        self.total += float(chunk.sum())
        self.squares += squares

    def stats(self, n: int) -> Stats:
        return Stats(self.high, self.low, self.total / n, math.sqrt(self.squares))


class _PairSums:
    """What the chunks of a pair add up to."""

    __slots__ = ("golden", "target", "diff_squares", "dot", "max_abs", "max_rel", "within_1",
                 "within_5", "non_finite")

    def __init__(self):
        self.golden, self.target = _SideSums(), _SideSums()
        self.diff_squares = 0.0      # sum of (target - golden)^2
        self.dot = 0.0               # sum of golden * target
        self.max_abs = self.max_rel = 0.0
        self.within_1 = self.within_5 = 0   # elements within 1 and 5 per mille relative error
        self.non_finite = False      # NaN/Inf (at the same places on both sides) were zeroed


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """The float64 dot product of two flat chunks (the command line runs numpy's BLAS on one
    thread: cli.py)."""
    return float(np.dot(a, b))


def _squeezed(shape: tuple) -> tuple:
    return tuple(d for d in shape if d != 1)


def _cosine(golden_squares: float, target_squares: float, dot: float) -> float | None:
    eps = np.finfo(np.float64).eps
    golden_norm, target_norm = math.sqrt(golden_squares), math.sqrt(target_squares)
    if golden_norm <= eps and target_norm <= eps:
        return 1.0
    if golden_norm <= eps or target_norm <= eps:
        return None
    return min(1.0, max(-1.0, dot / (golden_norm * target_norm)))


def array_stats(array: np.ndarray) -> Stats | None:
    """(max, min, mean, L2 norm) of an array, as the probe computes them; None when empty."""
    if array.size == 0:
        return None
    x = np.abs(array) if np.iscomplexobj(array) else array
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return Stats(float(x.max()), float(x.min()), float(x.mean()), math.sqrt(_dot(x, x)))


def stats_metrics(golden: Stats | None, target: Stats | None) -> StatsDiff:
    """Differences and relative errors (%) of max/min/mean/norm; absent ones are None."""
    if golden is None or target is None:
        return StatsDiff()
    max_diff, max_rel = _difference(golden.max, target.max)
    min_diff, min_rel = _difference(golden.min, target.min)
    mean_diff, mean_rel = _difference(golden.mean, target.mean)
    norm_diff, norm_rel = _difference(golden.norm, target.norm)
    return StatsDiff(max_diff, min_diff, mean_diff, norm_diff,
                     max_rel, min_rel, mean_rel, norm_rel)


def _difference(golden: float, target: float) -> tuple[float | None, float | None]:
    """target - golden and its relative error in percent (0 when equal, None when the golden
    value is 0); both None when either value is NaN/Inf."""
    if not (math.isfinite(golden) and math.isfinite(target)):
        return None, None
    diff = target - golden
    if diff == 0:
        return diff, 0.0
    return diff, (abs(diff / golden * 100) if golden != 0 else None)


def max_abs(stats: Stats) -> float:
    """The largest magnitude a tensor holds, from its statistics."""
    return max(abs(stats.max), abs(stats.min))
