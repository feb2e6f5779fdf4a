"""Multi-process runs of the privacy features: secure aggregation (with dropouts),
differential privacy with its budget across a coordinator kill, and robust aggregation
against Byzantine sites. Real coordinator and site processes, over mTLS, on port 0.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
import torch

from fedra.accounting import Accountant, RoundEvent, epsilon_after
from fedra.coordinator.engine.rounds import ACCOUNTANT_KEY
from fedra.local import LocalCluster
from fedra.protos.codec import decode_chunks
from fedra.protos.v1 import admin_pb2
from fedra.runspec import AggregationSpec, PrivacySpec, RunSpec, SecAggSpec, TrainSpec
from fedra.storage import BlobStore, Store
from tests.test_cluster import (
    FAST,
    SYNTHETIC,
    finished,
    start_synthetic_sites,
    synthetic_spec,
    wait_until,
)

pytestmark = pytest.mark.multiprocess

TRAIN = TrainSpec(local_steps=5, batch_size=16, learning_rate=0.02)


def start_sites(cluster: LocalCluster, n: int, env: dict[str, dict[str, str]]) -> list[str]:
    """Synthetic sites with mild shifts (stable training), some with fault injection."""
    ids = [f"site-{i}" for i in range(n)]
    for i, site_id in enumerate(ids):
        data = {"shift": 0.25 * i, "seed": i, "samples": 128}
        cluster.start_site(site_id, [SYNTHETIC], data, extra_env=env.get(site_id))
    cluster.wait_for_sites(ids)
    return ids


def run_into_fault(
    cluster: LocalCluster, fault: str, spec: RunSpec, start: Callable[[], object]
) -> str:
    """Submit ``spec`` to a coordinator that kills itself at ``fault`` (FEDRA_FAULT_CRASH),
    wait for that SIGKILL, and start it again on the same state and port; the run's id."""
    address = cluster.start_coordinator(flags=FAST, extra_env={"FEDRA_FAULT_CRASH": fault})
    port = int(address.rsplit(":", 1)[1])
    start()
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
    assert cluster.coordinator is not None
    assert cluster.coordinator.popen.wait(120) == -signal.SIGKILL
    cluster.start_coordinator(port=port, flags=FAST)
    return run_id


def mean_eval_loss(r: admin_pb2.RoundStatus, sites: set[str]) -> float:
    """The global model of the round before, as evaluated by ``sites`` on their own data."""
    values = [p.metrics["eval_loss"] for p in r.participations if p.site_id in sites]
    assert len(values) == len(sites)
    return sum(values) / len(values)


def test_secure_aggregation_gives_the_plain_mean(cluster: LocalCluster) -> None:
    """Masked, quantised and unmasked, the sum is the plain one: with equal sample counts,
    a [secagg] run ends on the model of the same run without it (up to quantisation)."""
    cluster.start_coordinator(flags=FAST)
    start_synthetic_sites(cluster, 3)
    plain = synthetic_spec(rounds=2, strategy="fedavg", train=TRAIN)
    masked = synthetic_spec(
        rounds=2, strategy="fedavg", train=TRAIN, secagg=SecAggSpec(clip=64.0, setup_timeout_s=30)
    )
    with cluster.admin() as admin:
        plain_id = admin.submit(plain)
        assert wait_until(admin, plain_id, finished).state == "completed"
        masked_id = admin.submit(masked)
        status = wait_until(admin, masked_id, finished)
        assert status.state == "completed", status.reason
        expected = admin.export_model(plain_id)
        got = admin.export_model(masked_id)
    for name, tensor in expected.items():
        # 3 sites, 30 bits per coordinate over [-64, 64]: steps of 1.2e-7, far below atol.
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)
    numel = sum(t.numel() for t in expected.values())
    for r in (r for r in status.rounds if r.number > 0):
        assert [p.status for p in r.participations] == ["accepted"] * 3
        # No stage waits out a site's 20 s long poll: each stage's close wakes them.
        assert r.stages["round_s"] < 10.0, r.stages
        for p in r.participations:  # one int32 per parameter, plus the safetensors header
            assert 4 * numel <= p.bytes_up < 4 * numel + 256


def test_secure_aggregation_survives_dropouts_at_each_stage(cluster: LocalCluster) -> None:
    """Five sites; one dies after the key exchange (its masks are cancelled with its
    rebuilt key), one dies after uploading (its self-mask is rebuilt from its neighbours'
    shares, its update counts). The round commits with the four updates that arrived."""
    cluster.start_coordinator(flags=FAST)
    env = {
        "site-2": {"FEDRA_FAULT_CRASH": "after_secagg_setup:1"},
        "site-3": {"FEDRA_FAULT_CRASH": "after_upload:1"},
    }
    start_sites(cluster, 5, env)
    spec = synthetic_spec(
        rounds=2,
        sites_per_round=5,
        min_sites=3,
        join_timeout_s=5.0,
        strategy="fedavg",
        train=TRAIN,
        secagg=SecAggSpec(threshold=0.5, clip=4.0, setup_timeout_s=30, unmask_timeout_s=20),
    )
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    for site_id in ("site-2", "site-3"):
        assert cluster.sites[site_id].popen.wait(30) == -signal.SIGKILL
    r1 = next(r for r in status.rounds if r.number == 1)
    by_site = {p.site_id: p.status for p in r1.participations}
    assert r1.attempt == 1, "the dropouts must not cost a retry"
    assert by_site == {
        "site-0": "accepted",
        "site-1": "accepted",
        "site-2": "failed",
        "site-3": "accepted",
        "site-4": "accepted",
    }
    r2 = next(r for r in status.rounds if r.number == 2)
    assert sorted(p.site_id for p in r2.participations) == ["site-0", "site-1", "site-4"]
    honest = {"site-0", "site-1", "site-4"}
    assert mean_eval_loss(r2, honest) < mean_eval_loss(r1, honest)


