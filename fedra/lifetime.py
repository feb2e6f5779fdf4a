"""Child processes that must not outlive the process that started them.

Two ways, for two kinds of child:

- ``die_with_parent``: a helper the daemon or a site starts itself (the read replica, a
  site's training workers) asks the kernel to signal it when its parent dies (Linux's
  ``PR_SET_PDEATHSIG``).
- A *lifeline* (``Lifeline``, ``follow_lifeline``): a federation started by a program on
  one machine (``fedra.local.LocalCluster``: ``fedra demo``, the tests, the benchmarks)
  hands each process it starts the read end of a pipe whose write end only the starter
  holds. However the starter ends (an exception, SIGTERM, SIGKILL, a CI job's timeout),
  the kernel closes that write end, the child reads end-of-file, and it stops as SIGTERM
  stops it (gracefully), or is killed if that takes longer than ``LIFELINE_GRACE_S``.
  Unlike ``PR_SET_PDEATHSIG`` this does not fire when the thread that started the child
  ends, and works on every POSIX system.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import MutableMapping

log = logging.getLogger("fedra.lifetime")

_PR_SET_PDEATHSIG = 1
LIFELINE_ENV = "FEDRA_LIFELINE_FD"
LIFELINE_GRACE_S = 60.0  # from the lifeline's end to SIGKILL, if SIGTERM did not stop it


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Be sent ``sig`` when the parent ``parent_pid`` dies, however it dies (Linux; a
    no-op elsewhere, where the caller needs a watchdog of its own); exit at once if it
    is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:  # it died before the line above
        sys.exit(0)


class Lifeline:
    """The starter's side: a pipe whose read end goes to each child (``fd`` in
    ``pass_fds``, ``env()`` in its environment) and whose write end stays here, never
    written, until ``cut`` or this process's end. Both ends are opened non-inheritable:
    of the programs this process starts, only those given ``fd`` get it, and none gets
    the write end (a child forked without a new program, as ``multiprocessing``'s
    default start on Linux does, holds both until it ends, and keeps the line up)."""

    def __init__(self) -> None:
        # Above the standard descriptors: a starter with one of them closed would get it
        # from os.pipe(), and a child's own stdin, stdout or stderr would replace it.
        read_fd, write_fd = os.pipe()
        try:
            self.fd = fcntl.fcntl(read_fd, fcntl.F_DUPFD_CLOEXEC, 3)
            self._write_fd = fcntl.fcntl(write_fd, fcntl.F_DUPFD_CLOEXEC, 3)
        finally:
            os.close(read_fd)
            os.close(write_fd)

    def env(self) -> dict[str, str]:
        return {LIFELINE_ENV: str(self.fd)}

    def cut(self) -> None:
        """End the line: every child still following it stops. Idempotent."""
        for attr in ("_write_fd", "fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)


def follow_lifeline(
    environ: MutableMapping[str, str] = os.environ, grace_s: float = LIFELINE_GRACE_S
) -> bool:
    """The child's side: if ``FEDRA_LIFELINE_FD`` names a pipe, watch it on a daemon
    thread and, when the starter is gone, SIGTERM this process (its own graceful stop),
    then SIGKILL it ``grace_s`` later if it is still here. The variable is removed from
    ``environ`` and the descriptor made non-inheritable, so this process's own children
    neither see nor hold it. Returns whether a lifeline is followed."""
    value = environ.pop(LIFELINE_ENV, None)
    if value is None:
        return False
    try:
        fd = int(value)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise ValueError("not a pipe")
        os.set_inheritable(fd, False)
    except (ValueError, OSError) as exc:  # not the pipe a starter handed this process
        log.warning("$%s=%r is not an open pipe (%s): not followed", LIFELINE_ENV,
                    value, exc)  # fmt: skip
        return False

    def watch() -> None:
        # This thread never takes a stop signal, which the main thread must handle.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while True:
            try:
                if not os.read(fd, 4096):
                    break  # end of file: no process holds the write end any more
            except InterruptedError:
                continue
            except OSError:
                break
        log.warning("the process that started this one is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.error("still running %g s after its starter went: killing it", grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fedra-lifeline", daemon=True).start()
    return True
