"""Writing under the output tree without following links and without leaving partial files.

Every directory below the tree root is created with mode 0750 and opened with `O_NOFOLLOW`
relative to its parent's descriptor, so a symbolic link planted anywhere in the tree (the root
included) is refused rather than followed. Files are written to a hidden temporary name in their
final directory and renamed into place, with mode 0640 whatever the umask: a reader sees a
complete file or none, and a link planted at the final name is replaced, never written through.
Appending is done the same way (old content + new lines into a temporary file, then a rename), so
even a process killed in the middle of a write leaves only complete lines behind.

Names are checked before use: one path component (no `/`, no NUL, not `.` or `..`), at most 255
bytes, and the whole path at most `MAX_PATH` characters; anything else is an `UnsafePathError`.
A process killed between creating and renaming a temporary file leaves a hidden
`.<name>.<pid>.<random>.tmp` behind, never a partial file under the final name.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict

DIR_MODE = 0o750
FILE_MODE = 0o640
MAX_PATH = 2048
MAX_NAME_BYTES = 255
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
# O_NONBLOCK: a FIFO planted at the name must not block the writer.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
TMP_SUFFIX = ".tmp"
_WRITE_CHUNK = 8 * 1024 * 1024  # bytes per write call, so progress is visible on slow disks


class UnsafePathError(OSError):
    """A path that the tree refuses: a symbolic link, a non-directory, a bad name, too long."""


class SafeTree:
    """A directory tree rooted at `root` (created if needed) that is written safely.

    More methods than we like in a class: every way of writing shares the cache of open
    directory descriptors and its lock."""

    def __init__(self, root: str, max_open_dirs: int = 64):
        self.root = os.path.abspath(root)
        self._dirs: OrderedDict[str, int] = OrderedDict()
        self._max = max_open_dirs
        self._lock = threading.Lock()
        self._closed = False  # after close(): directories are opened per use, not cached
        self.stuck = False    # set when the disk stopped answering: fail fast, never block
        self.progress = None  # called with the byte count after each chunk written

    def watch_progress(self, callback) -> None:
        """Call `callback(nbytes)` after each chunk written (the writer's stall detection)."""
        self.progress = callback

    def give_up(self) -> None:
        """The disk stopped answering: later writes fail at once instead of blocking."""
        self.stuck = True

    def path(self, rel_dir: str, name: str = "") -> str:
        """The absolute path of `rel_dir/name` (either may be empty)."""
        return os.path.join(self.root, *(part for part in (rel_dir, name) if part))

    def check_length(self, rel_dir: str, name: str = "") -> None:
        """UnsafePathError when `rel_dir/name` would be longer than `MAX_PATH` characters."""
        full = self.path(rel_dir, name)
        if len(full.encode("utf-8", "surrogateescape")) > MAX_PATH:
            raise UnsafePathError(errno.ENAMETOOLONG,
                                  f"path of {len(full)} characters is over the {MAX_PATH} limit",
                                  full[:120] + "...")

    def ensure_dir(self, rel: str) -> int:
        """A new descriptor of directory `rel` (relative to the root), created as needed.

        The caller closes it; the tree keeps its own cached descriptors private so that evicting
        one never pulls a descriptor from under a concurrent writer."""
        self.check_length(rel)
        if self.stuck:
            raise OSError(errno.ETIMEDOUT, "the disk stopped responding; not writing",
                          self.path(rel))
        with self._lock:
            if self._closed:
                return self._open_uncached(rel)
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

    def _open_uncached(self, rel: str) -> int:
        fd = self._open_root()
        for name in rel.split("/") if rel else ():
            try:
                child = _open_child_dir(fd, name, self.path(rel))
            finally:
                os.close(fd)
            fd = child
        return fd

    def _open_root(self) -> int:
        parent, name = os.path.split(self.root)
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
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
        check_name(name, self.path(rel_dir))
        self.check_length(rel_dir, name)
        dfd = self.ensure_dir(rel_dir)
        try:
            return self._replace(dfd, name, lambda fd: self._write_all(fd, chunks),
                                 self.path(rel_dir, name))
        finally:
            os.close(dfd)

    def remove_file(self, rel_dir: str, name: str) -> None:
        """Remove `rel_dir/name` if it is there (a link is removed, never followed)."""
        check_name(name, self.path(rel_dir))
        dfd = self.ensure_dir(rel_dir)
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def append_lines(self, rel_dir: str, name: str, text: bytes, header: bytes = b"") -> int:
        """Append complete lines to `rel_dir/name`; a new file starts with `header`.

        The old content and the new lines go to a temporary file that replaces the old one, so a
        reader (or a kill) never sees a partial line. Something other than a regular file at the
        name (a planted link, a FIFO) is neither read nor written through: a new file replaces
        it. Returns the number of new bytes."""
        check_name(name, self.path(rel_dir))
        self.check_length(rel_dir, name)
        dfd = self.ensure_dir(rel_dir)
        try:
            old = _open_existing(dfd, name)
            try:
                def fill(fd):
                    if old is None:
                        return self._write_all(fd, [header, text])
                    _copy(old, fd)
                    return self._write_all(fd, [text])
                return self._replace(dfd, name, fill, self.path(rel_dir, name))
            finally:
                if old is not None:
                    os.close(old)
        finally:
            os.close(dfd)

    def _replace(self, dfd: int, name: str, fill, shown: str) -> int:
        tmp = _temp_name(name)
        try:
            fd = os.open(tmp, _NEW_FILE_FLAGS, FILE_MODE, dir_fd=dfd)
        except OSError as exc:  # name the file the caller asked for, not our temporary one
            raise OSError(exc.errno, exc.strerror, shown) from None
        try:
            os.fchmod(fd, FILE_MODE)
            total = fill(fd)
            os.close(fd)
            fd = -1
            try:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as exc:
                if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                raise UnsafePathError(exc.errno, "a directory is in the way of a file",
                                      shown) from None
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            if type(exc) is not UnsafePathError and isinstance(exc, OSError) and \
                    exc.filename in (None, tmp):
                raise OSError(exc.errno, exc.strerror, shown) from None
            raise
        return total

    def _write_all(self, fd: int, chunks: list) -> int:
        views = [memoryview(c).cast("B") for c in chunks]
        views = [v for v in views if v.nbytes]
        total = sum(v.nbytes for v in views)
        progress = self.progress
        while views:
            batch, size = [], 0
            while views and size < _WRITE_CHUNK:
                v = views[0]
                if size + v.nbytes > _WRITE_CHUNK:
                    v, views[0] = v[:_WRITE_CHUNK - size], v[_WRITE_CHUNK - size:]
                else:
                    views.pop(0)
                batch.append(v)
                size += v.nbytes
            while batch:
                n = os.writev(fd, batch)
                if progress is not None:
                    progress(n)
                while batch and n >= batch[0].nbytes:
                    n -= batch[0].nbytes
                    batch.pop(0)
                if batch and n:
                    batch[0] = batch[0][n:]
        return total

    def free_bytes(self, rel_dir: str) -> int:
        """Bytes available to this (unprivileged) user on the file system holding `rel_dir`."""
        dfd = self.ensure_dir(rel_dir)
        try:
            st = os.fstatvfs(dfd)
        finally:
            os.close(dfd)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        """Close the cached directory descriptors; later writes open directories per use."""
        if not self._lock.acquire(timeout=1):  # a writer stuck in the kernel holds it
            self._closed = True
            return
        try:
            self._closed = True
            for fd in self._dirs.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._dirs.clear()
        finally:
            self._lock.release()


def check_name(name: str, where: str = "") -> None:
    """UnsafePathError unless `name` is one harmless path component of at most 255 bytes."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafePathError(errno.EINVAL, f"refusing the file name {name[:80]!r}: not a "
                              "single path component", where)
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise UnsafePathError(errno.ENAMETOOLONG, f"refusing a file name of {len(name)} "
                              f"characters (at most {MAX_NAME_BYTES} bytes)", where)


def _temp_name(name: str) -> str:
    # Unpredictable, so nobody can plant something at it in advance; short enough for NAME_MAX.
    stem = name.encode("utf-8", "surrogateescape")[:180].decode("utf-8", "ignore")
    return f".{stem}.{os.getpid()}.{os.urandom(6).hex()}{TMP_SUFFIX}"


def _open_child_dir(parent_fd: int, name: str, shown: str) -> int:
    check_name(name, shown)
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
            try:
                link = stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode)
            except OSError:
                link = exc.errno == errno.ELOOP
            what = "a symbolic link" if link else "not a directory"
            raise UnsafePathError(exc.errno, f"refusing to write through {what}",
                                  shown) from None
        raise
    if created:
        try:
            os.fchmod(fd, DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _open_existing(dfd: int, name: str) -> int | None:
    """A read descriptor of the regular file `name` in `dfd`; None when there is none (or
    something else is there: a link is not followed, a FIFO not waited on)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return None
        raise
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _copy(src: int, dst: int) -> None:
    """Copy all of `src` (from its start) to `dst`, in the kernel where it can."""
    offset = 0
    try:
        while True:
            n = os.copy_file_range(src, dst, 1 << 30, offset)
            if not n:
                return
            offset += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) \
                or offset:
            raise
    os.lseek(src, 0, os.SEEK_SET)
    while True:
        part = os.read(src, 1 << 20)
        if not part:
            return
        view = memoryview(part)
        while view:
            view = view[os.write(dst, view):]
