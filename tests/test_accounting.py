"""Tests for fedra.accounting: ε against dp-accounting's own figures (the events built here,
in the test, from the library's documented API), the 10%-sampling figure, the round budget,
and the accountant's checkpoint state (and the one from before dp-accounting)."""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld, rdp

from fedra.accounting import (
    MAX_ROUNDS_CAP,
    PLD_DISCRETIZATION,
    Accountant,
    RoundEvent,
    epsilon_after,
    max_rounds,
)
from fedra.privacy import PrivacyError

REL = dpa.NeighboringRelation


def library_epsilon(
    sampling: str, accountant: str, z: float, m: int, n: int, rounds: int, delta: float,
    discretization: float = PLD_DISCRETIZATION,
) -> float:  # fmt: skip
    """ε straight from dp-accounting, for a round as the docs describe it."""
    if sampling == "poisson":
        event: Any = dpa.PoissonSampledDpEvent(m / n, dpa.GaussianDpEvent(z))
        relation = REL.ADD_OR_REMOVE_ONE
    elif sampling == "fixed":  # replace one: sensitivity 2 * clip, so noise z / 2 of it
        event = dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z / 2))
        relation = REL.REPLACE_ONE
    else:
        event, relation = dpa.GaussianDpEvent(z), REL.ADD_OR_REMOVE_ONE
    if accountant == "pld":
        acc: Any = pld.PLDAccountant(relation, value_discretization_interval=discretization)
    else:
        acc = rdp.RdpAccountant(neighboring_relation=relation)
    return float(acc.compose(dpa.SelfComposedDpEvent(event, rounds)).get_epsilon(delta))


def event_of(sampling: str, accountant: str, z: float, m: int, n: int) -> RoundEvent:
    if sampling == "none":
        return RoundEvent(z, accountant=accountant)
    return RoundEvent(z, sampling, m, n, accountant)


# (sampling, accountant, z, sites_per_round, population, rounds, delta)
LIBRARY_CASES = [
    ("poisson", "rdp", 1.0, 10, 100, 100, 1e-5),
    ("poisson", "pld", 1.0, 10, 100, 100, 1e-5),
    ("poisson", "rdp", 0.8, 10, 1000, 1000, 1e-6),
    ("poisson", "pld", 0.8, 10, 1000, 1000, 1e-6),
    ("poisson", "rdp", 2.0, 5, 10, 10, 1e-5),
    ("poisson", "pld", 2.0, 5, 10, 10, 1e-5),
    ("fixed", "rdp", 1.0, 10, 100, 100, 1e-5),
    ("fixed", "rdp", 1.5, 50, 1000, 200, 1e-6),
    ("fixed", "rdp", 3.0, 3, 4, 20, 1e-5),
    ("none", "rdp", 1.0, 0, 0, 2, 1e-5),
    ("none", "rdp", 5.0, 0, 0, 89, 1e-5),
    ("none", "pld", 1.0, 0, 0, 2, 1e-5),
    ("none", "pld", 5.0, 0, 0, 89, 1e-5),
]


@pytest.mark.parametrize(
    ("sampling", "accountant", "z", "m", "n", "rounds", "delta"), LIBRARY_CASES
)
def test_epsilon_is_the_librarys(
    sampling: str, accountant: str, z: float, m: int, n: int, rounds: int, delta: float
) -> None:
    ours = Accountant(event_of(sampling, accountant, z, m, n), rounds).epsilon(delta)
    theirs = library_epsilon(sampling, accountant, z, m, n, rounds, delta)
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert 0 < ours < math.inf


@pytest.mark.parametrize(("z", "m", "n", "rounds"), [(1.0, 10, 100, 100), (0.8, 10, 1000, 1000)])
def test_pld_discretisation_costs_almost_nothing(z: float, m: int, n: int, rounds: int) -> None:
    """fedra's PLD uses a coarser grid than the library's default (1e-4), rounding
    pessimistically: ε is no smaller and within 1e-3 relative of the default's."""
    ours = Accountant(RoundEvent(z, "poisson", m, n, "pld"), rounds).epsilon(1e-5)
    fine = library_epsilon("poisson", "pld", z, m, n, rounds, 1e-5, discretization=1e-4)
    assert fine * (1 - 1e-9) <= ours <= fine * (1 + 1e-3)


