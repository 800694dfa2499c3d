"""The floor under `stat-child` for any design in Python: what a `TorchDispatchMode` costs a
generation when it does no more than the least any kernel-statistics design must do.

Nothing of atb-probe runs in the first variants. A bare dispatch mode is pushed around each
call of the model (a round: the probe pushes its own around each tracked layer-level op of
it), and each variant adds a step to the one before:

* `mode`: the mode only calls the kernel: the floor of the dispatch itself;
* `refs`: it also keeps a reference to each kernel's tensors until the round ends;
* `stats`: at the round's end every distinct floating-point tensor kept is measured once (max,
  min, sum, sum of squares in numpy, after a float32 conversion where needed); a weight, or a
  view of one, is measured once for all rounds while its version stays;
* `grouped`: the same, with the tensors under 4096 elements of one length as the rows of one
  2-D array, each statistic one numpy call for all of them;
* `rows`: `grouped`, and while the kernel runs, what a statistic.csv row of each of its sides
  needs: its Op Id and Op Name (a counter and two f-strings), its kernel name (looked up once
  per operator) and one flat tuple per side with each tensor's index, dtype and Shape cells and
  a cell (a `bytearray`) for its statistics.

`stats` and `grouped` make no rows, and `rows` neither fills nor formats them; none has
module sides, a selection, a writer, or any safety against a kernel writing a kept tensor
before the round ends: no probe that records every kernel's statistics could be cheaper.

`atb-probe` is the probe's `stat-child` case in the same process (`atb-track` its
`track-only`: every module and kernel taken through the probe's own steps, nothing
recorded), attached once, as `run.py --attach once` measures it: each probed generation is a
later one of the attachment, timed until its files are on disk, and the un-probed ones call
torch's own `Module.__call__`.

Each variant alternates with un-probed generations in pairs, the order flipping from pair to
pair, after two warm-up pairs; the ratio is the median over the pairs (as `run.py` measures).

    python bench/kernel_floor.py                          # small, one torch thread
    python bench/kernel_floor.py --workload large --threads 2 --pairs 5
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cases import BY_NAME
from measure import module_call_of_torch
from workload import Workload, spec

VARIANTS = ("mode", "refs", "stats", "grouped", "rows", "atb-track", "atb-probe")
ATB_CASES = {"atb-track": "track-only", "atb-probe": "stat-child"}  # bench/cases.py's
GROUP_BELOW = 4096


class _Refs(TorchDispatchMode):
    """Calls each kernel; with `kept`, appends its arguments and output to it; with `rows`,
    also the row record of each of its sides to that (`_side_row`)."""

    def __init__(self, kept: list | None, rows: list | None = None):
        super().__init__()
        self.kept = kept
        self.rows = rows
        self.children = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.kept is not None:
            self.kept.append((args, out))
        if self.rows is not None:
            name = _NAMES.get(func)
            if name is None:
                name = _NAMES[func] = str(func).split(".")[1].title().replace("_", "") + \
                    "Kernel"
            index = self.children
            self.children = index + 1
            op_id = f"0_{index}"
            full_name = f"LlamaModel/{name}"
            rows = self.rows
            rows.append(_side_row(full_name, name, op_id, "input", args))
            rows.append(_side_row(full_name, name, op_id, "output", (out,)))
        return out


_NAMES: dict = {}
_SHAPES: dict = {}
_INDEX = [str(i) for i in range(64)]


def _side_row(full_name: str, name: str, op_id: str, side: str, tensors) -> tuple:
    """One side's flat row record: names, then index, dtype, Shape and a statistics cell per
    tensor."""
    cells = []
    for i, t in enumerate(tensors):
        if type(t) is not torch.Tensor:
            continue
        shape = _SHAPES.get(t.shape)
        if shape is None:
            shape = _SHAPES[t.shape] = "x".join(map(str, t.shape))
        cells += (_INDEX[i] if i < 64 else str(i), str(t.dtype), shape, bytearray(32))
    return (full_name, name, op_id, side, *cells)


class Floor:
    """One variant wrapped around a workload's model: `forward` replaces its `forward`."""

    def __init__(self, workload: Workload, variant: str):
        self.variant = variant
        self.kept: list | None = [] if variant != "mode" else None
        self.rows: list | None = [] if variant == "rows" else None
        self.weights = {p.untyped_storage().data_ptr() for p in workload.model.parameters()}
        self.measured_weights: set = set()
        self.measured = []  # tensors measured per round
        self.original = workload.model.forward

        def forward(*args, **kwargs):
            with _Refs(self.kept, self.rows):
                out = self.original(*args, **kwargs)
            if self.kept is not None:
                self.end_round()
            return out

        self.forward = forward

    def end_round(self) -> None:
        kept, self.kept = self.kept, []
        if self.rows is not None:
            self.rows = []
        if self.variant == "refs":
            return
        seen, groups, count = set(), {}, 0
        for args, out in kept:
            for t in (*args, out):
                if type(t) is not torch.Tensor or not t.dtype.is_floating_point or \
                        id(t) in seen or not t.numel():
                    continue
                seen.add(id(t))
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.weights:
                    key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                           t._version)
                    if key in self.measured_weights:
                        continue
                    self.measured_weights.add(key)
                a = t.detach().float().contiguous().numpy().reshape(-1)
                count += 1
                if self.variant in ("grouped", "rows") and a.size < GROUP_BELOW:
                    groups.setdefault(a.size, []).append(a)
                    continue
                a.max(), a.min(), np.add.reduce(a), a @ a
        for arrays in groups.values():
            m = np.stack(arrays)
            m.max(axis=1), m.min(axis=1), np.add.reduce(m, axis=1), np.einsum("ij,ij->i", m, m)
        self.measured.append(count)


