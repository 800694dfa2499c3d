"""Statistics computed in batches give the numbers of one tensor at a time.

The CPU path batches max and min of small tensors (`reduceat` over their concatenation) and keeps
numpy's own `add.reduce` and BLAS `dot` per tensor (taken through `matmul`, which keeps the
GIL where `np.dot` gives it up): checked bit for bit against the per-tensor formula the probe
used before batching, `np.dot` included. The accelerator path (run here on CPU tensors) reduces
a batch's tensors of one dtype by segments, or tensor by tensor, with float64 sums, and brings
all rows of a batch back in one copy: tensor by tensor it gives the per-tensor torch formula bit
for bit; by segments, and against the host's float32 sums, the same to float32 rounding.
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from atb_probe.capture import stats_compute as statistics
from atb_probe.capture.landing import Landings
from atb_probe.capture.stats_compute import DeviceStatistics, dense_flat, prepare
from atb_probe.capture.stats_compute import compute as _compute
from atb_probe.capture.tensors import DUMPABLE_DTYPES
from atb_probe.record.jobs import TensorFileJob
from atb_probe.record.safefs import SafeTree
from atb_probe.record.writer import Writer
from atb_probe.stats_cell import (EMPTY, QUEUED, READY, new_cell, new_serial,
                                  values as stats_of, waits_in)

from conftest import dump, only_proc, probe_lines, read_csv
from harness import config, wait_until


def compute(tensors, cells) -> None:
    """The statistics of (CPU) tensors, filled at once."""
    _compute(tensors, cells, DeviceStatistics())


def device_batch(tensors, cells, device: DeviceStatistics | None = None) -> DeviceStatistics:
    """The device path's batch of `tensors` (here CPU tensors), its cells filled by the landing
    thread; waited for as the writer waits, on what `landings.last()` gives after the batch."""
    device = device or DeviceStatistics()
    device.batch(tensors, cells)
    wait_landed(device)
    return device


def wait_landed(device: DeviceStatistics) -> None:
    landed = device.landings.last()  # None: everything queued has landed already
    if landed is not None:
        landed.wait()


def _numpy_one(t: torch.Tensor):
    """The CPU formula, one tensor at a time (the probe's statistics before batching)."""
    x = prepare(t)
    if x.is_contiguous():
        a = x.numpy().reshape(-1)
    elif _dense(x):  # storage order
        a = x.as_strided((x.numel(),), (1,)).numpy()
    else:
        a = x.reshape(-1).numpy()
    # Over more than SCRATCH_ELEMENTS elements measured in float32, the sum of squares is that
    # of each part numpy's pairwise summation splits the array into (`_numpy_parts`), added
    # exactly; the float64 sums of an overflow too.
    parts = a.dtype == np.float32 and a.size > statistics.SCRATCH_ELEMENTS
    with np.errstate(all="ignore"):
        high, low = float(np.maximum.reduce(a)), float(np.minimum.reduce(a))
        total, squares = float(np.add.reduce(a)), _squares(a, parts)
        if not (math.isfinite(total) and math.isfinite(squares)) and math.isfinite(high) \
                and math.isfinite(low):
            a = a.astype(np.float64)
            total, squares = float(np.add.reduce(a)), _squares(a, parts)
    return high, low, total / a.size, math.sqrt(squares)


def _squares(a, parts: bool) -> float:
    if not parts:
        return float(np.dot(a, a))
    try:
        return math.fsum(float(np.dot(p, p))
                         for p in _numpy_parts(a, statistics.PART_ELEMENTS))
    except OverflowError:
        return math.inf


def _numpy_parts(a, most: int) -> list:
    """The runs numpy's pairwise summation (`pairwise_sum` in its loops) splits `a` into, in
    order, down to runs of at most `most` elements."""
    if a.size <= most:
        return [a]
    half = a.size // 2
    half -= half % 8
    return _numpy_parts(a[:half], most) + _numpy_parts(a[half:], most)


def _torch_one(t: torch.Tensor):
    """The accelerator formula, one tensor at a time, with a host transfer per tensor: sums
    accumulated in float64."""
    x = dense_flat(prepare(t))  # storage order, as before
    low, high = torch.aminmax(x)
    high, low = float(high), float(low)
    total = float(x.sum(dtype=torch.float64))
    norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    if math.isnan(norm):
        high = low = norm
    return high, low, total / x.numel(), norm


def _dense(x: torch.Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (1, 2, 3, 7, 64, 255, 256, 1000, 4096, 4097, 30000):
        out.append(torch.randn(n, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g)))
    base = torch.randn(48, 64, generator=g)
    out += [base.t(), base[:, ::2], base.view(64, 48)[3:40], base.double(),
            base.to(torch.bfloat16), base.half(), (base > 0), (base * 100).long(),
            (base * 10).to(torch.int8), torch.complex(base, -base), torch._neg_view(base),
            torch.tensor([0.0, -0.0, 0.0]), torch.tensor([-0.0, 0.0]),
            torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([float("inf"), -1.0]),
            torch.full((100,), 3e19), torch.full((5000,), -4e19)]  # float32 sums overflow
    return out


def _cells(n: int) -> list[bytearray]:
    serial = new_serial()
    return [new_cell(serial) for _ in range(n)]


def _same(a, b) -> bool:
    """Bit-identical tuples of floats (nan equal to nan, -0.0 told from 0.0)."""
    return [repr(float(x)) for x in a] == [repr(float(x)) for x in b]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70000), st.integers(0, 15), st.sampled_from([np.float32, np.float64]),
       st.integers(-30, 30))
def test_the_sum_of_squares_is_np_dot_bit_for_bit(size, offset, dtype, scale):
    data = np.random.default_rng(size).standard_normal(size + offset).astype(dtype) * 2.0 ** scale
    a = data[offset:]  # every alignment of the BLAS kernel's loads
    assert statistics._square_sum(a) == float(np.dot(a, a))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_gives_each_tensor_its_own_statistics_bit_for_bit(seed):
    _check_shuffled_batch(_tensors(seed), seed)


