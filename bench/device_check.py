#!/usr/bin/env python
"""On a CUDA machine: the probe never waits on the device inside a round, and what it costs.

    python bench/device_check.py                     # small workload on cuda:0, 5 pairs
    python bench/device_check.py --pairs 3 --cases stat-child

The small workload of run.py (workload.py) is moved to the GPU. For each case:

1. **Syncs.** One probed generation with `torch.cuda.set_sync_debug_mode` switched on from the
   start to the end of every root `forward` (a pre-hook and a hook on the root module, so the
   probe's round start and round end, where a sync would be allowed, stay outside). The mode is
   "error" when the un-probed model makes no synchronising call inside its forward, else "warn",
   and the warnings are counted against the un-probed run's. A sync the probe makes raises
   inside the probe, which reports it and goes on, so the probe's `last_error` is checked too.
2. **Ratios.** Pairs of un-probed and probed generations (alternating, `torch.cuda.synchronize`
   and the writer's flush inside the timing), the median of probed / un-probed as in run.py;
   for `tensor-layer` also probed / (un-probed + a plain Python write of the same files).

Exit status 1 when the probe synchronised (or failed) in any case. Without CUDA it says that it
needs a GPU and exits 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from cases import ATB_BASE, BY_NAME  # noqa: E402
from measure import plain_write, remove, scan  # noqa: E402
import workload as workloads  # noqa: E402

CASES = ("stat-layer", "stat-child", "tensor-layer")
GOALS = {"stat-layer": "<= 1.3", "stat-child": "<= 4.0 (then 3.0)",
         "tensor-layer": "<= 1.2 x (un-probed + plain write)"}
SYNC_WORDS = "synchronizing"


class SyncWatch:
    """Switches the sync debug mode on for the duration of each root forward."""

    def __init__(self, model, mode: str):
        self.mode = mode
        self.handles = [
            model.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode(mode)),
            model.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"),
                                        always_call=True)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        torch.cuda.set_sync_debug_mode("default")


def _syncs(run, model, mode: str) -> int:
    """Synchronising calls made inside root forwards during `run()`."""
    watch = SyncWatch(model, mode)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        watch.close()
    return sum(SYNC_WORDS in str(w.message) for w in caught)


def _generate(wl) -> None:
    wl.run()
    torch.cuda.synchronize()


def _check(wl, name: str, pairs: int, base_syncs: int, work: str) -> dict:
    import atb_probe
    config = {**ATB_BASE, **BY_NAME[name].config}
    out = os.path.join(work, name)
    atb_probe.enable(out, config)
    try:
        _generate(wl)  # warm-up
        atb_probe.active().writer.flush(600)
        mode = "error" if base_syncs == 0 else "warn"
        syncs = _syncs(lambda: _generate(wl), wl.model, mode)
        atb_probe.active().writer.flush(600)
        error = atb_probe.active().last_error
        segments = atb_probe.active().engine.recorder.stats.device.segment_failure
        if segments is not None:
            print(f"{name}: statistics by segments failed, batches went tensor by tensor: "
                  f"{segments}")
    finally:
        atb_probe.disable(timeout=600)
    remove(out)
    ratios, plain_ratios, plain_s, probed_s = [], [], [], []
    for i in range(pairs):
        times = {}
        for side in (("plain", "probed") if i % 2 == 0 else ("probed", "plain")):
            if side == "plain":
                start = time.perf_counter()
                _generate(wl)
                times["plain"] = time.perf_counter() - start
            else:
                run_dir = os.path.join(out, f"run{i}")
                atb_probe.enable(run_dir, config)
                start = time.perf_counter()
                _generate(wl)
                atb_probe.active().writer.flush(600)
                times["probed"] = time.perf_counter() - start
                atb_probe.disable(timeout=600)
                _, files = scan(run_dir)
                remove(run_dir)
                copy = os.path.join(work, "plain")
                times["written"] = plain_write(files, copy)
                remove(copy)
        plain_s.append(times["plain"])
        probed_s.append(times["probed"])
        ratios.append(times["probed"] / times["plain"])
        plain_ratios.append(times["probed"] / (times["plain"] + times["written"]))
    return {"case": name, "syncs": syncs, "mode": mode, "error": error,
            "ratio": statistics.median(ratios), "plain_ms": 1e3 * statistics.median(plain_s),
            "probed_ms": 1e3 * statistics.median(probed_s),
            "plain_ratio": statistics.median(plain_ratios) if BY_NAME[name].plain_baseline
            else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workload", choices=sorted(workloads.SPECS), default="small")
    parser.add_argument("--no-segments", action="store_true",
                        help="reduce a batch's tensors one by one (stats_compute.device_row), not "
                        "by segments: the A/B of that choice")
    opts = parser.parse_args(argv)
    if opts.no_segments:
        from atb_probe.capture import stats_compute as probe_statistics
        probe_statistics.SEGMENTS_FROM = 1 << 62
    if not torch.cuda.is_available():
        print("device_check needs a CUDA GPU (torch.cuda.is_available() is False here); "
              "nothing checked.")
        return 0
    wl = workloads.Workload(workloads.spec(opts.workload))
    wl.model.to("cuda")
    wl.prompt = wl.prompt.to("cuda")
    for _ in range(3):
        _generate(wl)
    base_syncs = _syncs(lambda: _generate(wl), wl.model, "warn")
    work = tempfile.mkdtemp(prefix="atb-device-check-")
    results = []
    try:
        for name in [c.strip() for c in opts.cases.split(",") if c.strip()]:
            results.append(_check(wl, name, opts.pairs, base_syncs, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; workload "
          f"{opts.workload}; {opts.pairs} pairs; statistics "
          f"{'tensor by tensor' if opts.no_segments else 'by segments'}; the un-probed model "
          f"synchronises "
          f"{base_syncs} times inside its forwards per generation")
    print("| case | goal | ratio | un-probed ms | probed ms | probed / (un-probed + plain write) "
          "| syncs in forwards (un-probed) | probe error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for r in results:
        synced = r["syncs"] > base_syncs or r["error"] is not None
        failed |= synced
        plain = f"{r['plain_ratio']:.2f}" if r["plain_ratio"] is not None else ""
        print(f"| {r['case']} | {GOALS.get(r['case'], '')} | {r['ratio']:.2f} | "
              f"{r['plain_ms']:.1f} | {r['probed_ms']:.1f} | {plain} | "
              f"{r['syncs']} ({base_syncs}; mode {r['mode']}) | {r['error'] or ''} |")
    print("no sync by the probe inside a round" if not failed else
          "THE PROBE SYNCHRONISED INSIDE A ROUND (see the table)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
