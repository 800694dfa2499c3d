"""Process hooks: close every open probe at exit and on SIGTERM, restart them in a forked child.

A probe calls `register` when it starts and `unregister` when it closes. The hooks themselves
are installed once per process and always act on the probes open at that moment, so a probe
enabled, disabled and enabled again is flushed by SIGTERM like the first one was, and a closed
probe is neither kept alive nor touched again.

- exit: one `atexit` function closes the open probes (each flushes what it has queued, bounded
  by `exit_timeout()`). A `multiprocessing` child never runs `atexit`: it leaves through
  `os._exit` once its target returns (or raises, as vLLM's engine core and workers do on
  SIGTERM). It does run the finalizers of `multiprocessing.util` first, so the probes are closed
  by one of those too. The child clears the finalizers it inherited or registered before its
  target starts (spawn loads the probe before that), so ours is registered again then, by an
  after-fork function of the same module.
- SIGTERM: when the host has no handler of its own (the disposition is the default), ours
  closes the open probes and then dies of SIGTERM as the process would have. A host with its own
  handler (uvicorn, gunicorn...) exits normally, through `atexit`; uvicorn also puts this handler
  back and re-raises the signal once it has shut down. When the last probe closes in the main
  thread, the default disposition is put back.
- fork: a forked child is a new process; each probe open at the fork starts afresh there
  (`Probe.after_fork_in_child`). `os.register_at_fork` cannot be undone, so it is registered once
  and consults the open probes.

`_lock` guards `_open` and the installed flags; nothing here calls a probe while holding it.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading

from .threadname import name_this_thread

_open: list = []            # the probes open in this process, oldest first
_lock = threading.Lock()
_process_hooks = False      # atexit and fork functions registered (once per process)


def exit_timeout() -> float:
    """How long closing may wait for queued data at exit (`ATB_PROBE_EXIT_TIMEOUT`, s)."""
    try:
        return float(os.environ.get("ATB_PROBE_EXIT_TIMEOUT", "60"))
    except ValueError:
        return 60.0


def register(probe) -> None:
    """`probe` is open: close it at exit and on SIGTERM, restart it after a fork."""
    global _process_hooks
    with _lock:
        _open.append(probe)
        first = not _process_hooks
        _process_hooks = True
    if first:
        atexit.register(close_all)
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _close_at_multiprocessing_exit()
    _install_sigterm()


def unregister(probe) -> None:
    """`probe` is closed: the hooks leave it alone from now on."""
    with _lock:
        if probe in _open:
            _open.remove(probe)
        last = not _open
    if last:
        _restore_sigterm()


def open_probes() -> list:
    """The probes open now, oldest first."""
    with _lock:
        return list(_open)


def close_all() -> None:
    """Close every open probe, newest first (each flushes its queue, bounded)."""
    for probe in reversed(open_probes()):
        probe.close()


class _ChildExit:
    """The object `multiprocessing.util.register_after_fork` holds (weakly) for our finalizer."""


_child_exit = _ChildExit()


def _close_at_multiprocessing_exit() -> None:
    """Close the open probes when a multiprocessing child ends (it skips `atexit`), also after
    the child's start clears the finalizers (spawn and fork alike)."""
    from multiprocessing import util
    _finalizer()
    util.register_after_fork(_child_exit, _finalizer)


def _finalizer(_=None) -> None:
    from multiprocessing import util
    util.Finalize(None, close_all, exitpriority=100)


def _after_fork_in_child() -> None:
    global _lock
    # The parent's lock may have been held by another of its threads at the fork: the child
    # has only this thread, so it takes a fresh one.
    _lock = threading.Lock()
    for probe in list(_open):
        probe.after_fork_in_child()


def _close_all_named() -> None:
    name_this_thread()
    close_all()


def _on_sigterm(signum, frame) -> None:
    # The handler runs between two bytecodes of the main thread, which may hold a lock `close`
    # needs: close from another thread, for a bounded time.
    closer = threading.Thread(target=_close_all_named, name="atb-probe-exit", daemon=True)
    closer.start()
    closer.join(exit_timeout() + 5)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Ours, over the default disposition only (not over the host's handler, nor twice); only
    the main thread can install one."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass


def _restore_sigterm() -> None:
    """The default disposition back, if ours is still the handler (the host may have replaced
    it since) and this is the main thread (else ours stays: with no probe open it just dies)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
