#!/usr/bin/env python
"""compare's statistics-first triage against the full comparison on a large tensor dump.

    python bench/compare_scale.py                   # two dumps of >= 10 GB each, then both compares
    python bench/compare_scale.py --gb 1 --keep big # smaller dumps, kept in ./big
    python bench/compare_scale.py --golden A --target B   # dumps you already have
    python bench/compare_scale.py --task tensor     # dumps without statistics

Without --golden/--target it dumps a wider tiny Llama (random weights from a fixed seed; see
`MODEL`) with `task: all` (statistics and tensors), `save_child: true`, `filter_level: 0`, one
round per forward call of a prompt of `--prompt` tokens, as many rounds as make `--gb` GB of
`.bin` per dump. The target is the same run with one weight perturbed (`mlp.down_proj` of the
middle layer scaled by 1%) from round `--fault-round` on (default: the middle round), so the
rounds before the fault are bit-identical: what statistics can skip. Both dumps go to a
temporary folder that is deleted afterwards (unless `--keep`); they take about 2 x `--gb` GB.

Then it runs `atb-probe compare GOLDEN TARGET --no-xlsx --no-html` (the triage, the default)
and the same with `--full`, each in a new process, timed end to end as a user runs them (the
triage first: the full comparison reads every file and leaves the page cache warmer, not
colder, for nothing the triage reads). It prints both times, their ratio (the goal: the triage
in less than a tenth of the full comparison's time), what the triage read, and whether the two
verdicts (the summaries' `first_divergence`) agree. The machine's load average is printed
before each step: on a shared machine the times move with it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

MODEL = dict(layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=32000)

DUMP = r"""
import json, os, sys, torch
import atb_probe
from transformers import LlamaConfig, LlamaForCausalLM
out, side, rounds, prompt, fault_round, task = sys.argv[1:7]
rounds, prompt, fault_round = int(rounds), int(prompt), int(fault_round)
model_cfg = json.loads(sys.argv[7])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=model_cfg["vocab"], hidden_size=model_cfg["hidden"],
                  intermediate_size=model_cfg["intermediate"],
                  num_hidden_layers=model_cfg["layers"], num_attention_heads=model_cfg["heads"],
                  num_key_value_heads=model_cfg["kv_heads"], max_position_embeddings=prompt)
model = LlamaForCausalLM(cfg).eval()
atb_probe.enable(out, dict(task=task, dump_enable=True, exec_range="all", ids="", op_name="",
                           save_child=True, device="", filter_level=0))
