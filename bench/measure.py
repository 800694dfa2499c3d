"""One case, measured in this process: paired runs, bytes written, peak memory, profiles.

A *pair* is one un-probed generation and one probed generation, back to back in this process,
their order alternating from pair to pair so that a slow drift of the machine (other jobs, heat,
the page cache) falls on both sides alike. The case's value is the median of the pairs' ratios.

A probed run is timed from the start of the generation to the moment its data is on disk (for
atb-probe a flush of the writer queue; for msprobe `stop()` and `step()`, which write
synchronously), so background writing is never hidden; the part of it after the generation
(that wait) is recorded too, and `gen_ratio` leaves it out: the generation's own slowdown, which
is what a service pays when the next request starts before the disk has the data. Attaching
and detaching the tool (`enable`/`disable`, msprobe's `start`) happen outside the timing and
are reported apart. The dump is then scanned (bytes, files) and deleted, and the file system is
synced, outside the timed region.

Garbage collection: by default (`gc_mode="collect"`) a full collection runs before each timed
run, so every run starts from the same collector state. A long-running service never does that:
`gc_mode="steady"` skips it, and what a tool leaves for the collector (objects that live long
enough to be promoted, then full collections over every object of the process) is paid inside
the runs, as it is in real use. Either way the time spent in collections during each run and the
number of full (oldest-generation) collections are recorded (`gc.callbacks`).
"""
from __future__ import annotations

import gc
import os
import re
import resource
import shutil
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from workload import Workload

_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")


# -- memory -------------------------------------------------------------------------------------

def reset_peak() -> bool:
    """Restart this process's peak-RSS counter (Linux `clear_refs` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mib() -> float | None:
    """Peak RSS since the last `reset_peak` (or since start), MiB."""
    try:
        with open("/proc/self/status") as f:
            m = _HWM.search(f.read())
        return int(m.group(1)) / 1024 if m else None
    except OSError:
        return None


def process_peak_mib() -> float:
    """Peak RSS of the whole process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- files --------------------------------------------------------------------------------------

def scan(root: str) -> tuple[int, list[tuple[str, int]]]:
    """(total bytes, [(path relative to root, size)]) of every regular file below `root`."""
    files, total = [], 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                size = os.lstat(path).st_size
            except OSError:
                continue
            files.append((os.path.relpath(path, root), size))
            total += size
    return total, files


