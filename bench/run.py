#!/usr/bin/env python
"""How much slower atb-probe makes a model, measured against the un-probed model and msprobe.

    python bench/run.py                     # small workload, every case, 5 pairs: a table
    python bench/run.py --quick             # smoke run: 16+4 tokens, 3 pairs
    python bench/run.py --workload all --json results.json
    python bench/run.py --msprobe-python /path/to/msprobe-venv/bin/python
    python bench/run.py --commit HEAD       # measure a clean export of a commit's src/
    python bench/run.py --profile stat-child --top 15

Every case runs in a fresh subprocess of this script (`--case NAME`), so its peak RSS is its
own and no case leaves caches or hooks behind for the next. Inside that subprocess probed and
un-probed generations alternate (see measure.py). Cases and goals: cases.py; workloads:
workload.py; method and results: bench/README.md and docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cases import BY_NAME, CASES, RSS_GOAL_MIB  # noqa: E402
from disk import disk_file_us, disk_note  # noqa: E402
import workload as workloads  # noqa: E402

DEFAULT_PAIRS = 5
QUICK_PAIRS = 3
MSPROBE_BASELINE = "unprobed@msprobe"  # the un-probed case run by msprobe's interpreter


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.case:
        return _run_one(args)
    exported = None
    try:
        if args.commit:
            exported, args.src, args.commit = _export(args.commit)
        if args.src:
            args.src = os.path.abspath(args.src)
            sys.path.insert(0, args.src)
        if args.profile:
            return _profile(args)
        return _orchestrate(args)
    finally:
        if exported:
            shutil.rmtree(exported, ignore_errors=True)


def _export(rev: str) -> tuple[str, str, str]:
    """A clean copy of `rev`'s src/ in a temporary folder: (folder, its src/, short sha)."""
    import io
    import tarfile
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], capture_output=True,
                         text=True, check=True).stdout.strip()
    tar = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", sha, "src"],
                         capture_output=True, check=True).stdout
    folder = tempfile.mkdtemp(prefix=f"atb-bench-src-{sha}-")
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(folder, filter="data")
    return folder, os.path.join(folder, "src"), sha


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Overhead of atb-probe (and of msprobe, when installed) on tiny Llama "
                    "generations: probed time / un-probed time, bytes written, peak RSS.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + ", ".join(c.name for c in CASES) + "\n\nexample:\n"
               "  python bench/run.py --quick --cases sleeping,stat-layer")
    p.add_argument("--quick", action="store_true",
                   help="short generations and 3 pairs: a smoke run of the harness")
    p.add_argument("--workload", choices=("small", "large", "all"), default="small",
                   help="small: 4 layers, hidden 256, fp32; large: 8 layers, hidden 1024, bf16")
    p.add_argument("--pairs", type=int, default=None,
                   help=f"paired runs per case (default {DEFAULT_PAIRS}, --quick {QUICK_PAIRS})")
    p.add_argument("--cases", default="",
                   help="comma list of cases (default: all but the heavy ones on 'large' and "
                        "with --quick; msprobe's when its interpreter is found, not with --quick)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each side per pair, the fastest kept (default 1; 3 on a "
                        "machine shared with other jobs)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--gc", choices=("collect", "steady"), default="collect",
                   help="collect (default): a full garbage collection before each timed run; "
                        "steady: none, as in a service, so the collections a tool causes fall "
                        "inside the runs")
    p.add_argument("--attach", choices=("each", "once"), default="each",
                   help="each (default): atb-probe is enabled before every probed run and "
                        "disabled after it, so each run pays the first generation after "
                        "enable; once: enabled once per case and kept, as a service keeps it "
                        "(msprobe's hooks stay registered either way)")
    p.add_argument("--out", default="",
                   help="keep the last dump of each case and the logs here "
                        "(default: a temporary folder, deleted at the end)")
    p.add_argument("--json", default="", help="write every measurement to this file")
    p.add_argument("--msprobe-python", default="auto",
                   help="interpreter with mindstudio-probe installed; 'off' to skip; 'auto' "
                        "(default): $ATB_BENCH_MSPROBE_PYTHON, else this interpreter if it "
                        "imports msprobe")
    p.add_argument("--commit", default="",
                   help="measure atb-probe as committed at this revision (a clean export of "
                        "its src/), not the working tree")
    p.add_argument("--src", default="",
                   help="measure the atb_probe package found in this folder (a src/ directory)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per case")
    p.add_argument("--profile", metavar="CASE", default="",
                   help="instead of timing: profile one warm probed run of CASE (cProfile)")
    p.add_argument("--top", type=int, default=15, help="lines per profile listing")
    # Internal: one case in this process (what the orchestrator starts).
    p.add_argument("--case", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    return p


# -- one case (subprocess) ----------------------------------------------------------------------

def _run_one(args) -> int:
    import measure
    case = BY_NAME[args.case.split("@")[0]]
    spec = workloads.spec(args.workload, args.quick)
    pairs = args.pairs or (QUICK_PAIRS if args.quick else DEFAULT_PAIRS)
    measure.GC_MODE = args.gc
    result = measure.run_case(case, spec, pairs, args.threads, args.work, keep=args.keep,
                              repeat=args.repeat, attach=args.attach)
    result["case"] = args.case
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def _profile(args) -> int:
    import measure
    case = BY_NAME[args.profile]
    names = ("small", "large") if args.workload == "all" else (args.workload,)
    work = args.out or tempfile.mkdtemp(prefix="atb-bench-prof-")
    try:
        for name in names:
            spec = workloads.spec(name, args.quick)
            print(measure.profile_case(case, spec, args.threads, os.path.join(work, name),
                                       args.top, save=os.path.join(work, "profiles")
                                       if args.out else None))
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    return 0


# -- orchestration ------------------------------------------------------------------------------

def _orchestrate(args) -> int:
    pairs = args.pairs or (QUICK_PAIRS if args.quick else DEFAULT_PAIRS)
    ms_python, ms_note = _find_msprobe(args.msprobe_python)
    named = [c.strip() for c in (args.cases or "").split(",")]
    if ms_python is None and any(BY_NAME.get(c) and BY_NAME[c].tool == "msprobe" for c in named):
        print(f"msprobe cases named in --cases are skipped: msprobe {ms_note}", file=sys.stderr)
    names = ("small", "large") if args.workload == "all" else (args.workload,)
    root = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="atb-bench-")
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    meta = _machine(args)
    meta["disk_file_us"] = disk_file_us(root)
    meta.update(pairs=pairs, repeat=args.repeat, threads=args.threads, quick=args.quick,
                gc=args.gc, attach=args.attach, msprobe=ms_note,
                started=datetime.datetime.now().isoformat(timespec="seconds"))
    doc = {"meta": meta, "workloads": {}}
    failed = False
    try:
        for name in names:
            spec = workloads.spec(name, args.quick)
            plan = _plan(args, name, ms_python)
            results = {}
            for key, python in plan:
                res = _spawn(args, key, name, pairs, python, root)
                results[key] = res
                failed |= "error" in res
            doc["workloads"][name] = {"spec": spec.__dict__, "describe": spec.describe(),
                                      "results": results}
            print(render(name, doc["workloads"][name], meta), flush=True)
    finally:
        meta["load_after"] = _loadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"measurements written to {args.json}", file=sys.stderr)
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def _plan(args, workload: str, ms_python: str | None) -> list[tuple[str, str]]:
    """(result key, interpreter) of every subprocess to run, in order."""
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in BY_NAME]
        if unknown:
            sys.exit(f"unknown case(s): {', '.join(unknown)}; known: "
                     + ", ".join(c.name for c in CASES))
    else:
        wanted = [c.name for c in CASES
                  if not (c.heavy and (workload == "large" or args.quick or c.tool == "msprobe"))
                  and not (c.tool == "msprobe" and args.quick)]
    plan = []
    if "unprobed" not in wanted and any(BY_NAME[c].tool == "atb-probe" for c in wanted):
        wanted.insert(0, "unprobed")  # the RSS baseline
    for name in wanted:
        case = BY_NAME[name]
        if case.tool == "msprobe":
            if ms_python is None:
                continue
            if not any(k == MSPROBE_BASELINE for k, _ in plan):
                plan.append((MSPROBE_BASELINE, ms_python))
            plan.append((name, ms_python))
        else:
            plan.append((name, sys.executable))
    return plan


