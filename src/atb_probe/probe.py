"""The probe of one process: its parts put together, its rounds and its device.

All of the process's probe state lives in the `Probe` object, which puts together parts with one
job each (`process/`): a `ConfigWatcher` that reads the config file when it changes, a
`StatusFile` that keeps `status/<dev>_<pid>.json` up to date, and the process `hooks` that close
the probe at exit and on SIGTERM and restart it in a forked child. One background thread drives
the first two (a `stat` of the config file every `POLL_SECONDS`; no per-op work). Each new
configuration is published as an immutable `Selection`; a round reads it once, when it starts,
so every round is dumped under one configuration (SPEC §4). The thread is woken at the end of
every dumped round, so the status file trails the model by a few tens of ms.

The capture side (`capture/`) sees the probe as a `rounds.RoundSource` (`start_round`,
`round_dumped`, `report`), called from the model's threads, and writes to `writer`.

Locks: `_lock` guards `rounds_dumped` and the decision of `device` (taken by model threads);
`status.lock` is held, inside `_lock`, while `devpid` changes, so that no status write sees the
old name after its file is removed. `next_round` needs no lock: `itertools.count` hands out each
index once even across threads (its `__next__` runs under the GIL without releasing it), and
`rounds_started` only ever grows to an index it was given. `selection`, `config` and
`config_applied_at` are replaced whole by the background thread and read whole by the others.

This module does not import torch; the torch adapter (`capture/`) is imported when the probe
attaches, which happens when the host program imports torch.
"""
from __future__ import annotations

import itertools
import json
import os
import threading

from . import layout, log
from .config import DumpConfig, parse_config
from .process import hooks
from .process.configwatch import ConfigWatcher
from .process.identity import local_rank, proc_start
from .process.role import Role, role_of
from .process.statusfile import StatusFile, utc_now
from .process.threadname import name_this_thread
from .record.safefs import SafeTree
from .record.writer import Writer
from .rounds import RoundStart
from .selection import Selection

POLL_SECONDS = 0.2
STATUS_MIN_INTERVAL = 0.05
WAKE_MESSAGE = "Ready to dump ATB data, the running speed of the model will be affected"


