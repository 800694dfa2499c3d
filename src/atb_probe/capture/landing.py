"""Copies from an accelerator to pinned host memory, seen through off the model thread.

A tensor file's bytes and a batch of device statistics reach the host by a copy queued without
blocking (`to_host`), with an event recorded after it. The model thread never waits for such an
event, and the writer must not either: it never touches torch. So each probe has a landing
thread (`atb-probe-landing`, started at the first copy, ending after a second with nothing to
do) that waits for the copies' events in the order they were queued and runs what follows each
(filling a batch's statistics cells). What the writer is handed is a `Landed`: it waits on a
`threading.Condition`, nothing else.

Without an accelerator nothing is queued here and no thread starts.
"""
from __future__ import annotations

import threading

import torch

from ..process.threadname import name_this_thread

# The landing thread ends after this long with no copy to wait for; the next copy starts it again.
IDLE_SECONDS = 1.0


def to_host(x: torch.Tensor):
    """A copy of device tensor `x` in pinned host memory, queued on the current stream without
    waiting, and the event recorded after it: (host tensor, event). Read the host tensor only
    once the event is complete (`Landings.watch`)."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    event = getattr(torch, x.device.type).Event()
    event.record()
    return host, event


class Landed:
    """The writer's side of copies on their way: `wait` returns once the copy numbered
    `number`, and every copy queued before it, has landed and been followed up. It raises the
    error of the first copy that failed (a device error) if that one is among them: such a dump
    cannot go on."""

    __slots__ = ("_landings", "_number")

    def __init__(self, landings: Landings, number: int):
        self._landings, self._number = landings, number

    def wait(self) -> None:
        self._landings.wait_for(self._number)


class Landings:
    """The copies of one probe on their way to the host, and the thread that sees them land."""

    def __init__(self):
        self._begin()

    def _begin(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict = {}      # number -> (event or None, what follows it or None)
        self._queued = 0              # copies numbered so far (`reserve`)
        self._landed = 0              # copies landed and followed up so far
        self._thread: threading.Thread | None = None
        self.failure: Exception | None = None  # the first copy that failed
        self._failed_at = 0                    # its number (0: none failed)

    def reserve(self) -> int:
        """The number of a copy about to be queued. Take it before anything another thread
        may see points at the copy (a `DEVICE` cell), so that `last()` covers it from then on."""
        with self._cond:
            self._queued += 1
            return self._queued

    def watch(self, event, then=None, number: int | None = None) -> Landed:
        """Queue a copy whose `event` (None: nothing to wait for) completes it, as `number`
        (from `reserve`) or the next number; `then()` runs on the landing thread once it has.
        The model thread's side: never waits."""
        with self._cond:
            if number is None:
                self._queued += 1
                number = self._queued
            self._waiting[number] = (event, then)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="atb-probe-landing",
                                                daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()
        return Landed(self, number)

    def last(self) -> Landed | None:
        """What to wait for before reading anything queued so far: None when it has all landed
        (always, without accelerators)."""
        if self._landed == self._queued:  # no lock needed to see that nothing is on its way
            return None
        with self._cond:
            if self._landed == self._queued:
                return None
            return Landed(self, self._queued)

    def pending(self) -> int:
        """How many copies have not landed yet."""
        return self._queued - self._landed

    def wait_for(self, number: int) -> None:
        """Wait until copy `number` has landed; raise if it, or one before it, failed."""
        with self._cond:
            while self._landed < number:
                self._cond.wait()
            if self._failed_at and self._failed_at <= number:
                raise self.failure

    def after_fork(self) -> None:
        """In a forked child: the copies and the thread are the parent's."""
        self._begin()

    def _run(self) -> None:
        name_this_thread()
        cond = self._cond
        while True:
            with cond:
                number = self._landed + 1  # copies land in the order of their numbers
                while number not in self._waiting:
                    if self._queued >= number:
                        cond.wait()  # numbered, and being queued right now
                    elif not cond.wait(IDLE_SECONDS) and number not in self._waiting \
                            and self._queued < number:
                        self._thread = None
                        return
                event, then = self._waiting.pop(number)
            try:
                if event is not None:
                    event.synchronize()
                if then is not None:
                    then()
            except Exception as exc:  # the writer, waiting, reports it and stops
                with cond:
                    if not self._failed_at:
                        self.failure, self._failed_at = exc, number
            with cond:
                self._landed = number
                cond.notify_all()