def _spawn(args, key: str, workload: str, pairs: int, python: str, root: str) -> dict:
    work = os.path.join(root, workload, key.replace("@", "-"))
    result_path = os.path.join(root, "logs", f"{workload}-{key.replace('@', '-')}.json")
    log_path = result_path[:-5] + ".log"
    cmd = [python, os.path.abspath(__file__), "--case", key, "--workload", workload,
           "--pairs", str(pairs), "--repeat", str(args.repeat), "--threads", str(args.threads),
           "--gc", args.gc, "--attach", args.attach, "--work", work,
           "--json", result_path]
    if args.quick:
        cmd.append("--quick")
    if args.out:
        cmd.append("--keep")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.src, env.get("PYTHONPATH")) if p)
    for var in ("ATB_DUMP_CONFIG", "ATB_OUTPUT_DIR"):  # a probe loaded in this shell: inert
        env.pop(var, None)
    print(f"[{workload}] {key}: {pairs} pairs ...", end=" ", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=args.timeout, cwd=REPO)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    took = time.monotonic() - started
    if rc == 0 and os.path.exists(result_path):
        with open(result_path) as f:
            res = json.load(f)
        print(f"ratio {res['ratio']:.2f} ({took:.0f} s)", file=sys.stderr, flush=True)
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
        return res
    with open(log_path, errors="replace") as f:
        tail = "".join(f.readlines()[-25:])
    print(f"FAILED ({rc}, {took:.0f} s); last lines of {log_path}:\n{tail}", file=sys.stderr,
          flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"case": key, "error": f"exit {rc}", "log_tail": tail}