def _check_shuffled_batch(tensors: list, seed: int) -> None:
    """`tensors` measured as one batch, in an order shuffled by `seed`: each gets the
    per-tensor formula's statistics bit for bit."""
    order = torch.randperm(len(tensors), generator=torch.Generator().manual_seed(seed)).tolist()
    tensors = [tensors[i] for i in order]
    cells = _cells(len(tensors))
    compute(tensors, cells)
    for t, cell in zip(tensors, cells):
        assert _same(stats_of(cell), _numpy_one(t)), (t.dtype, tuple(t.shape))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_half_precision_tensors_converted_together_get_their_own_statistics(seed):
    """Dense bfloat16, float16 and bool tensors of a batch are converted to float32 in one
    concatenation per dtype (`_convert_together`): each still gets its own formula's values,
    whatever its layout, offset, lazy negation or grad; gapped ones and large ones go their
    own ways in the same batch."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(40, 24, generator=g) * 10 ** seed
    tensors = []
    for dtype in (torch.bfloat16, torch.float16):
        b = base.to(dtype)
        tensors += [b, b.t(), b[:, ::2], b[3:17], b.view(-1)[5:300], torch._neg_view(b), b[0],
                    b[1:2].clone().requires_grad_(), torch.randn(1, 1, 1024, generator=g).to(dtype),
                    torch.tensor([-0.0, 0.0, float("nan")], dtype=dtype),
                    torch.randn(statistics.SCRATCH_FROM + 5, generator=g).to(dtype)]
    tensors += [base > 0, (base > 0).t(), torch.tensor([True]), torch.tensor([False, False])]
    _check_shuffled_batch(tensors, seed)


def test_small_tensors_batched_together_keep_signed_zeros_and_nan():
    tensors = [torch.tensor([0.0, -0.0]), torch.tensor([-0.0, 0.0]), torch.tensor([-0.0]),
               torch.tensor([float("nan"), 1.0]), torch.tensor([2.0, float("nan")]),
               torch.tensor([-0.0, -0.0, 0.0, -0.0])]
    cells = _cells(len(tensors))
    compute(tensors, cells)
    for c, t in zip(cells, tensors):
        assert _same(stats_of(c), _numpy_one(t))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(3, 12), st.sampled_from([torch.float32, torch.float64,
                                                                   torch.bfloat16]),
       st.integers(0, 2 ** 31 - 1))
def test_small_tensors_of_one_size_measured_as_rows_get_their_own_statistics(size, count,
                                                                             dtype, seed):
    """A batch with several small tensors of one dtype and size measures them as the rows of
    one array (`_host`, `_rows`): each still gets the per-tensor formula's bits, non-finite and
    overflowing rows included, and so do the others of the batch."""
    g = torch.Generator().manual_seed(seed)
    same = [(torch.randn(size, generator=g) * 10.0 ** (i % 5 - 2)).to(dtype)
            for i in range(count)]
    same[0][0] = float("nan")
    if size > 1:
        same[1][-1] = float("-inf")
        same[2].fill_(3e19 if dtype is not torch.bfloat16 else 1.0)  # float32 sums overflow
    others = [torch.randn(size + 1, generator=g), torch.randn(7, generator=g).double()]
    tensors = same[:2] + others + same[2:]
    cells = _cells(len(tensors))
    compute(tensors, cells)
    for t, cell in zip(tensors, cells):
        assert _same(stats_of(cell), _numpy_one(t)), (t.dtype, tuple(t.shape))


@st.composite
def _layouts(draw):
    """(shape, strides) of a non-empty tensor: a permutation of a contiguous layout, the same
    with one stride changed (a slice, an expanded dimension, an overlap), or any strides."""
    shape = draw(st.lists(st.integers(1, 4), max_size=4))
    order = draw(st.permutations(range(len(shape))))
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    how = draw(st.sampled_from(["dense", "one changed", "any"]))
    if how == "one changed" and shape:
        strides[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(0, 24))
    elif how == "any":
        strides = [draw(st.integers(0, 24)) for _ in shape]
    return tuple(shape), tuple(strides)


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.integers(0, 3))
def test_is_dense_tells_exactly_the_layouts_that_fill_their_memory(layout, offset):
    """`is_dense` against its definition: the elements' addresses are exactly the `numel`
    addresses from the first one (non-empty tensors, which are all it is asked about)."""
    shape, strides = layout
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    x = torch.arange(span + offset, dtype=torch.float32).as_strided(shape, strides, offset)
    addresses = x.reshape(-1).tolist()  # the element at address a holds the value a
    dense = sorted(addresses) == list(range(offset, offset + x.numel()))
    assert statistics.is_dense(x) == dense


def test_float32_overflow_falls_back_to_float64_sums():
    t = torch.full((1000,), 1e20)
    cells = _cells(1)
    compute([t], cells)
    high, low, mean, norm = stats_of(cells[0])
    assert math.isfinite(mean) and math.isfinite(norm)
    assert mean == pytest.approx(1e20) and norm == pytest.approx(1e20 * math.sqrt(1000))


def _run_slices(t: torch.Tensor, runs, one_after_another: bool = False) -> list:
    """Each run's cell from `compute_runs`: a request's slice of a contiguous host tensor."""
    cells = [EMPTY if start >= stop else new_cell(new_serial()) for start, stop in runs]
    statistics.compute_runs([(t, runs, cells, one_after_another)])
    return cells


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("width", [1, 256, 5000])
def test_runs_of_a_tensor_get_the_statistics_of_their_slices_bit_for_bit(seed, width):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(9, width, generator=g) * 1000
    base[2, :1] = float("nan")
    base[4, -1] = -0.0
    base[5] = 3e19  # float32 sums overflow: float64 again
    for t in (base, base.to(torch.bfloat16), base.double(), base > 0, torch._neg_view(base)):
        # requests one after another, with a gap (padding) and a run up to the end
        runs = [(0, width), (width, 3 * width), (4 * width, 6 * width), (6 * width, 7 * width),
                (8 * width, 9 * width)]
        for order in (runs, runs[::-1], runs[:2]):
            cells = _run_slices(t, order)
            for (start, stop), cell in zip(order, cells):
                piece = t.reshape(-1)[start:stop]
                assert _same(stats_of(cell), _numpy_one(piece)), (t.dtype, start, stop)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("width", [1, 7, 256, 5000])
def test_runs_of_one_length_one_after_another_get_their_slices_statistics_bit_for_bit(
        seed, width):
    # A token per request (a decode step), or the rows of a batch: one 2-D view of the runs.
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, width, generator=g) * 1000
    base[1, :1] = float("nan")
    base[3, -1] = float("-inf")
    base[4] = -0.0
    base[6] = 3e19  # float32 sums overflow: float64 again
    for t in (base, base.to(torch.bfloat16), base.double(), base > 0, torch._neg_view(base)):
        for first, count in ((0, 8), (width, 5), (3 * width, 2)):
            runs = [(first + k * width, first + (k + 1) * width) for k in range(count)]
            cells = _run_slices(t, runs, one_after_another=True)
            for (start, stop), cell in zip(runs, cells):
                piece = t.reshape(-1)[start:stop]
                assert _same(stats_of(cell), _numpy_one(piece)), (t.dtype, start, stop)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9000), st.integers(2, 9), st.integers(0, 5),
       st.sampled_from([torch.float32, torch.float64]), st.integers(-30, 30))
def test_equal_runs_of_any_size_and_alignment_match_their_slices(width, count, offset, dtype,
                                                                 scale):
    g = torch.Generator().manual_seed(width * 31 + count)
    t = (torch.randn(offset + count * width + 3, generator=g) * 2.0 ** scale).to(dtype)
    runs = [(offset + k * width, offset + (k + 1) * width) for k in range(count)]
    for (start, stop), cell in zip(runs, _run_slices(t, runs, one_after_another=True)):
        assert _same(stats_of(cell), _numpy_one(t[start:stop]))


def test_an_empty_run_gets_an_empty_cell_and_the_others_their_values():
    t = torch.arange(12, dtype=torch.float32)
    cells = _run_slices(t, [(0, 4), (4, 4), (4, 12)])
    assert cells[1] is EMPTY
    assert _same(stats_of(cells[0]), _numpy_one(t[:4]))
    assert _same(stats_of(cells[2]), _numpy_one(t[4:]))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_device_path_gives_the_per_tensor_device_formula_bit_for_bit(seed, monkeypatch):
    """The device code run on CPU tensors, tensor by tensor: one stacked transfer for the whole
    batch gives what a transfer per tensor gave."""
    monkeypatch.setattr(statistics, "SEGMENTS_FROM", 10 ** 9)
    tensors = _tensors(seed)
    cells = _cells(len(tensors))
    device_batch([prepare(t) for t in tensors], cells)
    for t, cell in zip(tensors, cells):
        assert _same(stats_of(cell), _torch_one(t)), (t.dtype, tuple(t.shape))


def test_device_and_host_paths_agree_to_float32_rounding():
    tensors = _tensors(3)
    host, device = _cells(len(tensors)), _cells(len(tensors))
    compute(tensors, host)
    device_batch([prepare(t) for t in tensors], device)
    for t, a, b in zip(tensors, host, device):
        assert stats_of(a) == pytest.approx(stats_of(b), rel=1e-4, abs=1e-5, nan_ok=True), t.dtype


def _agree(got, want) -> bool:
    """Max and min equal (nan to nan, either zero to either zero), mean and norm to float32
    rounding."""
    if [repr(abs(x)) if x == 0 else repr(x) for x in got[:2]] != \
            [repr(abs(x)) if x == 0 else repr(x) for x in want[:2]]:
        return False
    return got[2:] == pytest.approx(want[2:], rel=1e-5, abs=1e-6, nan_ok=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("part", [64, 5000, statistics.SEGMENT_ELEMENTS])
def test_tensors_reduced_by_segments_get_their_own_statistics(seed, part, monkeypatch):
    """The device path's batches (run here on CPU tensors): tensors of one dtype concatenated
    and reduced by segments, in parts of at most `part` elements (a larger tensor alone), give
    the host path's statistics, nan, inf and the float64 fallback included."""
    monkeypatch.setattr(statistics, "SEGMENT_ELEMENTS", part)
    tensors = _tensors(seed) + [torch.tensor([2.0, float("nan"), -3.0]) for _ in range(3)] + \
        [torch.tensor([float("inf"), -float("inf")]), torch.tensor([-float("inf"), 1.0])]
    order = torch.randperm(len(tensors), generator=torch.Generator().manual_seed(seed)).tolist()
    tensors = [tensors[i] for i in order]
    cells = _cells(len(tensors))
    assert device_batch(tensors, cells).segment_failure is None
    for t, cell in zip(tensors, cells):
        assert _agree(stats_of(cell), _numpy_one(t)), (t.dtype, tuple(t.shape), t.flatten()[:4])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("start, limit", [(64, 5000), (statistics.BUFFER_ELEMENTS,
                                                       statistics.SEGMENT_ELEMENTS)])
