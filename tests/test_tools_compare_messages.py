"""What `atb-probe compare` says when it cannot do what was asked: each side's entries under
that side's own process, no sheet named that was never written, a file given as --output."""
from __future__ import annotations

import subprocess
import sys

from harness import config, run_loaded

MLP = """
import torch
from torch import nn
torch.manual_seed(0)
nn.Sequential(nn.Linear(4, 4), nn.ReLU())(torch.ones(2, 4))
print("pid", __import__("os").getpid())
"""
CONV = """
import torch
from torch import nn
torch.manual_seed(0)
nn.Sequential(nn.Conv1d(2, 2, 1), nn.Tanh(), nn.Conv1d(2, 2, 1))(torch.ones(1, 2, 3))
print("pid", __import__("os").getpid())
"""


def dump_of(tmp, script) -> tuple[str, str]:
    tmp.mkdir()
    result = run_loaded(tmp, script, cfg=config())
    assert result.returncode == 0, result.stderr
    pid = result.stdout.split("pid ")[1].split()[0]
    return str(tmp), f"0_{pid}"


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atb_probe.cli", "compare", *args],
                          capture_output=True, text=True, timeout=300)


def test_unrelated_dumps_name_each_sides_own_process_and_no_unwritten_sheet(tmp_path):
    golden, golden_proc = dump_of(tmp_path / "golden", MLP)
    target, target_proc = dump_of(tmp_path / "target", CONV)
    shown = compare(golden, target, "--output", str(tmp_path / "out"))
    assert shown.returncode == 1
    lines = shown.stdout.splitlines()
    assert any(f"only in golden: op {golden_proc}/0: 0_Linear" in line for line in lines), lines
    assert any(f"only in target: op {target_proc}/0: 0_Conv1d" in line for line in lines), lines
    assert "sheet" not in shown.stdout and not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_is_called_not_a_folder(tmp_path):
    golden, _ = dump_of(tmp_path / "golden", MLP)
    (tmp_path / "a-file").write_text("x")
    shown = compare(golden, golden, "--output", str(tmp_path / "a-file"), "--no-xlsx",
                    "--no-html")
    assert shown.returncode == 2
    assert "is not a folder" in shown.stderr and "Errno" not in shown.stderr, shown.stderr
