"""The probe's threads under names of their own where the system shows a thread's name.

On Linux a thread shows its process's name (`python`, or what a serving engine calls its
worker, `VLLM::Worker`) in `top -H`, `ps -L`, `/proc/PID/task/TID/comm`, py-spy and perf,
unless it names itself. Python gives its threads names only inside Python before 3.14, so
the probe's writer, watcher and landing threads, and its writer process, would be counted as
the model's. Each names itself when it starts: the Python name, `atb-probe-` shortened to
`atb-`, cut at Linux's 15 bytes (`atb-writer`, `atb-watch`, `atb-landing`, `atb-exit`,
`atb-spawn`; the writer process `atb-writer-proc`).
"""
from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl(2)
_MAX_BYTES = 15    # TASK_COMM_LEN less the NUL
_libc = None


def system_name(name: str) -> bytes:
    """What the system shows for a thread named `name` in Python."""
    if name.startswith("atb-probe-"):
        name = "atb-" + name[len("atb-probe-"):]
    return name.encode("ascii", "replace")[:_MAX_BYTES]


def name_this_thread(name: str | None = None) -> None:
    """Show the calling thread under `name` (default: its Python name) where the system shows
    thread names (Linux); nothing elsewhere, or where the C library cannot be reached."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(
            system_name(threading.current_thread().name if name is None else name)), 0, 0, 0)
    except (OSError, AttributeError):
        pass