def _find_msprobe(choice: str) -> tuple[str | None, str]:
    """The interpreter that runs msprobe's cases, and a note saying what was found."""
    if choice == "off":
        return None, "skipped (--msprobe-python off)"
    candidates = [choice] if choice != "auto" else \
        [p for p in (os.environ.get("ATB_BENCH_MSPROBE_PYTHON"), sys.executable) if p]
    for python in candidates:
        try:
            proc = subprocess.run(
                [python, "-c", "import msprobe.pytorch, transformers; from importlib.metadata "
                               "import version; print('VERSION', version('mindstudio-probe'))"],
                capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERSION ")]
        if proc.returncode == 0 and lines:
            return python, f"mindstudio-probe {lines[-1].split()[1]} ({python})"
    return None, ("not found (mindstudio-probe and transformers must import in the interpreter "
                  "given by --msprobe-python or $ATB_BENCH_MSPROBE_PYTHON); msprobe columns "
                  "skipped")


def _machine(args) -> dict:
    info = {"platform": platform.platform(), "cores": os.cpu_count(), "cpu": platform.machine(),
            "python": platform.python_version(), "load_before": _loadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if models:
            info["cpu"] = models[0]
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        info["memory_gib"] = round(kib / 1024 ** 2, 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        info["commit"] = commit + (" + uncommitted changes in src/" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        info["commit"] = "?"
    if args.commit:
        info["commit"] = f"{args.commit} (clean export)"
    elif args.src:
        info["commit"] = f"the package in {args.src}"
    return info


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- the table ----------------------------------------------------------------------------------

def render(name: str, wl: dict, meta: dict) -> str:
    """The markdown report of one workload."""
    results = wl["results"]
    base = results.get("unprobed", {})
    ms_base = results.get(MSPROBE_BASELINE, {})
    versions = next((r.get("versions") for r in results.values() if r.get("versions")), {})
    repeat = meta.get("repeat", 1)
    repeat_note = f" (each side the fastest of {repeat} runs)" if repeat > 1 else ""
    lines = [
        f"### Workload `{name}`: {wl['describe']}",
        "",
        f"{meta['threads']} threads; median of {meta['pairs']} paired runs"
        f"{repeat_note}; garbage collector: {_GC_NOTE[meta.get('gc', 'collect')]}; "
        f"{_ATTACH_NOTE[meta.get('attach', 'each')]}"
        f"{' (--quick)' if meta['quick'] else ''}. Machine: {meta.get('cpu', '?')}, "
        f"{meta.get('cores', '?')} cores, {meta.get('memory_gib', '?')} GiB, "
        f"{meta['platform']}; load average before {meta['load_before']}; "
        f"{disk_note(meta.get('disk_file_us'))}. "
        f"Python {versions.get('python', '?')}, torch {versions.get('torch', '?')}, "
        f"transformers {versions.get('transformers', '?')}; atb-probe commit "
        f"{meta.get('commit', '?')}.",
        "",
        "| case | goal | ratio | pair range | best-of ratio | CPU ratio | generation ratio "
        "| un-probed s | probed s | of it writing after ms | GC ms (full per run) "
        "| attach+detach ms | MB written | files | extra peak RSS MiB | measured vs goal "
        "| verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- |",
    ]
    legend = []
    for case in CASES:
        if case.tool == "msprobe" or case.name not in results:
            continue
        r = results[case.name]
        legend.append(f"`{case.name}`: {case.what}")
        goal = case.goal.for_workload(name) if case.goal else None
        if "error" in r:
            lines.append(f"| {case.name} | {goal.text() if goal else ''} | failed: "
                         f"{r['error']} | | | | | | | | | | | | | | |")
            continue
        extra = _extra_rss(r, base)
        value, verdict = _verdict(case, goal, r, results, extra)
        lines.append(
            f"| {case.name} | {goal.text() if goal else ''} | {r['ratio']:.2f} | "
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | {r['best_ratio']:.2f} | "
            f"{r['cpu_ratio']:.2f} | {_fmt_opt(r, 'gen_ratio', '{:.2f}')} | "
            f"{r['unprobed_s']:.3f} | {r['probed_s']:.3f} | "
            f"{_fmt_opt(r, 'after_s', '{:.1f}', 1e3)} | {_fmt_gc(r)} | "
            f"{r.get('start_finish_s', 0) * 1e3:.1f} | {r['bytes'] / 1e6:.1f} | "
            f"{r['files']:.0f} | {_fmt_extra(extra, r)} | {value} | {verdict} |")
    lines += ["", "; ".join(legend) + ". `generation ratio` leaves out the wait for the disk "
              "after the generation (`of it writing after`), which a service does not wait "
              "for; the goals hold the whole `ratio`."]
    for case in CASES:
        tl = results.get(case.name, {})
        if "plain_s" in tl:
            lines += ["", f"`{case.name}`: plain Python writes the same {tl['files']:.0f} files "
                          f"({tl['bytes'] / 1e6:.1f} MB) in {tl['plain_s']:.3f} s; probed / "
                          f"(un-probed + plain write) = {tl['plain_ratio']:.2f} (best-of "
                          f"{tl['plain_best_ratio']:.2f})."]
    ms_rows = [c for c in CASES if c.tool == "msprobe" and c.name in results]
    if ms_rows:
        lines += ["", f"msprobe, same workload and method ({meta.get('msprobe', '')}; its "
                      "un-probed runs keep msprobe's hooks registered, switched off, as in the "
                      "issue's measurement; `ratio vs pristine` divides by runs made before "
                      "msprobe was imported):", "",
                  "| msprobe case | ratio | pair range | best-of ratio | ratio vs pristine | "
                  "probed s | MB written | files | extra peak RSS MiB | nearest atb-probe case "
                  "| its ratio | atb-probe / msprobe |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for case in ms_rows:
            r = results[case.name]
            if "error" in r:
                lines.append(f"| {case.name} | failed: {r['error']} | | | | | | | | | | |")
                continue
            ours = results.get(case.compare_to, {})
            ours_ratio = ours.get("ratio")
            ratio_cell = f"{ours_ratio:.2f}" if ours_ratio else ""
            rel = f"{ours_ratio / r['ratio']:.2f}" if ours_ratio else ""
            lines.append(
                f"| {case.name} | {r['ratio']:.2f} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} "
                f"| {r['best_ratio']:.2f} | {r['probed_s'] / r['pristine_s']:.2f} | {r['probed_s']:.3f} | "
                f"{r['bytes'] / 1e6:.1f} | {r['files']:.0f} | "
                f"{_fmt_extra(_extra_rss(r, ms_base), r)} | {case.compare_to} | {ratio_cell} "
                f"| {rel} |")
        lines += ["", "; ".join(f"`{c.name}`: {c.what}" for c in ms_rows) + "."]
    return "\n".join(lines) + "\n"


_ATTACH_NOTE = {"each": "atb-probe enabled before each probed run",
                "once": "atb-probe enabled once per case (`--attach once`), as in a service"}
_GC_NOTE = {"collect": "a full collection before each timed run",
            "steady": "no collection between runs (`--gc steady`), as in a service"}


def _fmt_opt(r: dict, key: str, form: str, scale: float = 1.0) -> str:
    """`r[key]` (times `scale`) in `form`; empty for results saved before it was measured."""
    value = r.get(key)
    return "" if value is None else form.format(value * scale)


def _fmt_gc(r: dict) -> str:
    if "gc_ms" not in r:
        return ""
    return f"{r['gc_ms']:.1f} ({r['full_gcs_per_run']:.2f})"


def _extra_rss(r: dict, base: dict) -> float | None:
    if not base or "process_peak_mib" not in base or "process_peak_mib" not in r:
        return None
    return r["process_peak_mib"] - base["process_peak_mib"]


def _fmt_extra(extra: float | None, r: dict) -> str:
    return f"{extra:+.0f}" if extra is not None else "?"


def _verdict(case, goal, r: dict, results: dict, extra: float | None) -> tuple[str, str]:
    """(the measured value `goal` (the case's, on this workload) is about, met / missed by how
    much)."""
    parts, value = [], ""
    if goal is not None:
        if goal.kind == "ratio":
            measured = r["ratio"]
            value = f"{measured:.2f}"
        elif goal.kind == "plain":
            measured = r.get("plain_ratio")
            value = f"{measured:.2f}" if measured is not None else "?"
        else:
            other = results.get(goal.other, {})
            measured = r["bytes"] / other["bytes"] if other.get("bytes") else None
            value = f"{measured:.0%} of {goal.other}" if measured is not None else \
                f"needs {goal.other}"
        if measured is None:
            parts.append("?")
        elif measured <= goal.limit:
            parts.append("met")
        elif goal.kind == "bytes":
            parts.append(f"missed by {(measured - goal.limit) * 100:.0f} points")
        else:
            parts.append(f"missed by {measured - goal.limit:.2f} ({measured / goal.limit:.1f}x "
                         "the goal)")
    if case.tensors and extra is not None:
        parts.append("RSS met" if extra <= RSS_GOAL_MIB else
                     f"RSS missed by {extra - RSS_GOAL_MIB:.0f} MiB")
    return value, "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