with torch.no_grad():
    for r in range(rounds):
        if side == "target" and r == fault_round:
            model.model.layers[len(model.model.layers) // 2].mlp.down_proj.weight.mul_(1.01)
        ids = torch.randint(0, cfg.vocab_size, (1, prompt),
                            generator=torch.Generator().manual_seed(r))
        model(ids, use_cache=False)
        if r == 0:
            atb_probe.active().writer.flush()
            print(json.dumps({"round_bytes": sum(
                os.path.getsize(os.path.join(b, n)) for b, _, ns in os.walk(out)
                for n in ns if n.endswith(".bin"))}), flush=True)
assert atb_probe.disable(timeout=3600)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/compare_scale.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--golden", help="an existing dump (else one is made)")
    p.add_argument("--target", help="an existing dump (else one is made)")
    p.add_argument("--gb", type=float, default=10.0, help="GB of .bin per made dump (10)")
    p.add_argument("--prompt", type=int, default=256, help="tokens per round (256)")
    p.add_argument("--fault-round", type=int, default=None,
                   help="first round of the target with the fault (default: the middle one)")
    p.add_argument("--task", default="all", choices=("all", "tensor"),
                   help="the made dumps' task (all: statistics and tensors)")
    p.add_argument("--jobs", type=int, default=None, help="compare --jobs (default: its own)")
    p.add_argument("--keep", help="make the dumps in this folder and keep them")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    work = None
    try:
        if args.golden and args.target:
            golden, target = os.path.abspath(args.golden), os.path.abspath(args.target)
        else:
            work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(
                prefix="atb-compare-scale-")
            golden, target = _make_dumps(work, args)
        sizes = [_bin_bytes(golden), _bin_bytes(target)]
        print(f"golden {golden}: {sizes[0] / 1e9:.2f} GB of .bin; target {target}: "
              f"{sizes[1] / 1e9:.2f} GB; {_load()}")
        runs = {}
        for name, extra in (("triage", []), ("full", ["--full"])):
            print(f"{name}: running ({_load()})", flush=True)
            runs[name] = _compare(golden, target, extra, args.jobs)
            print(f"{name}: {runs[name]['wall_s']:.1f} s; {runs[name]['verdict']}")
        triage, full = runs["triage"], runs["full"]
        same = triage["first_divergence"] == full["first_divergence"]
        ratio = triage["wall_s"] / full["wall_s"]
        read = triage["triage"]
        print(f"\nfull compare {full['wall_s']:.1f} s, triage {triage['wall_s']:.1f} s, ratio "
              f"{ratio:.3f} (goal < 0.1); the triage read {read['read']} of {read['pairs']} "
              f"tensor pairs ({read['units_read']} of {read['units']} layer-level op "
              f"executions); verdicts {'agree' if same else 'DIFFER'}; {_load()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"golden": golden, "target": target, "bin_bytes": sizes,
                           "full": full, "triage": triage, "ratio": ratio,
                           "verdicts_agree": same}, f, indent=2)
        return 0 if same else 1
    finally:
        if work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _make_dumps(folder: str, args) -> tuple[str, str]:
    """Dump the golden run (its first round tells how many rounds make `--gb`), then the
    target with the same rounds."""
    paths, rounds, fault = [], None, args.fault_round
    for side in ("golden", "target"):
        out = os.path.join(folder, side)
        paths.append(out)
        if os.path.isdir(os.path.join(out, "atb_dump_data")):
            rounds = rounds or _rounds_of(out)
            continue
        if rounds is None:       # one round first: how big is it?
            probe = os.path.join(folder, "probe")
            first = _dump(probe, "golden", 1, args.prompt, 0, args.task)
            shutil.rmtree(probe, ignore_errors=True)
            rounds = max(2, math.ceil(args.gb * 1e9 / first))
            print(f"one round is {first / 1e6:.0f} MB of .bin: {rounds} rounds per dump")
        fault = rounds // 2 if fault is None else fault
        print(f"dumping the {side} ({_load()})", flush=True)
        start = time.perf_counter()
        _dump(out, side, rounds, args.prompt, fault, args.task)
        print(f"  {time.perf_counter() - start:.0f} s")
    return tuple(os.path.join(p, "atb_dump_data") for p in paths)


def _dump(out: str, side: str, rounds: int, prompt: int, fault: int, task: str) -> int:
    """Run the dumping process; the .bin bytes of its first round."""
    run = subprocess.run([sys.executable, "-c", DUMP, out, side, str(rounds), str(prompt),
                          str(fault), task, json.dumps(MODEL)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"dumping the {side} failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[0])["round_bytes"]


def _rounds_of(out: str) -> int:
    data = os.path.join(out, "atb_dump_data", "data")
    proc = os.path.join(data, os.listdir(data)[0])
    return sum(1 for n in os.listdir(proc) if n.isdigit())


def _compare(golden: str, target: str, extra: list[str], jobs: int | None) -> dict:
    """`atb-probe compare` as a user runs it, timed from the start of its process; its
    summary."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "atb_probe.cli", "compare", golden, target, "--no-xlsx",
               "--no-html", "--output", out] + extra
        if jobs:
            cmd += ["--jobs", str(jobs)]
        start = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if run.returncode != 0:
            raise SystemExit(f"atb-probe compare failed:\n{run.stdout}\n{run.stderr}")
        with open(os.path.join(out, "atb_compare_summary.json")) as f:
            summary = json.load(f)
    return {"wall_s": wall, "verdict": summary["verdict"],
            "first_divergence": summary["first_divergence"], "triage": summary["triage"],
            "tensor_pairs": summary["counts"]["tensor_pairs"]}


def _bin_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(b, n)) for b, _, names in os.walk(path)
               for n in names if n.endswith(".bin"))


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} on {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
