"""Fault injection for tests: crash this process at a named point of a given round.

Points: ``before_commit:N`` (coordinator: round N's checkpoint is durable, its database
commit not yet made), ``after_download:N`` (site: the model of round N is in, no
training done), ``after_secagg_setup:N`` (site: its keys and key shares are sent, no
masked update), ``after_upload:N`` (site: its masked update is in, no shares revealed)
and ``after_unmask:N`` (coordinator: round N's secure sum is unmasked, not committed).
``FEDRA_FAULT_CRASH=before_commit:3`` kills the process at that point.

``FEDRA_FAULT_ATTACK=scale:-10`` makes a site Byzantine: every update it sends is its
honest update times the factor (robust-aggregation tests).
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Mapping

import torch

log = logging.getLogger("fedra.faults")
ENV = "FEDRA_FAULT_CRASH"
ATTACK_ENV = "FEDRA_FAULT_ATTACK"


def crash_point(name: str, round_number: int) -> None:
    """SIGKILL this process if ``FEDRA_FAULT_CRASH`` names this point and round."""
    if os.environ.get(ENV) == f"{name}:{round_number}":
        log.error("fault injection: killing the process at %s of round %d", name, round_number)
        os.kill(os.getpid(), signal.SIGKILL)


def attack(delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The update a site sends: ``delta`` itself unless ``FEDRA_FAULT_ATTACK`` says otherwise."""
    spec = os.environ.get(ATTACK_ENV, "")
    if not spec:
        return dict(delta)
    kind, _, value = spec.partition(":")
    factor = float(value) if kind == "scale" else math.nan
    if not math.isfinite(factor):
        raise ValueError(f"{ATTACK_ENV}: expected 'scale:<finite number>', got {spec!r}")
    log.error("fault injection: sending the update scaled by %g", factor)
    return {k: v * factor if v.is_floating_point() else v for k, v in delta.items()}
