"""Durable file writes (what must survive a crash is written whole or not at all), and
locks that end with the process that holds them."""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range``, which Python's ``os`` does not offer; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; wait for nothing


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` at ``offset`` to disk now, so
    that a later fsync has less left to wait for (Linux; elsewhere it does nothing). A hint,
    never a promise: only fsync makes bytes durable, and an error here is ignored."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def drop_cached(path: Path) -> None:
    """Ask the kernel to drop ``path``'s pages from its page cache: a file written once and
    not read again soon need not crowd out what is (a hint; a later read finds the bytes
    on disk). Only pages already on disk go, so sync the file first. Does nothing where
    unsupported or if the file is gone."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, chunks: Iterable[bytes], mode: int | None = None) -> None:
    """Temp file in the same folder, fsync, rename, fsync the folder: a reader (or a
    restart after a crash) sees the old file or the new one, never a partial one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is the pid it wrote, or ''."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by {f'pid {holder}' if holder else 'another process'}")
        self.path, self.holder = path, holder

    @property
    def who(self) -> str:
        """' (pid N)', or '' when the holder wrote none yet: for messages."""
        return f" (pid {self.holder})" if self.holder else ""


class ProcessLock:
    """An exclusive lock on ``path`` for as long as this process holds it open.

    The kernel lets it go when the process exits however it exits, SIGKILL included, so
    a lock left behind never needs clearing. The holder's pid is written into the file,
    for the message another process gets.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise LockHeld(path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # and the lock with it
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor lets the lock go
            self._fd = None