def _timed(run) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _pairs(plain, probed, pairs: int) -> tuple[list, list]:
    """Un-probed and probed seconds of `pairs` pairs, the order flipping, after a warm-up."""
    for _ in range(2):
        _timed(plain)
        _timed(probed)
    a_s, b_s = [], []
    for i in range(pairs):
        if i % 2:
            a_s.append(_timed(plain))
            b_s.append(_timed(probed))
        else:
            b_s.append(_timed(probed))
            a_s.append(_timed(plain))
    return a_s, b_s


def _floor(workload: Workload, variant: str, pairs: int) -> tuple[list, list, list]:
    floor = Floor(workload, variant)
    model = workload.model

    def with_forward(forward):
        def run():
            model.forward = forward
            workload.run()
        return run

    try:
        a_s, b_s = _pairs(with_forward(floor.original), with_forward(floor.forward), pairs)
    finally:
        model.__dict__.pop("forward", None)  # the class's own again
    return a_s, b_s, floor.measured


def _atb_probe(workload: Workload, pairs: int, case_name: str) -> tuple[list, list, list]:
    """atb-probe's bench case `case_name`, attached once (`run.py --attach once`)."""
    runner = BY_NAME[case_name].runner()
    module_call = torch.nn.Module.__call__  # torch's own, before the probe wraps it
    out = tempfile.mkdtemp(prefix="kernel_floor_")

    def plain():
        with module_call_of_torch(module_call):
            workload.run()

    runner.setup(workload, out)
    runner.start(workload, out)
    try:
        a_s, b_s = _pairs(plain, lambda: runner.run(workload, out), pairs)
    finally:
        runner.finish()
        shutil.rmtree(out, ignore_errors=True)
    return a_s, b_s, []


def measure(workload: Workload, variant: str, pairs: int) -> dict:
    if variant in ATB_CASES:
        a_s, b_s, measured = _atb_probe(workload, pairs, ATB_CASES[variant])
    else:
        a_s, b_s, measured = _floor(workload, variant, pairs)
    ratios = [b / a for a, b in zip(a_s, b_s)]
    return {"variant": variant, "ratio": statistics.median(ratios),
            "range": (min(ratios), max(ratios)), "probed_s": statistics.median(b_s),
            "unprobed_s": statistics.median(a_s),
            "measured_per_round": round(statistics.median(measured)) if measured else ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="small", choices=("small", "large"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    workload = Workload(spec(args.workload))
    print(f"{workload.spec.describe()}; {args.threads} torch threads; median of {args.pairs} "
          f"pairs; torch {torch.__version__}")
    print("| variant | ratio | pair range | probed s (un-probed s) | tensors measured a round |")
    print("| --- | --- | --- | --- | --- |")
    for variant in args.variants.split(","):
        r = measure(workload, variant, args.pairs)
        print(f"| `{variant}` | {r['ratio']:.2f} | {r['range'][0]:.2f}-{r['range'][1]:.2f} | "
              f"{r['probed_s']:.3f} ({r['unprobed_s']:.3f}) | {r['measured_per_round']} |",
              flush=True)


if __name__ == "__main__":
    main()
