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
`bytes_queued` until they are on disk.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from .. import log
from ..statcsv import SideRows, format_sides
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
_JOB_OVERHEAD = 256        # accounted bytes for a job besides its payload
_RECORD_BYTES = 192        # accounted bytes for a statistic.csv record
_NA = "N/A"                # the Tensor Path of a row whose file was not written (statcsv.NA)
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

    __slots__ = ("header", "parts", "nbytes", "accounted", "due", "file_bytes")

    def __init__(self, header: str, now: float, file_bytes: int):
        self.header = header
        self.parts: list = []  # csv bytes, or lists of statcsv.SideRows
        self.nbytes = 0        # bytes of rows waiting (records: estimated)
        self.accounted = 0     # their share of bytes_queued
        self.file_bytes = file_bytes  # bytes this writer has appended to the file so far
        self.due = now + min(ROWS_MAX_DELAY, ROWS_DELAY * max(1.0, file_bytes / ROWS_BATCH))


class Writer:
    """Writes files and csv rows under a `SafeTree` from a background thread."""

    def __init__(self, tree: SafeTree, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 min_free: int | None = None, stall_seconds: float | None = None):
        self.tree = tree
        self.capacity = queue_bytes
        self.min_free = _min_free_from_env() if min_free is None else min_free
        self.stall_seconds = _stall_from_env() if stall_seconds is None else stall_seconds
        self.stats = WriterStats()
        self.failed = False
        self._warned: set[str] = set()
        self._reset_queue()
        self._closed = False
        tree.progress = self._progress

    def _reset_queue(self) -> None:
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._rows: dict[tuple[str, str], _Rows] = {}
        self._row_file_bytes: dict[tuple[str, str], int] = {}
        self._missing: set[str] = set()   # absolute paths of files skipped, until their row
        self._urgent = 0                  # threads waiting for the disk: write rows now
        self._wakes_at = 0.0              # when the sleeping writer wakes on its own (inf: never)
        self._last_progress = time.monotonic()

    # -- producer side (model threads) --------------------------------------------------------

    def put_file(self, rel_dir: str, name: str, chunks: list, payload_bytes: int,
                 ready=None) -> None:
        """Queue a file made of `chunks` (header bytes, then buffers the writer may keep).
        `ready`: None, or an event (`torch.cuda.Event`...) to wait for before reading the
        buffers: they are being copied from an accelerator."""
        self._put(("file", rel_dir, name, chunks, ready), payload_bytes + _JOB_OVERHEAD)

    def put_rows(self, rel_dir: str, name: str, text: str, header: str) -> None:
        """Queue complete csv lines for `rel_dir/name`; a new file starts with `header`."""
        data = text.encode("utf-8")
        self._put_rows(rel_dir, name, data, header, len(data) + _JOB_OVERHEAD)

    def put_records(self, rel_dir: str, name: str, sides: list, header: str) -> None:
        """Queue statistic.csv rows as `statcsv.SideRows` records: they are formatted on the
        writer thread, when their batch is written."""
        self._put_rows(rel_dir, name, sides, header,
                       _RECORD_BYTES * sum([len(side.rows) for side in sides]))

    def put_json(self, rel_dir: str, name: str, obj) -> None:
        """Queue a JSON document; it is serialised on the writer thread."""
        self._put(("json", rel_dir, name, obj), 4096)

    def _put(self, job: tuple, size: int) -> None:
        with self._cond:
            if not self._admit(size):
                return
            self._jobs.append((job, size))
            self._cond.notify_all()

    def _put_rows(self, rel_dir: str, name: str, part, header: str, size: int) -> None:
        """Rows join their file's batch at once when nothing is queued before them (so every
        file they name has been dealt with), without waking the writer unless the batch is new
        or full: the writer sleeps until the batch is due. Otherwise they queue in order."""
        with self._cond:
            if not self._admit(size):
                return
            if self._jobs or self._busy:
                self._jobs.append((("rows", rel_dir, name, part, header), size))
                self._cond.notify_all()
            elif self._batch((rel_dir, name), header, part, size):
                self._cond.notify_all()

    def _admit(self, size: int) -> bool:
        """(Holding `_cond`.) Wait for room for `size` bytes (back-pressure), then account for
        them; False when nothing can be queued any more."""
        if self.failed or self._closed:
            return False
        self._ensure_thread()
        if self.stats.bytes_queued and self.stats.bytes_queued + size > self.capacity:
            self._urgent += 1
            try:
                while self.stats.bytes_queued and \
                        self.stats.bytes_queued + size > self.capacity and not self.failed:
                    idle = time.monotonic() - self._last_progress
                    if idle > self.stall_seconds:
                        self._stop(f"the disk under {self.tree.root} took nothing for "
                                   f"{idle:.0f} s; dumping stopped so the model can go on")
                        break
                    self._cond.notify_all()
                    self._cond.wait(min(0.5, max(0.01, self.stall_seconds - idle)))
            finally:
                self._urgent -= 1
        if self.failed:
            return False
        if not self._jobs and not self._busy:
            self._last_progress = time.monotonic()  # the writer was idle, not stalled
        self.stats.bytes_queued += size
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is on disk; False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()
            try:
                while self._jobs or self._busy or self._rows:
                    if self._thread is None or not self._thread.is_alive():
                        return not self._jobs and not self._rows
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.1 if left is None else min(left, 0.1))
            finally:
                self._urgent -= 1
        return True

    def pending(self) -> int:
        with self._cond:
            return self.stats.bytes_queued

    def close(self, timeout: float | None = None) -> bool:
        """Flush (at most `timeout` s) and stop the writer thread. When the disk did not take
        everything in time, the tree is marked stuck: later writes fail at once instead of
        blocking the exit behind a writer that is itself blocked in the kernel."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            stuck = not done and self._busy
            self._cond.notify_all()
        if stuck:
            self.tree.stuck = True
        else:
            self.tree.close()
        return done

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's queue and thread."""
        self._reset_queue()
        self.stats = WriterStats()

    # -- writer thread ------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="atb-probe-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                job = size = None
                while True:
                    # Rows that are due go first, even while files keep coming: a busy writer
                    # must not let statistic.csv fall behind the files it lists.
                    wait = self._rows_wait() if self._rows else None
                    if wait is not None and wait <= 0:
                        break
                    if self._jobs:
                        job, size = self._jobs.popleft()
                        break
                    if wait is None and self._closed:
                        return
                    self._wakes_at = float("inf") if wait is None else time.monotonic() + wait
                    self._cond.wait(wait)
                    self._wakes_at = 0.0
                self._busy = True
                self._last_progress = time.monotonic()  # idle time is not a stall
            self.tree.progress = self._progress  # the tree may have been replaced (fork)
            kept = 0
            try:
                if job is None:
                    self._write_rows()
                elif job[0] == "rows":
                    kept = size  # the batch accounts for it from here
                    _, rel_dir, name, part, header = job
                    with self._cond:  # written when due: see the wait above
                        self._batch((rel_dir, name), header, part, size)
                elif not self.failed:
                    self._do(job)
            except Exception as exc:  # the writer must never die silently
                self._fail(exc, self._where(job))
            finally:
                with self._cond:
                    if size:
                        self.stats.bytes_queued -= size - kept
                    self._busy = False
                    self._last_progress = time.monotonic()
                    self._cond.notify_all()

    def _rows_wait(self) -> float:
        """Seconds until waiting rows must be written (0: now)."""
        if self._urgent or self._closed or self.failed:
            return 0
        return min(r.due for r in self._rows.values()) - time.monotonic()

    def _progress(self, nbytes: int) -> None:
        self._last_progress = time.monotonic()

    def _do(self, job: tuple) -> None:
        kind, rel_dir, name = job[:3]
        try:
            if kind == "file":
                chunks, ready = job[3], job[4]
                if ready is not None:
                    ready.synchronize()
                nbytes = sum(memoryview(c).nbytes for c in chunks)
                if not self._has_room(rel_dir, nbytes, name):
                    self._missing.add(self.tree.path(f"{rel_dir}/{name}"))
                    return
                self.tree.write_file(rel_dir, name, chunks)
                self.stats.files_written += 1
                self.stats.bytes_written += nbytes
            elif kind == "json":
                data = json.dumps(job[3], indent=2, ensure_ascii=False,
                                  default=str).encode("utf-8")
                self.stats.bytes_written += self.tree.write_file(rel_dir, name, [data])
                self.stats.files_written += 1
        except UnsafePathError as exc:
            self._refuse(exc, rel_dir, name, kind)

    def _where(self, job: tuple | None) -> str:
        return self.tree.path(f"{job[1]}/{job[2]}") if job else self.tree.root

    def _refuse(self, exc: UnsafePathError, rel_dir: str, name: str, kind: str) -> None:
        self.stats.files_skipped += 1
        if kind == "file":
            self._missing.add(self.tree.path(f"{rel_dir}/{name}"))
        where = exc.filename or self.tree.path(rel_dir)
        message = f"{exc.strerror}: {where}; such files are skipped"
        self.stats.last_error = message
        self._warn_once(f"unsafe-path-{exc.errno}", message)

    # -- csv rows -----------------------------------------------------------------------------

    def _batch(self, key: tuple[str, str], header: str, part, size: int) -> bool:
        """(Holding `_cond`.) Add rows (bytes or records) to the batch of file `key`; from here
        the batch accounts for their `size` queued bytes. True when the writer should look at
        the batches now: a new one due before the writer wakes anyway, or one big enough to
        write."""
        rows = self._rows.get(key)
        new = rows is None
        if new:
            rows = self._rows[key] = _Rows(header, time.monotonic(),
                                           self._row_file_bytes.get(key, 0))
        rows.parts.append(part)
        rows.nbytes += size
        rows.accounted += size
        if len(self._rows) > MAX_ROW_FILES or rows.nbytes >= max(ROWS_BATCH, rows.file_bytes):
            rows.due = 0.0
            return True
        # A new batch wakes the writer only if it would sleep past the batch's due time: a
        # wake-up costs the model thread a GIL hand-over, and rows come once per layer.
        return new and rows.due < self._wakes_at

    def _write_rows(self) -> None:
        """Append every waiting row to its file (each file in one atomic step). Never raises:
        a write error stops the writer."""
        while True:
            with self._cond:
                if not self._rows:
                    return
                key = next(iter(self._rows))
                rows = self._rows.pop(key)
            error = None
            try:
                self._append(key, rows)
            except UnsafePathError as exc:
                self._refuse(exc, key[0], key[1], "rows")
            except Exception as exc:
                error = exc
            finally:
                self._release(rows)
            if error is not None and not self.failed:
                self._fail(error, self.tree.path(f"{key[0]}/{key[1]}"))

    def _append(self, key: tuple[str, str], rows: _Rows) -> None:
        data = b"".join(self._encode(part) for part in rows.parts)
        if not data:
            return
        self.stats.bytes_written += self.tree.append_lines(key[0], key[1], data,
                                                           rows.header.encode("utf-8"))
        if len(self._row_file_bytes) >= 256:
            self._row_file_bytes.clear()
        self._row_file_bytes[key] = rows.file_bytes + len(data)

    def _encode(self, part) -> bytes:
        """csv bytes of a batch part; rows naming a skipped file say N/A in their Tensor Path."""
        if isinstance(part, bytes):
            return self._unname_missing(part) if self._missing else part
        if self._missing:
            part = [self._unname_side(side) for side in part]
        return format_sides(part).encode("utf-8")

    def _unname_side(self, side: SideRows) -> SideRows:
        missing = self._missing
        if not any(row[4] in missing for row in side.rows):
            return side
        rows = []
        for row in side.rows:
            if row[4] in missing:
                missing.discard(row[4])
                row = row[:4] + (_NA,)
            rows.append(row)
        return SideRows(side.head, rows)

    def _release(self, rows: _Rows) -> None:
        with self._cond:
            self.stats.bytes_queued -= rows.accounted
            self._cond.notify_all()

    def _unname_missing(self, data: bytes) -> bytes:
        """Rows whose Tensor Path (the last cell) names a file that was skipped say N/A."""
        try:
            out = io.StringIO()
            writer = csv.writer(out, lineterminator="\n")
            changed = False
            for row in csv.reader(io.StringIO(data.decode("utf-8"))):
                if row and row[-1] in self._missing:
                    self._missing.discard(row[-1])
                    row[-1] = _NA
                    changed = True
                writer.writerow(row)
        except (ValueError, csv.Error):
            return data
        if len(self._missing) > 100_000:  # files whose rows never came: forget them
            self._missing.clear()
        return out.getvalue().encode("utf-8") if changed else data

    # -- free space and failure ---------------------------------------------------------------

    def _has_room(self, rel_dir: str, nbytes: int, name: str) -> bool:
        need = self.min_free + 2 * nbytes
        free = self.tree.free_bytes(rel_dir)
        if free >= need:
            return True
        self.stats.files_skipped += 1
        message = (f"only {_size(free)} free under {self.tree.root}; skipping {name} "
                   f"(a tensor file needs {_size(self.min_free)} free plus twice its size)")
        self.stats.last_error = message
        self._warn_once("free-space", message + ". Free some space; later files are skipped "
                      "the same way (set ATB_PROBE_MIN_FREE_BYTES to change the reserve).")
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

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warn(message)

    def _stop(self, message: str) -> bool:
        """Stop writing: drop what is queued and say why, once. False if already stopped."""
        with self._cond:
            if self.failed:
                return False
            self.failed = True
            self.stats.last_error = message
            dropped = sum(s for _, s in self._jobs)
            self._jobs.clear()
            self.stats.bytes_queued -= dropped
            self._cond.notify_all()
        log.error(message)
        return True


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 1024 ** 2:.1f} MiB"


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
