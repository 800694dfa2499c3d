"""The background writer: the model thread hands over copies, a writer thread puts them on disk.

Jobs are queued in order and written by one thread, so the rows of a round's statistic.csv come
after the files they name. The queue is bounded in bytes: a producer that outruns the disk waits
(back-pressure) instead of growing memory without limit, but never longer than the stall timeout
(`ATB_PROBE_STALL_TIMEOUT`, 120 s) without the disk taking a single byte: then dumping stops and
the model goes on.

Before each tensor file the free space is checked (SPEC §6: at least `min_free` bytes and twice
the file); a file that does not fit is skipped with one warning, and its statistic.csv row says
`N/A` instead of naming a file that is not there. A name the tree refuses (a planted link, a path
over the length limit) skips that file the same way. Any other write error (disk full, permission
denied, I/O error) stops the writer with one clear message; nothing half-written is left behind.

csv rows are batched per file and appended atomically (see `SafeTree.append_lines`) at most every
`ROWS_DELAY` seconds, and at once on `flush`/`close`. Queued and batched bytes both count in
`bytes_queued` until they are on disk. The other small files (JSON documents: tokens.json, the
structure files, op_param.json) wait in the queue up to `ROWS_DELAY` too, so the writer wakes a
few times a second, each time for whatever has come, instead of once or twice per round: every
wake-up costs the model a GIL hand-over, and the writes done while the model runs slow it more
than the same writes done together. A tensor file is written at once, with everything queued
before it: it holds memory.

The writer thread runs at the lowest CPU priority (`yield_the_cores`): a model's own threads
(OpenMP, oneDNN) often wait for each other by spinning on every core, and a writer at their
priority that takes a core from one of them in the middle of a kernel stalls the whole kernel
until that thread runs again. At the lowest priority it writes in the time the cores leave
idle. When a thread waits for it (a producer for room, `flush`, `close`), waiting is all that
thread does, and other processes may keep the cores busy: the writer is then handed over to a
new thread at the process's priority (a thread cannot take back a priority it gave up), which
yields the cores again once nothing waits (`_hurry`).

A job is a typed record (record/jobs.py) that carries everything the writer needs: a tensor
file's job holds the Tensor Path cell of the row that names it, and marks it missing when the
file is skipped, so that row says N/A. The writer imports no torch and calls nothing of the
capture side; the only thing it waits for is a job's `ready`: a `Landed` of accelerator copies,
which the capture side's landing thread completes (capture/landing.py).

A writer made with `process=True` (the probe's) sends a `statistics` dump's jobs to a writer
process instead (record/sidecar.py: `python -I`, running a writer of this class with a short
rows delay), where they cost the model neither the GIL nor a wait at `flush`. Tensor files and
jobs that wait for an accelerator copy stay in this process: the first of them waits for the
process to finish, and the thread is the route from then on (`_route`), so two writers never
append to one file. `expect_tensor_files` sets the route from the config, off the model thread.

`_cond` guards what producers and the writer thread share: the job queue, the csv batches
waiting (`RowBatches`), `stats.bytes_queued`, `failed` and closed, the busy and urgent flags and
the time of the last progress. The other counters of `stats` are written by the writer thread
only.
"""
from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from .. import log
from ..process.threadname import name_this_thread
from ..statcsv import format_request_sides, format_sides, mark_missing
from . import jsontext, sidecar
from .jobs import JsonJob, RowsJob, TensorFileJob
from .safefs import SafeTree, UnsafePathError

GIB = 1024 ** 3
DEFAULT_QUEUE_BYTES = 128 * 1024 ** 2
DEFAULT_STALL_SECONDS = 120.0
# csv rows wait up to ROWS_DELAY seconds (longer for big files, up to ROWS_MAX_DELAY) or until
# as many bytes as the file already holds are waiting: each append rewrites the file, and this
# keeps the total cost linear in its size.
ROWS_DELAY = 0.2
ROWS_MAX_DELAY = 2.0
ROWS_BATCH = 256 * 1024
MAX_ROW_FILES = 16         # csv files with rows waiting at once
_ERRNO_WORDS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EIO: "I/O error", errno.EROFS: "read-only file system"}


