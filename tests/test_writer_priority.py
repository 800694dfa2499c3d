"""The writer thread yields the cores to the model's threads: it runs at nice 19 (Linux), the
model's threads keep their priority, and `ATB_PROBE_WRITER_NICE` chooses another value or none.

Measured in a real process started through the load script: the script dumps a round of a tiny
model and prints each thread's nice value, read from the kernel (`os.getpriority` of its ID)."""
from __future__ import annotations

import json
import shlex
import sys

import pytest

from harness import clean_env, config, loaded, run_shell

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a thread's own nice value is Linux's")

SCRIPT = """
import json, os, threading
import torch
import atb_probe
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad():
    model(torch.randn(3, 8))
assert atb_probe.active().writer.flush(60)
print(json.dumps({t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                  for t in threading.enumerate()}))
"""


def _nice_by_thread(tmp, prefix: str = "", **env: str) -> dict:
    """Each thread's nice value in `prefix python SCRIPT` (e.g. `nice -n 5`), started through the
    load script with `env`; the round must be dumped without a warning."""
    tmp.mkdir(exist_ok=True)
    script = tmp / "user_script.py"
    script.write_text(SCRIPT)
    (tmp / "config.json").write_text(json.dumps(config()))
    command = loaded(f"{prefix} {shlex.join([sys.executable, str(script)])}", tmp,
                     tmp / "config.json")
    result = run_shell(command, tmp, clean_env(**env))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[atb-probe] WARNING" not in result.stderr, result.stderr
    assert list(tmp.glob("atb_dump_data/data/*/*/statistic.csv")), "nothing was dumped"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_writer_runs_at_the_lowest_priority_and_the_model_at_its_own(tmp_path):
    nice = _nice_by_thread(tmp_path)
    assert nice["atb-probe-writer"] == 19
    assert nice["MainThread"] == 0 and nice["atb-probe-watch"] == 0


@pytest.mark.parametrize("value, expected", [("0", 0), ("10", 10), ("99", 19), ("-5", 0),
                                             ("high", 19)])
def test_writer_nice_chooses_the_writers_priority(tmp_path, value, expected):
    nice = _nice_by_thread(tmp_path, ATB_PROBE_WRITER_NICE=value)
    assert nice["atb-probe-writer"] == expected and nice["MainThread"] == 0


def test_a_niced_process_keeps_its_priority_and_its_writer_still_yields(tmp_path):
    nice = _nice_by_thread(tmp_path / "asked-5", "nice -n 12", ATB_PROBE_WRITER_NICE="5")
    assert nice["MainThread"] == 12 and nice["atb-probe-writer"] == 12  # never raised
    nice = _nice_by_thread(tmp_path / "default", "nice -n 12")
    assert nice["MainThread"] == 12 and nice["atb-probe-writer"] == 19
