"""`atb-probe status` as a user reads it (SPEC §4): each process's role in the run, "waiting"
until a selected round has run (exit 4) rather than a COMPLETE that means nothing yet, old
launches left out with `--since`, and a multiprocessing child that ends (also on SIGTERM, through
a handler of its own as vLLM's processes have) read as a normal stop. Real processes started
through the load script."""
from __future__ import annotations

import json

import pytest

from atb_probe.tools.status import unfinished

from harness import cli, config, run_loaded, status_docs, wait_until
from test_live_config import Program


@pytest.fixture
def program(tmp_path):
    prog = Program(tmp_path)
    yield prog
    prog.kill()


def status(root, *args):
    return cli("status", *args, root, timeout=60)


def settled(program, rounds_dumped: int) -> None:
    wait_until(lambda: (lambda s: s["rounds_dumped"] == rounds_dumped and not unfinished(s))(
        program.status()), 10, f"{rounds_dumped} rounds dumped and on disk")


def test_status_waits_until_a_selected_round_has_run_and_only_then_says_complete(program):
    program.write_config(task="statistics", exec_range="0,1")
    program.wait_applied(task="statistics", exec_range="0,1")
    before = status(program.root)
    assert before.returncode == 4, before.stdout
    assert "WAITING: no selected round has run yet" in before.stdout
    assert "COMPLETE" not in before.stdout
    assert " no model " in before.stdout and " worker " not in before.stdout

    program.send("run 2")
    settled(program, 2)
    after = status(program.root)
    assert after.returncode == 0 and "COMPLETE" in after.stdout, after.stdout
    assert " worker " in after.stdout and " dumping " in after.stdout
    assert program.status()["role"] == "worker"

    # A new selection waits for its own rounds, whatever was dumped before it.
    program.write_config(task="statistics", exec_range="3,3")
    program.wait_applied(task="statistics", exec_range="3,3")
    assert status(program.root).returncode == 4
    program.send("run 2")
    settled(program, 3)
    assert status(program.root).returncode == 0

    # Only rounds that have passed: nothing more can come, so there is nothing to wait for.
    program.write_config(task="statistics", exec_range="0,1")
    program.wait_applied(task="statistics", exec_range="0,1")
    shown = status(program.root, "--json")
    assert shown.returncode == 0
    assert json.loads(shown.stdout)["finding"] == "complete"


def test_status_of_a_sleeping_process_is_complete(program):
    program.write_config(dump_enable=False)
    program.wait_applied(dump_enable=False)
    shown = status(program.root)
    assert shown.returncode == 0 and "COMPLETE" in shown.stdout, shown.stdout


CHILDREN = r"""
import multiprocessing as mp, signal, sys, time
import torch
from torch import nn

def child(ready, wait_for_sigterm):
    def stop(signum, frame):   # as vLLM's engine core and workers do
        raise SystemExit()
    signal.signal(signal.SIGTERM, stop)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model(torch.ones(1, 4))
    ready.set()
    while wait_for_sigterm:
        time.sleep(0.05)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    for wait_for_sigterm in (False, True):
        ready = ctx.Event()
        proc = ctx.Process(target=child, args=(ready, wait_for_sigterm))
        proc.start()
        assert ready.wait(120)
        if wait_for_sigterm:
            proc.terminate()
        proc.join(120)
        print("child", proc.pid, proc.exitcode, flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_multiprocessing_children_end_as_normal_stops_and_only_they_are_workers(tmp_path, method):
    (tmp_path / "children.py").write_text(CHILDREN)
    result = run_loaded(tmp_path, f"""
        import runpy, sys
        sys.argv = ["children.py", {method!r}]
        runpy.run_path({str(tmp_path / "children.py")!r}, run_name="__main__")
        """, config(task="statistics", exec_range="all"))
    assert result.returncode == 0, result.stderr
    children = {int(line.split()[1]) for line in result.stdout.splitlines()
                if line.startswith("child")}
    assert len(children) == 2
    docs = {d["pid"]: d for d in status_docs(tmp_path / "atb_dump_data")}
    for pid in children:
        assert docs[pid]["exited"] is True and docs[pid]["role"] == "worker", docs[pid]
        assert docs[pid]["rounds_dumped"] == 1
    parents = [d for pid, d in docs.items() if pid not in children]
    assert [d["role"] for d in parents] == ["no model"]
    shown = status(tmp_path)
    assert shown.returncode == 0, shown.stdout
    assert "killed" not in shown.stdout and " gone " not in shown.stdout, shown.stdout


def test_since_leaves_out_an_earlier_launch_that_failed_before_any_config(tmp_path):
    failed = run_loaded(tmp_path, "import torch\nraise SystemExit('no model here')")
    assert failed.returncode == 1
    first = status_docs(tmp_path / "atb_dump_data")
    assert len(first) == 1 and first[0]["config_in_effect"] is None
    ran = run_loaded(tmp_path, """
        import torch
        from torch import nn
        with torch.no_grad():
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))(torch.ones(1, 4))
        """, config(task="statistics", exec_range="all"))
    assert ran.returncode == 0, ran.stderr
    everything = status(tmp_path)
    assert "no config yet" in everything.stdout
    recent = status(tmp_path, "--since", first[0]["updated_at"])
    assert recent.returncode == 0, recent.stdout
    assert "no config yet" not in recent.stdout and recent.stdout.count(" exited ") == 1
    assert status(tmp_path, "--since", "1h").stdout.count(" exited ") == 2
    refused = status(tmp_path, "--since", "yesterday")
    assert refused.returncode == 2 and "neither a time" in refused.stderr
