"""Running an analysis over many tensors at once: the job count, the process pool, the
progress bar. Shared by `compare` and `scan`.

The work is numpy on tensors read from page cache: CPU-bound and holding the GIL between numpy
calls, so it runs in processes (`concurrent.futures.ProcessPoolExecutor`), one per job. The
workers start from a fork server that has already imported the tools: a clean process (no copy
of a parent's threads or locks, which a plain fork would take along) that costs one import for
all workers rather than one per worker.

A new worker re-runs the main script of its parent (as `__mp_main__`) when the parent's
`__main__` names a file, which fails where that file does not exist: a script fed on standard
input (`python - <<EOF`) has `__file__` "<stdin>". The workers need nothing from the main
script (their functions live in this package), so while such a pool starts its workers, that
`__file__` is set aside.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context

_PRELOAD = ["atb_probe.tools.compare", "atb_probe.tools.scan"]
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@contextmanager
def worker_pool(jobs: int):
    """A pool of `jobs` worker processes, shut down on leaving: `with worker_pool(n) as pool`.
    Its workers start at the first task, so the first task goes in inside the block."""
    try:
        context = get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
    except ValueError:          # no fork server on this platform
        context = get_context("spawn")
    with _main_file_set_aside(), _one_blas_thread_each(), \
            ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        yield pool


@contextmanager
def _one_blas_thread_each():
    """The jobs are the parallelism: each worker's BLAS gets one thread (unless the user's
    environment says otherwise), or the workers' dot products spread over threads that wait for
    cores the other workers hold. Set in the environment while the pool starts: the fork server
    (started once per process, at the first pool) and so every later worker keep it."""
    had = os.environ.get(_BLAS_THREADS)
    if had is None:
        os.environ[_BLAS_THREADS] = "1"
    try:
        yield
    finally:
        if had is None:
            os.environ.pop(_BLAS_THREADS, None)


@contextmanager
def _main_file_set_aside():
    """Remove `__main__.__file__` for the duration when workers could not run that file (see
    the module docstring); otherwise do nothing."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class progress_bar:
    """A rich progress bar on stderr while work is done (silent when not a terminal).

    Used as `with progress_bar(console, "comparing") as progress:`; `progress(total)` starts
    the bar and returns a callable that advances it by a count."""

    def __init__(self, console, label: str):
        self.console = console
        self.label = label
        self.bar = None

    def __enter__(self):
        return self.start

    def start(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
        self.bar = Progress(self.label, BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=self.console, transient=True,
                            disable=not self.console.is_terminal)
        self.bar.start()
        task = self.bar.add_task(self.label, total=total)
        return lambda n=1: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
