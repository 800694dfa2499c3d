"""The probe of one process: configuration, sleeping and waking, rounds, device, status, exit.

All of the process's probe state lives in the `Probe` object. A background thread watches the
config file (a `stat` every `POLL_SECONDS`; no per-op work) and publishes each new configuration
as an immutable `Selection`; a round reads it once, when it starts, so every round is dumped
under one configuration (SPEC §4). The same thread keeps the status file up to date.

This module does not import torch; the torch adapter (`capture/`) is imported when the probe
attaches, which happens when the host program imports torch.
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import os
import signal
import threading
import time

from . import log
from .config import ConfigFileError, DumpConfig, parse_config, read_config_file
from .record.safefs import SafeTree
from .record.writer import Writer
from .selection import Selection

POLL_SECONDS = 0.2
STATUS_MIN_INTERVAL = 0.25
WAKE_MESSAGE = "Ready to dump ATB data, the running speed of the model will be affected"
DUMP_DIR = "atb_dump_data"


def _exit_timeout() -> float:
    try:
        return float(os.environ.get("ATB_PROBE_EXIT_TIMEOUT", "60"))
    except ValueError:
        return 60.0


class Probe:
    """Everything the probe knows and does in this process."""

    def __init__(self, output: str, config_path: str | None = None,
                 config: DumpConfig | dict | None = None):
        self.output = os.path.abspath(output)
        self.config_path = os.path.abspath(config_path) if config_path else None
        self.tree = SafeTree(os.path.join(self.output, DUMP_DIR))
        self.writer = Writer(self.tree)
        self.config: DumpConfig | None = None
        self.selection: Selection | None = None
        self.pid = os.getpid()
        self.device: int | None = None
        self.devpid = f"{_env_device()}_{self.pid}"
        self.rounds_dumped = 0
        self.woken = False
        self.engine = None
        self._fixed_config = config
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file_sig = None
        self._status_last: tuple | None = None
        self._status_time = 0.0
        self._status_name: str | None = None
        self._status_lock = threading.RLock()  # one status write at a time, none mid-rename
        self._errors: set[str] = set()
        self.last_error: str | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Attach: read the config once now (so it governs the very first round), then watch."""
        from .capture.calltree import Engine
        self.engine = Engine(self)
        if self._fixed_config is not None:
            cfg = self._fixed_config
            if isinstance(cfg, dict):
                import json
                cfg, warnings = parse_config(json.dumps(cfg))
                for w in warnings:
                    log.warn(f"config: {w}")
            self._apply(cfg)
        else:
            self.poll_config()
        self._thread = threading.Thread(target=self._watch, name="atb-probe-watch", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        _register_fork_handler(self)
        _install_sigterm(self)

    def close(self, timeout: float | None = None) -> bool:
        """Detach: stop capturing, flush what is queued (bounded), write the final status."""
        if self._closed:
            return True
        self._closed = True
        self._stop.set()
        if self.engine is not None:
            self.engine.uninstall(force=True)
        done = self.writer.close(_exit_timeout() if timeout is None else timeout)
        if not done:
            self.last_error = (f"exit timeout: {self.writer.pending()} bytes still queued were "
                               "not written")
            log.error(self.last_error)
        self.write_status(final=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        return done

    # -- configuration ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                if self._fixed_config is None:
                    self.poll_config()
                self.write_status()
            except Exception as exc:
                self.report(exc)

    def poll_config(self) -> None:
        """Re-read the config file if it changed (or appeared, or vanished) since last time."""
        path = self.config_path
        if path is None:
            return
        try:
            st = os.stat(path)
            sig = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)
        except FileNotFoundError:
            sig = None
        except OSError as exc:
            sig = ("error", str(exc))
        if sig == self._file_sig:
            return
        self._file_sig = sig
        if sig is None:
            if self.config is not None and self.config.dump_enable:
                log.info(f"config {path} was removed; the probe goes back to sleep")
            self._apply(None)
            return
        try:
            text = read_config_file(path)
        except (ConfigFileError, OSError) as exc:
            log.warn(f"{exc}; keeping the last good configuration")
            return
        if text is None:
            self._apply(None)
            return
        config, warnings = parse_config(text)
        for w in warnings:
            log.warn(f"config {path}: {w}")
        if config is not None:
            self._apply(config)

    def _apply(self, config: DumpConfig | None) -> None:
        self.config = config
        self.selection = Selection(config) if config is not None else None
        if config is not None and config.dump_enable:
            if not self.woken:
                self.woken = True
                log._emit(WAKE_MESSAGE)
                try:
                    self.tree.makedirs("data")
                except OSError as exc:
                    self.report(exc)
            self.engine.install()
        elif self.engine is not None:
            self.engine.uninstall()
        self.write_status()

    # -- rounds and device ------------------------------------------------------------------

    def next_round(self) -> int:
        return next(self._rounds)

    def round_dumped(self) -> None:
        with self._lock:
            self.rounds_dumped += 1

    def decide_device(self, module, args, kwargs) -> int:
        """The device ID of this process, decided at its first round (SPEC §1)."""
        if self.device is not None:
            return self.device
        from .capture.device import device_id
        device = device_id(module, args, kwargs)
        with self._lock:
            if self.device is None:
                with self._status_lock:
                    self.device = device
                    old = self.devpid
                    self.devpid = f"{device}_{self.pid}"
                    if old != self.devpid and self._status_name:
                        self._remove_status(self._status_name)
        return self.device

    # -- errors and status ------------------------------------------------------------------

    def report(self, exc: BaseException) -> None:
        """A probe error: reported once per kind and place; the host program goes on."""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename.rpartition('/')[2]}:{tb.tb_lineno}" if tb \
            else "?"
        key = f"{type(exc).__name__}@{where}"
        self.last_error = f"{type(exc).__name__}: {exc} ({where})"
        if key not in self._errors:
            self._errors.add(key)
            log.error(f"internal error, the model goes on: {self.last_error}")

    def status(self) -> dict:
        stats = self.writer.stats
        awake = self.config is not None and self.config.dump_enable
        return {
            "pid": self.pid,
            "device": self.device if self.device is not None else _env_device(),
            "state": "dumping" if awake else "sleeping",
            "rounds_dumped": self.rounds_dumped,
            "files_written": stats.files_written,
            "bytes_written": stats.bytes_written,
            "bytes_queued": max(0, stats.bytes_queued),
            "files_skipped": stats.files_skipped,
            "last_error": stats.last_error or self.last_error,
            "exited": False,
            "output": self.output,
            "config": self.config_path,
        }

    def write_status(self, final: bool = False) -> None:
        with self._status_lock:
            self._write_status(final)

    def _write_status(self, final: bool) -> None:
        doc = self.status()
        if final:
            doc["exited"] = True
        key = tuple(doc.items())
        now = time.monotonic()
        if not final and key == self._status_last:
            return
        if not final and now - self._status_time < STATUS_MIN_INTERVAL and \
                self._status_last is not None and \
                dict(self._status_last).get("state") == doc["state"]:
            return
        doc["updated_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="milliseconds")
        name = f"{self.devpid}.json"
        try:
            import json
            self.tree.write_file("status", name, [json.dumps(doc, indent=2).encode()])
            self._status_last, self._status_time, self._status_name = key, now, name
        except OSError as exc:
            log.warn_once("status-write", f"cannot write the status file: {exc}")

    def _remove_status(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.tree.root, "status", name))
        except OSError:
            pass
        self._status_last = None

    # -- fork -------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """A forked child is a new process: its own folder, queue and threads."""
        self.pid = os.getpid()
        self.devpid = f"{self.device if self.device is not None else _env_device()}_{self.pid}"
        self.writer.reset_after_fork()
        self.tree = self.writer.tree = SafeTree(self.tree.root)
        self.rounds_dumped = 0
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._status_last = None
        self._status_name = None
        self._status_lock = threading.RLock()
        if self.engine is not None:
            self.engine.after_fork()
        self._thread = threading.Thread(target=self._watch, name="atb-probe-watch", daemon=True)
        self._thread.start()


def _env_device() -> int:
    raw = os.environ.get("LOCAL_RANK", "")
    return int(raw) if raw.isdecimal() else 0


_current: list[Probe] = []


def _register_fork_handler(probe: Probe) -> None:
    if not _current:
        os.register_at_fork(after_in_child=lambda: [p.after_fork_in_child() for p in _current
                                                    if not p._closed])
    _current.append(probe)


def _install_sigterm(probe: Probe) -> None:
    """Flush on SIGTERM when the host has no handler of its own, then die as SIGTERM would."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum, frame):
            probe.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass
