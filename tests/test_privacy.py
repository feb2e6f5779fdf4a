"""Tests for fedra.privacy: the RDP accountant against the exact Gaussian privacy curve, its
checkpoint tensor, the round budget, clipping and the CSPRNG Gaussian noise."""

from __future__ import annotations

import math
import random
from typing import Any, NoReturn

import pytest
import torch

from fedra.privacy import (
    DEFAULT_ORDERS,
    MAX_ROUNDS_CAP,
    PrivacyError,
    RdpAccountant,
    add_secure_gaussian_,
    clip_factor,
    gaussian_rdp,
    max_rounds,
    rdp_to_epsilon,
)

DELTA = 1e-5


# -- RDP of the Gaussian mechanism and composition ----------------------------------------------


def test_gaussian_rdp_formula() -> None:
    for z in (0.5, 1.0, 3.7):
        rdp = gaussian_rdp(z)
        assert len(rdp) == len(DEFAULT_ORDERS)
        for a, r in zip(DEFAULT_ORDERS, rdp, strict=True):
            assert r == pytest.approx(a / (2 * z * z), rel=1e-15)
    assert gaussian_rdp(2.0, [2.0, 10.0]) == [0.25, 1.25]


@pytest.mark.parametrize("z", [0.0, -1.0, math.inf, math.nan, 1e-300])
def test_gaussian_rdp_rejects_bad_noise(z: float) -> None:
    with pytest.raises(PrivacyError, match="noise_multiplier"):
        gaussian_rdp(z)


@pytest.mark.parametrize("orders", [[], [1.0], [0.5, 2.0], [2.0, math.inf]])
def test_gaussian_rdp_rejects_bad_orders(orders: list[float]) -> None:
    with pytest.raises(PrivacyError, match="order"):
        gaussian_rdp(1.0, orders)


def test_compose_is_additive_and_counts_rounds() -> None:
    acc = RdpAccountant()
    assert acc.rounds == 0
    assert acc.rdp == (0.0,) * len(DEFAULT_ORDERS)
    assert acc.orders == DEFAULT_ORDERS
    acc.compose(1.0)
    acc.compose(2.0, rounds=3)
    assert acc.rounds == 4
    one, two = gaussian_rdp(1.0), gaussian_rdp(2.0)
    for r, a, b in zip(acc.rdp, one, two, strict=True):
        assert r == pytest.approx(a + 3 * b, rel=1e-14)
    # Composing T rounds at once equals T single rounds.
    single = RdpAccountant()
    for _ in range(7):
        single.compose(1.3)
    batch = RdpAccountant()
    batch.compose(1.3, rounds=7)
    assert single.rounds == batch.rounds == 7
    assert single.rdp == pytest.approx(batch.rdp, rel=1e-14)


def test_after_leaves_self_alone() -> None:
    acc = RdpAccountant()
    acc.compose(1.0, rounds=2)
    before = (acc.rdp, acc.rounds)
    later = acc.after(1.0, rounds=5)
    assert (acc.rdp, acc.rounds) == before
    assert later.rounds == 7
    assert later.epsilon(DELTA) > acc.epsilon(DELTA)
    assert acc.after(1.0, rounds=0).rdp == acc.rdp


def test_epsilon_zero_before_any_round() -> None:
    assert RdpAccountant().epsilon(DELTA) == 0.0
    assert RdpAccountant([2.0, 4.0]).epsilon(0.5) == 0.0


def test_bad_arguments() -> None:
    acc = RdpAccountant()
    with pytest.raises(PrivacyError, match="rounds"):
        acc.compose(1.0, rounds=-1)
    with pytest.raises(PrivacyError, match="rounds"):
        acc.compose(1.0, rounds=1.5)  # type: ignore[arg-type]
    for d in (0.0, 1.0, -1e-5, math.nan):
        with pytest.raises(PrivacyError, match="delta"):
            acc.epsilon(d)
    with pytest.raises(PrivacyError, match="rdp"):
        RdpAccountant([2.0, 3.0], [0.1])
    with pytest.raises(PrivacyError, match="rdp"):
        RdpAccountant([2.0], [-0.1])
    with pytest.raises(PrivacyError, match="rdp"):
        rdp_to_epsilon([0.1], [2.0, 3.0], DELTA)
    assert acc.rounds == 0


