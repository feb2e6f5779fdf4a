"""Regional coordinators (fedra.region): a run given its starting model (the engine's
side), the flags, and two-level federations across real processes (an upstream, two
regions, two sites under each) against the flat federation of the same sites and seeds,
through a region's crash."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from fedra.accounting import RoundEvent, epsilon_after
from fedra.admin import AdminClient
from fedra.client.connection import Assignment
from fedra.config import ConfigError
from fedra.coordinator.engine import EngineSettings, GivenModel
from fedra.coordinator.errors import InvalidArgument
from fedra.local import LocalCluster
from fedra.privacy import clip_factor
from fedra.protos.v1 import admin_pb2, site_pb2
from fedra.region import RUN_PREFIX, RegionAgent, RegionConfig
from fedra.runspec import CodecSpec, PrivacySpec, RunSpec, SecAggSpec, TrainSpec
from tests.conftest import InProcessCoordinator, fedra_cli

SYNTHETIC = "fedra.examples.synthetic:task"
SITES = {"region-a": ["site-0", "site-1"], "region-b": ["site-2", "site-3"]}
FAST = ["--heartbeat-s", "0.5", "--site-timeout-s", "10", "--poll-timeout-s", "5",
        "--admin-port", "none"]  # fmt: skip


def spec(rounds: int, sites: int, secagg: bool = False) -> RunSpec:
    return RunSpec(
        task=SYNTHETIC, rounds=rounds, sites_per_round=sites, round_deadline_s=90.0,
        join_timeout_s=60.0, seed=11, strategy="fedavg",
        train=TrainSpec(local_steps=4, batch_size=16, learning_rate=0.05),
        secagg=SecAggSpec() if secagg else None,
    ).validate()  # fmt: skip


def site_data(site_id: str, equal: bool = False) -> dict[str, object]:
    """Unequal sizes, so that the weighting by samples shows; ``equal``: the same size
    for all (secure aggregation counts every site once)."""
    i = int(site_id.rsplit("-", 1)[1])
    return {"shift": 0.5 * i, "seed": i, "samples": 128 if equal else 64 * (i + 1)}


def _finished(admin: AdminClient, run_id: str, timeout_s: float = 240) -> admin_pb2.RunStatus:
    return next(
        s for s in admin.watch(run_id, timeout_s=timeout_s)
        if s.state in ("completed", "failed", "cancelled")
    )  # fmt: skip


# -- the engine: a run given its model ----------------------------------------------


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(tmp_path / "state", EngineSettings())
    try:
        yield c
    finally:
        c.close()


def test_a_run_given_its_model_starts_after_that_round(
    coordinator: InProcessCoordinator,
) -> None:
    engine = coordinator.engine
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)}
    run_id, _ = engine.submit(spec(rounds=5, sites=1), start=GivenModel(model, after_round=3))
    record = engine.get_run_record(run_id)
    assert (record.state, record.rounds_completed) == ("running", 3)
    outcome = engine.round_outcome(run_id, 3)  # the given round: the model, no updates
    assert (outcome.num_samples, outcome.sites) == (0, 0)
    assert sorted(outcome.tensors) == ["b", "w"]
    assert_close(outcome.tensors["w"], model["w"])
    ckpt = engine.export_checkpoint(run_id, None)
    assert ckpt.round_number == 3


@pytest.mark.parametrize(
    ("after_round", "model", "message"),
    [
        (5, {"w": torch.ones(2)}, "from 0 to rounds - 1"),
        (-1, {"w": torch.ones(2)}, "from 0 to rounds - 1"),
        (1, {}, "no tensors"),
        (1, {"w": torch.tensor([1.0, float("nan")])}, "non-finite values in 'w'"),
    ],
)
def test_a_bad_given_model_is_refused_and_no_run_is_made(
    coordinator: InProcessCoordinator,
    after_round: int,
    model: dict[str, torch.Tensor],
    message: str,
) -> None:
    engine = coordinator.engine
    with pytest.raises(InvalidArgument, match=message):
        engine.submit(spec(rounds=5, sites=1), start=GivenModel(model, after_round))
    assert engine.runs_named_from("") == []


def test_a_region_just_started_waits_for_its_first_site(
    coordinator: InProcessCoordinator, tmp_path: Path
) -> None:
    """An upstream task that comes before any of the region's sites has registered waits
    for one (half the task's deadline at most) instead of failing at once."""
    config = RegionConfig(upstream="127.0.0.1:1", region_id="r1", tasks=(SYNTHETIC,),
                          state_dir=tmp_path / "up", insecure=True)  # fmt: skip
    agent = RegionAgent(config, coordinator.engine)
    try:
        task = Assignment(
            task_id="t1", run_id="up", round=1, init=False, entry_point=SYNTHETIC,
            train=TrainSpec(local_steps=1), seed=0, model_sha256="", model_bytes=0,
            deadline_in_s=1.0, codec=CodecSpec(),
        )  # fmt: skip
        started = time.monotonic()
        assert agent._sites_serving(task) == 0  # nobody came: the reason is given upstream
        assert 0.4 < time.monotonic() - started < 5
        later = threading.Timer(0.3, lambda: coordinator.site.Register(
            site_pb2.RegisterRequest(site_id="s1", tasks=[SYNTHETIC]), timeout=10))  # fmt: skip
        later.start()
        task = dataclasses.replace(task, deadline_in_s=60.0)
        assert agent._sites_serving(task) == 1  # it came within the wait
        later.join()
    finally:
        agent.conn.close()


def test_region_flags_are_checked(tmp_path: Path) -> None:
    base = {"upstream": "127.0.0.1:1", "region_id": "r1", "tasks": (SYNTHETIC,),
            "state_dir": tmp_path, "insecure": True}  # fmt: skip
    RegionConfig(**base)  # type: ignore[arg-type]
    bad = [
        ({"region_id": "no spaces"}, "--region-id"),
        ({"tasks": ()}, "--region-task"),
        ({"insecure": False}, "--upstream-tls-dir"),
        ({"sites_per_round": 2, "min_sites": 3}, "--region-min-sites"),
    ]
    for change, flag in bad:
        with pytest.raises(ConfigError, match=flag):
            RegionConfig(**{**base, **change})  # type: ignore[arg-type]
    done = fedra_cli("coordinator", "--state-dir", str(tmp_path / "s"), "--insecure",
                     "--region-id", "r1")  # fmt: skip
    assert done.returncode != 0 and "--region-id: needs --upstream" in done.stderr
    done = fedra_cli("coordinator", "--state-dir", str(tmp_path / "s"), "--insecure",
                     "--upstream", "nohostport", "--region-id", "r1")  # fmt: skip
    assert done.returncode != 0 and "--upstream" in done.stderr


# -- across processes ------------------------------------------------------------------


ROUNDS = 3


@pytest.fixture(scope="module")
def flat() -> Iterator[dict[bool, dict[str, torch.Tensor]]]:
    """The flat federation's final models, by whether the sites are of equal sizes: run
    once for the module's two-level runs."""
    yield {}


def _flat(tmp_path: Path, rounds: int, equal: bool) -> dict[str, torch.Tensor]:
    with LocalCluster(tmp_path / "flat") as flat:
        flat.start_coordinator(flags=FAST)
        ids = [s for sites in SITES.values() for s in sites]
        for site_id in ids:
            flat.start_site(site_id, [SYNTHETIC], site_data(site_id, equal))
        flat.wait_for_sites(ids)
        with flat.admin() as admin:
            run_id = admin.submit(spec(rounds, sites=len(ids)))
            status = _finished(admin, run_id)
            assert status.state == "completed", status.reason
            return admin.export_model(run_id)


def _region_flags(upstream: LocalCluster, region_id: str, secagg: bool) -> list[str]:
    """Its identity upstream from the upstream's CA; its own sites' from its own."""
    return [*FAST, "--upstream", upstream.address, "--region-id", region_id,
            "--region-task", SYNTHETIC,
            "--upstream-tls-dir", str(upstream.site_tls_folder(region_id)),
            *(["--region-secagg"] if secagg else [])]  # fmt: skip


def _two_levels(
    stack: ExitStack,
    tmp_path: Path,
    secagg: bool,
    equal: bool,
    faults: dict[str, dict[str, str]] | None = None,
) -> tuple[LocalCluster, dict[str, LocalCluster]]:
    """An upstream and the regions of ``SITES``, each with its sites, all registered;
    ``faults``: a region's coordinator's extra environment (a crash point)."""
    upstream = stack.enter_context(LocalCluster(tmp_path / "upstream"))
    # A region silent while it restarts stays the round's site: a longer timeout.
    upstream.start_coordinator(flags=[
        "--heartbeat-s", "0.5", "--site-timeout-s", "30", "--poll-timeout-s", "5",
        "--admin-port", "none"])  # fmt: skip
    regions: dict[str, LocalCluster] = {}
    for region_id, sites in SITES.items():
        region = stack.enter_context(LocalCluster(tmp_path / region_id))
        region.start_coordinator(flags=_region_flags(upstream, region_id, secagg),
                                 extra_env=(faults or {}).get(region_id))  # fmt: skip
        for site_id in sites:
            region.start_site(site_id, [SYNTHETIC], site_data(site_id, equal=equal))
        region.wait_for_sites(sites)
        regions[region_id] = region
    upstream.wait_for_sites(list(SITES))
    return upstream, regions


def _regional_rounds(region: LocalCluster) -> dict[int, admin_pb2.RunStatus]:
    """The region's regional runs, by the upstream round each ran: one a round, each
    completed (a region that restarts carries on with its run, it starts none again)."""
    with region.admin() as admin:
        runs = [admin.status(s.run_id) for s in admin.runs() if s.spec.name.startswith(RUN_PREFIX)]
    done = [s for s in runs if s.state == "completed"]
    assert len(done) == len(runs), [(s.spec.name, s.state, s.reason) for s in runs]
    by_round = {s.rounds_completed: s for s in done}
    assert len(by_round) == len(done), [(s.spec.name, s.rounds_completed) for s in done]
    return by_round


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("crash", "secagg", "upstream_secagg"),
    [(False, False, False), (True, False, False), (False, True, True)],
    ids=["steady", "region_crash", "secagg_both_levels"],
)  # fmt: skip
def test_a_two_level_federation_ends_where_the_flat_one_does(
    tmp_path: Path,
    flat: dict[bool, dict[str, torch.Tensor]],
    crash: bool,
    secagg: bool,
    upstream_secagg: bool,
) -> None:
    """FedAvg weighted by samples: the upstream's mean of the regions' means is the mean
    of all the sites'; the same seeds train the same batches. With ``crash`` region-a's
    coordinator is SIGKILLed as it accepts a site's update of round 2, and is started
    again on the same state: it resumes its regional run, and the upstream sees a site
    that came back. With ``secagg`` each region aggregates securely (it sees only its
    sites' sum, each site counted once: equal sizes here, so the means agree), and with
    ``upstream_secagg`` the upstream does too (it sees only the regions' sum)."""
    rounds = ROUNDS
    equal = secagg or upstream_secagg
    if equal not in flat:
        flat[equal] = _flat(tmp_path, rounds, equal=equal)
    expected = flat[equal]
    with ExitStack() as stack:
        crashing = {"region-a": {"FEDRA_FAULT_CRASH": "after_accept:2"}} if crash else {}
        upstream, regions = _two_levels(stack, tmp_path, secagg, equal, crashing)
        with upstream.admin() as admin:
            run_id = admin.submit(spec(rounds, sites=len(SITES), secagg=upstream_secagg))
            if crash:
                a = regions["region-a"]
                assert a.coordinator is not None
                assert a.coordinator.popen.wait(240) == -signal.SIGKILL
                port = int(a.address.rsplit(":", 1)[1])
                a.start_coordinator(port=port, flags=_region_flags(upstream, "region-a", False))
            status = _finished(admin, run_id)
            assert status.state == "completed", status.reason
            got, first = admin.export_model(run_id), admin.export_model(run_id, round_number=0)
        regional = {region_id: _regional_rounds(r) for region_id, r in regions.items()}
        for r in (r for r in status.rounds if r.number > 0):
            counted = {p.site_id: p for p in r.participations
                       if p.status == "accepted" and p.attempt == r.attempt}  # fmt: skip
            assert sorted(counted) == sorted(SITES), (r.number, sorted(counted))
            for region_id, p in counted.items():
                assert p.metrics["region_sites"] == 2.0
                rr = next(x for x in regional[region_id][r.number].rounds if x.number == r.number)
                parts = [q for q in rr.participations
                         if q.status == "accepted" and q.attempt == rr.attempt]  # fmt: skip
                assert sorted(q.site_id for q in parts) == SITES[region_id]
                assert p.num_samples == sum(q.num_samples for q in parts)  # summed upstream
        assert sorted(regional["region-b"]) == list(range(1, rounds + 1))
        assert sorted(regional["region-a"]) == list(range(1, rounds + 1))
        if secagg:  # the region's own rounds were secure sums
            assert all(r.spec.HasField("secagg") for r in regional["region-a"].values())
    assert sorted(got) == sorted(expected)
    for name in expected:  # two means in a row round differently from one: fp32's last bits
        assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(first[k], got[k]) for k in got)  # and the model moved