@dataclass
class WriterStats:
    files_written: int = 0
    bytes_written: int = 0
    bytes_queued: int = 0
    files_skipped: int = 0
    last_error: str | None = None


class _Rows:
    """csv rows waiting to be appended to one file."""

    __slots__ = ("header", "requests", "parts", "nbytes", "accounted", "due", "file_bytes",
                 "ready")

    def __init__(self, header: str, now: float, file_bytes: int, requests: bool = False,
                 delay: float = 0.2):
        self.header = header
        self.requests = requests  # request_statistic.csv's rows
        self.parts: list = []  # lists of side records (statcsv.py)
        self.ready: list = []  # what to wait for before reading their statistics cells
        self.nbytes = 0        # bytes of rows waiting (estimated)
        self.accounted = 0     # their share of bytes_queued
        self.file_bytes = file_bytes  # bytes this writer has appended to the file so far
        self.due = now + min(ROWS_MAX_DELAY, delay * max(1.0, file_bytes / ROWS_BATCH))

    def encode(self, round_path: str) -> bytes:
        """The csv bytes of every waiting row (their Tensor Paths below `round_path`)."""
        for ready in self.ready:
            ready.wait()
        if self.requests:
            return "".join(format_request_sides(part) for part in self.parts).encode("utf-8")
        return "".join(format_sides(part, round_path) for part in self.parts).encode("utf-8")


class RowBatches:
    """csv rows waiting per file (the caller holds the writer's lock): how long they may wait,
    and how many bytes each file has had so far (a bigger file waits longer)."""

    def __init__(self, delay: float = 0.2):
        self.delay = delay  # how long rows may wait (`Writer.rows_delay`)
        self.waiting: dict[tuple[str, str], _Rows] = {}
        self._file_bytes: dict[tuple[str, str], int] = {}

    def add(self, job: RowsJob, wakes_at: float, waited: float = 0.0) -> bool:
        """Add a rows job to its file's batch; from here the batch accounts for its bytes.
        `waited`: seconds the job has waited in the queue already, which a new batch waits
        less. True when the writer should look at the batches now: a new one due before the
        writer wakes anyway (`wakes_at`), or one big enough to write."""
        key = (job.rel_dir, job.name)
        rows = self.waiting.get(key)
        new = rows is None
        if new:
            rows = self.waiting[key] = _Rows(job.header, time.monotonic() - waited,
                                             self._file_bytes.get(key, 0), job.requests,
                                             self.delay)
        rows.parts.append(job.sides)
        if job.ready is not None:
            rows.ready.append(job.ready)
        rows.nbytes += job.size
        rows.accounted += job.size
        if len(self.waiting) > MAX_ROW_FILES or rows.nbytes >= max(ROWS_BATCH, rows.file_bytes):
            rows.due = 0.0
            return True
        # A new batch wakes the writer only if it would sleep past the batch's due time: a
        # wake-up costs the model thread a GIL hand-over, and rows come once per layer.
        return new and rows.due < wakes_at

    def first_due(self) -> float:
        """When the first batch is due (`time.monotonic`)."""
        return min(r.due for r in self.waiting.values())

    def take(self):
        """The next file's (key, batch), removed; None when nothing waits."""
        if not self.waiting:
            return None
        key = next(iter(self.waiting))
        return key, self.waiting.pop(key)

    def appended(self, key: tuple[str, str], rows: _Rows, nbytes: int) -> None:
        if len(self._file_bytes) >= 256:
            self._file_bytes.clear()
        self._file_bytes[key] = rows.file_bytes + nbytes


