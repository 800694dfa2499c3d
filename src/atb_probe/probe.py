"""The probe of one process: configuration, sleeping and waking, rounds, device, status, exit.

All of the process's probe state lives in the `Probe` object. A background thread watches the
config file (a `stat` every `POLL_SECONDS`; no per-op work) and publishes each new configuration
as an immutable `Selection`; a round reads it once, when it starts, so every round is dumped
under one configuration (SPEC §4). The same thread keeps the status file up to date: it is
woken at the end of every dumped round, so the file trails the model by a few tens of ms.

The config file is read when its stat signature changes, and also on every poll while its mtime
is less than `RACY_SECONDS` old: two saves within one file-system timestamp tick that keep the
size would otherwise look like one. A file that does not parse is not used (the last good
configuration stays); the warning waits for the next poll, so an editor caught between
truncating and writing the file causes no warning at all.

This module does not import torch; the torch adapter (`capture/`) is imported when the probe
attaches, which happens when the host program imports torch.
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import json
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
STATUS_MIN_INTERVAL = 0.05
RACY_SECONDS = 2.0
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
        self.config_applied_at: str | None = None
        self.config_problem: str | None = None
        self.pid = os.getpid()
        self.device: int | None = None
        self.devpid = f"{_env_device()}_{self.pid}"
        self.rounds_dumped = 0
        self.rounds_started = 0
        self.woken = False
        self.engine = None
        self.started_at = _now()
        self.proc_start = _proc_start(self.pid)
        self.last_error: str | None = None
        self._fixed_config = config
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._file_sig: object = _UNSEEN
        self._file_text: str | None = None
        self._pending_problem: str | None = None
        self._status_lock = threading.RLock()  # one status write at a time, none mid-rename
        self._status_last: dict | None = None
        self._status_name: str | None = None
        self._status_final = False
        self._errors: set[str] = set()
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Attach: read the config once now (so it governs the very first round), then watch."""
        from .capture.calltree import Engine
        self.engine = Engine(self)
        if self._fixed_config is not None:
            cfg = self._fixed_config
            if isinstance(cfg, dict):
                cfg, warnings = parse_config(json.dumps(cfg))
                for w in warnings:
                    log.warn(f"config: {w}")
            self._apply(cfg)
        else:
            self.poll_config()
        self.write_status()
        self._start_thread()
        atexit.register(self.close)
        _register_fork_handler(self)
        _install_sigterm(self)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="atb-probe-watch", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> bool:
        """Detach: stop watching and capturing, flush what is queued (bounded), write the final
        status (`exited: true`)."""
        if self._closed:
            return True
        self._closed = True
        self._stop.set()
        self._kick.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception as exc:
                self.report(exc)
        done = self.writer.close(_exit_timeout() if timeout is None else timeout)
        if not done:
            self.last_error = (f"exit timeout: {self.writer.pending()} bytes still queued were "
                               "not written")
            log.error(self.last_error)
        # A status write blocked on the same stuck disk holds the lock: do not wait for it.
        if self._status_lock.acquire(timeout=2):
            try:
                self.write_status(final=True)
            finally:
                self._status_lock.release()
        return done

    # -- configuration ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            # While data is on its way, look often: "nothing queued" shows soon after it is so.
            busy = self.writer.stats.bytes_queued > 0
            self._kick.wait(STATUS_MIN_INTERVAL if busy else POLL_SECONDS)
            self._kick.clear()
            if self._stop.is_set():
                break
            try:
                if self._fixed_config is None:
                    self.poll_config()
                self.write_status()
            except Exception as exc:
                self.report(exc)
            # Bounds the status rewrites while rounds end in quick succession.
            self._stop.wait(STATUS_MIN_INTERVAL)

    def poll_config(self) -> None:
        """Apply the config file if it changed (or appeared, or vanished) since last time."""
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
        if sig is None:
            if self._file_sig is not None:
                self._file_sig, self._file_text, self._pending_problem = None, None, None
                self._gone(path)
            return
        racy = sig[0] != "error" and time.time_ns() - sig[0] < RACY_SECONDS * 1e9
        if sig == self._file_sig and not racy:
            self._warn_pending()
            return
        try:
            text = read_config_file(path)
        except (ConfigFileError, OSError) as exc:
            message = f"{exc}; keeping the last good configuration"
            if sig == self._file_sig and message == self.config_problem:
                self._warn_pending()
                return
            self._file_sig, self._file_text = sig, None
            self._invalid(message)
            return
        if text is None:  # removed between the stat and the read
            self._file_sig, self._file_text, self._pending_problem = None, None, None
            self._gone(path)
            return
        if sig == self._file_sig and text == self._file_text:
            self._warn_pending()
            return
        self._file_sig, self._file_text = sig, text
        config, warnings = parse_config(text)
        if config is None:
            self._invalid(f"config {path}: {warnings[0] if warnings else 'unusable'}")
            return
        self._pending_problem = self.config_problem = None
        for w in warnings:
            log.warn(f"config {path}: {w}")
        if config == self.config and self.config_applied_at is not None:
            self._kick.set()  # the same configuration saved again: nothing to apply
            return
        self._apply(config)

    def _gone(self, path: str) -> None:
        self.config_problem = None
        if self.config is not None and self.config.dump_enable:
            log.info(f"config {path} was removed; the probe goes back to sleep")
        if self.config is not None or self.config_applied_at is None:
            self._apply(None)

    def _invalid(self, message: str) -> None:
        """An unusable file: keep the last good config; warn unless it changes by the next poll
        (an editor half-way through saving)."""
        self._pending_problem = self.config_problem = message
        self._kick.set()

    def _warn_pending(self) -> None:
        if self._pending_problem is not None:
            log.warn(self._pending_problem)
            self._pending_problem = None

    def _apply(self, config: DumpConfig | None) -> None:
        if self._closed:
            return
        self.selection = Selection(config) if config is not None else None
        self.config = config
        self.config_applied_at = _now()
        if config is not None and config.dump_enable:
            if not self.woken:
                self.woken = True
                log._emit(WAKE_MESSAGE)
                try:
                    self.tree.makedirs("data")
                except OSError as exc:
                    log.warn_once("data-dir", f"cannot create {self.tree.path('data')}: {exc}")
            self.engine.install()
        elif self.engine is not None:
            self.engine.uninstall()
        self._kick.set()

    # -- rounds and device ------------------------------------------------------------------

    def next_round(self) -> int:
        index = next(self._rounds)
        if index >= self.rounds_started:
            self.rounds_started = index + 1
        return index

    def round_dumped(self) -> None:
        with self._lock:
            self.rounds_dumped += 1
        self._kick.set()

    def decide_device(self, module, args, kwargs) -> int:
        """The device ID of this process, decided at its first round (SPEC §1)."""
        if self.device is not None:
            return self.device
        from .capture.device import device_id
        device = device_id(module, args, kwargs)
        with self._lock:
            if self.device is None:
                # Under the status lock: a status write must not recreate the provisional file
                # just after the rename removed it.
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
        """The status document, `atb_dump_data/status/<dev>_<pid>.json` (SPEC §4).

        pid, device; state "sleeping" | "dumping"; device_selected (while dumping: whether the
        config's `device` list lets this process dump at all, else null); exited (true once the probe closed: every
        file is written or `last_error` says what was not); rounds_started (root calls seen
        since the probe first woke: the number the next round gets), rounds_dumped;
        files_written, bytes_written, bytes_queued (accepted, not yet on disk), files_skipped;
        last_error; config (the watched file), config_in_effect (the configuration new rounds
        start under, null while there is none), config_applied_at, config_problem (why the file
        on disk is not the one in effect, or null); output; started_at, proc_start (to tell a
        reused pid), updated_at (ISO 8601 times).
        """
        stats = self.writer.stats
        config = self.config
        awake = config is not None and config.dump_enable
        device = self.device if self.device is not None else _env_device()
        return {
            "pid": self.pid,
            "device": device,
            "state": "dumping" if awake else "sleeping",
            "device_selected": (not config.device or device in config.device) if awake else None,
            "exited": False,
            "rounds_started": self.rounds_started,
            "rounds_dumped": self.rounds_dumped,
            "files_written": stats.files_written,
            "bytes_written": stats.bytes_written,
            "bytes_queued": max(0, stats.bytes_queued),
            "files_skipped": stats.files_skipped,
            "last_error": stats.last_error or self.last_error,
            "config": self.config_path,
            "config_in_effect": _config_doc(config),
            "config_applied_at": self.config_applied_at,
            "config_problem": self.config_problem,
            "output": self.output,
            "started_at": self.started_at,
            "proc_start": self.proc_start,
        }

    def write_status(self, final: bool = False) -> None:
        """Rewrite the status file (atomically) if anything in it changed."""
        with self._status_lock:
            if self._status_final:
                return
            doc = self.status()
            if final:
                doc["exited"] = True
            if not final and doc == self._status_last:
                return
            snapshot = dict(doc)
            doc["updated_at"] = _now()
            name = f"{self.devpid}.json"
            try:
                self.tree.write_file("status", name, [json.dumps(doc, indent=2).encode()])
                self._status_last, self._status_name = snapshot, name
                self._status_final = final
            except OSError as exc:
                if not self.writer.failed:  # the writer has already said why the disk failed
                    log.warn_once("status-write", f"cannot write the status file: {exc}")

    def _remove_status(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.tree.root, "status", name))
        except OSError:
            pass
        self._status_last = None

    # -- fork -------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """A forked child is a new process: its own folder, queue, counters and threads."""
        self.pid = os.getpid()
        self.devpid = f"{self.device if self.device is not None else _env_device()}_{self.pid}"
        self.writer.reset_after_fork()
        self.tree = self.writer.tree = SafeTree(self.tree.root)
        self.rounds_dumped = 0
        self.rounds_started = 0
        self.started_at = _now()
        self.proc_start = _proc_start(self.pid)
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._status_lock = threading.RLock()
        self._status_last = None
        self._status_name = None
        self._status_final = False
        if self.engine is not None:
            self.engine.after_fork()
        self._start_thread()


_UNSEEN = object()  # the config file has not been looked at yet


def _config_doc(config: DumpConfig | None) -> dict | None:
    if config is None:
        return None
    return {
        "task": config.task,
        "dump_enable": config.dump_enable,
        "exec_range": config.exec_range.spec,
        "ids": ",".join(config.ids),
        "op_name": ",".join(config.op_name),
        "save_child": config.save_child,
        "device": ",".join(str(d) for d in config.device),
        "filter_level": config.filter_level,
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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
    """Flush on SIGTERM when the host has no handler of its own, then die as SIGTERM would.

    A host with its own handler (uvicorn, gunicorn...) exits normally, through `atexit`; uvicorn
    also puts this handler back and re-raises the signal once it has shut down.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum, frame):
            # The handler runs between two bytecodes of the main thread, which may hold a lock
            # `close` needs: close from another thread, for a bounded time.
            closer = threading.Thread(target=probe.close, name="atb-probe-exit", daemon=True)
            closer.start()
            closer.join(_exit_timeout() + 5)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass
