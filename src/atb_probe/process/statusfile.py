"""The status file of one process, `atb_dump_data/status/<dev>_<pid>.json` (SPEC §4).

`StatusFile.write` asks the probe for its document and rewrites the file atomically when the
document changed since the last write; `updated_at` is added at each write. The final write
(`exited: true`, when the probe closes) is the last: nothing is written after it. The fields are
listed in `Probe.status`; `atb-probe status` reads them.

`lock` (reentrant) serialises the writes, and is also what the probe holds while the process's
`<dev>_<pid>` name changes (its device is decided at the first round) and the file under the old
name is removed: a write taking the old name at that moment would bring the file back.
"""
from __future__ import annotations

import datetime
import json
import threading
from typing import Callable

from .. import layout, log
from ..record.safefs import SafeTree


def utc_now() -> str:
    """Now, as an ISO 8601 time in UTC with milliseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class StatusFile:
    """Writes a process's status document whenever it changes; `document` gives its
    `<dev>_<pid>` name and the document, `quiet` says whether a failing disk was reported."""

    def __init__(self, tree: SafeTree, document: Callable[[], tuple[str, dict]],
                 quiet: Callable[[], bool]):
        self.tree = tree
        self.lock = threading.RLock()
        self._document = document
        self._quiet = quiet
        self._last: dict | None = None  # the last document written, without updated_at
        self._name: str | None = None   # the file it went to
        self._final = False

    def write(self, final: bool = False) -> None:
        """Rewrite the file (atomically) if anything in it changed; `final` marks it exited."""
        with self.lock:
            if self._final:
                return
            devpid, doc = self._document()
            if final:  # the process is done: it neither sleeps nor dumps any more
                doc["exited"] = True
                doc["state"] = "exited"
            if not final and doc == self._last:
                return
            snapshot = dict(doc)
            doc["updated_at"] = utc_now()
            name = layout.status_file(devpid)
            try:
                self.tree.write_file(layout.STATUS_DIR, name, [json.dumps(doc, indent=2).encode()])
                self._last, self._name = snapshot, name
                self._final = final
            except OSError as exc:
                if not self._quiet():  # the writer has already said why the disk failed
                    log.warn_once("status-write", f"cannot write the status file: {exc}")

    def write_final(self, timeout: float) -> bool:
        """The last write, unless a write blocked on a stuck disk holds the lock for `timeout`
        seconds: the probe is closing and must not wait for it."""
        if not self.lock.acquire(timeout=timeout):
            return False
        try:
            self.write(final=True)
        finally:
            self.lock.release()
        return True

    def drop_other_names(self, devpid: str) -> None:
        """Remove the file written under another name than `devpid`'s. Call with `lock` held,
        together with the change of name."""
        if self._name is None or self._name == layout.status_file(devpid):
            return
        try:
            self.tree.remove_file(layout.STATUS_DIR, self._name)
        except OSError:
            pass
        self._last = None
