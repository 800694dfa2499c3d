"""The writer process: small files written by another process, out of the model's GIL.

In `statistics` mode a round's files are all small (statistic.csv rows, tokens.json, the
structure files, op_param.json) and writing them is mostly file-system work: a folder, a
temporary file and a rename each, ~0.1–0.3 ms apiece on a VM. A thread doing that in the model's
process either competes with the model for the GIL (writes during the generation slow it) or
leaves it all for the next `flush` (the model's caller waits for it). Another process does it
while the model runs and costs the model nothing but the pickling of each job.

`Sidecar` is the model side. It starts the process (`python -I`, so that no load script, no
`PYTHONPATH` and no user site loads a probe into it) from a thread, since `Popen` takes
milliseconds in a large process and the first job comes in a dumped round; it makes the pipes
first, so that jobs wait in them meanwhile. It writes each job to the process's stdin as a
length-prefixed pickle, and reads nothing back on the hot path: the process publishes its
counters (bytes done, files written and skipped, whether it failed and its last error) in a
shared memory page. The bytes sent and not yet done are bounded by the writer's queue size: a
producer that outruns the disk waits (back-pressure) for the process to catch up, at most the
stall timeout without progress. `flush` sends a marker and waits for the process to echo it,
once everything before it is on disk.

`serve` is the process side: it feeds the jobs to an ordinary `Writer` (a thread, the same
checks, messages and atomic writes) that batches rows for `PROCESS_ROWS_DELAY` only, so that
what a round queues is on disk soon after the round and a flush has little left to do. The
process runs at `ATB_PROBE_WRITER_NICE` (the lowest priority by default), ignores SIGINT and
SIGTERM (they are its parent's to handle: the parent flushes and closes) and ends when its stdin
closes, after writing everything it was sent: a killed parent loses nothing it had handed over.

Jobs that wait for an accelerator copy and tensor files are never sent: the writer keeps those
on its thread (writer.py). By default (`ATB_PROBE_WRITER=auto`) the probe starts a process only
where the model leaves a core idle for it: where the model's threads take every core, a process
at the lowest priority writes only once they wait, after the generation, and then costs more
than the thread (it unpickles what the thread has at hand). Linux only (a shared memory page
from `memfd_create`).
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from ..process.threadname import name_this_thread
from . import jsontext
from .jobs import JsonJob

PROCESS_ROWS_DELAY = 0.01
_PAGE = 4096
# done (accounted bytes), files, bytes, skipped, failed, progress_ns, error_len, error seq
_COUNTERS = struct.Struct("<8q")
_ERROR_AT = _COUNTERS.size
_FRAME = struct.Struct("<I")
_FLUSH = b"F"                      # a flush marker frame: b"F" + 8-byte sequence number
_PIPE_BYTES = 1024 * 1024
_READY = b"R"                      # the process's first byte on stdout: it runs
_CANNOT_START = 3                  # its exit status when it cannot import the writer
_BOOT = ("import sys\nsys.path.insert(0, sys.argv[1])\n"
         "try:\n    from atb_probe.record.sidecar import serve\n"
         "except Exception:\n    sys.exit(%d)\n"
         "serve(sys.argv[2], int(sys.argv[3]))" % _CANNOT_START)


def choice() -> str:
    """`ATB_PROBE_WRITER`: "process" (a statistics dump's files always go to a writer
    process), "thread" (never), or "auto" (the default, and what any other value means: a
    process when the model leaves a core idle for it, see `Writer`)."""
    value = os.environ.get("ATB_PROBE_WRITER", "").strip().lower()
    return value if value in ("process", "thread") else "auto"


def available() -> bool:
    """Whether jobs may go to a writer process here: Linux, a Python interpreter to start it
    with (an application that embeds Python has another program as `sys.executable`), and
    not `ATB_PROBE_WRITER=thread`."""
    return choice() != "thread" and sys.platform.startswith("linux") and \
        hasattr(os, "memfd_create") and \
        os.path.basename(sys.executable or "").lower().startswith("python")


class SidecarDied(Exception):
    """The writer process is gone (killed, or it never started)."""


class Sidecar:
    """The model side of one writer process writing under `root`.

    `put` and `flush` may be called from any thread (`_lock` keeps frames whole and in order);
    the counters are read from the shared page without a lock."""

    def __init__(self, root: str, capacity: int, stall_seconds: float):
        self.root = root
        self.capacity = capacity
        self.stall_seconds = stall_seconds
        self.sent = 0          # accounted bytes handed to the process
        self.ready = False     # the process said it runs (`_poll_ready`)
        self.early: list = []  # the jobs sent before it did: for the thread if it never does
        self.broken = False    # a frame was cut short (a stall): nothing more can be sent
        self._idle_at = time.monotonic()  # when it last had nothing to do, as seen here
        self._lock = threading.Lock()
        self._seq = 0
        memfd = os.memfd_create("atb-probe-writer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memfd, _PAGE)
            self._page = mmap.mmap(memfd, _PAGE)
            child_in, self._out = os.pipe()
            self._ack, child_out = os.pipe()
        except BaseException:
            os.close(memfd)
            raise
        try:
            import fcntl
            fcntl.fcntl(self._out, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except (ImportError, AttributeError, OSError):
            pass  # the default pipe size: the process reads it often enough
        os.set_blocking(self._out, False)
        # Started by a thread of its own: `Popen` takes milliseconds in a large process, on
        # the model's thread at its first dumped round. Jobs wait in the pipe meanwhile.
        self._popen: subprocess.Popen | None = None
        self._spawn_error: BaseException | None = None
        self._spawner: threading.Thread | None = threading.Thread(
            target=self._start, args=(memfd, child_in, child_out), name="atb-probe-spawn",
            daemon=True)
        try:
            self._spawner.start()
        except RuntimeError:  # no new thread at interpreter shutdown (Python 3.12): from here
            self._spawner = None
            self._start(memfd, child_in, child_out)

    def _start(self, memfd: int, child_in: int, child_out: int) -> None:
        if self._spawner is not None:
            name_this_thread()
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, package_parent, self.root, str(memfd)],
                stdin=child_in, stdout=child_out, pass_fds=(memfd,), close_fds=True,
                start_new_session=True)  # a Ctrl-C is for the model's process
        except BaseException as exc:  # said when a job finds the pipe's other end closed
            self._spawn_error = exc
        finally:  # (the mapping stays) the process's ends are its own now
            for fd in (memfd, child_in, child_out):
                os.close(fd)

    @property
    def _proc(self) -> subprocess.Popen | None:
        """The process once `Popen` has returned (waiting for that); None when it could not
        be started."""
        if self._spawner is not None:
            self._spawner.join()
        return self._popen

    # -- counters (written by the process) ----------------------------------------------------

    def _counters(self) -> tuple:
        return _COUNTERS.unpack_from(self._page, 0)

    @property
    def done(self) -> int:
        return self._counters()[0]

    @property
    def failed(self) -> bool:
        return bool(self._counters()[4])

    def queued(self) -> int:
        return max(0, self.sent - self.done)

    def counters(self) -> tuple[int, int, int, str | None]:
        """files written, bytes written, files skipped, last error."""
        for _ in range(3):  # a seqlock: the error text is re-read while it is being rewritten
            before = self._counters()
            text = bytes(self._page[_ERROR_AT:_ERROR_AT + before[6]]).decode("utf-8", "replace")
            after = self._counters()
            if before[7] == after[7] and not before[7] % 2:
                break
        return after[1], after[2], after[3], (text or None)

    # -- producer side --------------------------------------------------------------------------

    def put(self, job, size: int) -> None:
        """Send one job; wait while `size` more bytes would overrun the queue. Raises
        `SidecarDied` when the process is gone (nothing more can be sent to it)."""
        try:
            data = pickle.dumps(job, protocol=5)
        except Exception:  # a document holding what pickle refuses (a lambda in a config)
            data = pickle.dumps(_as_json_data(job), protocol=5)
        with self._lock:
            early = not self._poll_ready()
            queued = self.sent - self.done
            if not queued:
                self._idle_at = time.monotonic()  # idle time before a burst is no stall
            elif queued + size > self.capacity:
                self._wait_for_room(size)
            self._send(_FRAME.pack(len(data)) + data)
            self.sent += size
            if early:
                self.early.append(job)  # given back if the process cannot start

    def _poll_ready(self, timeout: float = 0.0) -> bool:
        """Whether the process has said it runs (its first byte), waiting at most `timeout`
        s. It starts with the writer and takes some 30 ms to import what it needs; jobs sent
        meanwhile wait in the pipe, and `early` keeps them until it has said so. Raises
        `SidecarDied` when it ended first."""
        if self.ready:
            return True
        if select.select([self._ack], [], [], timeout)[0]:
            if os.read(self._ack, 1) != _READY:
                self._reap()
                raise SidecarDied(self._why_gone(settle=False))
            self.ready, self.early = True, []
        return self.ready

    def _await_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._poll_ready(min(0.5, max(0.0, deadline - time.monotonic()))):
            self._check_alive()
            if time.monotonic() > deadline:
                self._kill()
                raise SidecarDied(self._why_gone())

    def _wait_for_room(self, size: int) -> None:
        pause = 0.0005
        while True:
            queued = self.sent - self.done
            if not queued or queued + size <= self.capacity or self.failed:
                return
            self._check_alive()
            self._check_stall()
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    def _check_stall(self) -> None:
        idle = time.monotonic() - max(self._idle_at, self._counters()[5] / 1e9)
        if idle > self.stall_seconds:
            raise SidecarStalled(stall_message(self.root, idle))

    def _check_alive(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise SidecarDied(self._why_gone())

    def _reap(self) -> None:
        """Wait for the process's end (it closed its stdout, or never started)."""
        proc = self._proc
        if proc is not None:
            proc.wait()

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _why_gone(self, settle: bool = True) -> str:
        """What became of the process (it has ended); whether it had started is settled
        first: its first byte may still wait in the pipe."""
        if settle and not self.ready:
            try:
                self._poll_ready()
            except (SidecarDied, OSError, ValueError):
                pass
        proc = self._proc
        if proc is None:
            return f"the writer process could not be started ({self._spawn_error})"
        code = proc.returncode
        if not self.ready:
            how = "could not import the probe" if code == _CANNOT_START else \
                f"did not start (status {code})"
        elif code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"ended with status {code}"
        return f"the writer process (pid {proc.pid}) {how}"

    def _send(self, frame: bytes) -> None:
        if self.broken:
            raise SidecarStalled("the writer process was given up on")
        view = memoryview(frame)
        try:
            while view:
                try:
                    n = os.write(self._out, view)
                except BlockingIOError:
                    self._check_alive()
                    self._check_stall()
                    select.select([], [self._out], [], 0.1)
                    continue
                except OSError as exc:  # EPIPE: nobody reads any more
                    proc = self._proc
                    if proc is not None:
                        proc.poll()
                    raise SidecarDied(self._why_gone()) from exc
                view = view[n:]
        except SidecarDied:
            self.broken = len(view) != len(frame)
            raise

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything sent is on disk; False when `timeout` ran out first. Raises
        `SidecarDied` when the process is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self.sent == self.done:
                return True
            if self.broken:
                return False
            if not self.ready:
                self._await_ready()
            self._seq += 1
            seq = self._seq
            self._send(_FRAME.pack(9) + _FLUSH + seq.to_bytes(8, "little"))
            got = b""
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                ready, _, _ = select.select([self._ack], [], [], 0.5 if left is None
                                            else min(left, 0.5))
                if not ready:
                    self._check_alive()
                    continue
                chunk = os.read(self._ack, 8 - len(got))
                if not chunk:
                    self._reap()
                    raise SidecarDied(self._why_gone())
                got += chunk
                if len(got) == 8:
                    if int.from_bytes(got, "little") == seq:
                        return True
                    got = b""  # an earlier flush's echo, given up on by its timeout

    def close(self, timeout: float | None = None) -> bool:
        """Flush (at most `timeout` s), then end the process: it exits by itself once its
        stdin closes, with nothing left to write (nobody waits for that). When it did not
        finish in time it is killed, as a writer thread dies with its process (a file it was
        writing stays under its hidden temporary name). Raises `SidecarDied` when it was
        gone already."""
        done = False
        try:
            done = self.flush(timeout)
            return done
        finally:
            self._close_pipes()
            if not done:
                self._kill()

    def forget(self) -> None:
        """In a forked child: let go of the parent's process without touching it."""
        self._close_pipes()

    def _close_pipes(self) -> None:
        out, ack, self._out, self._ack = self._out, self._ack, -1, -1
        for fd in (out, ack):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _as_json_data(job):
    """`job`'s document as the plain data its JSON text reads back as, which gives the same
    text (`default=str` applied here instead of in the process); anything else raises."""
    if type(job) is not JsonJob:
        raise TypeError(f"cannot send a {type(job).__name__} to the writer process")
    return JsonJob(job.rel_dir, job.name, json.loads(jsontext.dumps(job.doc)), job.size)