def test_ten_percent_poisson_sampling_at_z1_for_100_rounds() -> None:
    """The figure of issue 20: 10% of the sites a round, noise 1, 100 rounds, δ = 1e-5, in
    the add/remove-one-site relation: ε 7.9 (RDP) or 7.05 (PLD), where the accountant
    without amplification says 96."""
    rdp_eps = Accountant(RoundEvent(1.0, "poisson", 10, 100), 100).epsilon(1e-5)
    pld_eps = Accountant(RoundEvent(1.0, "poisson", 10, 100, "pld"), 100).epsilon(1e-5)
    unamplified = Accountant(RoundEvent(1.0), 100).epsilon(1e-5)
    assert rdp_eps == pytest.approx(7.9039, abs=1e-3)
    assert pld_eps == pytest.approx(7.0466, abs=1e-3)
    assert 7.0 < pld_eps < rdp_eps < 8.0
    assert unamplified == pytest.approx(96.116, abs=1e-2)
    assert RoundEvent(1.0, "poisson", 10, 100).relation == "add/remove one site"
    # The same fraction a round, drawn as a fixed-size sample: replace one site, whose
    # clipped update can move the sum twice as far, so the library gets noise z / 2.
    fixed = RoundEvent(1.0, "fixed", 10, 100)
    assert fixed.relation == "replace one site"
    half = library_epsilon("fixed", "rdp", 1.0, 10, 100, 100, 1e-5)
    assert Accountant(fixed, 100).epsilon(1e-5) == pytest.approx(half, rel=1e-12)
    full = float(
        rdp.RdpAccountant(neighboring_relation=REL.REPLACE_ONE)
        .compose(dpa.SampledWithoutReplacementDpEvent(100, 10, dpa.GaussianDpEvent(1.0)), 100)
        .get_epsilon(1e-5)
    )
    assert half > full  # fedra never claims the z figure for a replace-one sensitivity of 2C


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_fewer_sites_drawn_from_more_costs_no_more(sampling: str) -> None:
    """A fixed-size round drawn from more eligible sites than the declared population, or
    a Poisson round at a smaller rate, gives each site a smaller chance: the library's bound
    grows with the sampling rate, so the declared population's ε covers it."""
    for n_more in (101, 150, 1000):
        declared = Accountant(RoundEvent(1.0, sampling, 10, 100), 50).epsilon(1e-5)
        more = Accountant(RoundEvent(1.0, sampling, 10, n_more), 50).epsilon(1e-5)
        assert more <= declared


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _exact_epsilon(mu: float, delta: float) -> float:
    """The Gaussian mechanism's smallest ε at ``delta`` (Balle & Wang 2018, Thm. 8)."""

    def d(eps: float) -> float:
        return _phi(-eps / mu + mu / 2) - math.exp(eps) * _phi(-eps / mu - mu / 2)

    lo, hi = 0.0, 1.0
    while d(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("z", [0.8, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_unsampled_epsilon_sound_and_tight_against_exact_gaussian(z: float, rounds: int) -> None:
    """Without sampling, T rounds are one Gaussian with mu = sqrt(T) / z: RDP is above the
    exact ε by at most 12% on this grid, PLD by at most 0.1%, neither ever below it."""
    exact = _exact_epsilon(math.sqrt(rounds) / z, 1e-5)
    via_rdp = Accountant(RoundEvent(z), rounds).epsilon(1e-5)
    via_pld = Accountant(RoundEvent(z, accountant="pld"), rounds).epsilon(1e-5)
    assert exact <= via_pld <= exact * 1.001
    assert exact <= via_rdp <= exact * 1.12


# -- the round budget -------------------------------------------------------------------------

BUDGET_EVENTS = [
    RoundEvent(1.0),
    RoundEvent(1.0, accountant="pld"),
    RoundEvent(1.0, "poisson", 10, 100),
    RoundEvent(1.0, "poisson", 10, 100, "pld"),
    RoundEvent(2.0, "fixed", 10, 100),
]


@pytest.mark.parametrize("event", BUDGET_EVENTS, ids=str)
def test_max_rounds_fits_and_one_more_does_not(event: RoundEvent) -> None:
    n = max_rounds(event, 8.0, 1e-5)
    assert n >= 1
    assert epsilon_after(event, n, 1e-5) <= 8.0 < epsilon_after(event, n + 1, 1e-5)
    left = max_rounds(event, 8.0, 1e-5, spent=n - 1)
    assert left == 1
    assert max_rounds(event, 8.0, 1e-5, spent=n) == 0


def test_max_rounds_cap_zero_and_errors() -> None:
    assert max_rounds(RoundEvent(1000.0), 50.0, 1e-5) == MAX_ROUNDS_CAP
    assert max_rounds(RoundEvent(0.5), 1.0, 1e-5) == 0
    assert max_rounds(RoundEvent(1.0), 0.0, 1e-5) == 0
    with pytest.raises(PrivacyError, match="epsilon"):
        max_rounds(RoundEvent(1.0), -1.0, 1e-5)
    with pytest.raises(PrivacyError, match="delta"):
        max_rounds(RoundEvent(1.0), 1.0, 0.0)


def test_accountant_counts_and_leaves_itself_alone() -> None:
    event = RoundEvent(1.0, "poisson", 10, 100)
    spent = Accountant(event)
    assert spent.rounds == 0 and spent.epsilon(1e-5) == 0.0
    later = spent.after().after(4)
    assert (spent.rounds, later.rounds) == (0, 5)
    assert later.epsilon(1e-5) == epsilon_after(event, 5, 1e-5) > 0
    with pytest.raises(PrivacyError, match="rounds"):
        Accountant(event, -1)
    with pytest.raises(PrivacyError, match="delta"):
        later.epsilon(1.0)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "sampling": "shuffle"}, "sampling"),
        ({"noise_multiplier": 1.0, "accountant": "moments"}, "accountant"),
        ({"noise_multiplier": 1.0, "sampling": "poisson", "sample_size": 10}, "population"),
        ({"noise_multiplier": 1.0, "sampling": "fixed", "sample_size": 5, "population": 4},
         "population"),
        ({"noise_multiplier": 1.0, "population": 10}, "population"),
        ({"noise_multiplier": 1.0, "sampling": "fixed", "sample_size": 1, "population": 2,
          "accountant": "pld"}, "PLD"),
    ],
)  # fmt: skip
def test_round_event_refuses_what_it_cannot_account(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(PrivacyError, match=says):
        RoundEvent(**kwargs)


# -- the checkpoint state ---------------------------------------------------------------------


def test_state_round_trip_is_exact_json_in_uint8() -> None:
    event = RoundEvent(1.25, "fixed", 7, 93)
    spent = Accountant(event, 38)
    t = spent.to_tensor()
    assert t.dtype == torch.uint8 and t.dim() == 1
    assert b'"rounds": 38' in bytes(t.tolist())
    back = Accountant.from_tensor(t, event)
    assert back == spent and back.epsilon(1e-5) == spent.epsilon(1e-5)


def test_state_of_another_event_is_refused() -> None:
    t = Accountant(RoundEvent(1.0, "poisson", 10, 100), 3).to_tensor()
    others = [
        RoundEvent(1.0),
        RoundEvent(1.0, "poisson", 10, 101),
        RoundEvent(1.1, "poisson", 10, 100),
        RoundEvent(1.0, "poisson", 10, 100, "pld"),
    ]
    for other in others:
        with pytest.raises(PrivacyError, match="was kept for"):
            Accountant.from_tensor(t, other)


def _bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


@pytest.mark.parametrize(
    "t",
    [
        _bytes("not json"),
        _bytes("[]"),
        _bytes('{"format": "other", "rounds": 1, "event": {}}'),
        _bytes('{"format": "fedra-privacy-accountant/1", "rounds": -1, '
               '"event": {"noise_multiplier": 1.0}}'),
        _bytes('{"format": "fedra-privacy-accountant/1", "rounds": 1.5, '
               '"event": {"noise_multiplier": 1.0}}'),
        _bytes('{"format": "fedra-privacy-accountant/1", "rounds": 1, '
               '"event": {"noise_multiplier": 1.0, "extra": 1}}'),
        _bytes('{"format": "fedra-privacy-accountant/1", "rounds": 1, '
               '"event": {"noise_multiplier": -1.0}}'),
        _bytes("\xff"),
        torch.zeros(5000, dtype=torch.uint8),
        torch.zeros(2, 2, dtype=torch.uint8),
        torch.zeros(3, dtype=torch.float64),
    ],
)  # fmt: skip
def test_malformed_state_is_refused(t: torch.Tensor) -> None:
    with pytest.raises(PrivacyError):
        Accountant.from_tensor(t, RoundEvent(1.0))


def legacy_tensor(rounds: int, z: float = 1.0) -> torch.Tensor:
    """What checkpoints held before dp-accounting: orders, their RDP, the round count."""
    orders = [2.0, 4.0, 8.0, 32.0]
    return torch.tensor(
        [orders, [rounds * a / (2 * z * z) for a in orders], [float(rounds)] * len(orders)],
        dtype=torch.float64,
    )


def test_legacy_state_gives_its_round_count() -> None:
    back = Accountant.from_legacy_tensor(legacy_tensor(7), RoundEvent(1.0))
    assert back == Accountant(RoundEvent(1.0), 7)
    assert back.epsilon(1e-5) == pytest.approx(library_epsilon("none", "rdp", 1.0, 0, 0, 7, 1e-5))


@pytest.mark.parametrize(
    "t",
    [
        legacy_tensor(3).float(),
        legacy_tensor(3)[:2],
        legacy_tensor(3).index_fill_(0, torch.tensor([2]), 1.5),
        legacy_tensor(3).index_fill_(0, torch.tensor([2]), -2.0),
        torch.tensor([[2.0, 3.0], [0.1, math.nan], [1.0, 1.0]], dtype=torch.float64),
        torch.tensor([[2.0, 3.0], [0.1, 0.2], [1.0, 2.0]], dtype=torch.float64),
    ],
)
def test_malformed_legacy_state_is_refused(t: torch.Tensor) -> None:
    with pytest.raises(PrivacyError):
        Accountant.from_legacy_tensor(t, RoundEvent(1.0))


def test_legacy_state_cannot_stand_for_sampled_rounds() -> None:
    with pytest.raises(PrivacyError, match="unsampled"):
        Accountant.from_legacy_tensor(legacy_tensor(3), RoundEvent(1.0, "poisson", 1, 10))
