"""The probe enabled while a forward runs (in this thread or another): the rest of that call is
not a round, the next call of the model is round 0, whole (calltree.py, `_joined_mid_call`)."""
from __future__ import annotations

import sys
import textwrap
import threading

import torch
from torch import nn

import atb_probe

from harness import config, run


class Outer(nn.Module):
    """Two linears with a pause between them, where `between()` runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.between = lambda: None

    def forward(self, x):
        x = self.a(x)
        self.between()
        return self.b(x)


def rounds_written(out) -> dict[str, list[str]]:
    """{round: its op folders} of every round on disk."""
    return {r.name: sorted(p.name for p in r.iterdir() if p.is_dir())
            for r in sorted((out / "atb_dump_data" / "data").glob("*/*"))}


def test_enabled_inside_a_forward_the_rest_of_it_is_no_round(tmp_path):
    model, x = Outer().eval(), torch.ones(1, 4)
    model.between = lambda: atb_probe.enable(str(tmp_path), config(exec_range="all"))
    try:
        with torch.no_grad():
            model(x)  # the probe wakes between a and b: b is no round of its own
            model.between = lambda: None
            model(x)
        assert atb_probe.active().rounds_started == 1
    finally:
        assert atb_probe.disable(timeout=30)
    assert rounds_written(tmp_path) == {"0": ["0_Linear", "1_Linear"]}


def test_a_forward_running_in_another_thread_at_enable_is_no_round_until_it_ends(tmp_path):
    model, x = Outer().eval(), torch.ones(1, 4)
    inside, go = threading.Event(), threading.Event()
    calls = [0]

    def between():
        calls[0] += 1
        if calls[0] == 1:
            inside.set()
            assert go.wait(60)

    model.between = between
    failures = []

    def run():
        try:
            with torch.no_grad():
                model(x)  # began before the probe: its b is no round
                model(x)  # began after: round 0, whole
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert inside.wait(60)
        atb_probe.enable(str(tmp_path), config(exec_range="all"))
        go.set()
        worker.join(60)
        assert not worker.is_alive() and not failures, failures
        assert atb_probe.active().rounds_started == 1
    finally:
        go.set()
        assert atb_probe.disable(timeout=30)
    assert rounds_written(tmp_path) == {"0": ["0_Linear", "1_Linear"]}


def test_looking_at_every_threads_stack_survives_a_collection_inside_it():
    """The wake-up's look at every thread's stack (for the module calls begun before it) holds
    the garbage collector off: up to Python 3.11 a collection starting inside
    `sys._current_frames` that frees a `threading.local` hangs the process for good (CPython
    gh-106883; the script, with the call made directly, hangs there)."""
    script = textwrap.dedent("""
        import gc, sys, threading
        from atb_probe.process.stacks import current_frames

        class Litter:  # cyclic garbage holding thread-local data
            pass

        def litter():
            for _ in range(50):
                item = Litter()
                item.local, item.me = threading.local(), item
                item.local.x = 1

        gc.collect()
        litter()
        spare = {}
        del spare  # the dict it returns comes from the free list, so the first collection
        gc.set_threshold(1)  # starts where it makes a frame object: inside
        frames = current_frames()
        gc.set_threshold(700)
        print("done", threading.get_ident() in frames, gc.isenabled(), "torch" in sys.modules)
    """)
    result = run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["done", "True", "True", "False"]