def test_differential_privacy_stops_at_the_budget_across_a_coordinator_kill(
    cluster: LocalCluster,
) -> None:
    """noise 1.0, epsilon 8 allows two rounds. The coordinator dies between round 2's
    checkpoint and its commit; restarted, it must still know round 1 was spent, run round
    2 again, and then refuse round 3."""
    privacy = PrivacySpec(clip=0.5, noise_multiplier=1.0, epsilon=8.0, delta=1e-5)
    spec = synthetic_spec(rounds=4, strategy="fedavg", train=TRAIN, privacy=privacy)
    run_id = run_into_fault(
        cluster, "before_commit:2", spec, lambda: start_synthetic_sites(cluster, 3)
    )
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    assert status.rounds_completed == 2
    assert "privacy budget reached" in status.reason and "round 3" in status.reason
    two = epsilon_after(RoundEvent(1.0), 2, 1e-5)
    r2 = next(r for r in status.rounds if r.number == 2)
    assert r2.metrics["privacy_epsilon"] == pytest.approx(two)
    assert two <= 8.0 < epsilon_after(RoundEvent(1.0), 3, 1e-5)
    # The accountant is part of the checkpoint, committed with the round it accounts for.
    store = Store(f"sqlite:///{cluster.state_dir / 'fedra.db'}")
    try:
        ckpt = store.latest_checkpoint(run_id)
    finally:
        store.close()
    assert ckpt is not None and ckpt.round_number == 2 and ckpt.optimizer_sha256
    blobs = BlobStore(cluster.state_dir / "blobs")
    state = decode_chunks(blobs.read_chunks(ckpt.optimizer_sha256, 1 << 20))
    assert Accountant.from_tensor(state[ACCOUNTANT_KEY], RoundEvent(1.0)).rounds == 2


def test_poisson_sampled_private_run_stops_at_its_amplified_budget_across_a_kill(
    cluster: LocalCluster,
) -> None:
    """Four sites, each in a round with probability 2 / 4 (Poisson), noise 1: the accountant
    charges the amplified figure, 3 rounds fit epsilon 7 where unsampled only 2 would. The
    coordinator dies between round 2's checkpoint and its commit; restarted, it still knows
    round 1 was spent, and refuses round 4."""
    privacy = PrivacySpec(
        clip=0.5, noise_multiplier=1.0, epsilon=7.0, delta=1e-5, sampling="poisson", population=4
    )
    spec = synthetic_spec(
        rounds=6, sites_per_round=2, min_sites=0, strategy="fedavg", train=TRAIN, privacy=privacy
    )
    event = RoundEvent(1.0, "poisson", 2, 4)
    assert epsilon_after(event, 3, 1e-5) <= 7.0 < epsilon_after(event, 4, 1e-5)
    assert epsilon_after(RoundEvent(1.0), 3, 1e-5) > 7.0  # without amplification: 2 rounds
    run_id = run_into_fault(cluster, "before_commit:2", spec, lambda: start_sites(cluster, 4, {}))
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    assert status.rounds_completed == 3
    assert "privacy budget reached" in status.reason and "round 4" in status.reason
    for number in (1, 2, 3):
        r = next(r for r in status.rounds if r.number == number and r.status == "committed")
        assert r.metrics["privacy_epsilon"] == pytest.approx(epsilon_after(event, number, 1e-5))
        assert set(r.sampled_sites) <= {f"site-{i}" for i in range(4)}
    store = Store(f"sqlite:///{cluster.state_dir / 'fedra.db'}")
    try:
        ckpt = store.latest_checkpoint(run_id)
    finally:
        store.close()
    assert ckpt is not None and ckpt.round_number == 3 and ckpt.optimizer_sha256
    blobs = BlobStore(cluster.state_dir / "blobs")
    state = decode_chunks(blobs.read_chunks(ckpt.optimizer_sha256, 1 << 20))
    assert Accountant.from_tensor(state[ACCOUNTANT_KEY], event).rounds == 3


