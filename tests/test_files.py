"""fedra.files: the process lock a coordinator holds on its state directory, and the page
cache hint for files written once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedra.files import LockHeld, ProcessLock, drop_cached
from tests.pagecache import drops_pages, resident_pages

HOLD = """
import sys
from pathlib import Path
from fedra.files import ProcessLock
lock = ProcessLock(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_lock_is_held_until_released(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = ProcessLock(path)
    with pytest.raises(LockHeld) as info:
        ProcessLock(path)
    assert info.value.holder == str(os.getpid()) and info.value.path == path
    assert f"pid {os.getpid()}" in str(info.value)
    first.release()
    first.release()  # twice is harmless
    ProcessLock(path).release()


def test_a_killed_holder_leaves_no_lock_behind(tmp_path: Path) -> None:
    """SIGKILL gives no chance to clean up: the kernel lets the lock go all the same."""
    path = tmp_path / "x.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(LockHeld) as info:
            ProcessLock(path)
        assert info.value.holder == str(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    ProcessLock(path).release()


def test_a_synced_file_dropped_from_the_page_cache_keeps_its_bytes(tmp_path: Path) -> None:
    if not drops_pages(tmp_path):
        pytest.skip(f"{tmp_path}'s file system keeps a file's pages whatever it is asked")
    path = tmp_path / "blob"
    data = os.urandom(64 * 1024)
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert resident_pages(path) > 0
    drop_cached(path)
    assert resident_pages(path) == 0
    assert path.read_bytes() == data  # read back from disk
    drop_cached(tmp_path / "gone")  # a file that is not there: nothing to do, no error
