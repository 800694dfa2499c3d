"""Sleeping, waking and reloading while the program runs (SPEC §4), with a real process.

Each test starts one long-lived Python program under the load script and drives it through its
stdin (run N rounds, spin threads that call the model, report whether `nn.Module.__call__` is
patched) while the test edits config.json and watches stderr and the status file, as a user
would. The model is a small pure-torch one: its layer-level ops are 0 `Embedding`,
1 and 2 `Block`, 3 `Linear`.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import count_rounds_by_config, read_csv
from harness import LiveProcess, config, loaded, terminal, wait_until

WAKE = "Ready to dump ATB data, the running speed of the model will be affected"

DRIVER = r"""
import sys, threading, time
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.lin(x)) + x

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16)
    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

torch.manual_seed(0)
torch.set_num_threads(1)
model = Tiny().eval()
ids = torch.arange(6).unsqueeze(0)
spinning = threading.Event()
threads = []

calls = [0]

def spin(pause):
    while spinning.is_set():
        with torch.no_grad():
            model(ids)
        calls[0] += 1
        time.sleep(pause)  # a client's pause between its calls, not a wait

for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "run":
        with torch.no_grad():
            for _ in range(int(arg[0])):
                model(ids)
    elif cmd == "spin":
        spinning.set()
        threads[:] = [threading.Thread(target=spin, args=(float(arg[1]),))
                      for _ in range(int(arg[0]))]
        for t in threads:
            t.start()
    elif cmd == "stop":
        spinning.clear()
        for t in threads:
            t.join()
    print("ok", getattr(nn.Module.__call__, "__atb_probe__", False), calls[0], flush=True)