def plain_write(files: list[tuple[str, int]], dest: str) -> float:
    """Seconds plain Python takes to write the same tree: same relative paths, same sizes,
    one `open`/`write`/`close` per file (no temporary names, no checks)."""
    biggest = max((s for _, s in files), default=0)
    buf = memoryview(bytearray(os.urandom(min(biggest, 1 << 20)) * (biggest // (1 << 20) + 1)))
    made = set()
    start = time.perf_counter()
    for rel, size in files:
        folder = os.path.join(dest, os.path.dirname(rel))
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        with open(os.path.join(dest, rel), "wb") as f:
            f.write(buf[:size])
    return time.perf_counter() - start


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


# -- timing -------------------------------------------------------------------------------------

class _GcClock:
    """Seconds spent in garbage collections, and full collections, while installed."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


GC_MODE = "collect"  # or "steady": see the module docstring


def _timed(fn) -> tuple[float, float, float | None, object, _GcClock]:
    """(wall s, CPU s of the whole process, peak RSS MiB during the call, result, time in GC)."""
    if GC_MODE == "collect":
        gc.collect()
    has_peak = reset_peak()
    with _GcClock() as clock:
        cpu0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return wall, cpu, (peak_mib() if has_peak else None), result, clock


@contextmanager
def module_call_of_torch(module_call):
    """Inside, `nn.Module.__call__` is `module_call` (torch's own, taken before a probe wrapped
    it): the model runs un-probed while an attachment is kept, which sees nothing of it. The
    probe's wrapper is put back after."""
    wrapped = torch.nn.Module.__call__
    torch.nn.Module.__call__ = module_call
    try:
        yield
    finally:
        torch.nn.Module.__call__ = wrapped


def run_case(case, spec, pairs: int, threads: int, work_dir: str, keep: bool = False,
             repeat: int = 1, attach: str = "each") -> dict:
    """Measure `case` on workload `spec` in this process; a JSON-ready dict.

    With `repeat` > 1 each side of a pair is run that many times (alternating) and the pair
    keeps the fastest run of each side: a pair is then clean as soon as one run of each side
    escaped the other jobs on the machine. With `attach` "once", atb-probe is enabled before
    the warm-up run and disabled after the last pair, as a service keeps it: every probed run
    after the first is a later generation of one attachment, its dump kept in one folder
    until the case ends (a run's bytes and files are what it added)."""
    torch.set_num_threads(threads)
    os.makedirs(work_dir, exist_ok=True)
    wl = Workload(spec)

    pristine = [_timed(wl.run)[0] for _ in range(3)][1:]  # before any tool is imported
    runner = case.runner()
    runner.setup(wl, work_dir)

    counter = iter(range(10 ** 6))
    once = attach == "once" and case.tool == "atb-probe"
    attached = os.path.join(work_dir, "attached")
    module_call = torch.nn.Module.__call__  # torch's own, before the probe wraps it
    if once:
        t0 = time.perf_counter()
        runner.start(wl, attached)
        attach_s = time.perf_counter() - t0

    def probed_once(last: bool) -> dict:
        if once:  # a later generation of the attachment kept: what it added to the dump
            before = {rel for rel, _ in scan(attached)[1]}
            wall, cpu, peak, _, clock = _timed(lambda: runner.run(wl, attached))
            files = [(rel, size) for rel, size in scan(attached)[1] if rel not in before]
            return probed_record(wall, cpu, peak, clock, files, 0.0, 0.0)
        run_dir = os.path.join(work_dir, f"run{next(counter)}")
        t0 = time.perf_counter()
        runner.start(wl, run_dir)
        start_s = time.perf_counter() - t0
        try:
            wall, cpu, peak, dump_dir, clock = _timed(lambda: runner.run(wl, run_dir))
        finally:
            t0 = time.perf_counter()
            runner.finish()
            finish_s = time.perf_counter() - t0
        rec = probed_record(wall, cpu, peak, clock, scan(dump_dir)[1], start_s, finish_s)
        if not (keep and last):
            remove(dump_dir)
        return rec

    def probed_record(wall, cpu, peak, clock, files: list, start_s: float,
                      finish_s: float) -> dict:
        """A probed run's record; for tensor cases, with the plain write of its `files`."""
        rec = {"s": wall, "after_s": runner.after_s, "cpu_s": cpu, "peak_mib": peak,
               "bytes": sum(s for _, s in files),
               "files": len(files), "start_s": start_s, "finish_s": finish_s,
               "gc_s": clock.seconds, "full_gcs": clock.full}
        if case.plain_baseline:
            plain_dir = os.path.join(work_dir, "plain")
            rec["plain_s"] = plain_write(files, plain_dir)
            remove(plain_dir)
        return rec

    def without_probe():
        """An un-probed run while the attachment is kept."""
        with module_call_of_torch(module_call):
            wl.run()

    def unprobed_once() -> dict:
        wall, cpu, peak, _, clock = _timed(without_probe if once else wl.run)
        return {"s": wall, "cpu_s": cpu, "peak_mib": peak, "gc_s": clock.seconds,
                "full_gcs": clock.full}

    started = time.time()
    probed_once(last=False)  # warm-up: first-call costs (imports, caches, hook registration)
    unprobed_once()
    records, all_probed = [], []
    for i in range(pairs):
        uns, prs = [], []
        for j in range(repeat):
            last = i == pairs - 1 and j == repeat - 1
            if (i * repeat + j) % 2 == 0:
                uns.append(unprobed_once())
                prs.append(probed_once(last))
            else:
                prs.append(probed_once(last))
                uns.append(unprobed_once())
        all_probed += prs
        rec = {"unprobed": min(uns, key=lambda r: r["s"]),
               "probed": min(prs, key=lambda r: r["s"])}
        if case.plain_baseline:
            rec["plain_s"] = min(r["plain_s"] for r in prs)
        if repeat > 1:
            rec["runs"] = {"unprobed": [r["s"] for r in uns], "probed": [r["s"] for r in prs]}
        records.append(rec)

    if once:
        t0 = time.perf_counter()
        runner.finish()
        attach_s += time.perf_counter() - t0
        if not keep:
            remove(attached)

    ratios = [r["probed"]["s"] / r["unprobed"]["s"] for r in records]
    # the generation alone: the probed run less its wait for the disk after the generation
    gen_ratios = [(r["probed"]["s"] - r["probed"]["after_s"]) / r["unprobed"]["s"]
                  for r in records]
    cpu_ratios = [r["probed"]["cpu_s"] / max(r["unprobed"]["cpu_s"], 1e-9) for r in records]
    result = {
        "case": case.name,
        "tool": case.tool,
        "repeat": repeat,
        "pairs": records,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "best_ratio": min(r["probed"]["s"] for r in records)
        / min(r["unprobed"]["s"] for r in records),
        "cpu_ratio": statistics.median(cpu_ratios),
        "gen_ratio": statistics.median(gen_ratios),
        "after_s": statistics.median(r["probed"]["after_s"] for r in records),
        "unprobed_s": statistics.median(r["unprobed"]["s"] for r in records),
        "probed_s": statistics.median(r["probed"]["s"] for r in records),
        "pristine_s": statistics.median(pristine),
        "attach": "once" if once else "each",
        "start_finish_s": attach_s if once else statistics.median(
            r["probed"]["start_s"] + r["probed"]["finish_s"] for r in records),
        "bytes": statistics.median(r["probed"]["bytes"] for r in records),
        "files": statistics.median(r["probed"]["files"] for r in records),
        "process_peak_mib": process_peak_mib(),
        "gc_mode": GC_MODE,
        # every probed run, not only the pairs' fastest: full collections come every few runs
        "gc_ms": 1e3 * statistics.median(r["gc_s"] for r in all_probed),
        "full_gcs_per_run": sum(r["full_gcs"] for r in all_probed) / len(all_probed),
        "seconds": time.time() - started,
        "versions": _versions(),
    }
    if case.plain_baseline:
        plain = [r["plain_s"] for r in records]
        result["plain_s"] = statistics.median(plain)
        result["plain_ratio"] = statistics.median(
            r["probed"]["s"] / (r["unprobed"]["s"] + r["plain_s"]) for r in records)
        result["plain_best_ratio"] = min(r["probed"]["s"] for r in records) / (
            min(r["unprobed"]["s"] for r in records) + min(plain))
    return result


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "atb_probe", "msprobe"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    if "atb_probe" in sys.modules:
        out["atb_probe_path"] = os.path.dirname(sys.modules["atb_probe"].__file__)
    if "msprobe" in sys.modules:
        try:
            from importlib.metadata import version
            out["msprobe"] = version("mindstudio-probe")
        except Exception:
            pass
    return out


# -- profiling ----------------------------------------------------------------------------------

def profile_case(case, spec, threads: int, work_dir: str, top: int, save: str | None) -> str:
    """One warm probed run under cProfile: the model thread, and for atb-probe the writer
    thread too (profiled on its own). The report's text."""
    import cProfile
    import io
    import pstats

    torch.set_num_threads(threads)
    os.makedirs(work_dir, exist_ok=True)
    wl = Workload(spec)
    wl.run()
    runner = case.runner()
    runner.setup(wl, work_dir)
    warm = os.path.join(work_dir, "warm")
    runner.start(wl, warm)
    runner.run(wl, warm)
    runner.finish()
    remove(warm)

    writer_profiles = []
    if case.tool == "atb-probe":
        from atb_probe.record import writer as writer_mod
        original_run = writer_mod.Writer._run

        def profiled_run(self, *args):
            prof = cProfile.Profile()
            writer_profiles.append(prof)
            prof.enable()
            try:
                original_run(self, *args)
            finally:
                prof.disable()

        writer_mod.Writer._run = profiled_run

    prof = cProfile.Profile()
    run_dir = os.path.join(work_dir, "profiled")
    runner.start(wl, run_dir)
    t0 = time.perf_counter()
    prof.enable()
    dump_dir = runner.run(wl, run_dir)
    prof.disable()
    wall = time.perf_counter() - t0
    runner.finish()
    nbytes, files = scan(dump_dir)
    remove(dump_dir)
    t0 = time.perf_counter()
    wl.run()
    base = time.perf_counter() - t0

    out = io.StringIO()
    out.write(f"case {case.name}, workload {spec.name}: probed run {wall:.3f} s under cProfile "
              f"(un-probed run {base:.3f} s without it), {len(files)} files, "
              f"{nbytes / 1e6:.1f} MB\n")
    sections = [("model thread", prof)] + [(f"writer thread {i}", p)
                                           for i, p in enumerate(writer_profiles)]
    for title, p in sections:
        for key in ("tottime", "cumulative"):
            out.write(f"\n== {title}, top {top} by {key} ==\n")
            stats = pstats.Stats(p, stream=out).strip_dirs()
            stats.sort_stats(key).print_stats(top)
        if save:
            os.makedirs(save, exist_ok=True)
            p.dump_stats(os.path.join(save, f"{spec.name}-{case.name}-"
                                            f"{title.replace(' ', '_')}.prof"))
    return out.getvalue()
