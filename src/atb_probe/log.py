"""The probe's messages: one clear line each on stderr, never an exception into the host."""
from __future__ import annotations

import sys
import threading

PREFIX = "[atb-probe]"
_seen: set[str] = set()
_lock = threading.Lock()


def info(message: str) -> None:
    _emit(f"{PREFIX} {message}")


def warn(message: str) -> None:
    _emit(f"{PREFIX} WARNING: {message}")


def error(message: str) -> None:
    _emit(f"{PREFIX} ERROR: {message}")


def warn_once(key: str, message: str) -> None:
    """Warn the first time `key` is seen in this process."""
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    warn(message)


def _emit(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not break the host program
        pass
