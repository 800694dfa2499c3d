"""Max, min, mean and L2 norm of many tensors at once, without waiting on an accelerator.

The recorder collects the tensors of a layer-level op execution and asks for their statistics
in one `compute` call (see `Queue.resolve` in stats_reuse.py). Each result goes into a cell (stats_cell.py)
that the statistic.csv rows point to; the rows are formatted on the writer thread, which is the
only reader of the values.

What a statistic is (on the host, the numbers of every earlier version of the probe, bit for bit,
but for the Norm of a tensor of more than 4M elements, below):

* On the host, accumulated in float32 (float64 for double and integer tensors), over the
  tensor's memory in storage order (a transposed view is reduced as fast as its base); the
  mean is the sum divided by the element count. Where a float32 sum or sum of squares
  overflows although every element is finite (values beyond ~1e19), that tensor is summed
  again in float64, so a representable norm is never reported as inf. inf and nan in the data
  are results, not errors: numpy is kept from warning about them in the user's process.
* CPU tensors are reduced by numpy: single-threaded, so a busy machine's thread pool never
  makes a small reduction wait. The sum is numpy's `add.reduce` (pairwise) and the sum of
  squares the BLAS dot product of each tensor with itself, as before; max and min of the small
  tensors of a batch come from one `reduceat` over their concatenation (max and min do not
  depend on the order, and numpy's `reduceat` gives the same values as a `reduce` per tensor,
  signed zeros and nan included). The dot product is taken as `a @ a`, not `np.dot(a, a)`: the
  same BLAS call and the same bits, but `np.dot` gives up the GIL around it, and taking it back
  while another thread runs Python (the writer formatting rows, the user's own threads) costs
  up to the interpreter's switch interval, 5 ms, each time (`_square_sum`). Three or more
  small tensors of one dtype and size in a batch (a decode step's activations) are measured
  as the rows of one 2-D array, each row giving what it gives alone (`_rows`). The dense
  bfloat16, float16 and bool tensors of a batch are converted to float32 in one concatenation
  per dtype (`_convert_together`): the values each is measured over are the same.
* A module side's small contiguous host tensors (at most 4096 elements each: a decode step's
  hidden states, positions, logits), and their requests' runs where each is a row, are copied
  when the side is seen and measured when the thread hands its rows over, the copies of one
  dtype, shape and run count as the rows of one array (`DeviceStatistics.hold`), the same
  bits as alone: between two layers of the model each torch or numpy call runs cold, and a
  dozen of them a tensor cost more than one copy.
* A tensor of more than SCRATCH_ELEMENTS (4M) elements measured in float32 is measured a part
  at a time (`_one_in_parts`), each part converted into memory its thread keeps: max, min and
  the sum are those of the whole array bit for bit (the parts are the ones numpy's pairwise
  summation splits it into), the sum of squares is that of each part's BLAS dot product, added
  exactly. Before, the whole array's float32 dot product was taken: for a 32.8 M-element
  embedding it was off by 7 parts in 1e5, the parts' sum by 2 (its last digits differ from
  the versions before, which depended on the BLAS and its threads anyway). Cut into requests
  (`compute_runs`), such a tensor is converted a span of runs at a time (`_runs_in_parts`).
* Accelerator tensors are reduced on their device, the sum and the sum of squares accumulated
  in float64 (more exact than float32 and beyond its range, so no overflow fallback and no
  second pass: a small decode step on a GPU is bound by kernel launches, so the device path
  counts operations). The values of the tensors a thread asks about are copied into a buffer
  of that thread per device, dtype and stream, one copy per dtype and call
  (`DeviceStatistics.gather`): an op side costs a queued copy per dtype. When the thread hands
  its rows to the writer (at the latest when its round ends), each buffer is reduced by
  segments (`_segments`) on the stream that filled it, a fixed number of kernels for all it
  holds. A tensor larger than a buffer and a device without `torch.segment_reduce` go tensor by
  tensor (`device_row`, four operations). Every tensor's four numbers end in one device buffer
  per batch, copied to pinned host memory without blocking (a `DeviceBatch`). The probe's
  landing thread (capture/landing.py) waits for the copy and fills the batch's cells; the rows
  handed to the writer carry a `Landed` that covers every batch begun before them, which the
  writer waits on before it formats them. The model thread never synchronises, and the writer
  sees only filled cells.
"""
from __future__ import annotations

import math
import threading
from itertools import accumulate

import numpy as np
import torch

from .. import log
from ..stats_cell import DEVICE, QUEUED, READY, fill, new_serial, pack
from .landing import Landings, to_host

_max, _min, _sum = np.maximum.reduce, np.minimum.reduce, np.add.reduce
_isfinite = math.isfinite
SMALL = 4096  # elements: max/min of tensors up to this size are batched (`reduceat`)


