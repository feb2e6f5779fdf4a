"""Whether a file's pages are in the OS's page cache (Linux ``mincore``), for tests of
what fedra drops from it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_PAGE = mmap.PAGESIZE


def resident_pages(path: Path) -> int:
    """How many of ``path``'s pages the page cache holds now (reading nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        start = ctypes.c_char.from_buffer(mm)  # a private mapping: nothing is read or faulted
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.addressof(start), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            del start  # the mapping closes only once no buffer refers to it


def drops_pages(folder: Path) -> bool:
    """Whether a synced file under ``folder`` leaves the page cache when asked to (not on
    tmpfs, say, where a file is its pages)."""
    probe = folder / ".pagecache-probe"
    probe.write_bytes(os.urandom(4 * _PAGE))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        if resident_pages(probe) == 0:
            return False  # not cached after a write: nothing to see either way
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return resident_pages(probe) == 0
    finally:
        os.close(fd)
        probe.unlink()
