"""The probe's cost inside vLLM: offline `LLM.generate`, 8 prompts x 32 tokens, greedy.

    .venv-engines/bin/python bench/vllm_offline.py [--pairs 3] [--compiled]

The model is the shape of bench/run.py's `small` workload (a random-weight Llama: 4 layers,
hidden 256, intermediate 1024, vocab 1024, fp32). Run it in the engines' environment
(`.ci/engines-venv`). Cases, each in processes of its own
started like a user's (through the load script where probed), alternated pair by pair:

- `unprobed`: no probe loaded;
- `sleeping`: the probe loaded, `dump_enable` false;
- `stat-layer`: statistics of every step's layer-level ops (`exec_range` all).

Each process makes the engine, generates once to warm up, then times `--repeats` generations
(the median is its time). The ratio of a case is its time over the un-probed time measured in
the same pair; the table gives the median ratio and the range over the pairs. Separate engines
differ by ±10% on a shared machine, so the `sleeping` engine also measures the awake probe
itself: it alternates generations asleep and awake (statistics of every step's layer-level
ops; config.json rewritten between them, and the worker's status file read until it is in
effect), which gives `stat-layer / sleeping` within one engine. An awake generation is timed
until `generate` returns; the probe's writer may still be writing its rows then, so before
the next asleep generation the bench also waits until the worker's status shows nothing to
come (`atb-probe status`'s test: bytes queued, a model file pending, a round open): the
asleep generations do not pay for the awake ones' files (the writer thread at the lowest
priority on the worker's core otherwise wrote them there, 7.8 ms of its CPU an asleep
generation against 0.9 awake, one day's run). Engine start-up is not timed. With
`--compiled`, vLLM compiles the model (its default): the dumped steps of `stat-layer` run
eagerly, so its ratio includes what eager costs against compiled.

With `--floor VARIANT`, the awake probe's recording of each layer-level op side is that of
`layer_floor.py`'s variant instead of `stat-layer`'s (`walk`: the rounds walked to their
layer-level ops, nothing recorded; `refs` and `copies`: each side's tensors referenced or
copied, nothing written; `refs+rows` and `copies+rows`: the same, and each side's
statistic.csv row handed over with a constant cell, so each step's folder, statistic.csv and
tokens.json are written). `bench/floor_site/sitecustomize.py` puts the variant in every
process of the engine, and says so on stderr, which the bench checks. The variants write no
request_statistic.csv and no derived_statistic.csv rows, which vLLM's sides have: what they
cost is less than the least a design that writes SPEC's files would cost here.

The sleeping engine also reads the worker's threads' own scheduler counters
(/proc/PID/task/TID/schedstat, nanoseconds) around each generation: the CPU time each thread
ran and the time it waited, runnable, for a CPU, asleep against awake, by thread name (the
probe's threads name themselves: `atb-writer`, `atb-watch`). It shows where the probe's work
runs and what waits for a core: vLLM pins the worker to its cores, and the probe's writer
thread shares them at the lowest priority. The main thread's CPU time includes vLLM's own
wait for the next step, which spins (`sched_yield`), so it is not the probe's cost alone.
`ATB_PROBE_WRITER` and `ATB_PROBE_WRITER_NICE` pass to the engines (every other `ATB_*`
variable is dropped: the load script sets them), so the writer's settings can be compared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atb_probe.tools.status import unfinished
from disk import disk_file_us, disk_note

CASES = ("unprobed", "sleeping", "stat-layer")
FLOORS = ("walk", "refs", "copies", "refs+rows", "copies+rows")  # layer_floor.py's (`--floor`)
FLOOR_SITE = Path(__file__).resolve().parent / "floor_site"
FLOOR_MARK = "[bench] layer floor"  # what floor_site says on stderr where it took effect
PROMPTS = 8
TOKENS = 32
SCRIPTS = Path(__file__).resolve().parents[1] / "src" / "atb_probe" / "scripts" / "atb"


def child(args) -> None:
    """One engine: warm up, then print the time of each timed generation (with --alternate,
    also those of generations with the probe awake, alternating with asleep ones)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, enforce_eager=not args.compiled, max_model_len=256,
              dtype="float32", max_num_seqs=PROMPTS, seed=0)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [f"prompt {i}: the quick brown fox jumps over the lazy dog" for i in range(PROMPTS)]
    llm.generate(prompts, params, use_tqdm=False)
    times, awake = [], []
    threads = {False: [], True: []}  # the worker's threads, per generation (`_thread_times`)
    for i in range(args.repeats):
        for wake in ((False, True) if args.alternate else (False,))[::1 if i % 2 else -1]:
            worker = None
            if args.alternate:
                worker = _set_awake(args.alternate, wake, args.floor)
            before = _thread_times(worker)
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            (awake if wake else times).append(time.perf_counter() - started)
            threads[wake].append(_difference(_thread_times(worker), before))
    print("TIMES " + json.dumps(times), flush=True)
    if args.alternate:
        print("AWAKE " + json.dumps(awake), flush=True)
        print("THREADS " + json.dumps({"asleep": threads[False], "awake": threads[True]}),
              flush=True)


