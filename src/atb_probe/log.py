"""The probe's messages: one clear line each on stderr, never an exception into the host.

`warn_once` and `error_once` say a thing the first time its key is seen: in this process, or
within the `seen` set of one owner (a probe, a writer) that should say it again when a new one
starts. `_lock` guards every such set.
"""
from __future__ import annotations

import sys
import threading

PREFIX = "[atb-probe]"
_seen: set[str] = set()
_lock = threading.Lock()


def info(message: str) -> None:
    _emit(f"{PREFIX} {message}")


def say_verbatim(line: str) -> None:
    """A line without our prefix: the messages the original tool prints word for word."""
    _emit(line)


def warn(message: str) -> None:
    _emit(f"{PREFIX} WARNING: {message}")


def error(message: str) -> None:
    _emit(f"{PREFIX} ERROR: {message}")


def warn_once(key: str, message: str, seen: set[str] | None = None) -> None:
    """Warn the first time `key` is seen (in this process, or in `seen`)."""
    if _first(key, seen):
        warn(message)


def error_once(key: str, message: str, seen: set[str] | None = None) -> None:
    """Report an error the first time `key` is seen (in this process, or in `seen`)."""
    if _first(key, seen):
        error(message)


def _first(key: str, seen: set[str] | None) -> bool:
    keys = _seen if seen is None else seen
    with _lock:
        if key in keys:
            return False
        keys.add(key)
    return True


def _emit(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not break the host program
        pass
