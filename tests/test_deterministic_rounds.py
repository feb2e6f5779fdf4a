"""A synchronous round's model does not depend on the order its updates arrive in, nor
on a restart between them: the committed checkpoint is the same bits.

fp32 sums depend on the order of their terms; the updates here differ by orders of
magnitude, so that folding them in arrival order gives other bits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from fedra.coordinator.engine import EngineSettings
from fedra.protos.codec import encode
from fedra.protos.v1 import common_pb2, site_pb2
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    messages,
    model_state,
    register,
    start_round_one,
    upload,
    wait_round,
)

SETTINGS = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
SCALES = {"site-a": 1e-3, "site-b": 1.0, "site-c": 1e3, "site-d": 10.0}
RULES = {
    "mean": {},
    "fedadam": {"strategy": "fedadam"},
    "clipped": {"aggregation": common_pb2.Aggregation(rule="mean", norm_bound=50.0)},
    "trimmed_mean": {"aggregation": common_pb2.Aggregation(rule="trimmed_mean", trim=0.0)},
    "multikrum": {"aggregation": common_pb2.Aggregation(rule="multikrum", byzantine=0)},
}


def _update(site: str) -> bytes:
    g = torch.Generator().manual_seed(sum(map(ord, site)))
    return encode(
        {
            k: torch.randn(v.shape, generator=g, dtype=v.dtype) * SCALES[site]
            for k, v in model_state().items()
        }
    )


def _committed(c: InProcessCoordinator, run_id: str) -> str:
    """Round 1's checkpoint digest, once it is committed."""
    wait_round(c, run_id, 1, "committed")
    ckpt = c.engine._store.get_checkpoint(run_id, 1)
    assert ckpt is not None
    return ckpt.model_sha256


def _round_one(
    state_dir: Path, order: Sequence[str], spec: dict[str, object], restart_after: int = -1
) -> str:
    """Round 1's checkpoint digest, its updates sent in ``order`` (restarting the
    coordinator after the ``restart_after``-th one, if given)."""
    c = InProcessCoordinator(state_dir, SETTINGS)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3, seed=7, **spec)
        for i, site in enumerate(order):
            upload(c, messages(tasks[site], site, _update(site), nonce=os.urandom(16)))
            if i == restart_after:
                c.close()
                c = InProcessCoordinator(state_dir, SETTINGS)
        return _committed(c, run_id)
    finally:
        c.close()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_same_updates_in_any_order_give_the_same_bits(tmp_path: Path, rule: str) -> None:
    spec = RULES[rule]
    forward = _round_one(tmp_path / "a", ["site-a", "site-b", "site-c"], spec)
    backward = _round_one(tmp_path / "b", ["site-c", "site-b", "site-a"], spec)
    across_a_restart = _round_one(tmp_path / "c", ["site-c", "site-a", "site-b"], spec, 0)
    assert forward == backward == across_a_restart


def test_an_update_waits_for_its_turn_and_a_failed_site_gives_it_up(tmp_path: Path) -> None:
    """The last site in order delivers first and is not folded until the sites before it
    are final; one of them fails, and the round still sums the others in order."""
    c = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=2, seed=7)
        run = c.engine.runs[run_id]
        upload(c, messages(tasks["site-c"], "site-c", _update("site-c")))
        assert run.folded == set()  # waits in the spool for site-a and site-b
        upload(c, messages(tasks["site-a"], "site-a", _update("site-a")))
        assert run.folded == {"site-a"}  # site-b is still training: site-c waits on
        c.site.ReportFailure(
            site_pb2.ReportFailureRequest(
                site_id="site-b", task_id=tasks["site-b"].task_id, reason="out of memory"
            )
        )
        got = _committed(c, run_id)
    finally:
        c.close()
    assert got == _only_two(tmp_path / "reference")


def _only_two(state_dir: Path) -> str:
    """The same round with only site-a and site-c sampled and delivering, in order."""
    c = InProcessCoordinator(state_dir, SETTINGS)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=2, seed=7)
        c.site.ReportFailure(
            site_pb2.ReportFailureRequest(
                site_id="site-b", task_id=tasks["site-b"].task_id, reason="out of memory"
            )
        )
        for site in ("site-a", "site-c"):
            upload(c, messages(tasks[site], site, _update(site)))
        return _committed(c, run_id)
    finally:
        c.close()


def test_updates_behind_a_failed_site_are_folded_before_the_round_closes(
    tmp_path: Path,
) -> None:
    """A site early in the order fails while a later one is still training: the updates
    that waited behind it are folded then, not left for the commit."""
    c = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        register(c, "site-d")
        run_id, tasks = start_round_one(c, sites_per_round=4, min_sites=3, seed=7)
        run = c.engine.runs[run_id]
        upload(c, messages(tasks["site-c"], "site-c", _update("site-c")))
        upload(c, messages(tasks["site-a"], "site-a", _update("site-a")))
        assert run.folded == {"site-a"}
        c.site.ReportFailure(
            site_pb2.ReportFailureRequest(
                site_id="site-b", task_id=tasks["site-b"].task_id, reason="out of memory"
            )
        )
        deadline, version = time.monotonic() + 10, c.engine.version
        while run.folded != {"site-a", "site-c"}:  # site-d is still training
            assert time.monotonic() < deadline, run.folded
            version = c.engine.wait_for_change(version, 0.5)
        assert run.open_round == 1 and not run.closing
    finally:
        c.close()