def stall_message(root: str, idle: float) -> str:
    """What stops a dump whose disk (or writer process) took nothing for `idle` seconds: the
    writer thread and the writer process say the same."""
    return f"the disk under {root} took nothing for {idle:.0f} s; dumping stopped so the " \
           "model can go on"


class SidecarStalled(SidecarDied):
    """The process took nothing for the stall timeout; it is left alone and sent nothing more."""


# -- the process side ---------------------------------------------------------------------------

def serve(root: str, memfd: int) -> None:
    """The writer process's main: write every job read from stdin under `root` until EOF."""
    from .safefs import SafeTree
    from .writer import Writer, _nice_from_env

    name_this_thread("atb-writer-proc")  # what `ps` shows for the process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    nice = _nice_from_env()
    if nice > 0:
        try:
            os.nice(max(0, nice - os.nice(0)))
        except OSError:
            pass
    page = mmap.mmap(memfd, _PAGE)
    writer = Writer(SafeTree(root), queue_bytes=1 << 62, rows_delay=PROCESS_ROWS_DELAY,
                    stall_seconds=1e9, process=False)
    state = _Published(page, writer)
    state.publish()
    source = sys.stdin.buffer.raw
    out = sys.stdout.buffer.raw
    _tell(out, _READY)
    publisher = threading.Thread(target=state.keep_publishing, name="atb-probe-publish",
                                 daemon=True)
    publisher.start()
    try:
        while True:
            head = _read_exactly(source, _FRAME.size)
            if head is None:
                break
            frame = _read_exactly(source, _FRAME.unpack(head)[0])
            if frame is None:
                break
            if frame[:1] == _FLUSH:
                writer.flush()
                state.publish()
                _tell(out, frame[1:9])
                continue
            job = pickle.loads(frame)
            state.received(job.size)
            writer.put(job)
    finally:
        writer.close()
        state.stop()
        publisher.join(timeout=1)
        state.publish()


