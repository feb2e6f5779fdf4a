"""Fault injection for tests: crash this process at a named point of a given round.

Points: ``before_commit:N`` (coordinator: round N's checkpoint is durable, its database
commit not yet made) and ``after_download:N`` (site: the model of round N is in, no
training done). ``FEDRA_FAULT_CRASH=before_commit:3`` kills the process at that point.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("fedra.faults")
ENV = "FEDRA_FAULT_CRASH"


def crash_point(name: str, round_number: int) -> None:
    """SIGKILL this process if ``FEDRA_FAULT_CRASH`` names this point and round."""
    if os.environ.get(ENV) == f"{name}:{round_number}":
        log.error("fault injection: killing the process at %s of round %d", name, round_number)
        os.kill(os.getpid(), signal.SIGKILL)