"""


class Program(LiveProcess):
    """The driver program, started under the load script with no config file."""

    def __init__(self, tmp: Path):
        self.config_path = tmp / "config.json"
        self.root = tmp / "atb_dump_data"
        script = tmp / "driver.py"
        script.write_text(DRIVER)
        super().__init__(loaded(terminal(sys.executable, script), tmp, self.config_path), tmp,
                         interactive=True)
        # The status file appears when the probe attaches (after `import torch`).
        self.status_file = wait_until(self._find_status, 60, "the status file")

    def _find_status(self):
        self.check_running("the driver")
        files = list((self.root / "status").glob(f"*_{self.pid}.json"))
        return files[0] if files else None

    def send(self, command: str) -> bool:
        """Run one driver command; whether `nn.Module.__call__` is patched afterwards."""
        reply = self.ask(command)
        assert reply[0] == "ok", (reply, self.stderr)
        return reply[1] == "True"

    def calls(self) -> int:
        """How many model calls the spinning threads have made so far."""
        reply = self.ask("noop")
        assert reply[0] == "ok", (reply, self.stderr)
        return int(reply[2])


@pytest.fixture
def program(tmp_path):
    prog = Program(tmp_path)
    yield prog
    prog.kill()


def round_dirs(root: Path) -> dict[int, Path]:
    procs = list((root / "data").iterdir()) if (root / "data").is_dir() else []
    return {int(p.name): p for proc in procs for p in proc.iterdir() if p.is_dir()}


def test_sleeps_without_a_config_and_wakes_within_one_second_when_one_appears(program):
    assert program.send("run 3") is False
    status = program.status()
    assert (status["state"], status["config_in_effect"], status["rounds_started"]) == \
        ("sleeping", None, 0)
    assert not (program.root / "data").exists()
    saved = program.write_config(exec_range="none")
    # No request needed: the probe notices on its own.
    wait_until(lambda: program.lines(WAKE) and (program.root / "data").is_dir(), 5,
               "the wake message and the data folder")
    latency = time.monotonic() - saved
    print(f"wake latency {latency:.3f} s")
    assert latency < 1.0
    # The status follows the wake-up on the watcher's next write (SPEC §4: within a second).
    wait_until(lambda: program.status()["state"] == "dumping", 1, "the status to say dumping")
    assert program.send("run 2") is True
    # exec_range "none": rounds are counted from the wake-up on, nothing is written.
    wait_until(lambda: program.status()["rounds_started"] == 2, 2, "2 rounds counted")
    assert program.stop() == 0
    final = program.status()
    assert final["exited"] is True and final["files_written"] == 0
    assert list((program.root / "data").iterdir()) == []
    assert len(program.lines(WAKE)) == 1


def test_a_saved_change_applies_at_the_next_round_within_one_second(program):
    program.send("run 4")  # asleep: these calls are not rounds
    program.write_config(exec_range="1,3", ids="0")
    program.wait_applied(exec_range="1,3", ids="0")
    program.send("run 2")
    saved = program.write_config(exec_range="1,3", ids="3", task="statistics")
    status = program.wait_applied(exec_range="1,3", ids="3", task="statistics")
    latency = time.monotonic() - saved
    print(f"reload latency {latency:.3f} s")
    assert latency < 1.0
    assert status["rounds_started"] == 2
    program.send("run 3")
    assert program.stop() == 0
    rounds = round_dirs(program.root)
    assert sorted(rounds) == [1, 2, 3]
    for index, folder in rounds.items():
        rows = read_csv(folder / "statistic.csv")
        assert {r["Op Id"] for r in rows} == {"0" if index < 2 else "3"}
        assert {r["Execution Count"] for r in rows} == {str(index)}
        assert all((r["Tensor Path"] == "N/A") == (index >= 2) for r in rows)


def test_a_half_written_config_is_never_used_and_warns_once_only_if_left_so(program):
    program.write_config(ids="0")
    program.wait_applied(ids="0")
    # An editor between two writes: completed before the next poll, no warning. (The pause is
    # the editor's, not a wait: a poll may or may not fall into it. Whether one that does
    # stays quiet is tested without a race in test_config_abuse.py.)
    text = json.dumps(config(ids="3"))
    with open(program.config_path, "w") as f:
        f.write(text[:20])
        f.flush()
        time.sleep(0.03)
        f.write(text[20:])
    program.wait_applied(ids="3")
    assert not program.lines("WARNING"), program.stderr
    # Left half-written: the last good config stays, one warning, and the status says why.
    with open(program.config_path, "w") as f:
        f.write('{"task": "tensor", "dump_enable": fal')
    wait_until(lambda: program.lines("not valid JSON"), 5, "the invalid-JSON warning")
    status = wait_until(lambda: (lambda s: s if s["config_problem"] else None)(program.status()),
                        2, "the problem in the status file")
    assert "not valid JSON" in status["config_problem"]
    assert status["config_in_effect"] == config(ids="3")
    program.send("run 1")
    program.write_config(ids="0")
    status = program.wait_applied(ids="0")
    assert status["config_problem"] is None
    program.send("run 1")
    assert program.stop() == 0
    assert len(program.lines("WARNING")) == 1, program.stderr
    rounds = round_dirs(program.root)
    assert {r["Op Id"] for r in read_csv(rounds[0] / "statistic.csv")} == {"3"}
    assert {r["Op Id"] for r in read_csv(rounds[1] / "statistic.csv")} == {"0"}


def test_sleep_wake_cycles_and_deletion_print_the_wake_message_once(program):
    for step in ("on", "off", "on", "delete", "on"):
        if step == "delete":
            program.config_path.unlink()
            wait_until(lambda: program.status()["state"] == "sleeping", 5, "sleep after deletion")
            assert program.status()["config_in_effect"] is None
            assert program.send("run 2") is False
            continue
        enable = step == "on"
        program.write_config(dump_enable=enable, ids="3")
        program.wait_applied(dump_enable=enable, ids="3")
        assert program.send("run 1") is enable
    assert program.stop() == 0
    assert len(program.lines(WAKE)) == 1
    assert program.lines("was removed; the probe goes back to sleep")
    # Only the calls made while awake were rounds; all three were dumped.
    assert program.status()["rounds_started"] == 3
    assert sorted(round_dirs(program.root)) == [0, 1, 2]


def test_going_to_sleep_unpatches_the_model_while_threads_keep_calling_it(program):
    program.write_config(exec_range="none")
    program.wait_applied(exec_range="none")
    program.send("spin 3 0")
    wait_until(lambda: program.status()["rounds_started"] > 20, 10, "rounds from 3 threads")
    program.write_config(dump_enable=False)
    program.wait_applied(dump_enable=False)
    wait_until(lambda: program.send("noop") is False, 2, "the original nn.Module.__call__")
    counted = program.status()["rounds_started"]
    calls = program.calls()
    wait_until(lambda: program.calls() > calls + 30, 10, "more calls from the threads")
    # A new configuration in effect means the status was rewritten after those calls.
    program.write_config(dump_enable=False, ids="1")
    assert program.wait_applied(dump_enable=False, ids="1")["rounds_started"] == counted
    program.send("stop")
    assert program.stop() == 0


def test_every_round_is_dumped_under_one_config_while_threads_run_and_configs_flip(program):
    # Two configs that differ in what a round writes at its start (op 0) and at its end (op 3)
    # and in how (tensor files vs statistics): a round that changed config half-way would show.
    configs = [dict(ids="0", task="tensor"), dict(ids="3", task="statistics")]
    program.write_config(**configs[0])
    program.wait_applied(**configs[0])
    program.send("spin 3 0.002")
    for flip in range(6):
        dumped = program.status()["rounds_dumped"]
        wait_until(lambda: program.status()["rounds_dumped"] >= dumped + 5, 10,
                   "rounds dumped under this config")
        program.write_config(**configs[(flip + 1) % 2])
        program.wait_applied(**configs[(flip + 1) % 2])
    program.send("stop")
    assert program.stop() == 0
    rounds = round_dirs(program.root)
    # Each op has one input and one output; all rows from one config, all from this round.
    seen = count_rounds_by_config(rounds, "0", "3")
    assert seen["0"] >= 15 and seen["3"] >= 15, seen


def test_sigterm_while_threads_dump_flushes_and_reports_exited(program):
    # The program has no SIGTERM handler of its own: the probe's flushes, then the process dies
    # of SIGTERM as it would have.
    program.write_config(ids="0")
    program.wait_applied(ids="0")
    program.send("spin 2 0")
    wait_until(lambda: program.status()["rounds_dumped"] > 50, 10, "rounds being dumped")
    assert program.stop(signal.SIGTERM) == -signal.SIGTERM
    final = program.status()
    assert final["exited"] is True and final["bytes_queued"] == 0, final
    assert final["last_error"] is None
    rounds = round_dirs(program.root)
    assert len(rounds) >= 50
    partial = []
    for index, folder in rounds.items():
        csv_path = folder / "statistic.csv"
        rows = read_csv(csv_path) if csv_path.exists() else []
        assert all(r["Op Id"] == "0" and os.path.getsize(r["Tensor Path"]) > 0 for r in rows)
        if len(rows) != 2:
            partial.append(index)
    # Only the rounds running when the signal came (one per thread) may be incomplete.
    assert len(partial) <= 2, partial