def test_gathered_tensors_wait_for_the_flush_then_get_their_own_statistics(seed, start, limit,
                                                                           monkeypatch):
    """The device path as a model thread takes it (run here on CPU tensors): each call copies
    its tensors' values into the thread's buffers, one per dtype; their cells wait, under the
    thread's serial, until the flush reduces every buffer; buffers that fill are reduced and
    replaced by larger ones, and a tensor larger than a buffer goes alone. Each tensor gets
    the host path's statistics, nan, inf and the float64 fallback included, from the values it
    held when it was gathered."""
    monkeypatch.setattr(statistics, "BUFFER_ELEMENTS", start)
    monkeypatch.setattr(statistics, "SEGMENT_ELEMENTS", limit)
    tensors = _tensors(seed) + [torch.tensor([2.0, float("nan"), -3.0]),
                                torch.tensor([float("inf"), -float("inf")])]
    want = [_numpy_one(t) for t in tensors]
    device = DeviceStatistics()
    cells = _cells(len(tensors))
    for i in range(0, len(tensors), 3):  # a side at a time
        device.gather(tensors[i:i + 3], cells[i:i + 3])
    serial = device.serial_here()
    queued = [c for c in cells if c[-1] == QUEUED]
    assert queued and all(waits_in(c) == serial for c in queued)
    for t in tensors:  # what the model does next does not change what was gathered
        if t.is_floating_point():
            t.add_(1.0)
    device.flush()
    wait_landed(device)
    assert device.segment_failure is None
    for t, cell, w in zip(tensors, cells, want):
        assert _agree(stats_of(cell), w), (t.dtype, tuple(t.shape))
    assert not device._here.buffers  # the next round takes fresh buffers


def _planted(shape, dtype, values: str, g) -> torch.Tensor:
    """A random tensor of `shape` and `dtype` holding what `values` says: "normal", a "nan",
    an "inf", or values so "huge" that float32 sums overflow."""
    t = torch.randn(shape, generator=g) * 3
    if values == "nan":
        t.view(-1)[0] = float("nan")
    elif values == "inf":
        t.view(-1)[-1] = -float("inf")
    elif values == "huge":
        t.fill_(3e19)
    return t > 0 if dtype is torch.bool else t.to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(1,), (3,), (1, 1, 64), (2, 50), (4096,)]),
                          st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                           torch.float16, torch.bool, torch.int64]),
                          st.sampled_from(["normal", "nan", "inf", "huge"])),
                min_size=1, max_size=12),
       st.integers(0, 2 ** 31 - 1))
def test_held_host_tensors_wait_for_the_flush_then_get_their_own_statistics(kinds, seed):
    """A side's small host tensors left for later (`DeviceStatistics.hold`) are copied: their
    cells wait under the thread's serial until the flush, which measures the copies of one
    dtype and shape together. Each gets the bits the per-tensor formula gives it, nan, inf
    and the float64 fallback included, from the values it held when it was held, whatever
    the model wrote into it since."""
    g = torch.Generator().manual_seed(seed)
    tensors = [_planted(shape, dtype, values, g) for shape, dtype, values in kinds]
    want = [_numpy_one(t) for t in tensors]
    device = DeviceStatistics()
    cells = _cells(len(tensors))
    for i in range(0, len(tensors), 2):  # a side at a time
        device.hold(tensors[i:i + 2], cells[i:i + 2])
    assert all(c[-1] == QUEUED and waits_in(c) == device.serial_here() for c in cells)
    for t in tensors:  # what the model does next does not change what was held
        t.zero_()
    device.flush()
    for t, cell, w in zip(tensors, cells, want):
        assert _same(stats_of(cell), w), (t.dtype, tuple(t.shape))
    assert not device._here.held and not device._here.held_elements


@pytest.mark.parametrize("dtype", list(DUMPABLE_DTYPES), ids=str)
def test_held_tensors_of_every_dumpable_dtype_get_what_they_get_alone(dtype):
    """Held copies of one dtype and shape are stacked before they are converted: each gets
    the numbers `compute` gives it alone, for every dtype a dump records."""
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(3, 5, generator=g) * 4 for _ in range(3)]
    tensors = [torch.complex(v, -v).to(dtype) if dtype.is_complex else v.to(dtype)
               for v in values] + [values[0][0].to(dtype) if not dtype.is_complex else
                                   torch.complex(values[0][0], values[0][0]).to(dtype)]
    alone, held = _cells(len(tensors)), _cells(len(tensors))
    for t, cell in zip(tensors, alone):
        compute([t], [cell])
    device = DeviceStatistics()
    device.hold(tensors, held)
    device.flush()
    for a, b in zip(alone, held):
        assert _same(stats_of(b), stats_of(a)), (stats_of(a), stats_of(b))


def test_held_tensors_that_cannot_be_stacked_are_measured_one_at_a_time(monkeypatch):
    """Where torch cannot stack a group of held copies, each is measured alone: the same
    numbers, nothing lost."""
    def refuse(*args, **kwargs):
        raise RuntimeError("stack: not for this dtype here")

    tensors = [torch.randn(4, 8) for _ in range(3)]
    want = [_numpy_one(t) for t in tensors]
    monkeypatch.setattr(statistics.torch, "stack", refuse)
    device = DeviceStatistics()
    cells = _cells(3)
    device.hold(tensors, cells)
    device.flush()
    for cell, w in zip(cells, want):
        assert _same(stats_of(cell), w)