class _Published:
    """The process's counters on the shared page."""

    def __init__(self, page: mmap.mmap, writer):
        self.page = page
        self.writer = writer
        self.total = 0           # accounted bytes received
        self.error = None
        self.seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._work = threading.Event()  # a job came: publish until it is written
        self._done = -1

    def received(self, size: int) -> None:
        with self._lock:
            self.total += size
        self._work.set()

    def publish(self) -> None:
        with self._lock:
            stats = self.writer.stats
            done = self.total - max(0, stats.bytes_queued)
            if done != self._done or done == self.total:  # idle is not a stall
                self._done = done
                progress = time.monotonic_ns()
            else:
                progress = _COUNTERS.unpack_from(self.page, 0)[5] or time.monotonic_ns()
            error = stats.last_error
            if error != self.error:
                self.error = error
                text = (error or "").encode("utf-8")[:_PAGE - _ERROR_AT]
                self.seq += 1  # odd: being rewritten
                self._write(done, stats, progress, len(text))
                self.page[_ERROR_AT:_ERROR_AT + len(text)] = text
                self.seq += 1
            self._write(done, stats, progress, len((self.error or "").encode("utf-8")
                                                   [:_PAGE - _ERROR_AT]))

    def _write(self, done, stats, progress, error_len) -> None:
        _COUNTERS.pack_into(self.page, 0, done, stats.files_written, stats.bytes_written,
                            stats.files_skipped, int(self.writer.failed), progress,
                            error_len, self.seq)

    def keep_publishing(self) -> None:
        """Publish every few milliseconds while jobs wait; sleep while there are none."""
        name_this_thread()
        while not self._stop.is_set():
            if self.writer.pending():
                self._stop.wait(0.005)
            else:
                self._work.clear()
                self.publish()
                self._work.wait()
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        self._work.set()


def _tell(out, data: bytes) -> None:
    """Say something to the model's process; it may be gone (killed), and what it sent is
    written all the same."""
    try:
        out.write(data)
    except OSError:
        pass


def _read_exactly(source, n: int) -> bytes | None:
    parts = []
    while n:
        chunk = source.read(n)
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