def test_fixed_size_sampled_private_run_draws_its_cohort_and_stops_at_its_budget(
    cluster: LocalCluster,
) -> None:
    """Four sites, two drawn in each round without replacement (``fixed``, replace-one:
    charged at half the noise): every round's cohort is exactly two of the four, each
    round is charged what dp-accounting charges, and the run stops once a round would
    pass epsilon 21 (three rounds fit)."""
    privacy = PrivacySpec(
        clip=0.5, noise_multiplier=1.0, epsilon=21.0, delta=1e-5, sampling="fixed", population=4
    )
    spec = synthetic_spec(
        rounds=6, sites_per_round=2, min_sites=2, strategy="fedavg", train=TRAIN, privacy=privacy
    )
    event = RoundEvent(1.0, "fixed", 2, 4)
    assert epsilon_after(event, 3, 1e-5) <= 21.0 < epsilon_after(event, 4, 1e-5)
    cluster.start_coordinator(flags=FAST)
    start_sites(cluster, 4, {})
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    assert status.rounds_completed == 3
    assert "privacy budget reached" in status.reason and "round 4" in status.reason
    everyone = {f"site-{i}" for i in range(4)}
    for number in (1, 2, 3):
        r = next(r for r in status.rounds if r.number == number and r.status == "committed")
        assert len(set(r.sampled_sites)) == 2 and set(r.sampled_sites) <= everyone
        counted = {p.site_id for p in r.participations
                   if p.status == "accepted" and p.attempt == r.attempt}  # fmt: skip
        assert counted == set(r.sampled_sites)
        assert r.metrics["privacy_epsilon"] == pytest.approx(epsilon_after(event, number, 1e-5))


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_robust_aggregation_against_byzantine_sites(cluster: LocalCluster, rule: str) -> None:
    """Two of five sites send their update times -10. The mean is dragged away and the
    global model gets worse; the coordinate-wise median keeps improving it."""
    cluster.start_coordinator(flags=FAST)
    attack = {"FEDRA_FAULT_ATTACK": "scale:-10"}
    start_sites(cluster, 5, {"site-3": attack, "site-4": attack})
    spec = synthetic_spec(
        rounds=3,
        sites_per_round=5,
        min_sites=5,
        strategy="fedavg",
        train=TRAIN,
        aggregation=AggregationSpec(rule=rule, spill_mb=0),  # robust: every update on disk
    )
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = wait_until(admin, run_id, finished)
    assert not (cluster.state_dir / "updates" / "spill").exists() or not any(
        (cluster.state_dir / "updates" / "spill").iterdir()
    ), "spill files outlived their round"
    rounds = [r for r in status.rounds if r.number > 0 and r.status == "committed"]
    honest = {"site-0", "site-1", "site-2"}
    first, last = mean_eval_loss(rounds[0], honest), mean_eval_loss(rounds[-1], honest)
    if rule == "mean":
        assert status.state == "failed" or last > first, (status.state, first, last)
    else:
        assert status.state == "completed", status.reason
        assert last < 0.75 * first, (first, last)


def test_secure_aggregation_with_distributed_noise_stops_at_the_budget(
    cluster: LocalCluster,
) -> None:
    """[privacy] with [secagg]: each site clips its update and adds its share of the
    noise before masking (the coordinator could not add it to a sum it never sees); the
    accountant and the budget work as in central DP."""
    cluster.start_coordinator(flags=FAST)
    start_sites(cluster, 3, {})
    privacy = PrivacySpec(clip=0.5, noise_multiplier=1.0, epsilon=8.0, delta=1e-5)
    secagg = SecAggSpec(clip=8.0, setup_timeout_s=30)
    spec = synthetic_spec(rounds=3, strategy="fedavg", train=TRAIN, secagg=secagg, privacy=privacy)
    models = []
    with cluster.admin() as admin:
        for _ in range(2):  # the same spec twice: training is deterministic, the noise is not
            run_id = admin.submit(spec)
            status = wait_until(admin, run_id, finished)
            assert status.state == "completed", status.reason
            assert status.rounds_completed == 2 and "privacy budget reached" in status.reason
            r2 = next(r for r in status.rounds if r.number == 2)
            two = epsilon_after(RoundEvent(1.0), 2, 1e-5)
            assert r2.metrics["privacy_epsilon"] == pytest.approx(two)
            models.append(admin.export_model(run_id))
    # The mean carries noise of std 0.5 / 3 per coordinate: two runs differ far beyond
    # quantisation (1e-8), which is the only other thing that could separate them.
    gap = max(float((models[0][k] - models[1][k]).abs().max()) for k in models[0])
    assert gap > 1e-2, gap


def test_a_secure_round_unmasked_but_not_committed_ends_the_run(cluster: LocalCluster) -> None:
    """The coordinator dies right after unmasking round 1's sum. Running that round again
    would unmask a second sum of the same updates over another sample, whose difference
    could expose a site's update: the restarted coordinator ends the run instead."""
    spec = synthetic_spec(
        rounds=2, strategy="fedavg", train=TRAIN, secagg=SecAggSpec(clip=8.0, setup_timeout_s=30)
    )
    run_id = run_into_fault(cluster, "after_unmask:1", spec, lambda: start_sites(cluster, 3, {}))
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished, timeout_s=60)
    assert status.state == "failed"
    assert "round 1 was unmasked but not committed" in status.reason
    assert status.rounds_completed == 0