def compute(tensors: list, cells: list, device: DeviceStatistics) -> None:
    """Fill `cells[i]` with the statistics of `tensors[i]` (non-empty tensors); those of
    accelerator tensors fill when `device`'s batches land."""
    if len(tensors) == 1 and tensors[0].is_cpu:  # an op side computed at once: the common case
        t = tensors[0]
        if t.numel() > SCRATCH_ELEMENTS:
            with np.errstate(all="ignore"):
                stats = _in_parts(t)
            if stats is not None:
                fill(cells[0], stats)
                return
        a = _in_scratch(t) if t.numel() >= SCRATCH_FROM else None
        if a is None:  # (a tensor of float32 or float64 values, most often)
            x = prepare(t)
            a = x.numpy().reshape(-1) if x.is_contiguous() else dense_flat(x).numpy()
        fill(cells[0], _one_quiet(a))
        return
    arrays, host_cells, on_device = [], [], {}
    converted = None  # dtype -> [(index in arrays, values)]: converted together
    with np.errstate(all="ignore"):
        for t, cell in zip(tensors, cells):
            if t.is_cpu:
                if t.numel() > SCRATCH_ELEMENTS:
                    stats = _in_parts(t)
                    if stats is not None:  # measured a part at a time, now
                        fill(cell, stats)
                        continue
                elif t.numel() >= SCRATCH_FROM:
                    a = _in_scratch(t)
                    if a is not None:  # measured now: the next one takes the same memory
                        fill(cell, _one(a))
                        continue
                x = _values(t)
                if x.dtype in _TO_FLOAT32 and (x.is_contiguous() or is_dense(x)):
                    if converted is None:
                        converted = {}
                    converted.setdefault(x.dtype, []).append((len(arrays), x))
                    arrays.append(None)
                else:
                    x = _as_float(x)
                    arrays.append(x.numpy().reshape(-1) if x.is_contiguous() else
                                  dense_flat(x).numpy())
                host_cells.append(cell)
            else:
                on_device.setdefault(t.device, []).append((t, cell))
        if converted:
            for group in converted.values():
                _convert_together(group, arrays)
        if arrays:
            _host(arrays, host_cells)
    for items in on_device.values():
        device.gather([t for t, _ in items], [c for _, c in items])


def _convert_together(group: list, arrays: list) -> None:
    """Put in `arrays[i]` the float32 values (a flat numpy array, in storage order) of each
    dense host tensor `x` of `group`'s (i, x), all of one dtype: one concatenation and one
    conversion for the lot, where a conversion each costs a few microseconds of dispatch per
    tensor (a decode step's bfloat16 activations). The values are those `prepare` gives each
    alone, in the same order, so their statistics are too."""
    if len(group) == 1:
        i, x = group[0]
        arrays[i] = dense_flat(x.to(torch.float32)).numpy()
        return
    flats = [dense_flat(x) for _, x in group]
    joined = torch.cat(flats).to(torch.float32).numpy()
    start = 0
    for (i, _), flat in zip(group, flats):
        stop = start + flat.numel()
        arrays[i] = joined[start:stop]
        start = stop


def compute_runs(entries: list, tensors: list = (), cells: list = ()) -> tuple[list, list]:
    """Fill the cells of slices of contiguous host tensors: `entries` holds (tensor, runs,
    cells, one after another), a run (start, stop) being a slice of the tensor's elements in
    storage order and its cell EMPTY when the run is. Each tensor is prepared once (into the
    thread's scratch memory where `_in_scratch` takes it) and its runs are numpy views of it:
    runs of one length, one after another (a token per request in a decode step, the rows of
    a batch: the caller says so), as the rows of one 2-D view (`_rows`); any others as one
    `_host` batch (those of a tensor in the scratch: a batch of their own). Each slice gets
    what `compute` gives the tensor `t.view(-1)[start:stop]`, bit for bit.

    A tensor of more than SCRATCH_ELEMENTS elements converted to float32 (a bfloat16 hidden
    state of a long prefill) is not converted whole: its runs are, a few at a time
    (`_runs_in_parts`), and it is measured whole a part at a time, as `compute` would.

    `tensors` and `cells`: what `compute` is to measure next. Those among them that have runs
    here are measured whole from the same prepared values, as `compute` would; returns the
    others and their cells, for `compute`."""
    arrays, host_cells = [], []
    whole = {id(t): i for i, t in enumerate(tensors)} if tensors else None
    done = []
    with np.errstate(all="ignore"):
        for t, runs, run_cells, one_after_another in entries:
            if t.numel() > SCRATCH_ELEMENTS and t.dtype in _TO_FLOAT32:
                i = whole.pop(id(t), None) if whole else None
                if i is not None:
                    fill(cells[i], _in_parts(t))
                    done.append(i)
                _runs_in_parts(t, runs, run_cells, one_after_another)
                continue
            # Converted into the thread's scratch memory (a bfloat16 hidden state of a serving
            # step), not into new memory: its runs are then measured before the next tensor
            # takes that memory.
            a = _in_scratch(t) if SCRATCH_FROM <= t.numel() <= SCRATCH_ELEMENTS else None
            if a is None:
                x = prepare(t)
                a = (x if x.is_contiguous() else x.contiguous()).numpy().reshape(-1)
                mine, mine_cells = arrays, host_cells
            else:
                mine, mine_cells = [], []
            if whole:
                i = whole.pop(id(t), None)
                if i is not None:  # what `compute` gives it: the same values in the same order
                    fill(cells[i], _one(a))
                    done.append(i)
            if one_after_another:
                first, stop = runs[0]
                _rows(a[first:first + len(runs) * (stop - first)].reshape(len(runs), -1),
                      run_cells)
                continue
            for (start, stop), cell in zip(runs, run_cells):
                if start < stop:
                    mine.append(a[start:stop])
                    mine_cells.append(cell)
            if mine and mine is not arrays:
                _host(mine, mine_cells)
        if arrays:
            _host(arrays, host_cells)
    if not done:
        return tensors, cells
    done = set(done)
    return ([t for i, t in enumerate(tensors) if i not in done],
            [c for i, c in enumerate(cells) if i not in done])


