"""fedra.files: the process lock a coordinator holds on its state directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedra.files import LockHeld, ProcessLock

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
