"""The aggregator interface: one implementation per choice of a run spec, picked once by
``make_aggregator``, and each implementation driven only through the interface, with its
result checked against the computation it stands for."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fedra.config import ConfigError
from fedra.coordinator.aggregation import _RULES, ServerOptimizer, WeightedSum
from fedra.coordinator.aggregators import (
    UNMASKED_EVENT,
    AggregationError,
    Aggregator,
    Attempt,
    PrivateMean,
    PrivateSecureSum,
    RobustAggregate,
    SecureSum,
    StreamingMean,
    make_aggregator,
)
from fedra.coordinator.state import ActiveRun, Assignment, TaskState
from fedra.privacy import clip_factor
from fedra.protos.codec import TensorPiece, spec_of
from fedra.protos.compression import Piece, flatten_update
from fedra.runspec import (
    AGGREGATION_RULES,
    STRATEGY_PARAMS,
    AggregationSpec,
    AsyncSpec,
    CodecSpec,
    PrivacySpec,
    RunSpec,
    SecAggSpec,
)
from fedra.secagg import SiteSecAgg

MODEL = {"w": torch.zeros(3, 4), "b": torch.zeros(5), "steps": torch.zeros(2, dtype=torch.int64)}
SPECS = spec_of(MODEL)
SITES = ("site-a", "site-b", "site-c")


def _spec(
    rule: str = "mean",
    *,
    secagg: bool = False,
    privacy: bool = False,
    **aggregation: Any,
) -> RunSpec:
    return RunSpec(
        task="pkg.mod:task",
        rounds=3,
        sites_per_round=5,
        aggregation=dataclasses.replace(AggregationSpec(rule), **aggregation),
        privacy=PrivacySpec() if privacy else None,
        secagg=SecAggSpec(clip=10.0) if secagg else None,
    )


def _update(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=gen) * scale,
        "b": torch.randn(5, generator=gen) * scale,
        "steps": torch.full((2,), seed, dtype=torch.int64),
    }


class _Update:
    """A ``SpooledUpdate`` from tensors: dense pieces of ``piece`` elements at most, or the
    masked integers a site sent."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        masked: torch.Tensor | None = None,
        piece: int = 2,
    ) -> None:
        self.tensors, self._masked, self._piece = tensors, masked, piece
        self.reads = 0

    def dense(self) -> Iterator[Piece]:
        self.reads += 1
        for name, t in self.tensors.items():
            flat = t.reshape(-1)
            for start in range(0, flat.numel(), self._piece):
                yield TensorPiece(name, start, flat[start : start + self._piece])

    def masked(self) -> Iterator[tuple[int, torch.Tensor]]:
        assert self._masked is not None
        for start in range(0, self._masked.numel(), 7):
            yield start, self._masked[start : start + 7]


def _attempt(tmp_path: Path, sites: tuple[str, ...] = SITES) -> Attempt:
    return Attempt("run-1", 1, 1, sites, SPECS, tmp_path / "spill")


# -- the factory -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        (_spec("mean"), StreamingMean),
        (_spec("mean", privacy=True), PrivateMean),
        (_spec("mean", secagg=True), SecureSum),
        (_spec("mean", secagg=True, privacy=True), PrivateSecureSum),
        (_spec("median"), RobustAggregate),
        (_spec("trimmed_mean"), RobustAggregate),
        (_spec("krum"), RobustAggregate),
        (_spec("multikrum"), RobustAggregate),
    ],
)
def test_each_choice_of_a_spec_yields_its_aggregator(spec: RunSpec, kind: type) -> None:
    aggregator = make_aggregator(spec)
    assert type(aggregator) is kind
    assert isinstance(aggregator, Aggregator)
    report = spec.aggregation.rule in ("krum", "multikrum")
    assert getattr(aggregator, "report_selection", report) is report


