#!/usr/bin/env python
"""How fast `atb-probe compare` and `atb-probe scan` read a dump, and how they scale with jobs.

    python bench/compare_speed.py                       # make two dumps, measure jobs 1..cores
    python bench/compare_speed.py --jobs 1,2,4 --json speed.json
    python bench/compare_speed.py --golden A --target B # measure on dumps you already have
    python bench/compare_speed.py --profile             # where one job's time goes (cProfile)
    python bench/compare_speed.py --bf16-target --cli --what compare --jobs 1
                                # fp32 golden, bf16 target, timed as `atb-probe compare` runs

Without --golden/--target it dumps the `small` workload of workload.py twice (float32, a fixed
seed; the target with one projection scaled by 1%, or, with `--bf16-target`, the same model in
bfloat16) with `task: tensor`, `save_child: true` and `filter_level: 0`, so every `.bin` holds
its bytes and the bytes read are the files' sizes. With `--cli`, compare is timed end to end as
`atb-probe compare GOLDEN TARGET --no-xlsx --no-html --full --jobs N` in a new process (its
start included), as a user runs it. Compare reads every pair (`--full`): this measures reading,
not the statistics-first triage (bench/compare_scale.py measures that).
Before timing, every file is read once, so the numbers are those of page-cached files: what is
measured is the tool, not the disk. Each measurement runs in a fresh subprocess (its peak RSS,
and that of its largest worker, are its own).

Reported per run: wall time, MB/s (the `.bin` bytes of both dumps for compare, of the target
for scan, divided by the wall time), MB/s per job, the speed-up over one job, peak RSS of the
main process and of the largest worker. The speed-up is over the first job count measured. The goal of the project: >= 300 MB/s per job and
near-linear scaling, which a machine can show only up to the cores it has free.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/compare_speed.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--golden", help="an existing dump (else one is made)")
    p.add_argument("--target", help="an existing dump (else one is made)")
    p.add_argument("--rounds", type=int, default=4, help="rounds to dump (default 4)")
    p.add_argument("--jobs", default=None, help="comma list of job counts (default 1..cores)")
    p.add_argument("--repeat", type=int, default=3, help="runs per setting, fastest kept")
    p.add_argument("--what", default="compare,scan", help="compare, scan or both")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--keep", help="keep the made dumps in this folder")
    p.add_argument("--profile", action="store_true", help="profile one job of compare")
    p.add_argument("--bf16-target", action="store_true",
                   help="make the target dump with the model in bfloat16")
    p.add_argument("--cli", action="store_true",
                   help="time compare as the atb-probe command, process start included")
    p.add_argument("--one", nargs=3, metavar=("WHAT", "JOBS", "PATHS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return _one(*args.one)
    work = None
    try:
        if args.golden and args.target:
            golden, target = os.path.abspath(args.golden), os.path.abspath(args.target)
        else:
            work = args.keep or tempfile.mkdtemp(prefix="atb-compare-speed-")
            golden, target = _make_dumps(work, args.rounds, args.bf16_target)
        if args.profile:
            return _profile(golden, target)
        cores = _cores()
        jobs = [int(j) for j in args.jobs.split(",")] if args.jobs else list(range(1, cores + 1))
        sizes = {"golden": _bin_bytes(golden), "target": _bin_bytes(target)}
        _warm(golden)
        _warm(target)
        print(f"golden {golden}: {sizes['golden'] / 1e6:.1f} MB of .bin; target {target}: "
              f"{sizes['target'] / 1e6:.1f} MB; {cores} core(s) available")
        results = []
        header = (f"{'what':8} {'jobs':>4} {'wall s':>8} {'MB/s':>8} {'MB/s/job':>9} "
                  f"{'speed-up':>8} {'RSS MB':>7} {'worker RSS MB':>13} {'tensors':>8}")
        print(header)
        for what in args.what.split(","):
            volume = sizes["golden"] + sizes["target"] if what == "compare" else sizes["target"]
            base = None
            for n in jobs:
                runs = [_measure_cli(n, golden, target) if args.cli and what == "compare"
                        else _measure(what, n, golden, target) for _ in range(args.repeat)]
                best = min(runs, key=lambda r: r["wall_s"])
                base = base or best["wall_s"]     # the first job count's time
                rate = volume / best["wall_s"] / 1e6
                best.update(what=what, jobs=n, mb=volume / 1e6, mb_per_s=rate,
                            mb_per_s_per_job=rate / n, speedup=base / best["wall_s"],
                            all_walls=[r["wall_s"] for r in runs])
                results.append(best)
                print(f"{what:8} {n:>4} {best['wall_s']:>8.2f} {rate:>8.0f} "
                      f"{rate / n:>9.0f} {best['speedup']:>8.2f} {best['rss_mb']:>7.0f} "
                      f"{best['worker_rss_mb']:>13.0f} {best['tensors']:>8}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"golden": golden, "target": target, "sizes": sizes, "cores": cores,
                           "results": results}, f, indent=2)
        return 0
    finally:
        if work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _make_dumps(folder: str, rounds: int, bf16_target: bool = False) -> tuple[str, str]:
    code = f"""
