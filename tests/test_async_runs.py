"""Buffered asynchronous rounds (FedBuff) across real processes: fast sites never wait
for a slow one, stale updates count less, and a killed coordinator resumes the run."""

from __future__ import annotations

import statistics

import pytest

from fedra.local import LocalCluster
from fedra.runspec import AsyncSpec, TrainSpec
from tests.test_cluster import (
    FAST,
    SYNTHETIC,
    committed_rounds,
    finished,
    kill_and_restart_coordinator,
    synthetic_spec,
    wait_until,
)

pytestmark = pytest.mark.multiprocess

# One site's training time per task; the others take 0.2 s, so a round (two updates) takes
# at least 0.2 s, and the slow site's update is at most about 6 models old: well inside
# max_staleness, however fast this machine runs the rounds.
SLOW_S = 1.0
TRAIN = TrainSpec(local_steps=5, batch_size=16, learning_rate=0.02)


def start_sites(cluster: LocalCluster) -> list[str]:
    ids = [f"site-{i}" for i in range(3)]
    for i, site_id in enumerate(ids):
        delay = SLOW_S if site_id == "site-2" else 0.2
        data = {"shift": 0.25 * i, "seed": i, "samples": 128, "fit_delay_s": delay}
        cluster.start_site(site_id, [SYNTHETIC], data)
    cluster.wait_for_sites(ids)
    return ids


def async_spec(rounds: int) -> object:
    return synthetic_spec(
        rounds=rounds,
        sites_per_round=3,
        min_sites=0,
        strategy="fedavg",
        train=TRAIN,
        asynchronous=AsyncSpec(buffer=2, max_staleness=16),
    )


def test_fast_sites_never_wait_for_a_slow_one(cluster: LocalCluster) -> None:
    cluster.start_coordinator(flags=FAST)
    start_sites(cluster)
    with cluster.admin() as admin:
        run_id = admin.submit(async_spec(rounds=12))
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    rounds = [r for r in status.rounds if r.number > 0]
    assert [r.number for r in rounds] == list(range(1, 13))
    accepted = [(r.number, p) for r in rounds for p in r.participations if p.status == "accepted"]
    by_site: dict[str, list[float]] = {}
    for _, p in accepted:
        by_site.setdefault(p.site_id, []).append(p.metrics["staleness"])
    # Every version is made of (at least) the buffer's two updates, mostly the fast sites'.
    assert all(r.updates >= 2 for r in rounds)
    assert len(by_site.get("site-0", [])) + len(by_site.get("site-1", [])) >= 18
    # The slow site's update, trained while others moved the model on, arrives stale
    # and still counts (weighted by 1/sqrt(1 + staleness)).
    assert by_site.get("site-2") and max(by_site["site-2"]) >= 1
    # Rounds do not wait for the slow site's training time.
    assert statistics.median(r.stages["round_s"] for r in rounds) < SLOW_S
    assert rounds[-1].metrics["eval_loss"] < rounds[0].metrics["eval_loss"]


def test_an_async_run_resumes_after_a_coordinator_kill(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(flags=FAST)
    port = int(address.rsplit(":", 1)[1])
    start_sites(cluster)
    with cluster.admin() as admin:
        run_id = admin.submit(async_spec(rounds=8))
        wait_until(admin, run_id, lambda s: s.rounds_completed >= 3)
    kill_and_restart_coordinator(cluster, port)
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    assert [r.number for r in status.rounds] == list(range(9)), "a round is missing or doubled"
    assert committed_rounds(cluster.state_dir, run_id) == list(range(9))
    # No task is left half-way: every participation ended accepted, failed or expired.
    states = {p.status for r in status.rounds for p in r.participations}
    assert states <= {"accepted", "failed", "expired"}, states