def test_held_host_tensors_are_measured_once_their_bound_is_reached(monkeypatch):
    """A thread holds at most HOLD_ELEMENTS elements: the side that goes past it has
    everything held measured at once."""
    monkeypatch.setattr(statistics, "HOLD_ELEMENTS", 250)
    device = DeviceStatistics()
    tensors = [torch.randn(100) for _ in range(3)]
    cells = _cells(3)
    device.hold(tensors[:2], cells[:2])
    assert all(c[-1] == QUEUED for c in cells[:2])
    device.hold(tensors[2:], cells[2:])
    assert all(c[-1] == READY for c in cells) and not device._here.held
    for t, cell in zip(tensors, cells):
        assert _same(stats_of(cell), _numpy_one(t))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(1,), (8,), (1, 64), (8, 256), (3, 5, 7)]),
                          st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                           torch.float16, torch.int64, torch.int32]),
                          st.sampled_from(["normal", "nan", "inf", "huge"]),
                          st.sampled_from(["whole", "runs", "both"])),
                min_size=1, max_size=10),
       st.integers(0, 2 ** 31 - 1))
def test_held_runs_of_a_side_get_what_compute_runs_gives_them(kinds, seed):
    """A side cut per request (vLLM's decode step: a token per request, the rows of each
    tensor) is held too when its runs tile its tensors (`Queue._holdable`): each tensor is
    copied once whether it is measured whole, by runs or both, and at the flush every run
    gets the bits `compute_runs` gives it and every whole tensor those of `compute`, from the
    values held, whatever the model wrote since."""
    from atb_probe.capture.stats_reuse import StatsCache
    g = torch.Generator().manual_seed(seed)
    cache = StatsCache()
    queue = cache.new_queue()
    wants, got = [], []
    for shape, dtype, values, how in kinds:
        t = _planted(shape, dtype, values, g)
        if how != "runs":
            wants.append(_numpy_one(t))
            got.append(cache.fresh(t, queue))
        if how != "whole":
            rows = shape[0]
            width = t.numel() // rows
            runs = [(k * width, (k + 1) * width) for k in range(rows)]
            wants += [stats_of(c) for c in _run_slices(t, runs, True)]
            got += cache.fresh_runs(t, runs, queue, True)
    tensors = [t for t in queue.tensors] + [entry[0] for entry in queue.runs]
    assert queue._holdable()
    queue.resolve(later=True)
    assert not (queue.tensors or queue.runs or queue.nbytes)
    here = queue.device._here
    assert all(c[-1] == QUEUED and waits_in(c) == queue.device.serial_here() for c in got)
    assert len({id(c) for c, _, _ in here.held}) == len({id(t) for t in tensors})  # one copy each
    for t in tensors:  # what the model does next does not change what was held
        t.zero_()
    queue.device.flush()
    for cell, want in zip(got, wants):
        assert _same(stats_of(cell), want)
    assert not (here.held or here.held_elements)


@pytest.mark.parametrize("runs, one_after_another", [
    ([(0, 4), (4, 8)], False),            # not known to be of one length
    ([(4, 8), (8, 12)], True),            # not from the first element
    ([(0, 4), (4, 8)], True),             # not to the last
], ids=["any-runs", "offset", "short"])
def test_runs_that_do_not_tile_their_tensor_are_measured_at_once(runs, one_after_another):
    """Runs that are not the rows of their tensor (a prefill's prompts of several lengths, a
    slice of the tensor) are not held: the side is measured when it resolves, as before."""
    from atb_probe.capture.stats_reuse import StatsCache
    cache = StatsCache()
    queue = cache.new_queue()
    t = torch.randn(12) if runs[0][0] else torch.randn(3, 4)
    whole = cache.fresh(t, queue)
    cells = cache.fresh_runs(t, runs, queue, one_after_another)
    assert not queue._holdable()
    queue.resolve(later=True)
    assert all(c[-1] == READY for c in [whole, *cells])
    assert not queue.device._here.__dict__.get("held")
    assert _same(stats_of(whole), _numpy_one(t))
    for (start, stop), cell in zip(runs, cells):
        assert _same(stats_of(cell), _numpy_one(t.reshape(-1)[start:stop]))


def test_held_runs_that_cannot_be_stacked_are_measured_tensor_by_tensor(monkeypatch):
    """Where torch cannot stack a group of held copies cut by runs, each copy's runs are
    measured by `compute_runs`: the same numbers, nothing lost."""
    def refuse(*args, **kwargs):
        raise RuntimeError("stack: not for this dtype here")

    tensors = [torch.randn(4, 8) for _ in range(3)]
    runs = [(k * 8, (k + 1) * 8) for k in range(4)]
    want = [stats_of(c) for t in tensors for c in _run_slices(t, runs, True)]
    monkeypatch.setattr(statistics.torch, "stack", refuse)
    device = DeviceStatistics()
    cells = _cells(12)
    device.hold([], [], [(t, runs, cells[4 * k:4 * k + 4], True)
                         for k, t in enumerate(tensors)])
    device.flush()
    for cell, w in zip(cells, want):
        assert _same(stats_of(cell), w)


def test_each_thread_gathers_into_buffers_of_its_own():
    """A thread's gathered cells wait under its own serial, and one thread's flush leaves
    another's cells waiting."""
    device = DeviceStatistics()
    tensors = [torch.randn(100) for _ in range(4)]
    mine, theirs = _cells(2), _cells(2)
    serials = []

    def other():
        device.gather(tensors[2:], theirs)
        serials.append(device.serial_here())

    device.gather(tensors[:2], mine)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert serials[0] != device.serial_here()
    device.flush()
    wait_landed(device)
    assert all(c[-1] == READY for c in mine)
    assert all(c[-1] == QUEUED and waits_in(c) == serials[0] for c in theirs)


class _Kept:
    """Where jobs go (the writer's `put`), kept to be looked at."""

    def __init__(self):
        self.jobs = []

    def put(self, job) -> None:
        self.jobs.append(job)


def test_rows_handed_over_wait_for_what_their_thread_gathered():
    """A thread's rows reach the writer with what to wait for (`RowsJob.ready`), and that
    covers the statistics the thread gathered before it handed them over: its buffers are
    reduced first. Once the writer has waited (if there is anything to wait for), every cell
    of the rows is filled."""
    from atb_probe.capture.recorder import RoundRecord, _RowHandover
    from atb_probe.capture.stats_reuse import StatsCache
    stats, sink = StatsCache(), _Kept()
    handover = _RowHandover(sink, stats, "statistic.csv")
    record = RoundRecord("0_1", 0)
    t = torch.randn(300)
    (cell,) = _cells(1)
    stats.device.gather([t], [cell])
    handover.queue(record, [(*record.head, "Op", "Op", "0", "input",
                             "0", "float32", "[300]", cell, None)])
    handover.hand_over()
    (job,) = sink.jobs
    if job.ready is not None:  # None: everything queued has landed already
        job.ready.wait()
    assert cell[-1] == READY and _agree(stats_of(cell), _numpy_one(t))


def test_a_gathered_tensor_seen_again_in_its_thread_is_not_copied_again():
    """The statistics cache gives a tensor seen again by the same thread (the next layer's
    input, the last one's output) the cell waiting in that thread's buffer; another thread
    does not take that cell (its rows might reach the writer first) and gathers its own."""
    from atb_probe.capture import stats_reuse
    cache = stats_reuse.StatsCache()
    route = (lambda tensors, cells, device: device.gather(tensors, cells))
    original, stats_reuse.compute = stats_reuse.compute, route
    try:
        t = torch.randn(300)
        first = cache.new_queue()
        (cell,), _ = cache.side(first, [t])
        first.resolve()
        assert cell[-1] == QUEUED and waits_in(cell) == cache.device.serial_here()
        again, _ = cache.side(cache.new_queue(), [t])
        assert again[0] is cell
        got = []

        def other():
            queue = cache.new_queue()
            cells, _ = cache.side(queue, [t])
            queue.resolve()
            got.append(cells[0])

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert got[0] is not cell and got[0][-1] == QUEUED
        cache.device.flush()
        wait_landed(cache.device)
        assert _agree(stats_of(cell), _numpy_one(t))
    finally:
        stats_reuse.compute = original


