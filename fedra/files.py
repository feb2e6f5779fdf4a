"""Durable file writes (what must survive a crash is written whole or not at all), and
locks that end with the process that holds them."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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
