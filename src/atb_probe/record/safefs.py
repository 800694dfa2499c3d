"""Writing under the output tree without following links and without leaving partial files.

Every directory below the tree root is created with mode 0750 and opened with `O_NOFOLLOW`
relative to its parent's descriptor, so a symbolic link planted anywhere in the tree (the root
included) is refused rather than followed. Files are written to a hidden temporary name in their
final directory and renamed into place, with mode 0640: a reader sees a complete file or none.
"""
from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict

DIR_MODE = 0o750
FILE_MODE = 0o640
MAX_PATH = 2048
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NEW_FILE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                   | getattr(os, "O_CLOEXEC", 0))
TMP_SUFFIX = ".tmp"


class UnsafePathError(OSError):
    """A path that the tree refuses: a symbolic link, a non-directory, or too long."""


class SafeTree:
    """A directory tree rooted at `root` (created if needed) that is written safely."""

    def __init__(self, root: str, max_open_dirs: int = 64):
        self.root = os.path.abspath(root)
        self._dirs: OrderedDict[str, int] = OrderedDict()
        self._max = max_open_dirs
        self._lock = threading.Lock()

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def check_length(self, rel_dir: str, name: str = "") -> None:
        full = os.path.join(self.path(rel_dir), name)
        if len(full.encode("utf-8", "surrogateescape")) > MAX_PATH:
            raise UnsafePathError(errno.ENAMETOOLONG,
                                  f"path of {len(full)} characters is over the {MAX_PATH} limit",
                                  full[:120] + "...")

    def ensure_dir(self, rel: str) -> int:
        """A new descriptor of directory `rel` (relative to the root), created as needed.

        The caller closes it; the tree keeps its own cached descriptors private so that evicting
        one never pulls a descriptor from under a concurrent writer."""
        self.check_length(rel)
        with self._lock:
            return os.dup(self._ensure_locked(rel))

    def makedirs(self, rel: str) -> None:
        """Create directory `rel` (and its parents) below the root."""
        os.close(self.ensure_dir(rel))

    def _ensure_locked(self, rel: str) -> int:
        fd = self._dirs.get(rel)
        if fd is not None:
            self._dirs.move_to_end(rel)
            return fd
        if not rel:
            fd = self._open_root()
        else:
            parent_rel, _, name = rel.rpartition("/")
            parent = self._ensure_locked(parent_rel)
            fd = _open_child_dir(parent, name, self.path(rel))
        self._remember(rel, fd)
        return fd

    def _open_root(self) -> int:
        parent, name = os.path.split(self.root)
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            return _open_child_dir(pfd, name, self.root)
        finally:
            os.close(pfd)

    def _remember(self, rel: str, fd: int) -> None:
        self._dirs[rel] = fd
        # Parents are looked up again while children are open: evict least recently used only.
        while len(self._dirs) > self._max:
            _, old = self._dirs.popitem(last=False)
            os.close(old)

    def write_file(self, rel_dir: str, name: str, chunks: list) -> int:
        """Write `chunks` (bytes-like) atomically as `rel_dir/name`; the number of bytes."""
        self.check_length(rel_dir, name)
        dfd = self.ensure_dir(rel_dir)
        try:
            return self._write_in(dfd, name, chunks)
        finally:
            os.close(dfd)

    @staticmethod
    def _write_in(dfd: int, name: str, chunks: list) -> int:
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        fd = os.open(tmp, _NEW_FILE_FLAGS, FILE_MODE, dir_fd=dfd)
        total = 0
        try:
            os.fchmod(fd, FILE_MODE)
            total = _write_all(fd, chunks)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        return total

    def append_lines(self, rel_dir: str, name: str, text: bytes, header: bytes = b"") -> int:
        """Append complete lines to `rel_dir/name` in one write; a new file starts with `header`."""
        self.check_length(rel_dir, name)
        dfd = self.ensure_dir(rel_dir)
        try:
            try:
                fd = os.open(name, _NEW_FILE_FLAGS, FILE_MODE, dir_fd=dfd)
                os.fchmod(fd, FILE_MODE)
                data = header + text
            except FileExistsError:
                fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW
                             | getattr(os, "O_CLOEXEC", 0), dir_fd=dfd)
                data = text
        finally:
            os.close(dfd)
        try:
            return _write_all(fd, [data])
        finally:
            os.close(fd)

    def free_bytes(self, rel_dir: str) -> int:
        dfd = self.ensure_dir(rel_dir)
        try:
            st = os.fstatvfs(dfd)
        finally:
            os.close(dfd)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        with self._lock:
            for fd in self._dirs.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._dirs.clear()


def _open_child_dir(parent_fd: int, name: str, shown: str) -> int:
    if not name or name in (".", "..") or "/" in name:
        raise UnsafePathError(errno.EINVAL, "invalid directory name", shown)
    created = False
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(exc.errno, "refusing to write through a symbolic link or "
                                  "into a non-directory", shown) from None
        raise
    if created:
        os.fchmod(fd, DIR_MODE)
    return fd


def _write_all(fd: int, chunks: list) -> int:
    views = [memoryview(c).cast("B") for c in chunks]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total
