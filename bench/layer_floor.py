"""The floor under `stat-layer` for a design in Python: what a generation costs when the probe
walks its rounds as it does and each layer-level op side does no more than the least a safe
statistics design must do on the model's thread.

Every variant is atb-probe's `stat-layer` case with the recording of a module side (the
layer-level ops' inputs and outputs: `Recorder.write_side` for a module) replaced; kernels and
everything else are the probe's own. Each variant adds a step to `walk`:

* `walk`: atb-probe's `walk-only` case (ids matching nothing): the rounds are walked to their
  layer-level ops, nothing of them recorded;
* `refs`: each side's tensors are found (the probe's argument binding) and a reference to each
  is kept until the generation ends; nothing is written for the rounds. Unsafe, since a write
  into a kept tensor would go unseen: a bound, not a design;
* `copies`: each side's dumpable tensors are copied (`clone`) instead: the least a design that
  measures later must do while the side is seen, in a model whose tensors may be written in
  place before the round ends. Nothing is written for the rounds;
* `refs+rows`: the references, and each side's statistic.csv row handed over as the probe
  hands its rows (index, Dtype and Shape cells, and one constant statistics cell): each round's
  folder, statistic.csv and tokens.json are written as in a real dump, with the same rows.
  Unsafe as `refs`;
* `copies+rows`: the copies, and the rows as `refs+rows` hands them over. No statistics are
  computed and nothing is looked up: the floor of any safe design that writes what SPEC asks
  for;
* `stat-layer`: atb-probe's `stat-layer` case, as it is.

The replaced recording writes no derived_statistic.csv sums and no request_statistic.csv rows:
a `transformers` model's sides have neither (vLLM's do).

The distance between `copies+rows` and `stat-layer` is what the statistics cost (their cache,
their computation and their cells); `copies+rows` against the goal (1.3 on `small`, 1.15 on
`large`) says whether a design that computes statistics for nothing could meet it here.

As in `run.py`, each probed generation is the first of its attachment (enabled before it,
flushed and disabled after it, the flush timed), and alternates with an un-probed generation
in pairs, the order flipping from pair to pair, after two warm-up pairs; the ratio is the
median over the pairs.

    python bench/layer_floor.py                          # small, one torch thread
    python bench/layer_floor.py --workload large --threads 2 --pairs 5
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch

from cases import BY_NAME
from workload import Workload, spec

VARIANTS = ("walk", "refs", "copies", "refs+rows", "copies+rows", "stat-layer")
REPLACED = ("refs", "copies", "refs+rows", "copies+rows")  # those that replace `write_side`


def replaced_write_side(variant: str, kept) -> tuple:
    """(the probe's `Recorder.write_side`, the one of `variant`, one of REPLACED), keeping
    the sides' tensors (or their copies) in `kept` (anything with `append`)."""
    return _side(kept, copy=variant.startswith("copies"), rows=variant.endswith("+rows"))


def _side(kept: list, copy: bool, rows: bool):
    """A `Recorder.write_side` whose module sides keep (`copy`: copy) their dumpable tensors
    in `kept` and, with `rows`, hand over their statistic.csv rows with a constant cell;
    kernel sides go to the probe's own."""
    from atb_probe.capture import recorder
    from atb_probe.stats_cell import fill, new_cell

    original = recorder.Recorder.write_side
    dtypes, shape_cell, index_cells = recorder.DUMPABLE_DTYPES, recorder.shape_cell, \
        recorder._INDEX
    constant = new_cell(0)
    fill(constant, (1.0, -1.0, 0.0, 1.0))

    def write_side(self, rnd, frame, record, side, items, named, kernel, sums=None):
        if kernel:
            return original(self, rnd, frame, record, side, items, named, kernel, sums)
        labels, cells = [], []
        for i, (_, t) in enumerate(items):
            if type(t) is not torch.Tensor:
                continue
            dt = dtypes.get(t.dtype)
            if dt is None:
                continue
            kept.append(t.clone() if copy else t)
            index = index_cells[i] if i < 64 else str(i)
            labels.append(index)
            if rows:
                cells += (index, dt.csv_name, shape_cell(t.shape), constant, None)
        if cells:
            rnd.record.wrote = True
            row = (*rnd.record.head, frame.full_name, frame.name, frame.op_id, side, *cells)
            if frame.layer is not None:
                frame.layer.rows.append(row)
            else:
                self._rows.queue(rnd.record, [row])
        return labels

    return original, write_side


class Variant:
    """One variant: `run(out)` is a probed generation, timed with its flush."""

    def __init__(self, workload: Workload, variant: str):
        self.workload = workload
        self.variant = variant
        case = "walk-only" if variant == "walk" else "stat-layer"
        self.runner = BY_NAME[case].runner()
        self.kept: list = []
        self.write_side = None
        if variant in REPLACED:
            self.original, self.write_side = replaced_write_side(variant, self.kept)

    def run(self, out: str, keep: bool = False) -> float:
        """One probed generation into `out`, its attachment made before and undone after (not
        timed); the dump is deleted after unless `keep`."""
        from atb_probe.capture import recorder
        if self.write_side is not None:
            recorder.Recorder.write_side = self.write_side
        try:
            self.runner.start(self.workload, out)
            try:
                gc.collect()
                start = time.perf_counter()
                self.runner.run(self.workload, out)
                seconds = time.perf_counter() - start
            finally:
                self.runner.finish()
        finally:
            if self.write_side is not None:
                recorder.Recorder.write_side = self.original
            self.kept.clear()
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return seconds


def _plain(workload: Workload) -> float:
    gc.collect()
    start = time.perf_counter()
    workload.run()
    return time.perf_counter() - start


def measure(workload: Workload, variant: str, pairs: int, work_dir: str) -> dict:
    probe = Variant(workload, variant)
    probe.runner.setup(workload, work_dir)
    count = iter(range(10 ** 6))

    def probed() -> float:
        return probe.run(os.path.join(work_dir, f"{variant}-{next(count)}"))

    for _ in range(2):
        _plain(workload)
        probed()
    a_s, b_s = [], []
    for i in range(pairs):
        if i % 2:
            a_s.append(_plain(workload))
            b_s.append(probed())
        else:
            b_s.append(probed())
            a_s.append(_plain(workload))
    ratios = [b / a for a, b in zip(a_s, b_s)]
    return {"variant": variant, "ratio": statistics.median(ratios),
            "range": (min(ratios), max(ratios)), "probed_s": statistics.median(b_s),
            "unprobed_s": statistics.median(a_s)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="small", choices=("small", "large"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--quick", action="store_true", help="a shorter generation (16+4 tokens)")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    workload = Workload(spec(args.workload, quick=args.quick))
    print(f"{workload.spec.describe()}; {args.threads} torch threads; median of {args.pairs} "
          f"pairs; torch {torch.__version__}")
    print("| variant | ratio | pair range | probed s (un-probed s) |")
    print("| --- | --- | --- | --- |")
    work_dir = tempfile.mkdtemp(prefix="layer_floor_")
    try:
        for variant in args.variants.split(","):
            r = measure(workload, variant, args.pairs, work_dir)
            print(f"| `{variant}` | {r['ratio']:.2f} | {r['range'][0]:.2f}-{r['range'][1]:.2f} | "
                  f"{r['probed_s']:.3f} ({r['unprobed_s']:.3f}) |", flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