import sys, torch
sys.path.insert(0, {HERE!r})
import atb_probe, workload
w = workload.Workload(workload.spec("small"))
if sys.argv[2] == "target" and {bf16_target!r}:
    w.model.to(torch.bfloat16)
elif sys.argv[2] == "target":
    with torch.no_grad():
        w.model.model.layers[1].self_attn.v_proj.weight.mul_(1.01)
cfg = dict(task="tensor", dump_enable=True, exec_range="0,{rounds - 1}", ids="", op_name="",
           save_child=True, device="", filter_level=0)
atb_probe.enable(sys.argv[1], cfg)
w.run()
atb_probe.disable(timeout=600)
"""
    paths = []
    for side in ("golden", "target"):
        out = os.path.join(folder, side)
        if not os.path.isdir(os.path.join(out, "atb_dump_data")):
            subprocess.run([sys.executable, "-c", code, out, side], check=True)
        paths.append(out)
    return paths[0], paths[1]


def _bin_bytes(path: str) -> int:
    total = 0
    for base, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(base, n)) for n in names if n.endswith(".bin"))
    return total


def _warm(path: str) -> None:
    for base, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(base, n), "rb") as f:
                while f.read(1 << 20):
                    pass


def _measure(what: str, jobs: int, golden: str, target: str) -> dict:
    run = subprocess.run([sys.executable, __file__, "--one", what, str(jobs),
                          os.pathsep.join((golden, target))], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{what} with {jobs} job(s) failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _measure_cli(jobs: int, golden: str, target: str) -> dict:
    """`atb-probe compare` as a user runs it, timed from the start of its process."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "atb_probe.cli", "compare", golden, target,
                              "--no-xlsx", "--no-html", "--full", "--jobs", str(jobs),
                              "--output", out],
                             capture_output=True, text=True)
        wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"atb-probe compare failed:\n{run.stdout}\n{run.stderr}")
    tensors = int(run.stdout.split("compared ", 1)[1].split()[0])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "tensors": tensors,
            "rss_mb": usage.ru_maxrss / 1024, "worker_rss_mb": 0, "all_workers_rss_mb": 0}


def _one(what: str, jobs: str, paths: str) -> int:
    golden, target = paths.split(os.pathsep)
    import threading
    from atb_probe.tools.compare import compare_dumps
    from atb_probe.tools.scan import scan_dump
    peak = {"worker": 0, "all_workers": 0}
    stop = threading.Event()

    def watch():
        # The workers are children of a fork server, not of this process: RUSAGE_CHILDREN
        # does not see them, so their RSS is sampled from /proc.
        while not stop.wait(0.05):
            sizes = [rss for pid, rss in _descendants(os.getpid())]
            if sizes:
                peak["worker"] = max(peak["worker"], max(sizes))
                peak["all_workers"] = max(peak["all_workers"], sum(sizes))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start, cpu = time.perf_counter(), time.process_time()
    if what == "compare":
        result = compare_dumps(golden, target, jobs=int(jobs), full=True)
        tensors = len(result.rows)
    else:
        tensors = sum(r.tensors for r in scan_dump(target, jobs=int(jobs)))
    wall = time.perf_counter() - start
    stop.set()
    watcher.join()
    print(json.dumps({
        "wall_s": wall, "cpu_s": time.process_time() - cpu, "tensors": tensors,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_rss_mb": peak["worker"] / 1024, "workers_rss_mb": peak["all_workers"] / 1024}))
    return 0


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, RSS in KiB) of every live descendant of `root`."""
    parent, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        parent[int(entry)] = int(fields.get("PPid", "0"))
        rss[int(entry)] = int(fields.get("VmRSS", "0 kB").split()[0])
    out = []
    for pid in parent:
        p = parent[pid]
        while p and p != root:
            p = parent.get(p, 0)
        if p == root:
            out.append((pid, rss[pid]))
    return out


def _profile(golden: str, target: str) -> int:
    import cProfile
    import pstats
    from atb_probe.tools.compare import compare_dumps
    _warm(golden)
    _warm(target)
    prof = cProfile.Profile()
    prof.enable()
    compare_dumps(golden, target, jobs=1, full=True)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
