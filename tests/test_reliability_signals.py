"""Killed and stopped processes (issue #6): real processes loaded through the load script, real
signals. SIGKILL in the middle of a heavy dump leaves only complete `.bin` files and whole
statistic.csv lines; SIGTERM, SIGINT and a normal exit first write what is queued; and a disk
that stops answering cannot hang the model or its exit longer than the timeouts."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

import atb_probe

from conftest import bins, check_dump, probe_lines
from harness import (Running, clean_env, config, loaded, run_shell, status_of, terminal,
                     wait_until)

FIFREEZE, FITHAW = 0xC0045877, 0xC0045878

# A model whose rounds write a few MB each (save_child: kernel inputs include the weights).
HEAVY = """
import atexit, os, signal, sys, time
atexit.register(lambda: print("EXIT-DONE", flush=True))  # runs after the probe's own exit work
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Model(nn.Module):
    def __init__(self, h=128, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, h)
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

torch.manual_seed(0)
model = Model().eval()
x = torch.randn(32, 128)
rounds, ending = int(sys.argv[1]), sys.argv[2]
with torch.no_grad():
    for i in range(rounds):
        y = model(x)
        print("ROUND", i, flush=True)
import atb_probe
print("PENDING", atb_probe.active().status()["bytes_queued"], flush=True)
if ending in ("sigterm", "sigint"):
    os.kill(os.getpid(), getattr(signal, ending.upper()))
    time.sleep(60)  # the signal ends the process first: this line is never passed
print("MODEL-DONE", float(y.sum()), flush=True)
"""


def start(tmp: Path, out: Path, rounds: int, ending: str, cfg: dict, **env) -> Running:
    """`source load_atb_probe.sh`, then run the heavy model as the shell's own process."""
    script = tmp / "heavy.py"
    script.write_text(textwrap.dedent(HEAVY))
    (tmp / "config.json").write_text(json.dumps(cfg))
    command = loaded(terminal(sys.executable, script, rounds, ending), out, tmp / "config.json")
    return Running(command, tmp, clean_env(ATB_PROBE_MIN_FREE_BYTES="0", **env))


def wait_for_bins(proc: Running, root: Path, count: int, limit: float = 90,
                  with_csv: bool = False) -> None:
    """Wait until `count` .bin files (and, `with_csv`, a statistic.csv) are under `root`."""
    def there():
        proc.check_running("the dumping program")
        return len(bins(root)) >= count and (not with_csv or any(root.rglob("statistic.csv")))
    wait_until(there, limit, f"{count} tensor files", interval=0.005)


DUMP_ALL = config(save_child=True, filter_level=0, task="all")


@pytest.mark.parametrize("after_bins", [300])
def test_sigkill_mid_dump_leaves_only_complete_files_and_whole_lines(tmp_path, after_bins):
    out = tmp_path / "out"
    proc = start(tmp_path, out, 400, "exit", DUMP_ALL)
    try:
        wait_for_bins(proc, out, after_bins, with_csv=True)
        assert proc.stop(signal.SIGKILL, timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
    root = out / "atb_dump_data"
    assert len(bins(root)) >= after_bins
    rows = check_dump(root, temp_files_allowed=True)  # a kill may leave hidden .tmp files
    assert rows


@pytest.mark.parametrize("ending,returncode", [
    ("exit", 0), ("sigterm", -signal.SIGTERM), ("sigint", -signal.SIGINT)])
def test_exit_and_stop_signals_write_everything_queued_first(tmp_path, ending, returncode):
    out = tmp_path / "out"
    rounds = 4
    proc = start(tmp_path, out, rounds, ending, DUMP_ALL)
    assert proc.wait(timeout=120) == returncode, proc.stderr
    stderr = proc.stderr
    pending = int(proc.stdout.split("PENDING ")[1].split()[0])
    assert pending > 0  # there was something left to write when the program ended
    root = out / "atb_dump_data"
    rows = check_dump(root)
    per_round = {}
    for r in rows:
        per_round[r["Execution Count"]] = per_round.get(r["Execution Count"], 0) + 1
    assert sorted(per_round) == [str(i) for i in range(rounds)]
    assert len(set(per_round.values())) == 1  # the last round is as complete as the first
    assert all(r["Tensor Path"] != "N/A" for r in rows)
    status = status_of(root)
    assert status["bytes_queued"] == 0 and status["exited"] is True
    assert "Traceback" not in stderr or ending == "sigint"
    assert probe_lines(stderr, "ERROR") == []


# The in-process API: a probe enabled, disabled and enabled again, then SIGTERM.
REENABLED = """
import json, os, signal, sys, time
import torch
from torch import nn
import atb_probe

torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8))).eval()
x = torch.randn(64, 256)
cfg = json.loads(sys.argv[3])
atb_probe.enable(sys.argv[1], cfg)
with torch.no_grad():
    model(x)
atb_probe.disable()
atb_probe.enable(sys.argv[2], cfg)
with torch.no_grad():
    for i in range(int(sys.argv[4])):
        model(x)
print("PENDING", atb_probe.active().status()["bytes_queued"], flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)  # the signal ends the process first: this line is never passed
print("NOT-KILLED", flush=True)
"""


def test_sigterm_writes_the_queue_of_a_probe_enabled_again(tmp_path):
    """SIGTERM flushes the probe open now, not the first one this process had: enable, disable,
    enable, dump, SIGTERM; every round of the second probe is on disk."""
    script = tmp_path / "reenabled.py"
    script.write_text(REENABLED)
    first, second, rounds = tmp_path / "first", tmp_path / "second", 6
    cfg = config(save_child=True, filter_level=0, task="all")
    result = run_shell(terminal(sys.executable, script, first, second, json.dumps(cfg), rounds),
                       tmp_path, clean_env(ATB_PROBE_MIN_FREE_BYTES="0"), timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert int(result.stdout.split("PENDING ")[1].split()[0]) > 0
    root = second / "atb_dump_data"
    rows = check_dump(root)
    assert sorted({r["Execution Count"] for r in rows}) == [str(i) for i in range(rounds)]
    assert all(r["Tensor Path"] != "N/A" for r in rows)
    status = status_of(root)
    assert status["exited"] is True and status["bytes_queued"] == 0
    assert status["rounds_dumped"] == rounds
    assert probe_lines(result.stderr, "ERROR") == []


def test_stuck_disk_cannot_hang_the_model_or_its_exit(tmp_path, mount_fs):
    """The file system is frozen (every write blocks) in the middle of a dump: the model runs
    to its end once the queue stops moving (ATB_PROBE_STALL_TIMEOUT), and the exit flush gives
    up after ATB_PROBE_EXIT_TIMEOUT. (The kernel itself does not reap a process whose thread is
    inside a frozen file system until it thaws; what is bounded is the program's own run.)"""
    fs = mount_fs("ext4", size_mb=160)
    out = fs.path / "out"
    proc = start(tmp_path, out, 60, "exit", DUMP_ALL,
                 ATB_PROBE_STALL_TIMEOUT="2", ATB_PROBE_EXIT_TIMEOUT="2")
    fd = os.open(fs.path, os.O_RDONLY)
    frozen = False
    try:
        wait_for_bins(proc, out, 40)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
        except OSError as exc:
            pytest.skip(f"cannot freeze a file system here: {exc}")
        frozen = True
        wait_until(lambda: proc.printed_at("EXIT-DONE"), 60,
                   "the program to exit while the disk is stuck", interval=0.05)
        # The model ends once the queue stops moving; its exit waits the exit timeout, and a
        # little more.
        assert proc.printed_at("EXIT-DONE") - proc.printed_at("MODEL-DONE") < 2 + 5
    finally:
        if frozen:
            fcntl.ioctl(fd, FITHAW, 0)
        os.close(fd)
        try:
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
    stderr = proc.stderr
    assert code == 0, stderr
    stalls = [e for e in probe_lines(stderr, "ERROR") if "took nothing" in e]
    assert len(stalls) == 1, stderr
    assert "Traceback" not in stderr
    check_dump(out / "atb_dump_data", temp_files_allowed=True)


def test_the_sigterm_handler_is_there_while_a_probe_is_open_and_gone_after(tmp_path):
    """The probe's SIGTERM handler goes in when the first probe opens (over the default
    disposition only) and the default comes back when the last one closes."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # however the suite was started
    try:
        atb_probe.enable(str(tmp_path / "a"), config(dump_enable=False))
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        atb_probe.disable()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        atb_probe.enable(str(tmp_path / "b"), config(dump_enable=False))
        assert signal.getsignal(signal.SIGTERM) is handler
        atb_probe.disable()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_host_handler_for_sigterm_is_left_alone(tmp_path):
    def host(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, host)
    try:
        atb_probe.enable(str(tmp_path), config(dump_enable=False))
        assert signal.getsignal(signal.SIGTERM) is host
        atb_probe.disable()
        assert signal.getsignal(signal.SIGTERM) is host
    finally:
        signal.signal(signal.SIGTERM, previous)