def test_a_kernel_output_is_found_by_the_next_ops_and_kept_only_while_referenced():
    """A kernel output over fresh memory waits in its layer execution's queue, which hands its
    cell to the next ops that take it; when the queue resolves, the statistics cache keeps
    what something else still refers to (the layer's output) for later layer executions, and
    nothing of the outputs that died with the queue."""
    from atb_probe.capture.stats_reuse import StatsCache
    cache = StatsCache()
    queue = cache.new_queue()
    x = torch.randn(100)
    _, seen = cache.side(queue, [x], remember_inputs=True)
    (dead_cell,), _ = cache.side(queue, [x + 1], kernel_output=True, inputs_seen=seen)
    out = x * 2
    (cell,), _ = cache.side(queue, [out], kernel_output=True, inputs_seen=seen)
    assert dead_cell is not cell
    (again,), _ = cache.side(queue, [out])
    assert again is cell and cell[-1] == QUEUED
    queue.resolve()
    assert _same(stats_of(cell), _numpy_one(out))
    assert _same(stats_of(dead_cell), _numpy_one(x + 1))
    (later,), _ = cache.side(cache.new_queue(), [out])
    assert later is cell
    # x (an input) and out, each by identity and by memory: nothing of the dead `x + 1`
    assert (len(cache._seen), len(cache._entries)) == (2, 2)


def test_a_statistics_dumps_view_output_is_held_with_its_row_and_kept_only_while_referenced():
    """A view kernel's output in a statistics dump (given its row's cells) is held by the
    queue like an output over fresh memory: the next ops that take it get its input's cell
    and its row's cells from the entry; when the queue resolves, the view that something else
    still refers to is remembered by identity for later layer executions, and nothing of the
    one that died with the queue. A tensor dump's view (no row) is remembered at once."""
    from atb_probe.capture.stats_reuse import StatsCache
    cache = StatsCache()
    queue = cache.new_queue()
    x = torch.randn(4, 25)
    (x_cell,), seen = cache.side(queue, [x], remember_inputs=True)
    kept = x.view(100)
    assert cache.output_cell(kept, queue, seen, True, ("float32", "100")) is x_cell
    assert cache.output_cell(x.view(2, 50), queue, seen, True, ("float32", "2x50")) is x_cell
    entry = queue.held[id(kept)]
    assert entry[2] is x_cell and entry[4:6] == ("float32", "100")
    (again,), _ = cache.side(queue, [kept])
    assert again is x_cell
    assert len(cache._seen) == 1  # x alone: the views wait in the queue
    queue.resolve()
    assert _same(stats_of(x_cell), _numpy_one(x))
    assert set(cache._seen) == {id(x), id(kept)}
    (later,), _ = cache.side(cache.new_queue(), [kept])
    assert later is x_cell
    tensor_dump = cache.new_queue()
    transposed = x.t()
    assert cache.output_cell(transposed, tensor_dump, seen, True) is x_cell
    assert id(transposed) in cache._seen and not tensor_dump.held


def test_a_held_kernel_output_written_since_gets_new_statistics():
    """A held output changed in place, or given other memory through `.data`, is not taken
    for the values its cell holds."""
    from atb_probe.capture.stats_reuse import StatsCache
    cache = StatsCache()
    queue = cache.new_queue()
    x = torch.randn(50)
    _, seen = cache.side(queue, [x], remember_inputs=True)
    out = x * 2
    (cell,), _ = cache.side(queue, [out], kernel_output=True, inputs_seen=seen)
    out.mul_(3.0)
    (written,), _ = cache.side(queue, [out])
    other = x * 2
    (moved_cell,), _ = cache.side(queue, [other], kernel_output=True, inputs_seen=seen)
    other.data = torch.randn(50)
    (moved,), _ = cache.side(queue, [other])
    queue.resolve()
    assert written is not cell and _same(stats_of(written), _numpy_one(out))
    assert moved is not moved_cell and _same(stats_of(moved), _numpy_one(other))


def test_a_buffer_that_cannot_be_reduced_loses_its_statistics_not_the_round(monkeypatch, capfd):
    """A device error while a thread's buffers are reduced (`flush`, as its rows go to the
    writer) is said once on stderr; the flush returns, its cells stay without values (the rows
    say N/A) and the next round's buffers start afresh."""
    def fails(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(statistics, "_segments", fails)
    monkeypatch.setattr(statistics, "device_row", fails)
    device = DeviceStatistics()
    cells = _cells(2)
    device.gather([torch.randn(10), torch.randn(20)], cells)
    device.flush()
    assert [stats_of(c) for c in cells] == [None, None]
    assert "device statistics could not be computed (RuntimeError: device lost)" in \
        capfd.readouterr().err
    assert not device._here.buffers


def test_a_device_type_without_segments_goes_tensor_by_tensor():
    """A device type the probe has found without `torch.segment_reduce` (an accelerator whose
    torch lacks it) reduces each tensor alone: the per-tensor formula, bit for bit (by
    segments, half of these tensors would differ in their last bits)."""
    device = DeviceStatistics()
    device.no_segments.add("cpu")
    tensors = _tensors(0)
    cells = _cells(len(tensors))
    device_batch(tensors, cells, device)
    assert device.segment_failure is None  # not even tried
    for t, cell in zip(tensors, cells):
        assert _same(stats_of(cell), _torch_one(t)), (t.dtype, tuple(t.shape))


def test_a_batch_segment_reduce_refuses_goes_tensor_by_tensor_and_so_do_later_ones():
    """`torch.segment_reduce` has no forward-mode derivative: on the dual tensors of a model run
    under forward AD (`torch.func.jvp`) it raises. The batch then goes tensor by tensor, the
    failure is kept for the record, and later batches on that device type of this probe do not
    try again; another probe's statistics are not affected."""
    import torch.autograd.forward_ad as fwAD
    device = DeviceStatistics()
    plain = _tensors(0)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, torch.ones_like(t)) for t in plain if t.is_floating_point()]
        cells = _cells(len(duals))
        device_batch(duals, cells, device)
    assert device.no_segments == {"cpu"}
    assert device.segment_failure.startswith("NotImplementedError: Trying to use forward AD "
                                             "with segment_reduce")
    for t, cell in zip(duals, cells):
        assert _same(stats_of(cell), _torch_one(fwAD.unpack_dual(t).primal)), t.dtype
    cells = _cells(len(plain))
    device_batch(plain, cells, device)
    assert all(_same(stats_of(c), _torch_one(t)) for t, c in zip(plain, cells))
    other = DeviceStatistics()
    device_batch(plain, _cells(len(plain)), other)
    assert other.no_segments == set() and other.segment_failure is None


