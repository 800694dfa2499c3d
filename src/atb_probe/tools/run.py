"""`atb-probe run [--output=DIR] [--config=FILE] -- CMD...`: one command with the probe loaded."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .where import scripts_dir


def probe_env(output: str | None, config: str | None, base: dict | None = None) -> dict:
    """The environment load_atb_probe.sh would give, as a dict."""
    env = dict(os.environ if base is None else base)
    boot = os.path.normpath(os.path.join(scripts_dir(), "..", "..", "_bootstrap"))
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{boot}:{old}" if old else boot
    env["ATB_OUTPUT_DIR"] = os.path.abspath(output or os.getcwd())
    env["ATB_DUMP_CONFIG"] = os.path.abspath(config or os.path.join(scripts_dir(), "config.json"))
    return env


def register(sub) -> None:
    p = sub.add_parser("run", help="run one command with the probe loaded",
                       description="Run COMMAND with the probe loaded, as if started from a "
                                   "shell that sourced load_atb_probe.sh.",
                       epilog="example: atb-probe run --output=out --config=config.json -- "
                              "python infer.py")
    p.add_argument("--output", help="where atb_dump_data/ goes (default: current directory)")
    p.add_argument("--config", help="config file (default: config.json beside the load script)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=_run)


def _run(args) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("atb-probe run: give the command after --, e.g. "
              "atb-probe run --config=config.json -- python infer.py", file=sys.stderr)
        return 2
    try:
        return subprocess.call(cmd, env=probe_env(args.output, args.config))
    except FileNotFoundError:
        print(f"atb-probe run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