# A clip every region's update exceeds, and noise (std NOISE * CLIP a coordinate) small
# enough that the clipped sum stands out of it: a clip 20% wrong is 8 of its stds away
# (three rounds at this noise cost epsilon 772, within privacy.epsilon's 1,000).
CLIP, NOISE = 0.01, 0.05
EXTRA = 2000  # parameters besides the 9 trained ones: samples enough for the noise's std


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_upstream_privacy_clips_each_region_s_update_as_one_unit(tmp_path: Path) -> None:
    """An upstream run with ``[privacy]`` through two regions: each round's step is the
    regions' updates (each its regional run's final model minus the round's global
    model), each clipped as one unit to ``clip``, summed, plus Gaussian noise of standard
    deviation ``noise_multiplier * clip``, over ``sites_per_round``. Taken from the
    exported models, what is left once the clipped updates are taken away is that noise:
    its mean is 0 and its standard deviation is ``noise_multiplier * clip``, over the
    2,009 coordinates of three rounds, and none of it lies along the clipped sum (which
    a region clipped at another bound, or site by site, would leave); the run is charged
    its rounds' privacy."""
    privacy = PrivacySpec(clip=CLIP, noise_multiplier=NOISE, epsilon=1000.0, delta=1e-5)
    train = TrainSpec(local_steps=4, batch_size=16, learning_rate=0.05,
                      params={"extra_params": str(EXTRA)})  # fmt: skip
    run = dataclasses.replace(spec(ROUNDS, sites=len(SITES)), train=train, privacy=privacy)
    with ExitStack() as stack:
        upstream, regions = _two_levels(stack, tmp_path, secagg=False, equal=False)
        with upstream.admin() as admin:
            run_id = admin.submit(run.validate())
            status = _finished(admin, run_id)
            assert status.state == "completed", status.reason
            models = [admin.export_model(run_id, round_number=r) for r in range(ROUNDS + 1)]
        updates: dict[int, list[dict[str, torch.Tensor]]] = {r: [] for r in range(1, ROUNDS + 1)}
        for region in regions.values():
            with region.admin() as admin:
                for number, regional in _regional_rounds(region).items():
                    final = admin.export_model(regional.run_id)
                    base = models[number - 1]
                    updates[number].append({k: final[k] - base[k] for k in base})
    last = max(status.rounds, key=lambda r: r.number)  # charged as any run of 3 rounds
    assert last.metrics["privacy_epsilon"] == pytest.approx(
        epsilon_after(RoundEvent(NOISE), ROUNDS, 1e-5)
    )
    residuals = []
    for number in range(1, ROUNDS + 1):
        clipped: dict[str, torch.Tensor] = {k: torch.zeros_like(v, dtype=torch.float64)
                                            for k, v in models[0].items()}  # fmt: skip
        for u in updates[number]:
            norm = float(sum(float((t.double() ** 2).sum()) for t in u.values()) ** 0.5)
            assert norm > 2 * CLIP, norm  # the clip binds: an unclipped sum would show
            for k, t in u.items():
                clipped[k] += t.double() * clip_factor(norm, CLIP)
        step = {k: models[number][k].double() - models[number - 1][k].double() for k in clipped}
        # FedAvg, server_lr 1: step = (clipped sum + noise) / sites_per_round.
        residual = torch.cat([(len(SITES) * step[k] - clipped[k]).reshape(-1) for k in clipped])
        direction = torch.cat([t.reshape(-1) for t in clipped.values()])
        along = float(residual @ direction) / float(direction.norm())
        assert abs(along) < 5 * NOISE * CLIP, (number, along)  # noise's own: N(0, std^2)
        residuals.append(residual)
    noise = torch.cat(residuals)
    assert noise.numel() == ROUNDS * (EXTRA + 9)
    std = NOISE * CLIP  # over 6,027 draws the sample std's own spread is 0.9% (5 of it: 4.6%)
    assert abs(float(noise.mean())) < 5 * std / noise.numel() ** 0.5, float(noise.mean())
    assert abs(float(noise.std()) / std - 1) < 0.05, float(noise.std())
