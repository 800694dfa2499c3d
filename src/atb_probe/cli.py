"""The `atb-probe` command line. Each subcommand lives in its own module under `tools/` and
exposes `register(subparsers)`; this file only wires them together."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each job of compare and scan is one process doing one thing at a time (--jobs makes more):
# numpy's BLAS must not spread a dot product over threads that wait for busy cores. Set before
# numpy is imported, and inherited by the jobs' processes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import atb_probe  # noqa: E402

# Our own tools never dump themselves, even when started from a shell that loaded the probe.
atb_probe._suppressed = True

SUBCOMMANDS = ("where", "run", "demo", "status", "show", "parse", "compare", "scan",
               "replay")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; `only`: register that subcommand alone (its module is the only
    one imported: `atb-probe status` does not pay for numpy and the analysis tools)."""
    parser = argparse.ArgumentParser(
        prog="atb-probe",
        description="Operator-level precision dumps of PyTorch models in the msProbe ATB layout.",
        epilog="quick start:\n  atb-probe demo\n\nload into a shell (every Python process "
               "started from it is dumped):\n"
               "  source \"$(atb-probe where)/load_atb_probe.sh\" --output=$PWD "
               "--config=$PWD/config.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"atb-probe {atb_probe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (only,) if only in SUBCOMMANDS else SUBCOMMANDS:
        module = importlib.import_module(f"atb_probe.tools.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # A subcommand named first needs only its own module; anything else (no command, --help,
    # a typo) gets every subcommand, so the help and the error list them all.
    parser = build_parser(only=args[0] if args else None)
    parsed = parser.parse_args(args)
    if not getattr(parsed, "func", None):
        parser.print_help()
        return 2
    try:
        return int(parsed.func(parsed) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