def _thread_times(pid: int | None) -> dict:
    """{thread: [ms on a CPU, ms waiting for one]} of each thread of process `pid`, from the
    scheduler's own nanosecond counters (/proc/PID/task/TID/schedstat), by the thread's name
    (the main thread as "main"; threads of one name summed); {} where Linux does not tell."""
    found: dict = {}
    if pid is None:
        return found
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(v) for v in f.read().split()[:2])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = "main" if tid == str(pid) else f.read().strip()
        except (OSError, ValueError):
            continue
        entry = found.setdefault(name, [0.0, 0.0])
        entry[0] += run_ns / 1e6
        entry[1] += wait_ns / 1e6
    return found


def _difference(after: dict, before: dict) -> dict:
    """What each thread of `after` ran and waited since `before` (threads that started
    meanwhile count from zero)."""
    return {name: [round(run - before.get(name, (0.0, 0.0))[0], 2),
                   round(wait - before.get(name, (0.0, 0.0))[1], 2)]
            for name, (run, wait) in after.items()}


def _set_awake(out: str, wake: bool, floor: str | None = None) -> int | None:
    """Rewrite OUT/config.json and wait until the worker (the process with rounds, else the
    newest) has it in effect, and, to sleep, until it has nothing left to write; its process
    ID."""
    (Path(out) / "config.json").write_text(json.dumps(_config(wake, floor)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        docs = []
        for p in (Path(out) / "atb_dump_data" / "status").glob("*.json"):
            try:
                docs.append(json.loads(p.read_text()))
            except ValueError:
                pass
        docs.sort(key=lambda d: (d.get("role") == "worker", d.get("rounds_started", 0),
                                 d.get("started_at", "")))
        doc = docs[-1] if docs else {}
        if (doc.get("config_in_effect") or {}).get("dump_enable", False) == wake and \
                (wake or not unfinished(doc)):
            return doc.get("pid")
        time.sleep(0.05)
    raise SystemExit("the worker did not apply the config (and write its files) in 30 s")


def _config(wake: bool, floor: str | None = None) -> dict:
    """stat-layer's config.json (`walk`: ids that match no op, as bench/run.py's walk-only)."""
    return {"task": "statistics", "dump_enable": wake, "exec_range": "all",
            "ids": "999999" if floor == "walk" else "", "op_name": "", "save_child": False,
            "device": "", "filter_level": 1}


def run_case(case: str, args, work: Path) -> tuple[float, float | None]:
    """The median generation time of one process of `case` (and, for `sleeping`, the median
    of its awake generations)."""
    out = work / f"{case}-{time.monotonic_ns()}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(_config(case == "stat-layer", args.floor)))
    command = (f'"{sys.executable}" "{__file__}" --child --model "{args.model}" '
               f'--repeats {args.repeats}{" --compiled" if args.compiled else ""}'
               f'{f" --alternate {out}" if case == "sleeping" else ""}'
               f'{f" --floor {args.floor}" if args.floor else ""}')
    if case != "unprobed":
        command = (f'source "{SCRIPTS}/load_atb_probe.sh" --output="{out}" '
                   f'--config="{out}/config.json" >/dev/null && {command}')
    # The load script sets the dump's variables; the writer's knobs pass, for A/B runs.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ATB_") or k.startswith("ATB_PROBE_WRITER")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"), VLLM_NO_USAGE_STATS="1")
    if args.floor not in (None, "walk") and case != "unprobed":
        # After the probe's bootstrap, which runs the `sitecustomize` it shadows: this one.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(FLOOR_SITE), env.get("PYTHONPATH")) if p)
        env["BENCH_LAYER_FLOOR"] = args.floor
    result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                            timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("TIMES ")]
    if result.returncode or not lines:
        raise SystemExit(f"{case} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    if case != "unprobed" and (args.floor is None or args.floor.endswith("+rows")):
        rounds = list((out / "atb_dump_data" / "data").glob("*/*/statistic.csv"))
        assert rounds, f"{case} wrote no round"
    if case != "unprobed" and args.floor not in (None, "walk"):
        assert f"{FLOOR_MARK} {args.floor}" in result.stderr, \
            f"{case}: no process of the engine recorded as `{args.floor}`"
    awake = [line for line in result.stdout.splitlines() if line.startswith("AWAKE ")]
    threads = [line for line in result.stdout.splitlines() if line.startswith("THREADS ")]
    if threads:
        _THREADS.append(json.loads(threads[-1][len("THREADS "):]))
    return (statistics.median(json.loads(lines[-1][len("TIMES "):])),
            statistics.median(json.loads(awake[-1][len("AWAKE "):])) if awake else None)


_THREADS: list = []  # the sleeping engines' worker threads, per engine (`child`)


def thread_table(engines: list) -> str:
    """The worker's threads in the sleeping engines, asleep against awake: the median per
    generation of the CPU time each ran and of the time it waited, runnable, for a CPU. The
    main thread runs the model and the probe's work on its path, and between steps spins
    (`sched_yield`) until the engine sends the next one, so its CPU time is its whole time
    less what it waited; the probe's threads name themselves (`atb-writer`, `atb-watch`)."""
    names = sorted({name for engine in engines for state in engine.values()
                    for generation in state for name in generation},
                   key=lambda n: (n != "main", not n.startswith("atb-"), n))
    rows = ["| worker thread | CPU ms asleep | CPU ms awake | waiting ms asleep | "
            "waiting ms awake |", "| --- | --- | --- | --- | --- |"]
    for name in names:
        cells = []
        for what in (0, 1):
            for state in ("asleep", "awake"):
                values = [g.get(name, (0.0, 0.0))[what] for e in engines for g in e[state]]
                cells.append(f"{statistics.median(values):.1f}" if values else "-")
        if any(c not in ("0.0", "-") for c in cells):
            rows.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per process")
    parser.add_argument("--compiled", action="store_true",
                        help="let vLLM compile the model (default: enforce_eager)")
    parser.add_argument("--model", help="a checkpoint folder (default: a random Llama)")
    parser.add_argument("--floor", choices=FLOORS,
                        help="awake, record each layer-level op side as layer_floor.py's "
                             "variant does, not as stat-layer does")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--alternate", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="atb-bench-vllm-") as tmp:
        work = Path(tmp)
        if args.model is None:
            from atb_probe.tools.demo_model import save_llama
            args.model = str(save_llama(work / "model", layers=4, hidden=256, vocab=1024,
                                        intermediate=1024))
        disk_us = disk_file_us(str(work))  # each dumped step writes a folder and four files
        ratios: dict[str, list[float]] = {c: [] for c in CASES[1:]}
        same_engine: list[float] = []
        base: list[float] = []
        for pair in range(args.pairs):
            measured = {case: run_case(case, args, work) for case in CASES}
            times = {case: t for case, (t, _) in measured.items()}
            base.append(times["unprobed"])
            for case in CASES[1:]:
                ratios[case].append(times[case] / times["unprobed"])
            awake = measured["sleeping"][1]
            same_engine.append(awake / times["sleeping"])
            print(f"pair {pair + 1}: " + ", ".join(f"{c} {t * 1000:.0f} ms"
                                                   for c, t in times.items())
                  + f"; in the sleeping engine, awake {awake * 1000:.0f} ms", file=sys.stderr)
    mode = "compiled" if args.compiled else "enforce_eager"
    model = "the small workload's Llama" if args.model.startswith(tmp) else args.model
    floor = f"; awake: layer_floor.py's `{args.floor}`" if args.floor else ""
    print(f"vLLM offline, {PROMPTS} prompts x {TOKENS} tokens, {model}, {mode}, "
          f"{args.pairs} pairs x {args.repeats} generations; {disk_note(disk_us)}{floor}\n")
    print("| case | ratio to un-probed (pair range) |\n| --- | --- |")
    print(f"| unprobed | 1.00 ({statistics.median(base) * 1000:.0f} ms a generation) |")
    awake = f"`{args.floor}`" if args.floor else "stat-layer"
    for case, values in ratios.items():
        print(f"| {awake if case == 'stat-layer' else case} | {statistics.median(values):.2f} "
              f"({min(values):.2f}-{max(values):.2f}) |")
    print(f"| {awake} / sleeping, one engine alternating | "
          f"{statistics.median(same_engine):.2f} "
          f"({min(same_engine):.2f}-{max(same_engine):.2f}) |")
    if _THREADS and any(e["asleep"] and e["asleep"][0] for e in _THREADS):
        print("\nThe worker's threads in the sleeping engines, per generation (medians; "
              "/proc schedstat):\n")
        print(thread_table(_THREADS))


if __name__ == "__main__":
    main()