class Writer:
    """Writes files and csv rows under a `SafeTree` from a background thread.

    More methods than we like in a class: the queue, back-pressure, the csv batches, the free
    space check and failure share one condition (`_cond`), one thread and the state they guard,
    because a producer waiting for room must be woken by whatever frees it (a job written, rows
    appended, the writer failing or closing), and that lock protocol is easier to check in one
    place. The row batches themselves are `RowBatches`'."""

    def __init__(self, tree: SafeTree, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 min_free: int | None = None, stall_seconds: float | None = None,
                 rows_delay: float = ROWS_DELAY, process=False):
        self.tree = tree
        self.capacity = queue_bytes
        self.min_free = _min_free_from_env() if min_free is None else min_free
        self.stall_seconds = _stall_from_env() if stall_seconds is None else stall_seconds
        self.rows_delay = rows_delay
        self._stats = WriterStats()
        self._failed = False
        self._warned: set[str] = set()  # this writer's warn-once keys (log.warn_once)
        # Where small jobs go (record/sidecar.py): a writer process while `_threaded` is False.
        # `process`: False, True, or a function saying whether one would help (asked when one
        # is about to start, unless ATB_PROBE_WRITER says "process").
        self._process = bool(process) and sidecar.available()
        self._helps = process if callable(process) else None
        self._threaded = not self._process
        self._sidecar: sidecar.Sidecar | None = None
        self._route = threading.Lock()  # the route and what is sent along it, in one step
        self._reset_queue()
        self._closed = False
        tree.watch_progress(self._progress)

    @property
    def stats(self) -> WriterStats:
        """What this writer (its thread and its process together) has written and skipped."""
        own = self._stats  # first: `_retire` replaces it before it lets go of the process
        side = self._sidecar
        if side is None:
            return own
        files, nbytes, skipped, error = side.counters()
        return WriterStats(own.files_written + files, own.bytes_written + nbytes,
                           own.bytes_queued + side.queued(), own.files_skipped + skipped,
                           own.last_error or error)

    @property
    def failed(self) -> bool:
        """Writing has stopped (disk full, a stall, a write error): later jobs are dropped."""
        side = self._sidecar
        return self._failed or (side is not None and side.failed)

    def _reset_queue(self) -> None:
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._yielding = False            # `_thread` runs at the lowest priority
        self._rows = RowBatches(self.rows_delay)
        self._urgent = 0                  # threads waiting for the disk: write rows now
        self._wakes_at = 0.0              # when the sleeping writer wakes on its own (inf: never)
        self._jobs_due = 0.0              # when the queued jobs must be written (0: at once)
        self._last_progress = time.monotonic()

    # -- producer side (model threads) --------------------------------------------------------

    def put(self, job: TensorFileJob | JsonJob | RowsJob) -> None:
        """Queue a job (record/jobs.py). Waits while the queue is full (back-pressure); drops
        the job once the writer has stopped.

        While the writer process is the route, a job that may go there is sent to it;
        a tensor file, or a job that waits for an accelerator copy, first waits for the
        process to finish and makes the thread the route from then on."""
        with self._route:
            if self._threaded or not self._send(job):
                self._put_here(job)

    def _put_here(self, job: TensorFileJob | JsonJob | RowsJob) -> None:
        """Queue a job for the writer thread.

        statistic.csv rows join their file's batch at once when nothing is queued before them
        (so every file they name has been dealt with), without waking the writer unless the
        batch is new or full: the writer sleeps until the batch is due. Everything else
        queues in order, due `ROWS_DELAY` after the first of the queue (a tensor file: at
        once); the writer is woken only when it would sleep past that."""
        with self._cond:
            if not self._admit(job.size):
                return
            if self._thread is None:  # no writer thread could start (`_ensure_thread`)
                self._jobs.append(job)
            elif type(job) is RowsJob and not (self._jobs or self._busy):
                if self._rows.add(job, self._wakes_at):
                    self._cond.notify_all()
                return
            else:
                if type(job) is TensorFileJob:
                    self._jobs_due = 0.0  # it holds memory: written now, with what is before
                elif not self._jobs:
                    self._jobs_due = time.monotonic() + self.rows_delay
                self._jobs.append(job)
                if self._jobs_due < self._wakes_at:  # else the writer wakes for them anyway
                    self._cond.notify_all()
                return
        self._write_here()

    def _admit(self, size: int) -> bool:
        """(Holding `_cond`.) Wait for room for `size` bytes (back-pressure), then account for
        them; False when nothing can be queued any more."""
        if self._failed or self._closed:
            return False
        self._ensure_thread()
        if self._stats.bytes_queued and self._stats.bytes_queued + size > self.capacity:
            self._urgent += 1
            self._hurry()
            try:
                while self._stats.bytes_queued and \
                        self._stats.bytes_queued + size > self.capacity and not self._failed:
                    idle = time.monotonic() - self._last_progress
                    if idle > self.stall_seconds:
                        self._stop(sidecar.stall_message(self.tree.root, idle))
                        break
                    self._cond.notify_all()
                    self._cond.wait(min(0.5, max(0.01, self.stall_seconds - idle)))
            finally:
                self._urgent -= 1
                self._cond.notify_all()  # the writer may yield the cores again
        if self._failed:
            return False
        if not self._jobs and not self._busy:
            self._last_progress = time.monotonic()  # the writer was idle, not stalled
        self._stats.bytes_queued += size
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is on disk; False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._route:
            side = self._sidecar
            if side is not None:
                try:
                    if not side.flush(timeout):
                        return False
                except sidecar.SidecarDied as exc:
                    self._lost(side, exc)
        return self._flush_here(None if deadline is None else
                                max(0.0, deadline - time.monotonic()))

    def _flush_here(self, timeout: float | None = None) -> bool:
        """Wait until everything queued for the thread is on disk (at most `timeout` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not (self._jobs or self._busy or self._rows.waiting):
                return True  # nothing to wait for: no thread handed over for nothing
            self._urgent += 1
            self._hurry()
            self._cond.notify_all()
            try:
                while self._jobs or self._busy or self._rows.waiting:
                    if self._thread is None or not self._thread.is_alive():
                        return not self._jobs and not self._rows.waiting
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.1 if left is None else min(left, 0.1))
            finally:
                self._urgent -= 1
                self._cond.notify_all()  # the writer may yield the cores again
        return True

    def pending(self) -> int:
        with self._cond:
            here = self._stats.bytes_queued
        side = self._sidecar
        return here + (side.queued() if side is not None else 0)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (at most `timeout` s) and stop the writer thread and process. When the disk
        did not take everything in time, the tree is told to give up: later writes fail at
        once instead of blocking the exit behind a writer that is itself blocked in the
        kernel; a writer process is killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._route:
            side = self._sidecar
            side_done = True
            if side is not None:
                try:
                    side_done = side.close(timeout)
                except sidecar.SidecarDied as exc:
                    self._lost(side, exc)
                else:
                    self._retire(side)
            done = self._flush_here(None if deadline is None else
                                    max(0.0, deadline - time.monotonic()))
            with self._cond:
                self._closed = True
                stuck = not done and self._busy
                self._cond.notify_all()
        if stuck:
            self.tree.give_up()
        else:
            self.tree.close()
        return done and side_done

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's queue, thread and process, and write through
        a tree of its own (the parent's lock may be held for good)."""
        if self._sidecar is not None:
            self._sidecar.forget()
            self._sidecar = None
        self._route = threading.Lock()
        self._reset_queue()
        self._stats = WriterStats()
        self.tree = SafeTree(self.tree.root)
        self.tree.watch_progress(self._progress)

    # -- the writer process ---------------------------------------------------------------------

    def expect_tensor_files(self, expected: bool) -> None:
        """What the dump now asks for (the config just applied): tensor files keep every job on
        the thread (their rows must follow them); statistics alone go to the writer process,
        started at the first job where it helps."""
        with self._route:
            if expected:
                self._leave_process()
            elif self._process and not self._closed and self._threaded:
                self._flush_here()  # the process must not write beside the thread
                self._threaded = False

    def _send(self, job: TensorFileJob | JsonJob | RowsJob) -> bool:
        """(Holding `_route`.) Send `job` to the writer process; False when it must go to the
        thread instead (from now on)."""
        if self._failed or self._closed:
            return True  # dropped, as the thread drops it (no process started for it)
        if type(job) is TensorFileJob or getattr(job, "ready", None) is not None:
            self._leave_process()
            return False
        side = self._sidecar or self._ensure_sidecar()
        if side is None:
            return False
        if side.failed:
            return True
        try:
            side.put(job, job.size)
        except sidecar.SidecarStalled as exc:
            self._stop(str(exc))
        except sidecar.SidecarDied as exc:
            self._lost(side, exc)
            return False
        except Exception as exc:  # what the thread could not write either: the same message
            self._fail(exc, self._where(job))
        return True

    def _ensure_sidecar(self) -> sidecar.Sidecar | None:
        """(Holding `_route`.) The writer process, started now if it is not running; None
        (and the thread from now on) when it cannot start."""
        if self._sidecar is None:
            if self._helps is not None and sidecar.choice() == "auto" and not self._helps():
                self._threaded = True  # until a config asks for statistics again
                return None
            try:
                self._sidecar = sidecar.Sidecar(self.tree.root, self.capacity,
                                                self.stall_seconds)
            except Exception as exc:  # no process here: the thread writes, as it always did
                self._process, self._threaded = False, True
                log.warn_once("writer-process", f"cannot start a writer process ({exc}); "
                              "this process writes its files itself", self._warned)
        return self._sidecar

    def _leave_process(self) -> None:
        """(Holding `_route`.) From now on jobs go to the thread: the process finishes what it
        was sent first, then ends."""
        self._threaded = True
        side = self._sidecar
        if side is None:
            return
        try:
            side.close()
        except sidecar.SidecarDied as exc:
            self._lost(side, exc)
        else:
            self._retire(side)

    def _retire(self, side: sidecar.Sidecar) -> None:
        """(Holding `_route`.) Keep what the ended process wrote in this writer's counters."""
        files, nbytes, skipped, error = side.counters()
        own = self._stats  # the thread writes nothing while the process is the route
        self._stats = WriterStats(own.files_written + files, own.bytes_written + nbytes,
                                  own.bytes_queued, own.files_skipped + skipped,
                                  own.last_error or error)
        self._failed = self._failed or side.failed
        self._sidecar = None

    def _lost(self, side: sidecar.Sidecar, exc: Exception) -> None:
        """(Holding `_route`.) The writer process is gone: say what was lost, then write
        here."""
        lost = side.queued()
        side.forget()
        self._retire(side)
        self._process, self._threaded = False, True
        if side.ready:
            message = f"{exc}; {lost} bytes it had not written are lost, and this process " \
                      "writes the rest itself"
        else:
            message = f"{exc}; this process writes its files itself"
            for job in side.early:  # it never read them
                self._put_here(job)
        self._stats.last_error = message
        (log.error_once if side.ready else log.warn_once)("writer-process", message,
                                                          self._warned)

    # -- writer thread ------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        """(Holding `_cond`.) A writer thread, started at the first job, yielding the cores
        where it can (`yields`).

        Where none can start (at interpreter exit on Python 3.12, with no memory for a
        stack), `_thread` is None and the thread that queues a job writes it (`_write_here`);
        the next job tries again."""
        if self._thread is None or not self._thread.is_alive():
            if not self._start_thread(yielding=yields()):
                self._thread = None

    def _hurry(self) -> None:
        """(Holding `_cond`.) A thread waits for the writer: a writer thread that yields the
        cores hands over to a new one at the process's priority. The one replaced finishes the
        job it is writing (the new one waits for that), then ends; where no new one can
        start, it goes on."""
        if self._yielding and self._thread is not None and self._thread.is_alive():
            self._start_thread(yielding=False)

    def _start_thread(self, yielding: bool) -> bool:
        """(Holding `_cond`.) Start a writer thread, the one before (if any) to end after its
        job; False where no thread can start now."""
        thread = threading.Thread(target=self._run, args=(yielding,),
                                  name="atb-probe-writer", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread", "… at interpreter shutdown"
            return False
        self._yielding = yielding
        self._thread = thread  # (it reads this once it holds `_cond`, after us)
        self._cond.notify_all()
        return True

    def _run(self, yielding: bool) -> None:
        name_this_thread()
        if yielding:
            yield_the_cores()
        me = threading.current_thread()
        while True:
            with self._cond:
                job = None
                while True:
                    if self._thread is not me:
                        return  # handed over (`_hurry`), its job done
                    if self._busy:  # the thread this one replaced is still writing a job
                        self._cond.wait(0.1)
                        continue
                    if not self._yielding and not self._urgent and yields():
                        yield_the_cores()  # nothing waits for it any more
                        self._yielding = True
                    # Rows that are due go first, even while files keep coming: a busy writer
                    # must not let statistic.csv fall behind the files it lists.
                    wait = self._wait_for(self._rows.first_due()) if self._rows.waiting \
                        else None
                    if wait is not None and wait <= 0:
                        break
                    if self._jobs:
                        jobs_wait = self._wait_for(self._jobs_due)
                        if jobs_wait <= 0:
                            job = self._jobs.popleft()
                            break
                        wait = jobs_wait if wait is None else min(wait, jobs_wait)
                    if wait is None and self._closed:
                        return
                    self._wakes_at = float("inf") if wait is None else time.monotonic() + wait
                    self._cond.wait(wait)
                    self._wakes_at = 0.0
                self._busy = True
                self._last_progress = time.monotonic()  # idle time is not a stall
            self._write_one(job)

    def _write_here(self) -> None:
        """No writer thread could start (`_ensure_thread`): the calling thread writes what is
        queued, rows included, now. While another caller writes, that one takes this job
        too."""
        while True:
            with self._cond:
                if self._busy or self._thread is not None:
                    return  # a caller writing, or a thread started since, takes it
                if self._jobs:
                    job = self._jobs.popleft()
                elif self._rows.waiting:
                    job = None
                else:
                    return
                self._busy = True
            self._write_one(job)

    def _write_one(self, job: TensorFileJob | JsonJob | RowsJob | None) -> None:
        """Write a job taken from the queue, `_busy` set (None: the rows that wait); clear
        `_busy` after it."""
        batched = 0  # a rows job's bytes, accounted by its batch from here
        try:
            if job is None:
                self._write_rows()
            elif type(job) is RowsJob:
                batched = job.size
                with self._cond:  # written when due: see the wait in `_run`
                    # It waited for the queue's delay already, unless a tensor file cut that
                    # short: its batch does not wait for it again.
                    self._rows.add(job, 0.0, self.rows_delay if self._jobs_due else 0.0)
            elif not self._failed:
                self._write_job(job)
        except Exception as exc:  # the writer must never die silently
            self._fail(exc, self._where(job))
        finally:
            with self._cond:
                if job is not None:
                    self._stats.bytes_queued -= job.size - batched
                self._busy = False
                self._last_progress = time.monotonic()
                self._cond.notify_all()

    def _wait_for(self, due: float) -> float:
        """Seconds until what is due at `due` must be written (0: now, while a thread waits
        for the writer or it is closing or has failed)."""
        if self._urgent or self._closed or self._failed:
            return 0
        return due - time.monotonic()

    def _progress(self, nbytes: int) -> None:
        self._last_progress = time.monotonic()

    def _write_job(self, job: TensorFileJob | JsonJob) -> None:
        rel_dir, name = job.rel_dir, job.name
        try:
            if type(job) is TensorFileJob:
                chunks = job.chunks
                if job.ready is not None:
                    job.ready.wait()
                nbytes = sum(memoryview(c).nbytes for c in chunks)
                if not self._has_room(rel_dir, nbytes, name):
                    _unname(job)
                    return
                self.tree.write_file(rel_dir, name, chunks)
                self._stats.files_written += 1
                self._stats.bytes_written += nbytes
            else:
                data = jsontext.dumps(job.doc).encode("utf-8")
                self._stats.bytes_written += self.tree.write_file(rel_dir, name, [data])
                self._stats.files_written += 1
        except UnsafePathError as exc:
            if type(job) is TensorFileJob:
                _unname(job)
            self._refuse(exc, rel_dir)

    def _where(self, job: TensorFileJob | JsonJob | RowsJob | None) -> str:
        return self.tree.path(job.rel_dir, job.name) if job else self.tree.root

    def _refuse(self, exc: UnsafePathError, rel_dir: str) -> None:
        self._stats.files_skipped += 1
        where = exc.filename or self.tree.path(rel_dir)
        message = f"{exc.strerror}: {where}; such files are skipped"
        self._stats.last_error = message
        log.warn_once(f"unsafe-path-{exc.errno}", message, self._warned)

    # -- csv rows -----------------------------------------------------------------------------

    def _write_rows(self) -> None:
        """Append every waiting row to its file (each file in one atomic step). Never raises:
        a write error stops the writer. A thread handed over (`_hurry`) stops after its file."""
        me = threading.current_thread()
        while True:
            with self._cond:
                if self._thread is not me and self._thread is not None:
                    return  # handed over (None: no thread, the caller writes)
                taken = self._rows.take()
            if taken is None:
                return
            key, rows = taken
            error = None
            try:
                data = rows.encode(self.tree.path(key[0]))
                if data:
                    self._stats.bytes_written += self.tree.append_lines(
                        key[0], key[1], data, rows.header.encode("utf-8"))
                    with self._cond:
                        self._rows.appended(key, rows, len(data))
            except UnsafePathError as exc:
                self._refuse(exc, key[0])
            except Exception as exc:
                error = exc
            finally:
                self._release(rows)
            if error is not None and not self._failed:
                self._fail(error, self.tree.path(*key))

    def _release(self, rows: _Rows) -> None:
        with self._cond:
            self._stats.bytes_queued -= rows.accounted
            self._cond.notify_all()

    # -- free space and failure ---------------------------------------------------------------

    def _has_room(self, rel_dir: str, nbytes: int, name: str) -> bool:
        need = self.min_free + 2 * nbytes
        free = self.tree.free_bytes(rel_dir)
        if free >= need:
            return True
        self._stats.files_skipped += 1
        message = (f"only {_size(free)} free under {self.tree.root}; skipping {name} "
                   f"(a tensor file needs {_size(self.min_free)} free plus twice its size)")
        self._stats.last_error = message
        log.warn_once("free-space", message + ". Free some space; later files are skipped the "
                      "same way (set ATB_PROBE_MIN_FREE_BYTES to change the reserve).",
                      self._warned)
        return False

    def _fail(self, exc: Exception, where: str) -> None:
        word = _ERRNO_WORDS.get(getattr(exc, "errno", None))
        if word:
            message = f"{word} while writing {where}; dumping stopped, the model goes on"
        else:
            message = f"cannot write {where}: {type(exc).__name__}: {exc}; dumping stopped, " \
                      "the model goes on"
        if self._stop(message):
            # Rows already waiting name files that are on disk: keep them if the disk lets us.
            self._write_rows()

    def _stop(self, message: str) -> bool:
        """Stop writing: drop what is queued and say why, once. False if already stopped."""
        with self._cond:
            if self._failed:
                return False
            self._failed = True
            self._stats.last_error = message
            dropped = sum(job.size for job in self._jobs)
            self._jobs.clear()
            self._stats.bytes_queued -= dropped
            self._cond.notify_all()
        log.error(message)
        return True


def _unname(job: TensorFileJob) -> None:
    """A tensor file that is not written: the row naming it says N/A."""
    if job.row_path is not None:
        mark_missing(job.row_path)


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 1024 ** 2:.1f} MiB"


WRITER_NICE = 19  # the lowest priority of SCHED_OTHER, which any thread may take


def _nice_from_env() -> int:
    """`ATB_PROBE_WRITER_NICE` (at most 19), or the default `WRITER_NICE` when unset or bad."""
    raw = os.environ.get("ATB_PROBE_WRITER_NICE", "")
    try:
        return min(19, int(raw)) if raw else WRITER_NICE
    except ValueError:
        return WRITER_NICE


def yields(nice: int | None = None) -> bool:
    """Whether the writer thread yields the cores here: on Linux, where a thread has a nice value
    of its own, unless `ATB_PROBE_WRITER_NICE` (or `nice`, read from it) is 0 or less (a thread
    that does not yield is never handed over)."""
    return sys.platform.startswith("linux") and \
        (_nice_from_env() if nice is None else nice) > 0


def yield_the_cores() -> None:
    """Give the calling thread the CPU priority `ATB_PROBE_WRITER_NICE` says (default 19, the
    lowest; 0 leaves it as the process's, as does any value not above the thread's own).
    Lowering one needs privileges and is never asked for."""
    nice = _nice_from_env()
    if not yields(nice):
        return  # elsewhere PRIO_PROCESS with a thread ID would renice the whole process
    try:
        tid = threading.get_native_id()
        if nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass  # refused (a sandbox): the writer runs at the process's priority


def _min_free_from_env() -> int:
    # Documented for tests and small disks; the SPEC default is 2 GiB.
    raw = os.environ.get("ATB_PROBE_MIN_FREE_BYTES", "")
    try:
        return max(0, int(raw)) if raw else 2 * GIB
    except ValueError:
        return 2 * GIB


def _stall_from_env() -> float:
    raw = os.environ.get("ATB_PROBE_STALL_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_STALL_SECONDS
    except ValueError:
        return DEFAULT_STALL_SECONDS
    return value if value > 0 else DEFAULT_STALL_SECONDS
