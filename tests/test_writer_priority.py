"""The writer thread yields the cores to the model's threads: it runs at nice 19 (Linux), the
model's threads keep their priority, and `ATB_PROBE_WRITER_NICE` chooses another value or none.

Measured in a real process started through the load script: the script dumps a round of a tiny
model and prints each thread's nice value, read from the kernel (`os.getpriority` of its ID)."""
from __future__ import annotations

import json
import os
import shlex
import sys
import threading

import pytest

from atb_probe.record.jobs import JsonJob, TensorFileJob
from atb_probe.record.safefs import SafeTree
from atb_probe.record.writer import Writer
from harness import ONE_ROUND_SCRIPT, clean_env, config, loaded, run_shell, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a thread's own nice value is Linux's")

# After the flush (which hands the writer to a thread at the process's priority while it
# waits), the script waits until the writer has yielded the cores again, or 30 s: a writer
# that never does is seen at the process's priority.
SCRIPT = ONE_ROUND_SCRIPT + """
expected = int(os.environ.get("EXPECTED_WRITER_NICE", "19"))
deadline = time.monotonic() + 30
while True:
    nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
            if t.is_alive()}
    writers = [t for t in threading.enumerate() if t.name == "atb-probe-writer"]
    if len(writers) == 1 and nice.get("atb-probe-writer") == expected or \
            time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(json.dumps(nice))
"""


def _nice_by_thread(tmp, prefix: str = "", **env: str) -> dict:
    """Each thread's nice value in `prefix python SCRIPT` (e.g. `nice -n 5`), started through the
    load script with `env` (EXPECTED_WRITER_NICE: what the script waits for the writer to
    take); the round must be dumped without a warning."""
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
    nice = _nice_by_thread(tmp_path, ATB_PROBE_WRITER_NICE=value,
                           EXPECTED_WRITER_NICE=str(expected))
    assert nice["atb-probe-writer"] == expected and nice["MainThread"] == 0


def test_a_niced_process_keeps_its_priority_and_its_writer_still_yields(tmp_path):
    nice = _nice_by_thread(tmp_path / "asked-5", "nice -n 12", ATB_PROBE_WRITER_NICE="5",
                           EXPECTED_WRITER_NICE="12")
    assert nice["MainThread"] == 12 and nice["atb-probe-writer"] == 12  # never raised
    nice = _nice_by_thread(tmp_path / "default", "nice -n 12")
    assert nice["MainThread"] == 12 and nice["atb-probe-writer"] == 19


class _Gate:
    """A job's `ready` that holds the writer in the job until it is opened."""

    def __init__(self):
        self.entered, self.opened = threading.Event(), threading.Event()

    def wait(self):
        self.entered.set()
        assert self.opened.wait(60)


def _writer_threads() -> dict:
    return {t.native_id: os.getpriority(os.PRIO_PROCESS, t.native_id)
            for t in threading.enumerate() if t.name == "atb-probe-writer" and t.is_alive()}


def test_a_thread_waiting_for_the_writer_gets_one_at_its_own_priority(tmp_path, monkeypatch):
    """While a flush waits, the writer's work goes to a new thread at the process's priority;
    the yielding one finishes the job it was in first (one thread writes at a time), then
    ends; once nothing waits, the writer yields the cores again."""
    monkeypatch.delenv("ATB_PROBE_WRITER_NICE", raising=False)
    writer = Writer(SafeTree(str(tmp_path)), min_free=0)
    gate = _Gate()
    writer.put(TensorFileJob("d", "first.bin", [b"x" * 1000], 1000, ready=gate))
    writer.put(JsonJob("d", "second.json", {"after": "first"}))
    assert gate.entered.wait(30)
    wait_until(lambda: list(_writer_threads().values()) == [19], 30, "the writer yielding")
    flushed = []
    flusher = threading.Thread(target=lambda: flushed.append(writer.flush(60)))
    flusher.start()
    wait_until(lambda: sorted(_writer_threads().values()) == [0, 19], 30,
               "a second writer thread, at the process's priority, beside the busy one")
    assert not (tmp_path / "d" / "second.json").exists()  # it waits for the first job
    gate.opened.set()
    flusher.join(60)
    assert flushed == [True]
    assert (tmp_path / "d" / "first.bin").read_bytes() == b"x" * 1000
    assert json.loads((tmp_path / "d" / "second.json").read_text()) == {"after": "first"}
    wait_until(lambda: list(_writer_threads().values()) == [19], 30,
               "one writer thread, yielding again")
    assert writer.close(30)


def test_a_flush_with_nothing_queued_leaves_the_yielding_writer_alone(tmp_path, monkeypatch):
    """Nothing to wait for: the flush returns at once and no thread at the process's priority
    is started for it (disabling a probe whose files are on disk flushes again)."""
    monkeypatch.delenv("ATB_PROBE_WRITER_NICE", raising=False)
    writer = Writer(SafeTree(str(tmp_path)), min_free=0)
    writer.put(JsonJob("d", "doc.json", {"n": 1}))
    assert writer.flush(60)
    assert json.loads((tmp_path / "d" / "doc.json").read_text()) == {"n": 1}
    wait_until(lambda: list(_writer_threads().values()) == [19], 30,
               "one writer thread, yielding again")
    before = [t for t in threading.enumerate() if t.name == "atb-probe-writer"]
    assert writer.flush(60)
    after = [t for t in threading.enumerate() if t.name == "atb-probe-writer"]
    assert after == before and list(_writer_threads().values()) == [19]
    assert writer.close(30)
