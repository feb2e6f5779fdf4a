"""Fault injection for tests: crash this process at a named point of a given round.

``FEDRA_FAULT_CRASH=before_commit:3`` SIGKILLs the process when it reaches that point in
round 3. Coordinator points (``COORDINATOR_POINTS``), in the order a round meets them:
``mid_download`` (a model download has sent its first chunk), ``mid_upload`` (an
update's first chunk is spooled), ``after_accept`` (an update is durably accepted, not
folded, not answered), ``mid_fold`` (folding an update has read its first block),
``before_reply`` (an update is accepted and folded, the site not yet answered),
``after_unmask`` (a secure round's sum is unmasked, not committed), ``before_commit``
(the round's checkpoint is durable, its database commit not yet made),
``after_commit`` (committed, the next round not yet opened),
``after_attempt_failed`` (an attempt's failure is recorded, the next not yet opened) and
``during_startup`` (a restarted daemon has restored the run at that round, before
serving). Site points: ``after_download`` (the model of round N is in, no training
done), ``after_secagg_setup`` (keys and key shares sent, no masked update) and
``after_upload`` (its update is accepted, nothing of it kept at the site; a masked
update: no shares revealed).

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
COORDINATOR_POINTS = (
    "mid_download",
    "mid_upload",
    "after_accept",
    "mid_fold",
    "before_reply",
    "after_unmask",
    "before_commit",
    "after_commit",
    "after_attempt_failed",
    "during_startup",
)


def crash_point(name: str, round_number: int) -> None:
    """SIGKILL this process if ``FEDRA_FAULT_CRASH`` names this point and round."""
    if armed(name, round_number):
        log.error("fault injection: killing the process at %s of round %d", name, round_number)
        os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str, round_number: int) -> bool:
    """Whether ``FEDRA_FAULT_CRASH`` names this point and round (``crash_point`` will kill)."""
    return os.environ.get(ENV) == f"{name}:{round_number}"


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