def _runs_in_parts(t: torch.Tensor, runs: list, cells: list, one_after_another: bool) -> None:
    """(Inside `np.errstate`.) `compute_runs` of the runs of contiguous host tensor `t`, of more
    than SCRATCH_ELEMENTS elements converted to float32, without converting it whole: runs of
    at most SCRATCH_ELEMENTS elements a span of them at a time, each span (at most
    SCRATCH_ELEMENTS from its first run's start to its last run's stop) converted into the
    thread's scratch memory and measured before the next one takes it; a longer run a part at a
    time (`_one_in_parts`). Each run gets what `compute` gives its slice alone, bit for bit,
    as from a whole conversion: the same float32 values, measured the same way."""
    flat = dense_flat(_values(t))
    order = sorted((k for k, (start, stop) in enumerate(runs) if start < stop),
                   key=lambda k: runs[k][0])
    k = 0
    while k < len(order):
        start, stop = runs[order[k]]
        if stop - start > SCRATCH_ELEMENTS:
            fill(cells[order[k]], _one_in_parts(flat[start:stop]))
            k += 1
            continue
        end = k + 1
        while end < len(order) and max(stop, runs[order[end]][1]) - start <= SCRATCH_ELEMENTS:
            stop = max(stop, runs[order[end]][1])
            end += 1
        a = _in_scratch(flat[start:stop])
        members = order[k:end]
        if one_after_another:  # consecutive runs of one length: the rows of one 2-D view
            _rows(a.reshape(len(members), -1), [cells[m] for m in members])
        else:
            _host([a[runs[m][0] - start:runs[m][1] - start] for m in members],
                  [cells[m] for m in members])
        k = end


def _rows(m, cells: list) -> None:
    """(Inside `np.errstate`.) Fill `cells[i]` with the statistics of row i of `m`, a C-contiguous
    2-D float32/float64 array, in one call per statistic: bit for bit what `_one` gives each row
    alone, since numpy reduces each row of such an array along its last axis as it reduces a
    flat array, and `matmul` of stacked vectors makes each row's BLAS dot as `a @ a` does
    (tests/test_statistics_batch.py checks both)."""
    n = m.shape[1]
    if n > SCRATCH_ELEMENTS:  # rows that long are measured as `_one` measures them alone
        for row, cell in zip(m, cells):
            fill(cell, _one(row))
        return
    highs, lows = _max(m, axis=1).tolist(), _min(m, axis=1).tolist()
    totals = _sum(m, axis=1).tolist()
    squares = np.matmul(m[:, None, :], m[:, :, None]).reshape(-1).tolist()
    sqrt = math.sqrt
    for i, (cell, high, low, total, square) in enumerate(zip(cells, highs, lows, totals,
                                                             squares)):
        if _isfinite(total) and _isfinite(square):
            pack(cell, 0, high, low, total / n, sqrt(square), 0, READY)  # `fill`, inline
        else:  # inf or nan: `_one` tells an overflow (float64 again) from values that hold them
            fill(cell, _one(m[i], high, low))


# A host tensor of at least SCRATCH_FROM elements whose statistics are computed in float32 from
# another dtype (bfloat16, float16, bool) is converted into memory its thread keeps for that
# (`_in_scratch`), not into new memory: in a process whose memory is in use, memory that large
# comes fresh from the system, and touching it page by page costs several times the conversion
# (a 2.9 M-element bfloat16 weight, two torch threads: 0.95 ms against 0.12 while the previous
# conversion was still held; 130 against 103 us in a loop that frees each one first, where
# malloc hands the same memory back). A thread keeps at most SCRATCH_ELEMENTS (16 MiB); a
# larger tensor is measured a part at a time (`_in_parts`).
SCRATCH_FROM = 1 << 15
SCRATCH_ELEMENTS = 1 << 22
_TO_FLOAT32 = frozenset({torch.bfloat16, torch.float16, torch.bool})


class _Scratch(threading.local):
    data = None  # a thread's float32 conversion memory


_scratch = _Scratch()


def _in_scratch(t: torch.Tensor):
    """The values `prepare` gives host tensor `t`, in storage order, as a flat numpy array over
    the calling thread's scratch memory (valid until the thread's next `_in_scratch`); None
    where `t` is not converted to float32, is larger than the scratch may grow, or has gaps
    (`prepare` gives such a tensor strides of its own choosing)."""
    n = t.numel()
    if t.dtype not in _TO_FLOAT32 or n > SCRATCH_ELEMENTS:
        return None
    x = _values(t)
    if not (x.is_contiguous() or is_dense(x)):
        return None
    out = _scratch_memory(n)
    out.copy_(dense_flat(x))
    return out.numpy()


def _scratch_memory(n: int) -> torch.Tensor:
    """The first `n` elements of the calling thread's float32 scratch memory (n at most
    SCRATCH_ELEMENTS), grown to hold them."""
    data = _scratch.data
    if data is None or data.numel() < n:
        # A normal tensor on the host, whatever the caller runs under: an inference tensor
        # (made in `torch.inference_mode`) could not be written outside it, and a default
        # device (`with torch.device(...)`) would put it elsewhere.
        with torch.inference_mode(False):
            data = _scratch.data = torch.empty(max(n, 1 << 20), dtype=torch.float32,
                                               device="cpu")
    return data[:n]


