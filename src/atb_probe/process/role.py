"""What a process is in a run, as the probe sees it (its `role` in the status file).

A serving engine starts several processes and all of them load the probe, but only some run the
model: vLLM's API server and engine core never do, its worker does. `atb-probe status` names
each one's role, so a user knows whose line counts. Pure: no torch, and the engine is recognised
by the modules already imported, never by importing it.
"""
from __future__ import annotations

import sys

from ..enums import StrEnum

# Packages whose processes run a serving engine: one of them imported here, and no model runs
# in this process, makes it one of the engine's other processes (front end, scheduler).
ENGINE_PACKAGES = ("vllm", "sglang", "vllm_ascend")


class Role(StrEnum):
    """A process's part in the run."""

    WORKER = "worker"       # runs the model: it has started rounds, or holds an engine's runner
    ENGINE = "engine"       # an engine's process that runs no model (vLLM's API server, core)
    NO_MODEL = "no model"   # no model has run here while the probe was awake


def role_of(runs_model: bool) -> Role:
    """The role of this process, given whether a model runs here (`runs_model`)."""
    if runs_model:
        return Role.WORKER
    if any(name in sys.modules for name in ENGINE_PACKAGES):
        return Role.ENGINE
    return Role.NO_MODEL
