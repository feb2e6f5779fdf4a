"""A child process that must not outlive its parent (Linux: ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Be sent ``sig`` when the parent ``parent_pid`` dies, however it dies (Linux; a
    no-op elsewhere, where the caller needs a watchdog of its own); exit at once if it
    is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:  # it died before the line above
        sys.exit(0)