def test_a_device_batch_is_filled_once_whatever_thread_waits():
    import threading
    tensors = [torch.randn(10) for _ in range(20)]
    cells = _cells(len(tensors))
    device = DeviceStatistics()
    device.batch([prepare(t) for t in tensors], cells)
    landed = device.landings.last()
    got = []

    def wait_and_read():
        if landed is not None:
            landed.wait()
        got.append([stats_of(c) for c in cells])

    threads = [threading.Thread(target=wait_and_read) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(g == got[0] for g in got) and all(c[-1] == READY for c in cells)


@pytest.mark.parametrize("route", ["batch", "gather"])
@pytest.mark.parametrize("name", ["stat-child", "stat-layer", "all-child-fl1"])
def test_the_device_path_through_the_whole_probe_gives_the_golden_statistics(tmp_path,
                                                                            monkeypatch, route,
                                                                            name):
    """Every statistic routed through the accelerator code on the exact-arithmetic model of the
    golden dump: max, min and mean as the golden csv says; the norm, summed in float64 on that
    path, to float32 precision. `batch`: device rows, one stacked copy per call; `gather`: as
    the probe runs on an accelerator, values copied into the thread's buffers, reduced when its
    rows go to the writer (a row handed over before its buffer was reduced would say N/A)."""
    from atb_probe.capture import stats_reuse
    from test_dump_golden import CONFIGS, _golden, make_dump

    if route == "batch":
        monkeypatch.setattr(stats_reuse, "compute", lambda tensors, cells, device: device.batch(
            [prepare(t) for t in tensors], cells))
    else:
        monkeypatch.setattr(stats_reuse, "compute",
                            lambda tensors, cells, device: device.gather(tensors, cells))
    got = make_dump(tmp_path, CONFIGS[name])["csv"]
    want = _golden()[name]["csv"]
    assert sorted(got) == sorted(want)
    for path, rows in want.items():
        assert len(got[path]) == len(rows)
        for a, b in zip(got[path][1:], rows[1:]):
            assert a[:12] == b[:12] and a[14] == b[14], (a, b)
            assert float(a[13]) == pytest.approx(float(b[13]), rel=1e-6), (a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_tensor_at_a_time_gives_the_per_tensor_formula_bit_for_bit(seed):
    """The single-tensor path (an op side computed at once) skips numpy's error-state context
    where nothing can overflow: the numbers stay the same, overflow and nan included."""
    for t in _tensors(seed):
        cells = _cells(1)
        compute([t], cells)
        assert _same(stats_of(cells[0]), _numpy_one(t)), (t.dtype, tuple(t.shape))


@pytest.mark.parametrize("values", [[3e19] * 100, [1.0, float("inf")], [float("inf"), -float("inf")],
                                    [1.0, float("nan")], [1e-30, 2e-30]])
def test_statistics_leave_the_users_numpy_error_state_alone(values):
    """Neither warnings nor errors reach the user's code whatever numpy error state it set,
    and that state is the same afterwards."""
    t = torch.tensor(values)
    with np.errstate(all="raise"):
        cells = _cells(1)
        compute([t], cells)  # raises FloatingPointError if a reduction runs unguarded
        assert np.geterr() == {"divide": "raise", "over": "raise", "under": "raise",
                               "invalid": "raise"}
    assert _same(stats_of(cells[0]), _numpy_one(t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cells = _cells(1)
        compute([t], cells)
    assert _same(stats_of(cells[0]), _numpy_one(t))


def test_device_batches_are_filled_by_the_landing_thread_whoever_waits():
    """The landing thread fills a device batch's cells once its copy has landed, whether or not
    anything waits for them (the writer may have stopped), and ends once it has had nothing to
    do for a while; the next batch starts it again."""
    device = DeviceStatistics()
    for _ in range(2):
        tensors = [torch.randn(8), torch.randn(3)] * 10
        cells = _cells(len(tensors))
        device.batch([prepare(t) for t in tensors], cells)
        wait_until(lambda: all(c[-1] == READY for c in cells), 30, "the cells filled")
        assert all(_agree(stats_of(c), _numpy_one(t)) for t, c in zip(tensors, cells))
        assert device.landings.pending() == 0 and device.landings.last() is None
        wait_until(lambda: not any(t.name == "atb-probe-landing" for t in threading.enumerate()),
                   30, "the idle landing thread to end")


def test_a_copy_numbered_before_it_is_queued_is_waited_for_and_lands_in_order():
    """A device batch takes its number before its cells say DEVICE, so another thread that sees
    such a cell and hands its rows over waits for it (`last()` covers it) even before the copy
    is queued; copies land in the order of their numbers, not of their queueing."""
    landings = Landings()
    landed = []
    first = landings.reserve()
    covering = landings.last()
    assert covering is not None
    later = landings.watch(None, lambda: landed.append("later"))
    landings.watch(None, lambda: landed.append("first"), first)
    covering.wait()
    later.wait()
    assert landed == ["first", "later"]


def test_a_copy_that_fails_to_land_fails_every_wait_from_then_on(tmp_path, capfd):
    """A copy whose follow-up raises (a device error) is not taken for landed data: waiting for
    it, or for anything queued after it, raises that error, which the writer reports; what
    landed before it is still sound."""
    landings = Landings()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    before = landings.watch(None)
    before.wait()
    first = landings.watch(None, broken)
    later = landings.watch(None)
    before.wait()  # landed before the failure: its data is sound
    for landed in (first, later):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            landed.wait()

    tree = SafeTree(str(tmp_path / "atb_dump_data"))
    writer = Writer(tree, min_free=0)
    writer.put(TensorFileJob("d", "intensor0.bin", [bytes(64)], 64, later))
    assert writer.close(30) and writer.failed
    assert "illegal memory access" in writer.stats.last_error
    assert "dumping stopped, the model goes on" in writer.stats.last_error
    assert not (tmp_path / "atb_dump_data" / "d" / "intensor0.bin").exists()
    assert probe_lines(capfd.readouterr().err, "ERROR")


@pytest.mark.parametrize("one_after_another", [True, False])
def test_a_tensor_measured_whole_and_per_request_gets_both_from_one_conversion(
        one_after_another):
    from atb_probe.capture.stats_reuse import StatsCache
    cache = StatsCache()
    queue = cache.new_queue()
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(6, 40, generator=g) * 100).to(torch.bfloat16)
    other = torch.randn(5, generator=g)
    (whole, alone), _ = cache.side(queue, [t, other])
    runs = [(k * 40, (k + 1) * 40) for k in range(6)] if one_after_another else \
        [(0, 40), (40, 120), (200, 240)]
    parts = cache.fresh_runs(t, runs, queue, one_after_another)
    queue.resolve()
    assert _same(stats_of(whole), _numpy_one(t)) and _same(stats_of(alone), _numpy_one(other))
    for (start, stop), cell in zip(runs, parts):
        assert _same(stats_of(cell), _numpy_one(t.reshape(-1)[start:stop]))
    assert not (queue.tensors or queue.runs or queue.nbytes)


def test_per_request_runs_of_tensors_converted_in_the_scratch_are_their_own():
    """Tensors large enough for the thread's scratch memory are converted into it for their
    runs too (one after another or not), each measured before the next tensor takes that
    memory: every run and every whole tensor gets its own formula's numbers."""
    g = torch.Generator().manual_seed(4)
    width = statistics.SCRATCH_FROM // 16 + 3
    first, second = [(torch.randn(16, width, generator=g) * (k + 1)).to(torch.bfloat16)
                     for k in range(2)]
    half = torch.randn(4, 30, generator=g).half()  # prepared the usual way, in the batch
    runs_first = [(0, width), (width, 5 * width), (7 * width, 16 * width)]
    runs_second = [(k * width, (k + 1) * width) for k in range(16)]
    runs_half = [(0, 30), (30, 90)]
    entries = [(first, runs_first, _cells(3), False), (second, runs_second, _cells(16), True),
               (half, runs_half, _cells(2), False)]
    whole_cells = _cells(3)
    left, _ = statistics.compute_runs(entries, [first, half, second], whole_cells)
    assert left == []
    for t, runs, cells, _ in entries:
        flat = t.reshape(-1)
        for (start, stop), cell in zip(runs, cells):
            assert _same(stats_of(cell), _numpy_one(flat[start:stop])), (t.dtype, start)
    for t, cell in zip((first, half, second), whole_cells):
        assert _same(stats_of(cell), _numpy_one(t))


@pytest.mark.parametrize("seed", [0, 1])
def test_runs_of_a_tensor_over_the_scratch_are_their_own_without_a_whole_conversion(
        seed, monkeypatch):
    """The runs of a converted tensor over SCRATCH_ELEMENTS (a long prefill's bfloat16 hidden
    state, cut per request) are converted a span at a time, never the whole tensor: each run
    gets what `compute` gives its slice alone (a run over the scratch in parts), in any order
    and with gaps, and the tensor measured whole its parts statistics."""
    monkeypatch.setattr(statistics, "SCRATCH_ELEMENTS", 100_000)
    monkeypatch.setattr(statistics, "PART_ELEMENTS", 5_000)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(600, 640, generator=g) * 100
    base[3, 5], base[400, 7] = float("nan"), float("-inf")
    base[500] = 3e19  # float32 sums overflow: float64 again
    bf16 = base.to(torch.bfloat16)
    converted = []
    monkeypatch.setattr(statistics, "prepare", lambda t: converted.append(t.numel()) or
                        statistics._as_float(statistics._values(t)))
    irregular = [(640, 1280), (5000, 5000), (200_000, 384_000), (1280, 90_000),
                 (90_000, 150_000), (150_000, 151_000)]  # unsorted, a gap, one over it
    for t in (bf16, base.half(), base > 0, torch._neg_view(bf16)):
        flat = t.reshape(-1)
        rows = [(k * 640, (k + 1) * 640) for k in range(600)]
        long_rows = [(k * 128_000, (k + 1) * 128_000) for k in range(3)]
        for runs, one_after_another in ((irregular, False), (irregular[::-1], False),
                                        (rows, True), (long_rows, True)):
            cells = [EMPTY if start >= stop else new_cell(new_serial())
                     for start, stop in runs]
            whole = _cells(1)
            left, _ = statistics.compute_runs([(t, runs, cells, one_after_another)], [t],
                                              whole)
            assert left == [] and converted == [], (t.dtype, converted)  # nothing whole
            assert _same(stats_of(whole[0]), _numpy_one(t)), t.dtype
            for (start, stop), cell in zip(runs, cells):
                if start == stop:
                    assert cell is EMPTY
                    continue
                alone = _cells(1)
                statistics.compute([flat[start:stop]], alone, DeviceStatistics())
                assert _same(stats_of(cell), stats_of(alone[0])), (t.dtype, start, stop)
                assert _same(stats_of(cell), _numpy_one(flat[start:stop])), (t.dtype, start)
            converted.clear()


def test_runs_of_a_tensor_over_the_scratch_are_measured_without_memory_of_its_size(tmp_path):
    """Per-request runs of a bfloat16 tensor four times the scratch (64 M elements) take no
    memory of its size: converting it whole for its runs took 256 MB of float32."""
    script = tmp_path / "measure.py"
    script.write_text(textwrap.dedent("""
        import resource
        import torch
        from atb_probe.capture.stats_compute import DeviceStatistics, compute, compute_runs
        from atb_probe.stats_cell import new_cell, new_serial, values
        n = 64 << 20
        t = torch.ones(n, dtype=torch.bfloat16)
        t[::2] = -3
        compute([torch.zeros(4096)], [new_cell(new_serial())], DeviceStatistics())  # warm
        runs = [(0, 1000), (1000, n // 2), (n // 2, n)]
        rows = [(k * (n // 64), (k + 1) * (n // 64)) for k in range(64)]
        cells = [new_cell(new_serial()) for _ in runs]
        row_cells = [new_cell(new_serial()) for _ in rows]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        compute_runs([(t, runs, cells, False), (t, rows, row_cells, True)])
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown // 1024, values(cells[1]), values(row_cells[5]))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    grown, stats = done.stdout.split(" ", 1)
    assert int(grown) < 64, done.stdout  # MiB; the scratch is 16 at most
    half, row = (1 << 25) - 1000, 1 << 20
    assert stats.strip() == " ".join(repr(v) for v in (
        (1.0, -3.0, -1.0, math.sqrt(half // 2 * 9 + half // 2)),
        (1.0, -3.0, -1.0, math.sqrt(row // 2 * 9 + row // 2))))


def _converted_tensors(seed: int) -> list[torch.Tensor]:
    """Host tensors large enough to be converted to float32 in the thread's scratch memory
    (`stats_compute._in_scratch`), in every layout `prepare` meets, and one too large for it."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(256, 320, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))
    assert base.numel() >= statistics.SCRATCH_FROM
    bf16 = base.to(torch.bfloat16)
    return [bf16, base.half(), base > 0, bf16.t(), base.half()[:, ::2].t(),
            torch._neg_view(bf16), bf16.view(320, 256)[:200],
            (base * 1e20).to(torch.bfloat16),            # float32 sums overflow: float64 again
            torch.randn(600, 600, generator=g).to(torch.bfloat16)]  # over it: in parts


@pytest.mark.parametrize("seed", [0, 1])
def test_tensors_converted_in_the_scratch_get_the_per_tensor_formula_bit_for_bit(seed,
                                                                                monkeypatch):
    monkeypatch.setattr(statistics, "SCRATCH_ELEMENTS", 300_000)
    tensors = _converted_tensors(seed)
    gaps = tensors[4]  # `prepare` chooses its strides: converted as before
    assert [statistics._in_scratch(t) is None for t in tensors] == \
        [t is gaps or t is tensors[-1] for t in tensors]
    a = statistics._in_scratch(tensors[0])
    assert np.array_equal(a, prepare(tensors[0]).numpy().reshape(-1))
    for t in tensors:  # one side at a time
        cells = _cells(1)
        compute([t], cells)
        assert _same(stats_of(cells[0]), _numpy_one(t)), (t.dtype, tuple(t.shape))
    _check_shuffled_batch(tensors + _tensors(seed), seed)  # converted ones among small ones


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200_000), st.sampled_from([128, 136, 1000, 4096, 65536]),
       st.sampled_from([np.float32, np.float64]), st.integers(-20, 20), st.booleans())
def test_parts_are_summed_in_numpys_pairwise_order_bit_for_bit(size, most, dtype, scale, zeros):
    """`_pairwise` joins the sums of its parts as numpy's `add.reduce` sums the whole array: the
    Mean of a tensor measured a part at a time is the one measured whole."""
    a = np.random.default_rng(size).standard_normal(size).astype(dtype) * dtype(2.0 ** scale)
    if zeros:
        a[::3] = -0.0

    def part_sum(start, count):
        return np.add.reduce(a[start:start + count], initial=-0.0)

    got = dtype(0.0) + statistics._pairwise(0, size, part_sum, most)
    assert repr(float(got)) == repr(float(np.add.reduce(a)))
    zeros = np.full(size, -0.0, dtype)  # numpy's sum of zeros is +0.0
    got = dtype(0.0) + statistics._pairwise(
        0, size, lambda start, count: np.add.reduce(zeros[start:start + count], initial=-0.0),
        most)
    assert repr(float(got)) == repr(float(np.add.reduce(zeros))) == "0.0"


def _over_the_scratch(seed: int) -> list[torch.Tensor]:
    """Host tensors of more than 100,000 elements, in every layout and dtype `prepare` meets."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(600, 640, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))
    bf16 = base.to(torch.bfloat16)
    holes = base.clone()
    holes[7, 9], holes[300, 1] = float("nan"), float("inf")
    infinite = base.clone()
    infinite[5, 5], infinite[500, 600] = float("inf"), float("-inf")
    return [bf16, bf16.t(), base.half(), base > 0, base, base.t(), torch._neg_view(bf16),
            bf16[:, ::3], base[:, ::3],                     # gaps: converted whole, then parts
            bf16.view(-1)[1:300_001],                       # an offset into its memory
            torch.nn.Parameter(bf16.float()), holes, infinite,
            (base * 1e20).to(torch.bfloat16),               # float32 sums overflow: float64
            torch.full((150_001,), 3e38), torch.zeros(200_000), -torch.zeros(200_000)]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_tensor_over_the_scratch_is_measured_a_part_at_a_time(seed, monkeypatch):
    """A tensor of more than SCRATCH_ELEMENTS elements is measured in parts of at most
    PART_ELEMENTS, each converted into the thread's scratch memory: max, min and mean those of
    the whole array bit for bit, the sum of squares that of each part's dot product, added
    exactly, alone or in a batch, whatever its dtype and layout."""
    monkeypatch.setattr(statistics, "SCRATCH_ELEMENTS", 100_000)
    monkeypatch.setattr(statistics, "PART_ELEMENTS", 5_000)
    tensors = _over_the_scratch(seed)
    for t in tensors:
        cells = _cells(1)
        compute([t], cells)
        assert _same(stats_of(cells[0]), _numpy_one(t)), (t.dtype, tuple(t.shape))
    _check_shuffled_batch(tensors + _tensors(seed), seed)
    bf16 = tensors[0]
    cells = _cells(2)
    compute([bf16, bf16.float()], cells)  # the same values in float32: the same numbers
    assert _same(stats_of(cells[0]), stats_of(cells[1]))
    a = bf16.double().reshape(-1).numpy()
    assert math.isclose(stats_of(cells[0])[3], math.sqrt(float(a @ a)), rel_tol=1e-6)


def test_a_tensor_over_the_scratch_is_measured_without_memory_of_its_size(tmp_path):
    """A bfloat16 tensor four times the scratch (64 M elements, 128 MB) is measured without
    converting it whole: the process's peak memory grows by far less than its 256 MB of
    float32 (converting it whole took that much new memory, page by page)."""
    script = tmp_path / "measure.py"
    script.write_text(textwrap.dedent("""
        import resource, sys
        import torch
        from atb_probe.capture.stats_compute import DeviceStatistics, compute
        from atb_probe.stats_cell import new_cell, new_serial, values
        t = torch.ones(64 << 20, dtype=torch.bfloat16)
        t[::2] = -3
        cell = new_cell(new_serial())
        compute([torch.zeros(4096)], [new_cell(new_serial())], DeviceStatistics())  # warm
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        compute([t], [cell], DeviceStatistics())
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown // 1024, values(cell))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    grown, stats = done.stdout.split(" ", 1)
    assert int(grown) < 64, done.stdout  # MiB; the scratch is 16 at most
    n = 64 << 20
    assert stats.strip() == repr((1.0, -3.0, -1.0, math.sqrt(n // 2 * 9 + n // 2)))


def test_a_dumped_weight_over_the_scratch_has_its_parts_statistics_in_the_csv(tmp_path,
                                                                               monkeypatch):
    """Through the probe: the statistic.csv row of an embedding weight larger than the scratch
    (measured in parts) holds the numbers the formula gives it."""
    monkeypatch.setattr(statistics, "SCRATCH_ELEMENTS", 100_000)
    monkeypatch.setattr(statistics, "PART_ELEMENTS", 4_096)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(3000, 128)
            self.head = torch.nn.Linear(128, 16)

        def forward(self, ids):
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 2999]])
    with torch.no_grad():
        root = dump(tmp_path, config(task="statistics", save_child=True), lambda: model(ids))
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    weight = [r for r in rows if r["Op Type"] == "EmbeddingKernel" and
              r["Input/Output"] == "input" and r["Index"] == "0"]
    assert len(weight) == 1 and weight[0]["Shape"] == "3000x128"
    want = _numpy_one(model.embed.weight)
    got = tuple(float(weight[0][k]) for k in ("Max", "Min", "Mean", "Norm"))
    assert _same(got, want)


def test_each_thread_converts_in_scratch_memory_of_its_own():
    """Model threads measuring at once (torch's copy gives up the GIL between the conversion
    and the reductions) never see each other's values."""
    g = torch.Generator().manual_seed(5)
    work = [[(torch.randn(200, 200 + 10 * k + i, generator=g) * (i + 1)).to(torch.bfloat16)
             for i in range(4)] for k in range(2)]
    want = [[_numpy_one(t) for t in ts] for ts in work]
    got, failures = [[], []], []

    def measure(k: int) -> None:
        try:
            for _ in range(25):
                cells = _cells(len(work[k]))
                compute(work[k], cells)
                got[k].append([stats_of(c) for c in cells])
        except Exception as exc:  # reported below, with the thread's name
            failures.append((k, exc))

    threads = [threading.Thread(target=measure, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not failures, failures
    for k in range(2):
        assert len(got[k]) == 25
        assert all(all(_same(c, w) for c, w in zip(row, want[k])) for row in got[k])


def test_the_scratch_serves_inside_and_outside_inference_mode_and_any_default_device():
    """A thread's scratch memory made inside `torch.inference_mode` (a serving engine's step)
    still takes the next conversion outside it (the same thread's plain `no_grad` call), and
    the other way round; a default device set around the model does not move it off the host."""
    g = torch.Generator().manual_seed(9)
    tensors = [(torch.randn(300 + 20 * i, 300, generator=g) * (i + 1)).to(torch.bfloat16)
               for i in range(4)]
    want = [_numpy_one(t) for t in tensors]

    def measured(t):
        cells = _cells(1)
        compute([t], cells)
        return stats_of(cells[0])

    def in_a_new_thread(steps):
        got, failures = [], []

        def run():
            try:
                for step in steps:
                    got.append(step())
            except Exception as exc:  # reported below
                failures.append(exc)

        th = threading.Thread(target=run)  # a thread of its own: a scratch not made yet
        th.start()
        th.join(60)
        assert not failures, failures
        return got

    def inference(t):
        with torch.inference_mode():
            return measured(t)

    def on_meta(t):
        with torch.device("meta"):
            return measured(t)

    for first, then in [(inference, measured), (measured, inference), (on_meta, measured)]:
        got = in_a_new_thread([lambda: first(tensors[0]), lambda: then(tensors[1]),
                               lambda: first(tensors[3]), lambda: then(tensors[2])])
        assert all(_same(g_, w) for g_, w in zip(got, [want[0], want[1], want[3], want[2]]))


def test_a_buffer_made_in_inference_mode_still_takes_copies_outside_it(monkeypatch):
    """A thread's device buffer made during a serving step (`torch.inference_mode`) takes the
    next gather outside it (a plain `no_grad` call of the same thread) by a copy, as any
    other, not by falling back to a batch per side."""
    fallbacks = []
    batch = DeviceStatistics.batch
    monkeypatch.setattr(DeviceStatistics, "batch",
                        lambda self, tensors, cells: (fallbacks.append(len(tensors)),
                                                      batch(self, tensors, cells)))
    device = DeviceStatistics()
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(500, generator=g), torch.randn(700, generator=g) * 3
    first, second = _cells(1), _cells(1)
    with torch.inference_mode():
        device.gather([a], first)
    device.gather([b], second)  # the same buffer, outside inference mode
    device.flush()
    wait_landed(device)
    assert fallbacks == []
    assert _agree(stats_of(first[0]), _numpy_one(a)) and _agree(stats_of(second[0]),
                                                                 _numpy_one(b))