# A host tensor of more than SCRATCH_ELEMENTS elements measured in float32 (float32 itself,
# bfloat16, float16, bool) is measured a part of at most PART_ELEMENTS at a time (`_in_parts`),
# each part of a converted one converted into the thread's scratch memory: converting the
# whole tensor took new memory as large as it in float32, and its pages cost many times the
# conversion (a 32.8 M-element bfloat16 embedding: about 200 ms on the host of
# docs/performance.md, 26 ms a part at a time). A part's 1 MiB of float32 stays in the core's
# cache while its four reductions read it.
PART_ELEMENTS = 1 << 18


def _in_parts(t: torch.Tensor):
    """(Inside `np.errstate`.) The statistics of host tensor `t`, of more than
    SCRATCH_ELEMENTS elements, measured a part at a time (`_one_in_parts`); None where its
    values are not measured in float32 or have gaps (`prepare` lays those out its own way)."""
    x = _values(t)
    if x.dtype is not torch.float32 and x.dtype not in _TO_FLOAT32:
        return None
    if not (x.is_contiguous() or is_dense(x)):
        return None
    flat = dense_flat(x)
    return _one_in_parts(flat.numpy() if flat.dtype is torch.float32 else flat)


def _one_in_parts(values) -> tuple:
    """(Inside `np.errstate`.) `_one` of a float32 array of more than SCRATCH_ELEMENTS
    elements, in parts of at most PART_ELEMENTS: `values` is a flat float32 numpy array, or a
    1-D host tensor (bfloat16, float16, bool) converted to float32 a part at a time into the
    thread's scratch memory.

    Max, min and the sum are the numbers `_one` gives the whole array, bit for bit: the parts
    are those numpy's pairwise summation splits the array into (`_pairwise`), and their sums
    are joined as it joins them. The sum of squares is each part's BLAS dot product, added
    exactly (`math.fsum`): over millions of elements a float32 dot of the whole array is off by
    parts in 1e5 itself (the module's docstring), the parts' sum less so.
    A float32 sum that overflows while every element is finite is taken again in float64, as
    `_one` does."""
    converted = isinstance(values, torch.Tensor)
    n = values.numel() if converted else values.size
    scratch = _scratch_memory(PART_ELEMENTS) if converted else None
    highs, lows, squares = [], [], []

    def part(start: int, count: int):
        if not converted:
            return values[start:start + count]
        out = scratch[:count]
        out.copy_(values[start:start + count])
        return out.numpy()

    def measured(start: int, count: int):
        a = part(start, count)
        highs.append(_max(a))
        lows.append(_min(a))
        squares.append(float(a @ a))
        return _sum(a, initial=-0.0)  # the pairwise sum alone: -0.0 + x is x

    # numpy's reduction starts from add's identity, +0.0 (a sum of zeros is +0.0)
    total = float(np.float32(0.0) + _pairwise(0, n, measured))
    high, low = float(_max(np.array(highs))), float(_min(np.array(lows)))
    square = _added(squares)
    if not (_isfinite(total) and _isfinite(square)) and _overflowed(high, low, total, square):
        squares.clear()

        def measured64(start: int, count: int):
            a = part(start, count).astype(np.float64)
            squares.append(float(a @ a))
            return _sum(a, initial=-0.0)

        total = float(np.float64(0.0) + _pairwise(0, n, measured64))
        square = _added(squares)
    return high, low, total / n, math.sqrt(square)


def _pairwise(start: int, count: int, part_sum, most: int | None = None):
    """The sum of `count` elements from `start` in numpy's pairwise order (its
    `pairwise_sum`: a run longer than 128 elements is the sum of its two halves, the first
    rounded down to a multiple of 8), down to runs of at most `most` (PART_ELEMENTS, at least
    128), whose sums `part_sum(start, count)` gives as numpy scalars."""
    most = PART_ELEMENTS if most is None else most
    if count <= most:
        return part_sum(start, count)
    half = count // 2
    half -= half % 8
    return _pairwise(start, half, part_sum, most) + \
        _pairwise(start + half, count - half, part_sum, most)


def _added(values: list) -> float:
    """The exact sum of non-negative floats (inf where it overflows, nan with a nan)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


# Tensors of one dtype, from this many on, are reduced together by segments (`segment_rows`),
# in parts of at most SEGMENT_ELEMENTS elements; a larger tensor is reduced alone.
SEGMENTS_FROM = 3
SEGMENT_ELEMENTS = 1 << 22


def prepare(t: torch.Tensor) -> torch.Tensor:
    """`t` as the float32 or float64 tensor its statistics are computed over: its `_values`
    in float32 (floating point and bool) or float64 (double and integers)."""
    return _as_float(_values(t))


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """`prepare` of values `_values` gave."""
    if x.dtype is not torch.float32 and x.dtype is not torch.float64:
        x = x.to(torch.float32 if x.is_floating_point() or x.dtype is torch.bool
                 else torch.float64)
    return x


def _values(t: torch.Tensor) -> torch.Tensor:
    """The values whose statistics are computed, in their own dtype: `t` detached, a lazy
    negation resolved, a complex tensor's magnitudes."""
    x = t.detach() if t.requires_grad else t
    if x.dtype in _COMPLEX:
        x = x.abs()
    if x.is_neg():
        x = x.resolve_neg()
    return x


_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


def _host(arrays: list, cells: list) -> None:
    """(Inside `np.errstate`.) Statistics of flat float32/float64 numpy arrays. Small arrays of
    one dtype and one size (a decode step's hidden states, a layer's activations) are measured
    together as the rows of one 2-D array (`_rows`); max and min of the other small ones come
    from one `reduceat` over their concatenation."""
    n = len(arrays)
    highs, lows = [None] * n, [None] * n
    done = None
    if n >= 3:
        by_size: dict = {}
        for i, a in enumerate(arrays):
            if a.size <= SMALL:
                by_size.setdefault((a.dtype.char, a.size), []).append(i)
        groups: dict = {}
        for (char, size), members in by_size.items():
            if len(members) >= ROWS_FROM:
                _rows(np.concatenate([arrays[i] for i in members]).reshape(len(members), size),
                      [cells[i] for i in members])
                if done is None:
                    done = [False] * n
                for i in members:
                    done[i] = True
            else:
                groups.setdefault(char, []).extend(members)
        for small in groups.values():
            if len(small) < 3:
                continue
            parts = [arrays[i] for i in small]
            # (np.cumsum of a list takes numpy's slow path: about 5 us more)
            starts = list(accumulate([a.size for a in parts[:-1]], initial=0))
            joined = np.concatenate(parts)
            for i, high, low in zip(small, np.maximum.reduceat(joined, starts).tolist(),
                                    np.minimum.reduceat(joined, starts).tolist()):
                highs[i], lows[i] = high, low
    for i, (a, cell) in enumerate(zip(arrays, cells)):
        if done is not None and done[i]:
            continue
        high = highs[i]
        fill(cell, _one(a) if high is None else _one(a, high, lows[i]))


# Small arrays of one dtype and size, from this many on, are measured as rows (`_host`).
ROWS_FROM = 3


def _one_quiet(a) -> tuple:
    """`_one` of one array, entering `np.errstate` only where numpy could complain.

    Max and min never do (nan and inf included). With both finite and every element under
    `sqrt(largest / size)` in magnitude, neither the sum nor the sum of squares can overflow
    or meet inf - inf; numpy's default error state ignores underflow. So when the thread's
    error state is numpy's default, the sums run without the context (about half a
    microsecond per call); anything else (nan, inf, huge values, a state the user set) takes it."""
    if a.size > SCRATCH_ELEMENTS:  # `_one` (float32 in parts): the context costs nothing here
        with np.errstate(all="ignore"):
            return _one(a)
    high, low = float(_max(a)), float(_min(a))
    limit = _LIMITS.get(a.dtype.char, 0.0) / math.sqrt(a.size)
    if -limit < low and high < limit and _default_errstate():
        return high, low, float(_sum(a)) / a.size, math.sqrt(_square_sum(a))
    with np.errstate(all="ignore"):
        return _one(a, high, low)


# sqrt of a bound well under each float type's largest value: see `_one_quiet`.
_LIMITS = {"f": math.sqrt(1e37), "d": math.sqrt(1e307)}


def _error_state_probe():
    """A check that the calling thread's numpy error state is numpy's default (no
    `np.seterr`/`np.errstate` around us), or None where this numpy does not tell cheaply."""
    try:
        from numpy._core._ufunc_config import _extobj_contextvar
    except ImportError:
        return None
    default = _extobj_contextvar.get()
    get = _extobj_contextvar.get
    if np.geterr() != {"divide": "warn", "over": "warn", "under": "ignore",
                       "invalid": "warn"}:
        return None  # set at import, before us: the default is not known
    return lambda: get() is default


_default_errstate = _error_state_probe() or (lambda: False)


def _one(a, high=None, low=None) -> tuple:
    """(Inside `np.errstate`.) The statistics of a flat float32/float64 numpy array (of more
    than SCRATCH_ELEMENTS float32 elements: `_one_in_parts`)."""
    if a.size > SCRATCH_ELEMENTS and a.dtype.char == "f":
        return _one_in_parts(a)
    if high is None:
        high, low = float(_max(a)), float(_min(a))
    total, squares = float(_sum(a)), _square_sum(a)
    if not (_isfinite(total) and _isfinite(squares)) and _overflowed(high, low, total, squares):
        a = a.astype(np.float64)
        total, squares = float(_sum(a)), _square_sum(a)
    return high, low, total / a.size, math.sqrt(squares)


def _square_sum(a) -> float:
    """The sum of squares of a flat float32/float64 array: BLAS `dot(a, a)` as `np.dot` computes
    it (bit for bit), through `matmul`, which keeps the GIL where `np.dot` releases it."""
    return float(a @ a)


def device_row(x: torch.Tensor) -> torch.Tensor:
    """(max, min, sum, norm) of a prepared tensor, the sum and the norm accumulated in float64,
    as a float64 tensor on its device: four operations queued, nothing waited for."""
    x = dense_flat(x)
    low, high = torch.aminmax(x)
    return torch.stack((high, low, x.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(x, dtype=torch.float64)))


def segment_rows(tensors: list) -> torch.Tensor:
    """The `device_row`s of tensors of one dtype and device, stacked, from one concatenation of
    their values in float64: max, min, sum and sum of squares by `torch.segment_reduce`.
    Kernels queued, nothing waited for: the segment offsets go to the device from pinned
    memory without blocking, and `unsafe` skips the checks that would read them back."""
    return _segments(torch.cat([dense_flat(_values(t)) for t in tensors]),
                     [t.numel() for t in tensors])


def _segments(data: torch.Tensor, counts: list) -> torch.Tensor:
    """`segment_rows` of the tensors whose values lie one after another in `data` (1-D),
    `counts[i]` elements each."""
    data = data.double()
    ends = [0, *accumulate(counts)]
    offsets = torch.tensor(ends, dtype=torch.int64)
    if not data.is_cpu:
        offsets = offsets.pin_memory().to(data.device, non_blocking=True)

    def by_segment(values, how):
        return torch.segment_reduce(values, how, offsets=offsets, unsafe=True)

    block = torch.stack((by_segment(data, "max"), by_segment(data, "min"),
                         by_segment(data, "sum"), by_segment(data * data, "sum")), 1)
    block[:, 3].sqrt_()  # sums of squares -> norms
    return block


def finish_row(values, n: int) -> tuple:
    """The statistics of a `device_row` brought to the host: max and min nan where a value is
    nan (the norm is nan exactly then), as numpy gives them, whatever the device's max and min
    do with nan."""
    high, low, total, norm = values
    if norm != norm:
        high = low = norm
    return high, low, total / n, norm


# The dtypes a thread's buffer holds as they are (`DeviceStatistics.gather`); others are
# converted to what their statistics are computed in first.
_BUFFER_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                            torch.int64})
# A thread's buffer for one device and dtype (`DeviceStatistics.gather`) starts at this many
# elements, grows to what its rounds need, and holds at most SEGMENT_ELEMENTS: a fuller one is
# reduced and a new one begun. A tensor larger than that goes alone (`DeviceStatistics.batch`).
BUFFER_ELEMENTS = 1 << 16
# Elements of host copies one thread's `DeviceStatistics.hold` keeps at most (16 MiB of float32).
HOLD_ELEMENTS = 1 << 22


class _Buffer:
    """Values of one thread's tensors of one device and dtype, copied one after another, whose
    statistics wait for `DeviceStatistics.flush`: `counts[i]` elements for `cells[i]`."""

    __slots__ = ("stream", "data", "used", "cells", "counts")

    def __init__(self, stream, data: torch.Tensor):
        self.stream = stream  # where it is filled and reduced (None: a CPU tensor's)
        self.data = data
        self.used = 0
        self.cells: list = []
        self.counts: list = []


