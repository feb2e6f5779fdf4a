"""Tests for fedra.privacy: clipping and the CSPRNG Gaussian noise (the accountant is
tests/test_accounting.py's)."""

from __future__ import annotations

import math
import random
from typing import NoReturn

import pytest
import torch

from fedra.privacy import PrivacyError, add_secure_gaussian_, clip_factor

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