class Probe:
    """Everything the probe knows and does in this process.

    More methods than we like in a class: it is the one home of the process's probe state
    (its parts with one job each are in `process/`), and the capture side's `RoundSource`."""

    def __init__(self, output: str, config_path: str | None = None,
                 config: DumpConfig | dict | None = None):
        self.output = os.path.abspath(output)
        self.config_path = os.path.abspath(config_path) if config_path else None
        self.tree = SafeTree(layout.dump_root(self.output))
        self.writer = Writer(self.tree, process=self._writer_process_helps)
        self.config: DumpConfig | None = None
        self.selection: Selection | None = None
        self.config_applied_at: str | None = None
        self.device: int | None = None
        self.woken = False
        self._excluded_said = None  # the device list this process was last told it is not in
        self.engine = None
        self.last_error: str | None = None
        self._fixed_config = config
        self.watcher = ConfigWatcher(self.config_path, self._apply, self._wake_watcher) \
            if self.config_path and config is None else None
        self._thread: threading.Thread | None = None
        self._errors: set[str] = set()  # the kinds of error this probe has reported
        self._closed = False
        self._begin_process()

    def _begin_process(self) -> None:
        """What belongs to this process, not to the probe: its name, counters, status file,
        locks and events (a forked child starts them afresh)."""
        self.pid = os.getpid()
        self.devpid = layout.devpid(self.device if self.device is not None else local_rank(),
                                    self.pid)
        self.rounds_dumped = 0     # selected rounds that wrote data
        self.rounds_empty = 0      # selected rounds that wrote nothing (no op matched)
        self.rounds_started = 0
        self.config_rounds = 0     # selected rounds begun under the config in effect
        self.ran_model = False     # a model ran here: this process is a worker for good
        self.started_at = utc_now()
        self.proc_start = proc_start(self.pid)
        self.status_file = StatusFile(self.tree, lambda: (self.devpid, self.status()),
                                      lambda: self.writer.failed)
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # wakes the background thread before its next poll
        self._poll_lock = threading.Lock()  # one `poll_config` at a time (the watcher's state)

    def _writer_process_helps(self) -> bool:
        """Whether a writer process would help (record/sidecar.py): the model leaves a core
        idle for it. Where the model's threads take every core, a process at the lowest
        priority writes only once they wait, after the generation, and slower than the
        thread (docs/performance.md)."""
        return self.engine is not None and self.engine.leaves_a_core()

    @property
    def config_problem(self) -> str | None:
        """Why the config file on disk is not the one in effect, or None."""
        return self.watcher.problem if self.watcher is not None else None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Attach: read the config once now (so it governs the very first round), then watch.
        An output that cannot hold a folder leaves the probe inert, with one error."""
        problem = output_problem(self.output)
        if problem:
            self.last_error = problem
            log.error(f"{problem}: nothing can be dumped there, so the probe stays inert; "
                      f"give a folder with --output")
            self._closed = True
            return
        from .capture.calltree import Engine
        self.engine = Engine(self, self.writer)
        if self._fixed_config is not None:
            cfg = self._fixed_config
            if isinstance(cfg, dict):
                cfg, warnings = parse_config(json.dumps(cfg))
                for w in warnings:
                    log.warn(f"config: {w}")
            self._apply(cfg)
        else:
            self.poll_config()
            self._say_if_nothing()
        self.write_status()
        self._start_thread()
        hooks.register(self)

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
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception as exc:
                self.report(exc)
        done = self.writer.close(hooks.exit_timeout() if timeout is None else timeout)
        if not done:
            self.last_error = (f"exit timeout: {self.writer.pending()} bytes still queued were "
                               "not written")
            log.error(self.last_error)
        self.status_file.write_final(timeout=2)
        hooks.unregister(self)
        return done

    # -- configuration ----------------------------------------------------------------------

    def _say_if_nothing(self) -> None:
        """At load, say so when the probe will dump nothing for now, and how to change that
        (a device the config leaves out says so in `_apply`)."""
        where = self.config_path
        if self.config is None and self.config_problem is None:
            log.info(f"no config file at {where} yet: the probe sleeps and dumps nothing until "
                     f'it is written with "dump_enable": true')
        elif self.config is not None and not self.config.dump_enable:
            log.info(f'{where} has "dump_enable": false: the probe sleeps and dumps nothing '
                     f"until that is saved as true")

    def _watch(self) -> None:
        name_this_thread()
        while not self._stop.is_set():
            # While data is on its way, look often: "nothing queued" shows soon after it is so.
            busy = self.writer.stats.bytes_queued > 0
            self._wake.wait(STATUS_MIN_INTERVAL if busy else POLL_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.poll_config()
                if self.engine is not None:
                    self.engine.flush_model_files()
                self.write_status()
            except Exception as exc:
                self.report(exc)
            # Bounds the status rewrites while rounds end in quick succession.
            self._stop.wait(STATUS_MIN_INTERVAL)

    def poll_config(self) -> None:
        """Apply the config file if it changed (or appeared, or vanished) since last time.
        A caller beside the background thread returns once any poll under way has applied
        what it read."""
        if self.watcher is not None:
            with self._poll_lock:
                self.watcher.poll()

    def _wake_watcher(self) -> None:
        self._wake.set()

    def _apply(self, config: DumpConfig | None) -> None:
        if self._closed:
            return
        self.selection = Selection(config) if config is not None else None
        self.config = config
        self.config_rounds = 0
        self.config_applied_at = utc_now()
        if config is not None and config.dump_enable:
            device = self.device if self.device is not None else local_rank()
            excluded = bool(config.device) and device not in config.device
            if excluded:
                # SPEC §8: said at load (and in the status file), with no "Ready to dump" line.
                if config.device != self._excluded_said:
                    self._excluded_said = config.device
                    log.info(f"this process (device {device}) is not in the config's device "
                             f"list ({','.join(map(str, config.device))}): it dumps nothing")
            elif self._rounds_passed(config):
                log.info(f'exec_range "{config.exec_range.spec}" selects only rounds that have '
                         f"passed (the next round is {self.rounds_started}): nothing more is "
                         f"dumped; `atb-probe status` gives the next round's number")
            if not self.woken and not excluded:
                self.woken = True
                log.say_verbatim(WAKE_MESSAGE)
                try:
                    self.tree.makedirs(layout.DATA_DIR)
                except OSError as exc:
                    log.warn_once("data-dir", f"cannot create {self.tree.path(layout.DATA_DIR)}: "
                                              f"{exc}")
            if not excluded:
                self.writer.expect_tensor_files(config.wants_tensors)
            self.engine.install()
        elif self.engine is not None:
            self.engine.uninstall()
        self._wake.set()

    # -- rounds and device ------------------------------------------------------------------

    def _rounds_passed(self, config: DumpConfig) -> bool:
        """Whether a config applied while the process runs selects only rounds already past."""
        spec = config.exec_range
        return bool(self.rounds_started and not spec.everything and spec.pairs and
                    max(hi for _, hi in spec.pairs) < self.rounds_started)

    def start_round(self, module, args: tuple, kwargs: dict) -> RoundStart:
        """A root call begins a round (`rounds.RoundSource`): its index, the selection in
        effect, and whether exec_range and device select it. Once the writer has stopped (disk
        full, I/O error) no round is dumped."""
        selection = self.selection
        index = self.next_round()
        device = self.decide_device(module, args, kwargs)
        dumping = selection is not None and selection.round_selected(index, device) \
            and not self.writer.failed
        if dumping:
            self.config_rounds += 1
        return RoundStart(index, selection, self.devpid, dumping)

    def next_round(self) -> int:
        """The index of the round a root call starts (0, 1, 2... in this process)."""
        index = next(self._rounds)
        if index >= self.rounds_started:
            self.rounds_started = index + 1
        return index

    def round_dumped(self, wrote: bool) -> None:
        """A dumped round has ended: count it (apart when it wrote nothing) and let the status
        file show it soon."""
        with self._lock:
            if wrote:
                self.rounds_dumped += 1
            else:
                self.rounds_empty += 1
        self._wake.set()

    def next_round_dumped(self) -> bool:
        """Whether the next round would be dumped: an engine asks before a step, to run it
        eagerly (capture/engines)."""
        selection = self.selection
        device = self.device if self.device is not None else local_rank()
        return selection is not None and not self.writer.failed and \
            selection.round_selected(self.rounds_started, device)

    def decide_device(self, module, args, kwargs) -> int:
        """The device ID of this process, decided at its first round (SPEC §1)."""
        if self.device is not None:
            return self.device
        from .capture.device import device_id
        device = device_id(module, args, kwargs)
        with self._lock:
            if self.device is None:
                with self.status_file.lock:
                    self.device = device
                    self.devpid = layout.devpid(device, self.pid)
                    self.status_file.drop_other_names(self.devpid)
        return self.device

    # -- errors and status ------------------------------------------------------------------

    def report(self, exc: BaseException) -> None:
        """A probe error: reported once per kind and place; the host program goes on."""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename.rpartition('/')[2]}:{tb.tb_lineno}" if tb \
            else "?"
        self.last_error = f"{type(exc).__name__}: {exc} ({where})"
        log.error_once(f"{type(exc).__name__}@{where}",
                       f"internal error, the model goes on: {self.last_error}", self._errors)

    def status(self) -> dict:
        """The status document, `atb_dump_data/status/<dev>_<pid>.json` (SPEC §4).

        pid, device; role ("worker": a model runs here; "engine": an engine's process that runs
        no model; "no model": none has run here while awake); state "sleeping" | "dumping" |
        "awake" (the config says dump but the process runs no model) ("exited" in the final
        document);
        device_selected (while dumping: whether the config's `device` list lets this process
        dump at all, else null); exited (true once the probe closed: every file is written or
        `last_error` says what was not); rounds_started
        (root calls seen since the probe first woke: the number the next round gets),
        rounds_dumped (selected rounds that wrote data), rounds_empty (selected rounds that wrote
        nothing: no op matched `ids` / `op_name`), config_rounds (selected rounds begun under
        the config in effect);
        files_written, bytes_written, bytes_queued (accepted, not yet on disk),
        model_files_pending (model files whose latest rounds wait for their once-a-second
        rewrite), round_open (a dumped round is running: more of its data is to come),
        files_skipped;
        last_error; compile_problem (why the ops inside compiled code are not dumped, with
        what to do, or null); dtype_notice (the dtype the model runs in differs from the one
        its checkpoint's config declares: both, or null); config (the watched file),
        config_in_effect (the configuration new rounds start under, null while there is none),
        config_applied_at, config_problem
        (why the file on disk is not the one in effect, or null); output; started_at,
        proc_start (to tell a reused pid), updated_at (ISO 8601 times).
        """
        stats = self.writer.stats
        config = self.config
        awake = config is not None and config.dump_enable
        device = self.device if self.device is not None else local_rank()
        role = self.role()
        return {
            "pid": self.pid,
            "device": device,
            "role": role,
            "state": ("awake" if role is Role.ENGINE else "dumping") if awake else "sleeping",
            "device_selected": (not config.device or device in config.device) if awake else None,
            "exited": False,
            "rounds_started": self.rounds_started,
            "rounds_dumped": self.rounds_dumped,
            "rounds_empty": self.rounds_empty,
            "config_rounds": self.config_rounds,
            "files_written": stats.files_written,
            "bytes_written": stats.bytes_written,
            "bytes_queued": max(0, stats.bytes_queued),
            "model_files_pending": self.engine.model_files_pending() if self.engine else 0,
            "round_open": bool(self.engine and self.engine.dumped_rounds_open),
            "files_skipped": stats.files_skipped,
            "last_error": stats.last_error or self.last_error,
            "compile_problem": self.engine.compile_notice.problem if self.engine else None,
            "dtype_notice": self.engine.dtype_notice.message if self.engine else None,
            "config": self.config_path,
            "config_in_effect": _config_doc(config),
            "config_applied_at": self.config_applied_at,
            "config_problem": self.config_problem,
            "output": self.output,
            "started_at": self.started_at,
            "proc_start": self.proc_start,
        }

    def role(self) -> Role:
        """What this process is in the run: a worker once a model has run here (or an engine's
        model runner is loaded), else an engine's other process, else one with no model yet."""
        if not self.ran_model:
            self.ran_model = bool(self.rounds_started) or \
                bool(self.engine is not None and self.engine.runs_engine_steps)
        return role_of(self.ran_model)

    def write_status(self, final: bool = False) -> None:
        """Rewrite the status file (atomically) if anything in it changed."""
        self.status_file.write(final)

    # -- fork -------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """A forked child is a new process: its own folder, queue, counters and threads."""
        self.writer.reset_after_fork()
        self.tree = self.writer.tree
        self._begin_process()
        if self.engine is not None:
            self.engine.after_fork()
        self._start_thread()


def output_problem(output: str) -> str | None:
    """Why the output folder cannot be used (it, or a folder it would be made in, is a file),
    or None."""
    path = output
    while True:
        if os.path.exists(path):
            return None if os.path.isdir(path) else f"output {output} is not a folder " \
                f"({path} is a file)"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


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