def test_every_spec_that_validates_has_an_aggregator() -> None:
    """The table covers every combination the spec's validation lets through."""
    valid = 0
    for rule, secagg, privacy in itertools.product(AGGREGATION_RULES, (False, True), (False, True)):
        spec = _spec(rule, secagg=secagg, privacy=privacy)
        try:
            spec.validate()
        except ConfigError:
            continue
        make_aggregator(spec)
        valid += 1
    assert valid == len(AGGREGATION_RULES) + 3  # mean with [privacy], [secagg], or both


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (_spec("mode"), "no aggregator for rule 'mode'"),
        (_spec("median", privacy=True), "no aggregator for rule 'median' with \\[privacy\\]"),
        (_spec("krum", secagg=True), "no aggregator for rule 'krum' with \\[secagg\\]"),
    ],
)
def test_an_unknown_choice_is_a_clear_error(spec: RunSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^aggregation\.rule: {message} \(there are: .*\)"):
        make_aggregator(spec)


def test_a_run_chooses_its_aggregator_once_from_its_spec(tmp_path: Path) -> None:
    spec = _spec("mean", secagg=True)
    run = ActiveRun(run_id="run-1", spec=spec, optimizer=ServerOptimizer(spec))
    aggregator = run.aggregator
    assert isinstance(aggregator, SecureSum)
    run.open_round = 1
    # No attempt begun: no key exchange yet, but the updates will travel masked.
    assert (run.secure, run.upload_codec) == (None, CodecSpec("secagg"))
    aggregator.begin(_attempt(tmp_path))
    assert run.secure is aggregator.secure is not None
    run.set_closed(next_round=2)
    assert run.aggregator is aggregator and run.secure is None
    plain = ActiveRun(run_id="run-2", spec=_spec(), optimizer=ServerOptimizer(_spec()))
    plain.open_round = 1
    assert (plain.upload_codec, plain.accumulator) == (CodecSpec(), None)
    plain.aggregator.begin(_attempt(tmp_path))
    assert isinstance(plain.accumulator, WeightedSum) and plain.secure is None
    plain.drop_aggregate()
    assert plain.accumulator is None


def test_every_strategy_has_its_outer_step_and_an_unknown_one_is_refused() -> None:
    assert set(_RULES) == set(STRATEGY_PARAMS)
    spec = dataclasses.replace(_spec(), strategy="fedsgd")
    with pytest.raises(ConfigError, match=r"strategy\.name: unknown strategy 'fedsgd'"):
        ServerOptimizer(spec)


# -- streaming means ---------------------------------------------------------------


def _reference_sum(
    updates: Sequence[tuple[Mapping[str, torch.Tensor], float, float]], bound: float
) -> WeightedSum:
    """The bounded, weighted sum folded straight into a WeightedSum, as the coordinator did
    before the aggregator interface: (update, weight, staleness factor)."""
    acc = WeightedSum(SPECS)
    for update, weight, discount in updates:
        scale = discount
        if bound > 0:
            pieces = [p.values for p in _Update(update).dense() if p.values.is_floating_point()]
            norm = math.sqrt(sum(float(v.double().square().sum()) for v in pieces))
            scale *= clip_factor(norm, bound)
        acc.add_pieces(_Update(update).dense(), weight * scale)
        acc.finish_update(weight)
    return acc


@pytest.mark.parametrize("bound", [0.0, 1.5])
def test_the_streaming_mean_is_the_sample_weighted_mean(tmp_path: Path, bound: float) -> None:
    aggregator = make_aggregator(_spec("mean", norm_bound=bound))
    assert aggregator.ordered and aggregator.upload_codec == CodecSpec()
    aggregator.begin(_attempt(tmp_path))
    updates = [_update(i, scale=1.0 + i) for i in range(3)]
    spooled = [_Update(u) for u in updates]
    for site, update, samples in zip(SITES, spooled, (10, 30, 60), strict=True):
        aggregator.fold(site, update, samples, staleness=0)
    mean, count = aggregator.finish()
    assert count == 3 and set(mean) == {"w", "b"}  # integer buffers keep the global value
    weighted = [(u, n, 1.0) for u, n in zip(updates, (10, 30, 60), strict=True)]
    expected = _reference_sum(weighted, bound).mean()
    for name in mean:
        assert torch.equal(mean[name], expected[name])
    assert [u.reads for u in spooled] == [2 if bound else 1] * 3  # a norm pass when bounded
    aggregator.drop()
    aggregator.drop()


def test_the_next_attempt_sums_in_the_last_one_s_memory_from_zero(tmp_path: Path) -> None:
    """A synchronous mean's next attempt takes the memory of the last one's sums (there,
    the commit stepped the model: it holds anything by then) and starts from zero in it,
    as fresh memory would."""
    aggregator = make_aggregator(_spec("mean"))
    aggregator.begin(_attempt(tmp_path))
    for site, seed in zip(SITES, (1, 2, 3), strict=True):
        aggregator.fold(site, _Update(_update(seed)), 10, staleness=0)
    first, _ = aggregator.finish()
    memory = {name: t.data_ptr() for name, t in first.items()}
    for t in first.values():
        t.fill_(float("nan"))  # what a stepped model leaves there, as far as a sum cares
    aggregator.drop()
    aggregator.begin(_attempt(tmp_path))
    updates = [_update(4), _update(5)]
    for site, update, samples in zip(SITES[:2], updates, (10, 30), strict=True):
        aggregator.fold(site, _Update(update), samples, staleness=0)
    mean, count = aggregator.finish()
    assert {name: t.data_ptr() for name, t in mean.items()} == memory
    expected = _reference_sum([(updates[0], 10, 1.0), (updates[1], 30, 1.0)], 0.0).mean()
    assert count == 2
    for name in mean:
        assert torch.equal(mean[name], expected[name])


def test_an_async_mean_s_next_attempt_never_shares_the_last_one_s_memory(
    tmp_path: Path,
) -> None:
    """An async run's folds may outlast their attempt: its sums are never handed on."""
    aggregator = make_aggregator(dataclasses.replace(_spec(), asynchronous=AsyncSpec(buffer=2)))
    aggregator.begin(_attempt(tmp_path))
    aggregator.fold(SITES[0], _Update(_update(1)), 10, staleness=0)
    first, _ = aggregator.finish()
    aggregator.drop()
    aggregator.begin(_attempt(tmp_path))
    aggregator.fold(SITES[0], _Update(_update(2)), 10, staleness=0)
    second, _ = aggregator.finish()
    assert all(second[k].data_ptr() != first[k].data_ptr() for k in second)


def test_an_async_mean_discounts_stale_updates_and_folds_as_they_come(tmp_path: Path) -> None:
    spec = dataclasses.replace(_spec(), asynchronous=AsyncSpec(buffer=2))
    aggregator = make_aggregator(spec)
    assert not aggregator.ordered
    aggregator.begin(_attempt(tmp_path))
    updates = [_update(1), _update(2)]
    aggregator.fold(SITES[0], _Update(updates[0]), 10, staleness=3)  # weight 1/sqrt(1+3)
    aggregator.fold(SITES[1], _Update(updates[1]), 30, staleness=0)
    mean, count = aggregator.finish()
    expected = _reference_sum([(updates[0], 10, 0.5), (updates[1], 30, 1.0)], 0.0).mean()
    assert count == 2
    for name in mean:
        assert torch.equal(mean[name], expected[name])


def test_the_private_mean_clips_counts_each_site_once_and_adds_the_noise(tmp_path: Path) -> None:
    spec = _spec("mean", privacy=True)
    assert spec.privacy is not None
    aggregator = make_aggregator(spec)
    specs = spec_of({"w": torch.zeros(200_000)})
    aggregator.begin(Attempt("run-1", 1, 1, SITES[:2], specs, tmp_path))
    gen = torch.Generator().manual_seed(0)
    updates = [{"w": torch.randn(200_000, generator=gen) * s} for s in (0.001, 1.0)]
    for site, update, samples in zip(SITES[:2], updates, (1, 1000), strict=True):
        aggregator.fold(site, _Update(update, piece=4096), samples, staleness=0)
    mean, count = aggregator.finish()
    assert count == 2
    clip = spec.privacy.clip
    clipped = sum(u["w"] * clip_factor(float(u["w"].double().norm()), clip) for u in updates)
    assert isinstance(clipped, torch.Tensor)
    noise = mean["w"].double() * spec.sites_per_round - clipped.double()
    std = spec.privacy.noise_multiplier * spec.privacy.clip
    assert abs(float(noise.mean())) < 0.02 * std
    assert float(noise.std()) == pytest.approx(std, rel=0.02)


# -- robust rules ------------------------------------------------------------------


def test_a_robust_rule_spills_every_update_and_drop_deletes_them(tmp_path: Path) -> None:
    aggregator = make_aggregator(_spec("median", spill_mb=0))
    attempt = _attempt(tmp_path)
    aggregator.begin(attempt)
    updates = [_update(i) for i in range(3)]
    for site, update in zip(SITES, updates, strict=True):
        aggregator.fold(site, _Update(update), 1000, staleness=0)
    assert len(list(attempt.spill_dir.iterdir())) == 3
    mean, count = aggregator.finish()
    assert count == 3
    for name in mean:  # odd n: the middle value
        assert torch.equal(mean[name], torch.stack([u[name] for u in updates]).median(dim=0)[0])
    aggregator.drop()
    assert not attempt.spill_dir.exists()


def test_krum_reports_its_choice_and_refuses_too_few_updates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    aggregator = make_aggregator(_spec("krum", byzantine=1))
    aggregator.begin(_attempt(tmp_path, tuple(f"site-{i}" for i in range(5))))
    for i in range(3):
        aggregator.fold(f"site-{i}", _Update(_update(i)), 1, staleness=0)
    with pytest.raises(AggregationError, match=r"krum with byzantine=1 needs n >= .* got 3"):
        aggregator.finish()
    for i in range(3, 5):
        aggregator.fold(f"site-{i}", _Update(_update(i, scale=100.0 if i == 4 else 1.0)), 1, 0)
    with caplog.at_level(logging.INFO, logger="fedra.coordinator"):
        mean, count = aggregator.finish()
    assert count == 1
    assert "run run-1: krum kept updates [" in caplog.text
    assert any(torch.equal(mean["w"], _update(i)["w"]) for i in range(4))  # not the outlier


# -- secure aggregation ------------------------------------------------------------


@pytest.mark.parametrize("private", [False, True])
def test_a_secure_sum_runs_its_stages_through_the_interface(tmp_path: Path, private: bool) -> None:
    """Keys, shares, masked uploads, reveals: the survivors' mean, and nothing else."""
    # With [privacy] the denominator is sites_per_round, whoever survives.
    spec = dataclasses.replace(_spec("mean", secagg=True, privacy=private), sites_per_round=4)
    denominator = 4 if private else 3
    aggregator = make_aggregator(spec)
    assert not aggregator.ordered
    assert aggregator.release_event == UNMASKED_EVENT and aggregator.restart_reason
    assignments = {s: Assignment(f"task-{s}", s, TaskState.DOWNLOADED) for s in SITES}
    assert not aggregator.advance(assignments, quorum=3).changed  # round 0: no stages
    assert aggregator.close_uploads() is None and not aggregator.collecting()
    aggregator.begin(_attempt(tmp_path))
    sec = aggregator.secure
    assert sec is not None and sec.stage == "keys"
    sites = {s: SiteSecAgg(s, sec.plan.threshold, sec.context) for s in SITES}
    for s in SITES:
        sec.server.advertise(s, sites[s].public_keys())
        sec.keys_from.add(s)
    change = aggregator.advance(assignments, quorum=3)
    assert change.moved and not change.dropped and not change.broken and sec.stage == "shares"
    for s in SITES:
        sec.server.post_shares(s, sites[s].share_keys(sec.server.neighbour_keys(s)))
        sec.shares_from.add(s)
    assert aggregator.advance(assignments, quorum=3).moved and sec.stage == "masked"
    assert not aggregator.advance(assignments, quorum=3).changed
    updates = [_update(i, scale=0.1) for i in range(3)]
    for s, update in zip(SITES, updates, strict=True):
        sites[s].receive_shares(sec.server.inbox(s))
        masked = sites[s].mask(flatten_update(update), clip=10.0, bits=sec.bits)
        aggregator.fold(s, _Update(update, masked), 100, staleness=0)
    assert aggregator.close_uploads() == ""
    assert aggregator.collecting()
    for s in SITES:
        sec.server.post_reveal(s, sites[s].reveal(*sec.server.unmask_request(s)))
    assert not aggregator.collecting()
    aggregator.seal()
    assert sec.finishing
    mean, count = aggregator.finish()
    assert count == 3
    for name in ("w", "b"):
        plain = sum(u[name] for u in updates) / denominator
        assert isinstance(plain, torch.Tensor)
        torch.testing.assert_close(mean[name], plain, atol=3 * 20.0 / (1 << sec.bits), rtol=0)
    aggregator.drop()
    assert aggregator.secure is None


def test_a_secure_sum_drops_sites_that_miss_the_key_exchange(tmp_path: Path) -> None:
    spec = dataclasses.replace(_spec("mean", secagg=True), sites_per_round=3)
    aggregator = make_aggregator(spec)
    aggregator.begin(_attempt(tmp_path))
    sec = aggregator.secure
    assert sec is not None
    sec.deadline = 0.0  # overdue
    assignments = {s: Assignment(f"task-{s}", s, TaskState.DOWNLOADED) for s in SITES}
    change = aggregator.advance(assignments, quorum=2)
    assert change.dropped == list(SITES) and "key exchange in time" in change.dropped_why
    assert "only 0 of 3 sites sent their keys" in change.broken
