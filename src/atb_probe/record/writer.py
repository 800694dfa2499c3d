"""The background writer: the model thread hands over copies, a writer thread puts them on disk.

Jobs are queued in order and written by one thread, so the rows of a round's statistic.csv come
after the files they name. The queue is bounded in bytes: a producer that outruns the disk waits
(back-pressure) instead of growing memory without limit. Before each tensor file the free space
is checked (SPEC §6: at least `min_free` bytes and twice the file); a full disk or any other write
error stops the writer with one clear message, and nothing half-written is left behind.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from .. import log
from .safefs import SafeTree

GIB = 1024 ** 3
DEFAULT_QUEUE_BYTES = 128 * 1024 ** 2
_JOB_OVERHEAD = 256  # accounted bytes for a job besides its payload


@dataclass
class WriterStats:
    files_written: int = 0
    bytes_written: int = 0
    bytes_queued: int = 0
    files_skipped: int = 0
    last_error: str | None = None


class Writer:
    """Writes files and csv rows under a `SafeTree` from a background thread."""

    def __init__(self, tree: SafeTree, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 min_free: int | None = None):
        self.tree = tree
        self.capacity = queue_bytes
        self.min_free = _min_free_from_env() if min_free is None else min_free
        self.stats = WriterStats()
        self.failed = False
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self._free_checked: dict[str, tuple[float, int]] = {}

    # -- producer side (model threads) --------------------------------------------------------

    def put_file(self, rel_dir: str, name: str, chunks: list, payload_bytes: int) -> None:
        """Queue a file made of `chunks` (header bytes, then buffers the writer may keep)."""
        self._put(("file", rel_dir, name, chunks), payload_bytes + _JOB_OVERHEAD)

    def put_rows(self, rel_dir: str, name: str, text: str, header: str) -> None:
        """Queue complete csv lines for `rel_dir/name`; a new file starts with `header`."""
        data = text.encode("utf-8")
        self._put(("rows", rel_dir, name, data, header.encode("utf-8")),
                  len(data) + _JOB_OVERHEAD)

    def put_json(self, rel_dir: str, name: str, obj) -> None:
        """Queue a JSON document; it is serialised on the writer thread."""
        self._put(("json", rel_dir, name, obj), 4096)

    def _put(self, job: tuple, size: int) -> None:
        if self.failed or self._closed:
            return
        with self._cond:
            self._ensure_thread()
            while self.stats.bytes_queued and self.stats.bytes_queued + size > self.capacity \
                    and not self.failed:
                self._cond.wait(0.5)
            if self.failed:
                return
            self._jobs.append((job, size))
            self.stats.bytes_queued += size
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is on disk; False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                if self._thread is None or not self._thread.is_alive():
                    return not self._jobs
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(left, 0.1))
        return True

    def pending(self) -> int:
        with self._cond:
            return self.stats.bytes_queued

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's queue and thread."""
        self._jobs = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread = None
        self.stats = WriterStats()

    # -- writer thread ------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="atb-probe-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, size = self._jobs.popleft()
                self._busy = True
            try:
                if not self.failed:
                    self._do(job)
            except Exception as exc:  # the writer must never die silently
                self._fail(exc, job)
            finally:
                with self._cond:
                    self.stats.bytes_queued -= size
                    self._busy = False
                    self._cond.notify_all()

    def _do(self, job: tuple) -> None:
        kind = job[0]
        if kind == "file":
            _, rel_dir, name, chunks = job
            nbytes = sum(memoryview(c).nbytes for c in chunks)
            if not self._has_room(rel_dir, nbytes, name):
                return
            self.tree.write_file(rel_dir, name, chunks)
            self.stats.files_written += 1
            self.stats.bytes_written += nbytes
        elif kind == "rows":
            _, rel_dir, name, data, header = job
            self.stats.bytes_written += self.tree.append_lines(rel_dir, name, data, header)
        elif kind == "json":
            _, rel_dir, name, obj = job
            data = json.dumps(obj, indent=2, ensure_ascii=False, default=str).encode("utf-8")
            self.stats.bytes_written += self.tree.write_file(rel_dir, name, [data])
            self.stats.files_written += 1

    def _has_room(self, rel_dir: str, nbytes: int, name: str) -> bool:
        need = self.min_free + 2 * nbytes
        free = self.tree.free_bytes(rel_dir)
        if free >= need:
            return True
        self.stats.files_skipped += 1
        message = (f"only {free / GIB:.2f} GiB free under {self.tree.root}; skipping {name} "
                   f"(needs {self.min_free / GIB:.2f} GiB + twice the file's size)")
        if self.stats.last_error != message.split(";")[0]:
            log.warn_once("free-space", message + ". Free some space; later files are skipped "
                          "the same way.")
        self.stats.last_error = message
        return False

    def _fail(self, exc: Exception, job: tuple) -> None:
        where = os.path.join(self.tree.root, job[1], job[2]) if len(job) > 2 else self.tree.root
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            message = f"disk full while writing {where}; dumping stopped"
        else:
            message = f"cannot write {where}: {exc}; dumping stopped"
        self.failed = True
        self.stats.last_error = message
        log.error(message)
        with self._cond:
            dropped = sum(s for _, s in self._jobs)
            self._jobs.clear()
            self.stats.bytes_queued -= dropped
            self._cond.notify_all()


def _min_free_from_env() -> int:
    # Documented for tests and small disks; the SPEC default is 2 GiB.
    raw = os.environ.get("ATB_PROBE_MIN_FREE_BYTES", "")
    try:
        return max(0, int(raw)) if raw else 2 * GIB
    except ValueError:
        return 2 * GIB
