"""The config file, read when it changes (SPEC §3, §4).

`ConfigWatcher.poll` is called by the probe's background thread (a `stat` every poll; no per-op
work). The file is read when its stat signature changes, and also on every poll while its mtime
is less than `RACY_SECONDS` old: two saves within one file-system timestamp tick that keep the
size would otherwise look like one. A new usable configuration is handed to `apply`; a removed
file hands over None (the probe goes back to sleep). A file that does not parse is not used (the
last good configuration stays) and `problem` says why; the warning waits for the next poll, so
an editor caught between truncating and writing the file causes no warning at all.

All state here is touched by one thread at a time: the probe's start, then its background
thread, and any other caller of `Probe.poll_config` (which holds a lock for the poll).
"""
from __future__ import annotations

import os
import time
from typing import Callable

from .. import log
from ..config import ConfigFileError, DumpConfig, parse_config, read_config_file

RACY_SECONDS = 2.0
_UNSEEN = object()  # the config file has not been looked at yet


class ConfigWatcher:
    """Watches one config file; hands each new configuration (or None) to `apply`."""

    def __init__(self, path: str, apply: Callable[[DumpConfig | None], None],
                 notify: Callable[[], None]):
        self.path = path
        self.problem: str | None = None  # why the file on disk is not the one in effect
        self._apply = apply
        self._notify = notify            # something the status file shows has changed
        self._sig: object = _UNSEEN
        self._text: str | None = None
        self._pending: str | None = None  # a problem to warn about if it is still there next poll
        self._applied: DumpConfig | None = None
        self._handed_over = False

    def poll(self) -> None:
        """Apply the config file if it changed (or appeared, or vanished) since last time."""
        path = self.path
        try:
            st = os.stat(path)
            sig = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)
        except FileNotFoundError:
            sig = None
        except OSError as exc:
            sig = ("error", str(exc))
        if sig is None:
            if self._sig is not None:
                self._sig, self._text, self._pending = None, None, None
                self._gone()
            return
        racy = sig[0] != "error" and time.time_ns() - sig[0] < RACY_SECONDS * 1e9
        if sig == self._sig and not racy:
            self._warn_pending()
            return
        try:
            text = read_config_file(path)
        except (ConfigFileError, OSError) as exc:
            message = f"{exc}; keeping the last good configuration"
            if sig == self._sig and message == self.problem:
                self._warn_pending()
                return
            self._sig, self._text = sig, None
            self._invalid(message)
            return
        if text is None:  # removed between the stat and the read
            self._sig, self._text, self._pending = None, None, None
            self._gone()
            return
        if sig == self._sig and text == self._text:
            self._warn_pending()
            return
        self._sig, self._text = sig, text
        config, warnings = parse_config(text)
        if config is None:
            self._invalid(f"config {path}: {warnings[0] if warnings else 'unusable'}")
            return
        self._pending = self.problem = None
        for w in warnings:
            log.warn(f"config {path}: {w}")
        if self._handed_over and config == self._applied:
            self._notify()  # the same configuration saved again: nothing to apply
            return
        self._hand_over(config)

    def _hand_over(self, config: DumpConfig | None) -> None:
        self._applied, self._handed_over = config, True
        self._apply(config)

    def _gone(self) -> None:
        self.problem = None
        if self._applied is not None and self._applied.dump_enable:
            log.info(f"config {self.path} was removed; the probe goes back to sleep")
        if self._applied is not None or not self._handed_over:
            self._hand_over(None)

    def _invalid(self, message: str) -> None:
        """An unusable file: keep the last good config; warn unless it changes by the next poll
        (an editor half-way through saving)."""
        self._pending = self.problem = message
        self._notify()

    def _warn_pending(self) -> None:
        if self._pending is not None:
            log.warn(self._pending)
            self._pending = None
