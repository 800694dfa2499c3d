"""`atb-probe demo`: a real dump of a small model, end to end, on the embedded defaults.

It writes a config.json, runs a random-weight Llama generation in a child process started with
the probe loaded (as `source load_atb_probe.sh` would), and shows what was written.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .. import layout
from .dumpreader import DumpError, op_folders, open_dump
from .run import probe_env

DEMO_CONFIG = {
    "task": "all",
    "dump_enable": True,
    "exec_range": "0,1",
    "ids": "",
    "op_name": "",
    "save_child": False,
    "device": "",
    "filter_level": 1,
}


def register(sub) -> None:
    p = sub.add_parser("demo", help="dump a small random-weight Llama and show the result",
                       description="Write a config, run a short generation of a small "
                                   "random-weight Llama with the probe loaded, and show the dump.",
                       epilog="example: atb-probe demo --output /tmp/demo")
    p.add_argument("--output", default="atb-probe-demo",
                   help="folder for config.json and atb_dump_data/ (default: ./atb-probe-demo)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens to generate (default 4)")
    p.set_defaults(func=run_demo)


def run_demo(args) -> int:
    output = os.path.abspath(args.output)
    os.makedirs(output, exist_ok=True)
    config = os.path.join(output, "config.json")
    with open(config, "w") as f:
        json.dump(DEMO_CONFIG, f, indent=4)
    print(f"config:  {config}")
    cmd = [sys.executable, "-m", "atb_probe.tools.demo_model", "--layers", str(args.layers),
           "--new-tokens", str(args.new_tokens)]
    print(f"running: {' '.join(cmd[1:])}  (with the probe loaded)")
    result = subprocess.run(cmd, env=probe_env(output, config))
    if result.returncode:
        print(f"the model program failed (exit {result.returncode})", file=sys.stderr)
        return result.returncode
    root = layout.dump_root(output)
    print(f"\ndump:    {root}")
    print_tree(root)
    print("\nnext:    atb-probe show " + root + "\n         atb-probe status " + output +
          "\n         atb-probe scan " + root)
    return 0


def print_tree(root: str, max_ops: int = 8) -> None:
    """A short tree of the dump root `root`: processes, rounds, the first layer-level op
    folders of each round with their files."""
    try:
        dump = open_dump(root)
    except DumpError:
        print("  (no data: was dump_enable true?)")
        return
    for proc in dump.processes:
        print(f"  {layout.process_dir(proc.name)}/")
        for rnd in proc.rounds:
            ops = op_folders(rnd.path)
            rows = _count_lines(rnd.csv_path) - 1
            print(f"    {rnd.index}/  statistic.csv ({rows} tensors), {len(ops)} layer-level ops")
            for op in ops[:max_ops]:
                files, size = _disk_usage(op.path)
                print(f"      {layout.op_folder(op.own_id, op.name)}/  {files} files, "
                      f"{size} bytes")
            if len(ops) > max_ops:
                print(f"      ... {len(ops) - max_ops} more")
    kinds = [layout.info_kind_dir(kind) for kind in layout.INFO_KINDS]
    for sub in kinds + [layout.STATUS_DIR]:
        path = os.path.join(root, sub)
        if os.path.isdir(path):
            count = sum(len(files) for _, _, files in os.walk(path))
            print(f"  {sub}/  {count} files")


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _disk_usage(path: str) -> tuple[int, int]:
    files = size = 0
    for base, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(base, n))
    return files, size