def test_rdp_to_epsilon_formula() -> None:
    # One order: the tighter (Balle et al. 2020) conversion wins over the classic one.
    r, a, d = 0.5, 8.0, 1e-6
    tight = r + math.log((a - 1) / a) - (math.log(d) + math.log(a)) / (a - 1)
    classic = r + math.log(1 / d) / (a - 1)
    assert tight < classic
    eps, order = rdp_to_epsilon([r], [a], d)
    assert eps == pytest.approx(tight, rel=1e-14)
    assert order == a
    # The best order is reported, and ε is clamped at 0.
    eps, order = rdp_to_epsilon([5.0, 0.5, 9.0], [2.0, 8.0, 32.0], d)
    assert order == 8.0
    assert eps == pytest.approx(tight, rel=1e-14)
    assert rdp_to_epsilon([1e-9], [1024.0], 0.9)[0] == 0.0


# -- soundness and tightness against the exact Gaussian privacy curve ---------------------------


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _exact_delta(eps: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with sensitivity / noise = mu (Balle & Wang 2018, Thm. 8)."""
    return _phi(-eps / mu + mu / 2) - math.exp(eps) * _phi(-eps / mu - mu / 2)


def _exact_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) <= delta, by bisection (δ(ε) decreases in ε); rounded up."""
    lo, hi = 0.0, 1.0
    while _exact_delta(hi, mu) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        if _exact_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


# Going through RDP loses something against the exact curve: on this grid the accountant's ε is
# 4.7% to 9.9% above the exact one (worst: z=5, T=1, ε 0.797 vs 0.726), the loss being largest
# for small ε where the optimal order falls between grid points and the RDP-to-DP conversion is
# loosest. 12% leaves a little headroom for float noise yet fails if the tight conversion
# regressed to the classic one alone, which is up to 35% above the exact ε here.
TIGHTNESS = 1.12


@pytest.mark.parametrize("z", [0.8, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_epsilon_sound_and_tight_against_exact_gaussian(z: float, rounds: int) -> None:
    acc = RdpAccountant()
    acc.compose(z, rounds=rounds)
    eps = acc.epsilon(DELTA)
    # T rounds of an L2-sensitivity-1 Gaussian with std z are one Gaussian with mu = sqrt(T)/z.
    exact = _exact_epsilon(math.sqrt(rounds) / z, DELTA)
    assert eps >= exact, "accountant claims less ε than the Gaussian mechanism gives"
    assert eps <= TIGHTNESS * exact


# -- checkpoint tensor ------------------------------------------------------------------------


def test_tensor_round_trip_is_exact() -> None:
    acc = RdpAccountant()
    acc.compose(1.1, rounds=37)
    acc.compose(0.9)
    t = acc.to_tensor()
    assert t.dtype == torch.float64
    assert t.shape == (3, len(DEFAULT_ORDERS))
    assert t[0].tolist() == list(DEFAULT_ORDERS)
    assert t[2].tolist() == [38.0] * len(DEFAULT_ORDERS)
    back = RdpAccountant.from_tensor(t)
    assert back.orders == acc.orders
    assert back.rdp == acc.rdp
    assert back.rounds == 38
    assert back.epsilon(DELTA) == acc.epsilon(DELTA)
    assert torch.equal(back.to_tensor(), t)
    fresh = RdpAccountant.from_tensor(RdpAccountant([2.0, 3.0]).to_tensor())
    assert (fresh.orders, fresh.rdp, fresh.rounds) == ((2.0, 3.0), (0.0, 0.0), 0)


def _malformed() -> list[Any]:
    good = RdpAccountant([2.0, 4.0, 8.0], [0.1, 0.2, 0.4], rounds=3).to_tensor()

    def edit(row: int, col: int, value: float) -> torch.Tensor:
        t = good.clone()
        t[row, col] = value
        return t

    return [
        good.float(),
        good.to(torch.int64),
        good[:2],
        good.reshape(-1),
        good.reshape(1, 3, 3),
        torch.empty(3, 0, dtype=torch.float64),
        edit(1, 0, math.nan),
        edit(1, 1, math.inf),
        edit(0, 2, -math.inf),
        edit(1, 2, -0.5),  # negative rdp
        edit(0, 0, 1.0),  # order <= 1
        edit(0, 1, 0.5),
        edit(2, 1, 4.0),  # rounds differ between columns
        torch.full((3, 3), -1.0, dtype=torch.float64),
        good.clone().index_fill_(0, torch.tensor([2]), 1.5),  # fractional rounds
        good.clone().index_fill_(0, torch.tensor([2]), -2.0),  # negative rounds
        good.tolist(),  # not a tensor
    ]


@pytest.mark.parametrize("t", _malformed())
def test_from_tensor_rejects_malformed(t: Any) -> None:
    with pytest.raises(PrivacyError):
        RdpAccountant.from_tensor(t)


# -- round budget ---------------------------------------------------------------------------


@pytest.mark.parametrize(("z", "budget"), [(1.0, 8.0), (2.0, 8.0), (5.0, 10.0), (0.8, 50.0)])
def test_max_rounds_fits_and_one_more_does_not(z: float, budget: float) -> None:
    n = max_rounds(z, budget, DELTA)
    assert 0 < n < MAX_ROUNDS_CAP
    assert RdpAccountant().after(z, n).epsilon(DELTA) <= budget
    assert RdpAccountant().after(z, n + 1).epsilon(DELTA) > budget


def test_max_rounds_zero_when_one_round_is_over_budget() -> None:
    assert RdpAccountant().after(0.5, 1).epsilon(DELTA) > 1.0
    assert max_rounds(0.5, 1.0, DELTA) == 0
    assert max_rounds(1.0, 0.0, DELTA) == 0


def test_max_rounds_respects_spent() -> None:
    z, budget = 5.0, 10.0
    total = max_rounds(z, budget, DELTA)
    assert total > 20
    spent = RdpAccountant()
    spent.compose(z, rounds=10)
    left = max_rounds(z, budget, DELTA, spent=spent)
    assert abs(left - (total - 10)) <= 1  # the same budget, up to float rounding at the edge
    assert spent.after(z, left).epsilon(DELTA) <= budget
    assert spent.after(z, left + 1).epsilon(DELTA) > budget
    assert spent.rounds == 10  # not consumed
    over = RdpAccountant()
    over.compose(z, rounds=total + 1)
    assert max_rounds(z, budget, DELTA, spent=over) == 0
    # Spending at another noise level counts too.
    mixed = RdpAccountant()
    mixed.compose(2.0, rounds=3)
    n = max_rounds(z, budget, DELTA, spent=mixed)
    assert 0 < n < total - 3
    assert mixed.after(z, n).epsilon(DELTA) <= budget < mixed.after(z, n + 1).epsilon(DELTA)


def test_max_rounds_cap_and_errors() -> None:
    assert max_rounds(1000.0, 50.0, DELTA) == MAX_ROUNDS_CAP
    with pytest.raises(PrivacyError, match="epsilon"):
        max_rounds(1.0, -1.0, DELTA)
    with pytest.raises(PrivacyError, match="delta"):
        max_rounds(1.0, 1.0, 0.0)
    with pytest.raises(PrivacyError, match="noise_multiplier"):
        max_rounds(0.0, 1.0, DELTA)


# -- clipping ---------------------------------------------------------------------------------


def test_clip_factor() -> None:
    assert clip_factor(0.0, 1.0) == 1.0
    assert clip_factor(0.5, 1.0) == 1.0
    assert clip_factor(1.0, 1.0) == 1.0
    assert clip_factor(4.0, 1.0) == 0.25
    assert clip_factor(3.0, 0.3) == pytest.approx(0.1, rel=1e-15)
    assert 3.0 * clip_factor(3.0, 0.3) <= 0.3


@pytest.mark.parametrize(
    ("norm", "clip", "name"),
    [
        (1.0, 0.0, "clip"),
        (1.0, -1.0, "clip"),
        (1.0, math.inf, "clip"),
        (1.0, math.nan, "clip"),
        (math.nan, 1.0, "norm"),
        (math.inf, 1.0, "norm"),
        (-1.0, 1.0, "norm"),
    ],
)
def test_clip_factor_errors(norm: float, clip: float, name: str) -> None:
    with pytest.raises(PrivacyError, match=name):
        clip_factor(norm, clip)


# -- secure Gaussian noise --------------------------------------------------------------------


def _forbid(*_: object, **__: object) -> NoReturn:
    raise AssertionError("a statistical random generator was used")


@pytest.fixture
def no_statistical_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch and Python random source the noise must not use raises."""
    for name in ("randn", "randn_like", "normal", "rand", "rand_like", "randint", "randperm"):
        monkeypatch.setattr(torch, name, _forbid)
    for name in ("normal_", "uniform_", "random_", "exponential_", "log_normal_"):
        monkeypatch.setattr(torch.Tensor, name, _forbid)
    for name in ("random", "gauss", "normalvariate", "uniform", "getrandbits", "randbytes"):
        monkeypatch.setattr(random, name, _forbid)


def _ks_statistic(sample: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the sample's empirical CDF and N(0, 1)'s CDF."""
    x, _ = torch.sort(sample.double())
    n = x.numel()
    cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max(float((i / n - cdf).max()), float((cdf - (i - 1) / n).max()))


@pytest.mark.usefixtures("no_statistical_rng")
def test_noise_statistics() -> None:
    std, n = 0.37, 2_000_000
    state = torch.get_rng_state()
    x = add_secure_gaussian_(torch.zeros(n, dtype=torch.float64), std)
    assert torch.equal(torch.get_rng_state(), state)  # torch's generator was not advanced
    assert bool(torch.isfinite(x).all())
    assert abs(float(x.mean())) < 5 * std / math.sqrt(n)
    assert float(x.std()) == pytest.approx(std, rel=0.01)
    # At n = 200k the 5% critical value is ~0.003; 0.01 is far in the tail for real normals.
    assert _ks_statistic(x[:200_000] / std) < 0.01


@pytest.mark.usefixtures("no_statistical_rng")
def test_noise_float32_and_odd_chunks() -> None:
    # 100_003 elements in chunks of 999 (odd, and not a divisor): the last chunk is partial.
    base = torch.linspace(-1, 1, 100_003, dtype=torch.float32)
    x = add_secure_gaussian_(base.clone(), 2.0, chunk=999)
    assert x.dtype == torch.float32
    noise = (x - base).double()
    assert bool((noise != 0).all())  # every element, including the tail, got noise
    assert float(noise.std()) == pytest.approx(2.0, rel=0.03)
    assert abs(float(noise.mean())) < 5 * 2.0 / math.sqrt(noise.numel())
    assert _ks_statistic(noise / 2.0) < 0.01


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 10, 1 << 20])
def test_noise_chunk_sizes(chunk: int) -> None:
    x = add_secure_gaussian_(torch.zeros(5, 2, dtype=torch.float64), 1.0, chunk=chunk)
    assert bool((x != 0).all())
    assert bool(torch.isfinite(x).all())


def test_two_calls_differ() -> None:
    a = add_secure_gaussian_(torch.zeros(1000), 1.0)
    b = add_secure_gaussian_(torch.zeros(1000), 1.0)
    assert not torch.equal(a, b)
    assert int((a == b).sum()) == 0


def test_std_zero_and_empty_leave_tensor_unchanged() -> None:
    x = torch.arange(10, dtype=torch.float64)
    out = add_secure_gaussian_(x, 0.0)
    assert out is x
    assert torch.equal(x, torch.arange(10, dtype=torch.float64))
    assert add_secure_gaussian_(torch.empty(0), 1.0).numel() == 0


def test_noise_in_place_and_non_contiguous() -> None:
    base = torch.zeros(300, 400, dtype=torch.float64)
    view = base.t()  # non-contiguous view
    assert not view.is_contiguous()
    out = add_secure_gaussian_(view, 1.0, chunk=1000)
    assert out is view
    assert bool((base != 0).all())  # the noise reached the underlying storage
    strided = torch.zeros(1000, dtype=torch.float64)
    add_secure_gaussian_(strided[::2], 1.0)
    assert bool((strided[::2] != 0).all())
    assert bool((strided[1::2] == 0).all())  # the elements between are untouched
    leaf = torch.zeros(10, requires_grad=True)
    add_secure_gaussian_(leaf, 1.0)
    assert bool((leaf != 0).all())


def test_noise_errors() -> None:
    for std in (-1.0, math.inf, math.nan):
        with pytest.raises(PrivacyError, match="std"):
            add_secure_gaussian_(torch.zeros(3), std)
    with pytest.raises(PrivacyError, match="chunk"):
        add_secure_gaussian_(torch.zeros(3), 1.0, chunk=0)
    with pytest.raises(PrivacyError, match="tensor"):
        add_secure_gaussian_(torch.zeros(3, dtype=torch.int64), 1.0)
    with pytest.raises(PrivacyError, match="tensor"):
        add_secure_gaussian_(torch.zeros(1).expand(4), 1.0)
