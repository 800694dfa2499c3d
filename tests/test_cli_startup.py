"""`atb-probe COMMAND` imports only that command's module: `status`, which users poll while a
service runs, starts without numpy and the analysis tools; the bare command and a mistyped one
still list every subcommand."""
from __future__ import annotations

import ast
import sys

from harness import cli, run

HEAVY = ("numpy", "torch", "atb_probe.tools.compare", "atb_probe.tools.dumpreader")


def modules_after(*argv: str) -> list[str]:
    code = ("import sys\nfrom atb_probe.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = run([sys.executable, "-c", code, *argv], timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_status_and_where_import_none_of_the_analysis_tools(tmp_path):
    assert modules_after("status", str(tmp_path)) == []
    assert modules_after("where") == []


def test_the_analysis_commands_still_find_what_they_import(tmp_path):
    assert "numpy" in modules_after("compare", "--help")


def test_help_and_a_mistyped_command_list_every_subcommand():
    listing = cli("--help", timeout=60)
    assert listing.returncode == 0
    for name in ("where", "run", "demo", "status", "show", "parse", "compare", "scan", "replay"):
        assert name in listing.stdout
    typo = cli("statuss", timeout=60)
    assert typo.returncode == 2 and "invalid choice: 'statuss'" in typo.stderr
    assert "'replay'" in typo.stderr
