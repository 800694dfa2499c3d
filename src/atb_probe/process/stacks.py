"""Every thread's stack, looked at without hanging the process.

`sys._current_frames()` holds the interpreter's list of threads while it makes the frame
objects it returns. Up to Python 3.11, a garbage collection that starts on one of those
allocations and frees a `threading.local` waits for that same list, and the process hangs for
good (CPython gh-106883, fixed in 3.12). The collector is held off for the call instead.
"""
from __future__ import annotations

import gc
import sys


def current_frames() -> dict:
    """`sys._current_frames()`: {thread ident: its topmost frame}, with no collection inside."""
    if not gc.isenabled():
        return sys._current_frames()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        gc.enable()