class DeviceStatistics:
    """The statistics one probe computes on accelerators: the copies of its batches on their
    way to the host (`landings`), and the device types whose batches go tensor by tensor.

    Each tensor costs a Python call and a device kernel per torch operation: several per tensor
    (`device_row`) add up to most of a small model's decode step on a GPU, and a batch adds a
    copy to pinned memory and an event. So what a thread asks for (`gather`) is only copied,
    one copy per dtype and call, into a buffer of that thread for each device, dtype and
    stream; the copy is the snapshot of the values. When the thread hands its rows to the
    writer (`flush`, at the latest when its round ends), each buffer is reduced by segments, a
    fixed number of operations for it (`_segments`), and goes to the host as one batch.

    A side's small host tensors wait for the same flush the same way (`hold`): copied now,
    under the same serial, and measured on the host then."""

    def __init__(self):
        self.landings = Landings()
        self.no_segments: set[str] = set()  # device types where `torch.segment_reduce` failed
        self.segment_failure: str | None = None  # the first such failure, for the record
        self._here = threading.local()  # a thread's buffers, their serial, their sizes

    def serial_here(self) -> int:
        """The serial of the calling thread's buffers: their cells wait (`QUEUED`) under it
        until `flush`, and only this thread may take them meanwhile."""
        here = self._here
        try:
            return here.serial
        except AttributeError:
            here.serial, here.buffers, here.sizes = new_serial(), {}, {}
            here.held, here.held_elements = [], 0
            return here.serial

    def hold(self, tensors: list, cells: list, runs: list = ()) -> None:
        """Queue the statistics of small contiguous host `tensors` into `cells` until the
        calling thread's next `flush`, as its accelerator statistics wait: each is copied now
        (the model may write it in place later), and the copies are measured together then
        (`_measure_held`), each giving the bits it gives alone. On the model's path a side of
        a decode step then costs a copy a tensor, where measuring it there cost a dozen torch
        and numpy calls, each paid with the model's data in the caches. `runs`: (tensor,
        runs, cells, True) entries of `StatsCache.fresh_runs` whose runs tile their tensor
        (`Queue._holdable`), each run measured as `compute_runs` measures it; a tensor both
        measured whole and cut is copied once. At most HOLD_ELEMENTS wait."""
        serial = self.serial_here()
        here = self._here
        held = here.held  # (copy, its runs, their cells): a tensor measured whole is one run
        copies: dict = {}  # id(tensor) -> its copy
        entries = [(t, 1, [cell]) for t, cell in zip(tensors, cells)]
        entries += [(t, len(t_runs), run_cells) for t, t_runs, run_cells, _ in runs]
        for t, count, t_cells in entries:
            copy = copies.get(id(t))
            if copy is None:
                copy = copies[id(t)] = _values(t).clone()
                here.held_elements += t.numel()
            held.append((copy, count, t_cells))
            for cell in t_cells:
                pack(cell, 0, 0.0, 0.0, 0.0, 0.0, serial, QUEUED)
        if here.held_elements > HOLD_ELEMENTS:
            self._measure_held()

    def _measure_held(self) -> None:
        """Fill the cells of what the calling thread's `hold` copied: the copies of one dtype,
        shape and run count stacked, converted as `prepare` converts each, and their runs
        measured as the rows of one array (`_rows`), which gives a tensor measured whole what
        `_one` gives it alone and each run what `compute_runs` gives it."""
        here = self._here
        held, here.held, here.held_elements = here.held, [], 0
        groups: dict = {}  # (dtype, shape, runs a copy) -> (copies, their runs' cells)
        for t, count, cells in held:
            group = groups.get((t.dtype, t.shape, count))
            if group is None:
                groups[t.dtype, t.shape, count] = group = ([], [])
            group[0].append(t)
            group[1].extend(cells)
        for (_, _, count), (members, member_cells) in groups.items():
            try:
                with np.errstate(all="ignore"):
                    m = _as_float(torch.stack(members) if len(members) > 1 else members[0])
                    _rows(m.numpy().reshape(len(members) * count, -1), member_cells)
            except Exception:  # (a dtype torch cannot stack here) one at a time, as ever
                if count == 1:
                    compute(members, member_cells, self)
                    continue
                for k, t in enumerate(members):
                    width = t.numel() // count
                    compute_runs([(t, [(i * width, (i + 1) * width) for i in range(count)],
                                   member_cells[k * count:(k + 1) * count], True)])

    def gather(self, tensors: list, cells: list) -> None:
        """Queue the statistics of accelerator `tensors` into `cells`: their values copied into
        the calling thread's buffers now, reduced at its next `flush`. A tensor larger than a
        buffer, or on a device type without segments, is batched at once (`batch`)."""
        serial = self.serial_here()
        groups: dict = {}
        alone, alone_cells = [], []
        for t, cell in zip(tensors, cells):
            x = _values(t)
            n = x.numel()
            if n > SEGMENT_ELEMENTS or x.device.type in self.no_segments:
                alone.append(t)
                alone_cells.append(cell)
                continue
            if x.dtype not in _BUFFER_DTYPES:  # (float8...) what `prepare` makes of it
                x = prepare(x)
            groups.setdefault((x.device, x.dtype), []).append((dense_flat(x), cell, n))
        for (device, dtype), items in groups.items():
            key = (device, dtype, _current_stream(device))
            buffer = self._here.buffers.get(key)
            run, size = [], 0
            for item in items:
                n = item[2]
                if buffer is None or buffer.used + size + n > buffer.data.numel():
                    if run:
                        self._copy_in(buffer, run, size, serial)
                        run, size = [], 0
                    buffer = self._new_buffer(key, buffer, n)
                run.append(item)
                size += n
            self._copy_in(buffer, run, size, serial)
        if alone:
            self.batch(alone, alone_cells)

    def _copy_in(self, buffer: _Buffer, run: list, size: int, serial: int) -> None:
        """Copy the values of `run` ((flat tensor, cell, elements) of one device and dtype,
        `size` elements in all) into `buffer` after what it holds, in one operation; their
        cells wait in it (`serial`: its thread's). Where the copy fails (a dtype this
        backend cannot concatenate), they are batched at once instead."""
        out = buffer.data[buffer.used:buffer.used + size]
        try:
            if len(run) == 1:
                out.copy_(run[0][0])
            else:
                torch.cat([flat for flat, _, _ in run], out=out)
        except Exception:
            self.batch([flat for flat, _, _ in run], [cell for _, cell, _ in run])
            return
        buffer.used += size
        for _, cell, n in run:
            pack(cell, 0, 0.0, 0.0, 0.0, 0.0, serial, QUEUED)
            buffer.cells.append(cell)
            buffer.counts.append(n)

    def _new_buffer(self, key: tuple, full: _Buffer | None, needed: int) -> _Buffer:
        """(`gather`.) A new buffer for `key` (device, dtype, stream) with room for `needed`
        elements at least; the `full` one before it reduced. Its size is what the last one held,
        doubled when that was too little, up to SEGMENT_ELEMENTS."""
        sizes = self._here.sizes
        size = sizes.get(key, BUFFER_ELEMENTS)
        if full is not None:
            self._reduce(full)
            size = min(SEGMENT_ELEMENTS, 2 * size)
        size = max(size, needed)
        sizes[key] = size
        device, dtype, stream = key
        with torch.inference_mode(False):  # writable outside inference mode too (`_in_scratch`)
            data = torch.empty(size, dtype=dtype, device=device)
        buffer = self._here.buffers[key] = _Buffer(stream, data)
        return buffer

    def flush(self) -> None:
        """Queue the statistics of everything the calling thread's `gather` copied: one batch per
        buffer, its cells filled by the landing thread. `landings.last()`, taken after this
        call, waits for them. What its `hold` copied is measured now."""
        here = self._here
        if getattr(here, "held", None):
            self._measure_held()
        buffers = getattr(here, "buffers", None)
        if not buffers:
            return
        for buffer in buffers.values():
            if buffer.cells:
                try:
                    self._reduce(buffer)
                except Exception as exc:  # a device error: these statistics, not the rows, lost
                    log.error_once(f"device-statistics-{type(exc).__name__}",
                                   f"device statistics could not be computed "
                                   f"({type(exc).__name__}: {exc}); their rows say N/A")
        buffers.clear()  # the next round takes fresh memory (the allocator's, per stream)

    def _reduce(self, buffer: _Buffer) -> None:
        """Queue the statistics of what `buffer` holds, on the stream that filled it: the
        operations that read it are ordered after the copies that wrote it."""
        if buffer.stream is None:
            self._reduce_here(buffer)
        else:
            with getattr(torch, buffer.data.device.type).stream(buffer.stream):
                self._reduce_here(buffer)

    def _reduce_here(self, buffer: _Buffer) -> None:
        data, counts = buffer.data[:buffer.used], buffer.counts
        try:
            block = _segments(data, counts)
        except Exception as exc:  # no segment_reduce for this device (or this torch)
            self.no_segments.add(data.device.type)
            self.segment_failure = self.segment_failure or f"{type(exc).__name__}: {exc}"
            block = torch.stack([device_row(prepare(piece))
                                 for piece in torch.split(data, counts)])
        DeviceBatch(block, buffer.cells, counts, self.landings)
        buffer.cells, buffer.counts = [], []

    def batch(self, tensors: list, cells: list) -> None:
        """Queue the statistics of `tensors` (one device) into `cells`: the landing thread
        fills them, and `landings.last()`, taken after this call, waits for that."""
        groups: dict = {}
        for t, cell in zip(tensors, cells):
            groups.setdefault(t.dtype, []).append((t, cell))
        rows, ordered, counts = [], [], []
        for items in groups.values():
            part, size = [], 0
            for t, cell in items:
                n = t.numel()
                if n > SEGMENT_ELEMENTS or len(items) < SEGMENTS_FROM or \
                        t.device.type in self.no_segments:
                    rows.append(device_row(prepare(t)).unsqueeze(0))
                    ordered.append(cell)
                    counts.append(n)
                    continue
                if size + n > SEGMENT_ELEMENTS:
                    self._add_segments(part, rows, ordered, counts)
                    part, size = [], 0
                part.append((t, cell))
                size += n
            self._add_segments(part, rows, ordered, counts)
        stacked = rows[0] if len(rows) == 1 else torch.cat(rows)
        DeviceBatch(stacked, ordered, counts, self.landings)

    def _add_segments(self, part: list, rows: list, cells: list, counts: list) -> None:
        """Append the rows of `part` ((tensor, cell) pairs of one dtype) to `rows`, its cells
        to `cells` and its element counts to `counts`: by segments, else tensor by tensor."""
        if not part:
            return
        tensors = [t for t, _ in part]
        if len(part) == 1:
            block = device_row(prepare(tensors[0])).unsqueeze(0)
        else:
            try:
                block = segment_rows(tensors)
            except Exception as exc:  # no segment_reduce for this device (or this torch)
                self.no_segments.add(tensors[0].device.type)
                self.segment_failure = self.segment_failure or f"{type(exc).__name__}: {exc}"
                block = torch.stack([device_row(prepare(t)) for t in tensors])
        rows.append(block)
        cells.extend(c for _, c in part)
        counts.extend(t.numel() for t in tensors)

    def after_fork(self) -> None:
        """In a forked child: the copies on their way, and the buffers, are the parent's."""
        self.landings.after_fork()
        self._here = threading.local()


