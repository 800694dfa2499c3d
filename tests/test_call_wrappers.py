"""Another tool that wraps `nn.Module.__call__` too (a profiler, a tracer), before or after the
probe: both keep working, and the probe's uninstall never removes the other's wrapper
(docs/design.md, "Why `__call__` is patched")."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import atb_probe

from harness import config


class OtherTool:
    """A wrapper of `nn.Module.__call__` as other tools install one: it keeps what it found and
    puts it back when it is removed."""

    def __init__(self):
        self.seen: list[str] = []
        self.inner = None

    def install(self) -> None:
        inner = self.inner = nn.Module.__call__
        seen = self.seen

        def wrapped(module, *args, **kwargs):
            seen.append(type(module).__name__)
            return inner(module, *args, **kwargs)

        self.wrapper = wrapped
        nn.Module.__call__ = wrapped

    def remove(self) -> None:
        nn.Module.__call__ = self.inner


@pytest.fixture
def other():
    original = nn.Module.__call__
    tool = OtherTool()
    yield tool
    atb_probe.disable()
    nn.Module.__call__ = original  # whatever the test left behind


def model_and_input():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval(), torch.ones(1, 4)


CALLS_PER_RUN = ["Sequential", "Linear", "ReLU", "Linear"]


def layer_dirs(out) -> list[str]:
    rounds = sorted((out / "atb_dump_data" / "data").glob("*/0"))
    assert len(rounds) == 1
    return sorted(p.name for p in rounds[0].iterdir() if p.is_dir())


def test_a_wrapper_installed_before_the_probe_sees_every_call_and_is_back_after_disable(
        tmp_path, other):
    model, x = model_and_input()
    expected = model(x)
    other.install()
    atb_probe.enable(str(tmp_path), config(exec_range="all"))
    with torch.no_grad():
        got = model(x)
    assert atb_probe.disable(timeout=30)
    assert torch.equal(got, expected)
    assert other.seen == CALLS_PER_RUN
    assert layer_dirs(tmp_path) == ["0_Linear", "1_ReLU", "2_Linear"]
    assert nn.Module.__call__ is other.wrapper
    other.seen.clear()
    model(x)
    assert other.seen == CALLS_PER_RUN


def test_a_wrapper_installed_over_the_probe_is_left_in_place_by_disable(tmp_path, other):
    model, x = model_and_input()
    expected = model(x)
    atb_probe.enable(str(tmp_path), config(exec_range="all"))
    other.install()
    with torch.no_grad():
        got = model(x)
    assert other.seen == CALLS_PER_RUN
    assert atb_probe.disable(timeout=30)
    assert torch.equal(got, expected)
    assert layer_dirs(tmp_path) == ["0_Linear", "1_ReLU", "2_Linear"]
    assert nn.Module.__call__ is other.wrapper  # not replaced by what the probe found
    assert torch.equal(model(x), expected)


def test_a_disabled_probe_under_another_wrapper_takes_no_part_in_later_calls(tmp_path, other):
    model, x = model_and_input()
    probe = atb_probe.enable(str(tmp_path), config(exec_range="all"))
    other.install()
    model(x)
    assert atb_probe.disable(timeout=30)
    counted = probe.rounds_started
    other.seen.clear()
    model(x)
    assert (other.seen, probe.rounds_started) == (CALLS_PER_RUN, counted)


def test_a_disabled_probe_steps_out_once_the_wrapper_above_it_is_removed(tmp_path, other):
    model, x = model_and_input()
    original = nn.Module.__call__
    atb_probe.enable(str(tmp_path), config(exec_range="all"))
    other.install()
    assert atb_probe.disable(timeout=30)
    other.remove()  # puts back what it found: the probe's (now passive) wrapper
    model(x)
    assert nn.Module.__call__ is original


def test_enable_again_under_another_wrapper_dumps_once_per_call(tmp_path, other):
    model, x = model_and_input()
    atb_probe.enable(str(tmp_path / "first"), config(exec_range="all"))
    other.install()
    assert atb_probe.disable(timeout=30)
    probe = atb_probe.enable(str(tmp_path / "second"), config(exec_range="all"))
    other.seen.clear()
    with torch.no_grad():
        model(x)
    assert atb_probe.disable(timeout=30)
    assert other.seen == CALLS_PER_RUN
    assert probe.rounds_started == 1
    assert layer_dirs(tmp_path / "second") == ["0_Linear", "1_ReLU", "2_Linear"]
