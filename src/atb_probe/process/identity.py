"""Which process this is: its provisional device ID and its start time."""
from __future__ import annotations

import os


def local_rank() -> int:
    """`LOCAL_RANK` from the environment (set per process by torchrun), else 0."""
    raw = os.environ.get("LOCAL_RANK", "")
    return int(raw) if raw.isdecimal() else 0


def proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None elsewhere: with the pid,
    it tells a live process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
