"""The probe's threads and its writer process show names of their own where the system shows
names (Linux: `top -H`, `ps`, /proc/PID/task/TID/comm), not the process's (`python`, or a
serving engine's `VLLM::Worker`): a user can tell the probe's CPU time from the model's.

Read from the kernel in a real process started through the load script, which dumps a round
of a tiny model, then prints the names of its threads and of its child processes."""
from __future__ import annotations

import json
import shlex
import sys
import threading

import pytest

from atb_probe.process.threadname import name_this_thread, system_name
from harness import ONE_ROUND_SCRIPT, clean_env, config, loaded, run_shell

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread names in /proc are Linux's")

SCRIPT = ONE_ROUND_SCRIPT + """
def comm(path):
    with open(path) as f:
        return f.read().strip()

threads = []
for tid in os.listdir("/proc/self/task"):
    try:
        threads.append(comm(f"/proc/self/task/{tid}/comm"))
    except OSError:  # a thread that ended since (a writer thread handing over, say)
        pass
threads.sort()
children = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid():
            children.append(comm(f"/proc/{pid}/comm"))
    except (OSError, ValueError, IndexError):
        pass
print(json.dumps({"threads": threads, "children": children}))
"""


def _names(tmp, **env: str) -> dict:
    script = tmp / "user_script.py"
    script.write_text(SCRIPT)
    (tmp / "config.json").write_text(json.dumps(config(task="statistics")))
    command = loaded(shlex.join([sys.executable, str(script)]), tmp, tmp / "config.json")
    result = run_shell(command, tmp, clean_env(**env))
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(tmp.glob("atb_dump_data/data/*/*/statistic.csv")), "nothing was dumped"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_writer_and_watch_threads_show_their_own_names(tmp_path):
    names = _names(tmp_path, ATB_PROBE_WRITER="thread")
    assert "atb-writer" in names["threads"] and "atb-watch" in names["threads"]
    assert "atb-writer-proc" not in names["children"]


def test_the_writer_process_shows_its_own_name(tmp_path):
    names = _names(tmp_path, ATB_PROBE_WRITER="process")
    assert names["children"] == ["atb-writer-proc"]
    assert "atb-watch" in names["threads"]


def _comm_of_a_thread_named(name: str | None, python_name: str) -> str:
    seen = []

    def run():
        name_this_thread(name)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    thread = threading.Thread(target=run, name=python_name)
    thread.start()
    thread.join(30)
    return seen[0]


def test_a_name_is_shortened_to_what_linux_keeps():
    assert _comm_of_a_thread_named(None, "atb-probe-landing") == "atb-landing"
    assert _comm_of_a_thread_named(None, "atb-probe-a-very-long-name") == "atb-a-very-long"
    assert _comm_of_a_thread_named("atb-writer-proc", "anything") == "atb-writer-proc"
    assert system_name("somebody-else's-thread") == b"somebody-else's"
