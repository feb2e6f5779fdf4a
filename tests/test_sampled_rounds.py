"""The round driver samples a private run's sites the way its accountant assumes: Poisson
(each eligible site independently, from secret randomness, no quorum) or a fixed-size
sample drawn only from the declared population; the restored accountant is the run's."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from fedra.accounting import Accountant, RoundEvent, epsilon_after
from fedra.coordinator.aggregation import ServerOptimizer
from fedra.coordinator.engine.recovery import restore_accountant
from fedra.coordinator.engine.rounds import ACCOUNTANT_KEY, LEGACY_ACCOUNTANT_KEY, draw
from fedra.coordinator.state import ActiveRun
from fedra.privacy import PrivacyError
from fedra.protos.codec import encode
from fedra.protos.v1 import admin_pb2, common_pb2
from fedra.runspec import PrivacySpec, RunSpec
from tests.conftest import InProcessCoordinator
from tests.test_accounting import legacy_tensor
from tests.test_round_rules import exported
from tests.test_site_service import (
    SITES,
    messages,
    model_state,
    register,
    submit,
    tasks_of_round,
    upload,
    wait_round,
)

SITE_IDS = [f"s{i:02d}" for i in range(20)]


def spec_with(sampling: str, population: int, sites_per_round: int = 5) -> RunSpec:
    privacy = PrivacySpec(epsilon=100.0, sampling=sampling, population=population)
    return RunSpec("m:t", 10, sites_per_round=sites_per_round, privacy=privacy).validate()


def test_poisson_draw_takes_each_site_with_its_probability() -> None:
    spec = spec_with("poisson", 20)  # q = 5 / 20
    counts: Counter[str] = Counter()
    sizes = set()
    draws = 2000
    for _ in range(draws):
        sample = draw(spec, 3, 1, SITE_IDS, 5)
        assert sample == sorted(sample) and set(sample) <= set(SITE_IDS)
        counts.update(sample)
        sizes.add(len(sample))
    sd = (draws * 0.25 * 0.75) ** 0.5
    for site in SITE_IDS:
        assert abs(counts[site] - 0.25 * draws) < 6 * sd, (site, counts[site])
    assert len(sizes) > 3  # the cohort's size is random, not sites_per_round


def test_sampled_draws_are_secret_unsampled_ones_follow_the_seed() -> None:
    """With amplification claimed, the same spec, round and attempt draw different sites
    (an observer cannot recompute them from the seed); without it, the same ones."""
    fixed = spec_with("fixed", 20)
    fixed_draws = {tuple(draw(fixed, 3, 1, SITE_IDS, 5)) for _ in range(20)}
    assert len(fixed_draws) > 1 and all(len(d) == 5 for d in fixed_draws)
    plain = RunSpec("m:t", 10, sites_per_round=5, privacy=PrivacySpec(epsilon=100.0))
    plain_draws = {tuple(draw(plain, 3, 1, SITE_IDS, 5)) for _ in range(20)}
    assert len(plain_draws) == 1
    # Round 0 (the initial model) is no private release: drawn as always.
    assert len({tuple(draw(fixed, 0, 1, SITE_IDS, 1)) for _ in range(10)}) == 1


def test_poisson_round_with_an_empty_sample_commits_the_noise_alone(
    coordinator: InProcessCoordinator,
) -> None:
    """q = 1e-6: the round draws no site and, without a quorum to wait for, commits the
    model moved by the noise alone, charged as one Poisson round."""
    c = coordinator
    register(c, *SITES)
    privacy = common_pb2.Privacy(
        clip=0.1, noise_multiplier=1.0, epsilon=1.0, delta=1e-5, sampling="poisson",
        population=10**6,
    )  # fmt: skip
    run_id = submit(c, sites_per_round=1, min_sites=0, join_timeout_s=0.5, privacy=privacy,
                    rounds=1)  # fmt: skip
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    upload(c, messages(init_task, init_site, encode(model_state())))
    r1 = wait_round(c, run_id, 1, "committed")
    assert list(r1.sampled_sites) == [] and list(r1.participations) == []
    event = RoundEvent(1.0, "poisson", 1, 10**6)
    assert r1.metrics["privacy_epsilon"] == pytest.approx(epsilon_after(event, 1, 1e-5))
    before, after = model_state(), exported(c, run_id, 1)
    noise = torch.cat([(after[k] - before[k]).flatten() for k in before])
    # Noise std clip * z / sites_per_round = 0.1. Nine draws: 8 s^2 / 0.01 is chi-squared
    # with 8 degrees of freedom, so 0.02 < s < 0.25 fails by chance once in 50,000 runs
    # (0.05 < s failed once in 50: the noise comes from secret randomness, not a seed).
    assert 0.02 < float(noise.std()) < 0.25


def test_fixed_size_round_waits_for_the_declared_population(
    coordinator: InProcessCoordinator,
) -> None:
    """Declared population 4, three sites online: round 1 does not open (drawn from fewer,
    each site's chance would exceed the accounted 2 / 4); a fourth site lets it open."""
    c = coordinator
    register(c, *SITES)
    privacy = common_pb2.Privacy(
        clip=0.1, noise_multiplier=2.0, epsilon=50.0, delta=1e-5, sampling="fixed", population=4
    )
    run_id = submit(c, sites_per_round=2, min_sites=2, join_timeout_s=0.2, privacy=privacy)
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    upload(c, messages(init_task, init_site, encode(model_state())))
    deadline = time.monotonic() + 20
    while True:
        status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
        if "sampling fixed wants 4" in status.reason:
            break
        assert time.monotonic() < deadline, status.reason
        time.sleep(0.05)
    assert "3 eligible" in status.reason
    assert not any(r.number == 1 for r in status.rounds)
    register(c, "site-d")
    tasks = tasks_of_round(c, run_id, 1)
    assert len(tasks) == 2 and set(tasks) <= {*SITES, "site-d"}


def _run(privacy: PrivacySpec) -> ActiveRun:
    spec = RunSpec("m:t", 10, sites_per_round=2, privacy=privacy).validate()
    return ActiveRun(run_id="r", spec=spec, optimizer=ServerOptimizer(spec))


def test_restore_accountant_reads_both_formats_and_refuses_another_run() -> None:
    poisson = _run(PrivacySpec(epsilon=50.0, sampling="poisson", population=4))
    event = RoundEvent(1.0, "poisson", 2, 4)
    state = {ACCOUNTANT_KEY: Accountant(event, 5).to_tensor(), "m": torch.zeros(1)}
    restore_accountant(poisson, state)
    assert poisson.accountant == Accountant(event, 5) and list(state) == ["m"]
    # A checkpoint from before dp-accounting: its round count, charged as unsampled rounds.
    plain = _run(PrivacySpec(epsilon=50.0))
    restore_accountant(plain, {LEGACY_ACCOUNTANT_KEY: legacy_tensor(2)})
    assert plain.accountant == Accountant(RoundEvent(1.0), 2)
    assert plain.privacy_spent().after().epsilon(1e-5) == epsilon_after(RoundEvent(1.0), 3, 1e-5)
    with pytest.raises(PrivacyError, match="was kept for"):
        restore_accountant(plain, {ACCOUNTANT_KEY: Accountant(event, 5).to_tensor()})
    with pytest.raises(PrivacyError, match="unsampled"):
        restore_accountant(poisson, {LEGACY_ACCOUNTANT_KEY: legacy_tensor(2)})


def test_poisson_tasks_tell_the_expected_cohort() -> None:
    """A site's policy compares its min_sites to the cohort a task names: for Poisson rounds
    that is sites_per_round, never the random size (which would tie one site's answer to
    whether another was sampled)."""
    run = _run(PrivacySpec(epsilon=50.0, sampling="poisson", population=4))
    assert run.cohort_size == 2
    plain = _run(PrivacySpec(epsilon=50.0))
    assert plain.cohort_size == 0  # no round open: no site assigned