def _current_stream(device: torch.device):
    """The stream work on `device` is queued on now (CUDA's, torch_npu's...), or None for the
    CPU and a backend without streams."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    try:
        if not callable(getattr(backend, "stream", None)):
            return None  # no way to queue work on a given stream later
        stream = backend.current_stream(device)
        hash(stream)
        return stream
    except Exception:  # a backend without streams, or without hashable ones
        return None


class DeviceBatch:
    """The statistics rows of one batch on their way from a device to pinned host memory. Its
    cells say `DEVICE` until the landing thread has seen the copy land and `finish` has filled
    them."""

    __slots__ = ("host", "cells", "counts")

    def __init__(self, stacked: torch.Tensor, cells: list, counts: list, landings: Landings):
        if stacked.is_cpu:  # CPU tensors sent this way (tests): nothing to wait for
            self.host, event = stacked, None
        else:
            self.host, event = to_host(stacked)
        self.cells, self.counts = cells, counts
        number = landings.reserve()  # first: a thread that sees a DEVICE cell waits for it
        for cell in cells:
            pack(cell, 0, 0.0, 0.0, 0.0, 0.0, 0, DEVICE)
        landings.watch(event, self.finish, number)

    def finish(self) -> None:
        """Fill the cells from the landed copy (the landing thread)."""
        for cell, row, n in zip(self.cells, self.host.tolist(), self.counts):
            fill(cell, finish_row(row, n))
        self.cells = self.host = None


def _overflowed(high: float, low: float, total: float, squares: float) -> bool:
    """A float32 sum (or sum of squares) went infinite while every element is finite."""
    return not (math.isfinite(total) and math.isfinite(squares)) and \
        math.isfinite(high) and math.isfinite(low)


def is_dense(x: torch.Tensor) -> bool:
    """Whether `x`'s elements fill its memory densely in some order (contiguous, transposed,
    permuted). (Pairs sorted as tuples: a quarter faster than a key function, and a tie of
    strides between dimensions longer than 1 fails either way.)"""
    expected = 1
    for stride, size in sorted(zip(x.stride(), x.shape)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def dense_flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 1-D tensor over the same memory when its elements fill it densely in some order
    (contiguous, transposed, permuted), else a contiguous copy."""
    if x.is_contiguous():
        return x.view(-1)
    if is_dense(x):
        return x.as_strided((x.numel(),), (1,))
    return x.reshape(-1)
