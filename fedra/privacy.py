"""Central differential privacy for DP-FedAvg at site level: clipping, secure Gaussian noise
and a Rényi-DP accountant.

Each round the coordinator clips every site's update to L2 norm ``clip``
(:func:`clip_factor`), averages them and adds Gaussian noise of standard deviation
``noise_multiplier * clip`` (scaled to the average) with :func:`add_secure_gaussian_`, as in
DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018). One round is then a Gaussian mechanism with L2 sensitivity 1 and noise
``noise_multiplier`` in units of ``clip``.

Privacy loss is tracked in Rényi differential privacy (Mironov, "Rényi Differential Privacy",
CSF 2017), where composition is addition, and converted to (ε, δ)-DP with the conversion of
Balle, Barthe, Gaboardi, Hsu, Sato, "Hypothesis Testing Interpretations and Rényi Differential
Privacy", AISTATS 2020, and Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential
Privacy", NeurIPS 2020 (Proposition 12), falling back to Mironov's classic one where tighter.

No privacy amplification by subsampling is claimed: fedra samples a fixed number of sites per
round rather than each site independently, and the accountant is sound without it.

The accountant's state is one float64 tensor (:meth:`RdpAccountant.to_tensor`) stored in each
round checkpoint, so a resumed run knows what it has spent and :func:`max_rounds` can refuse a
round that would exceed the budget.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

if TYPE_CHECKING:  # imported where used: run specs validate, and the CLI starts, without it
    import torch

__all__ = [
    "DEFAULT_ORDERS",
    "MAX_ROUNDS_CAP",
    "PrivacyError",
    "RdpAccountant",
    "add_secure_gaussian_",
    "clip_factor",
    "gaussian_rdp",
    "max_rounds",
    "rdp_to_epsilon",
]

DEFAULT_ORDERS: tuple[float, ...] = (
    1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0,
    14.0, 16.0, 20.0, 24.0, 28.0, 32.0, 48.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
)  # fmt: skip
"""Rényi orders the accountant tracks: dense near 1 (large ε), sparse far out (small ε)."""

MAX_ROUNDS_CAP = 10**6
"""The most rounds :func:`max_rounds` reports."""


class PrivacyError(ValueError):
    """A privacy parameter or stored accountant state is invalid; the message names it."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PrivacyError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise PrivacyError(f"{name} must be finite, got {value!r}")
    return v


def _positive(name: str, value: float) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise PrivacyError(f"{name} must be > 0, got {value!r}")
    return v


def _delta(delta: float) -> float:
    d = _finite("delta", delta)
    if not 0 < d < 1:
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    return d


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PrivacyError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _orders(orders: Sequence[float]) -> tuple[float, ...]:
    out = tuple(_finite("order", a) for a in orders)
    if not out:
        raise PrivacyError("orders must not be empty")
    for a in out:
        if a <= 1:
            raise PrivacyError(f"every order must be > 1, got {a!r}")
    return out


def gaussian_rdp(noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS) -> list[float]:
    """RDP ``alpha / (2 z**2)`` at each order of one Gaussian mechanism with L2 sensitivity 1 and
    noise standard deviation ``z = noise_multiplier`` (Mironov 2017, Proposition 7).

    No amplification by sampling: fedra picks a fixed number of sites per round, not each site
    independently with some probability, so the plain Gaussian bound is what holds.
    """
    z = _positive("noise_multiplier", noise_multiplier)
    rdp = [0.5 * a / z / z for a in _orders(orders)]  # z * z could underflow to 0
    if not all(math.isfinite(r) for r in rdp):
        raise PrivacyError(
            f"noise_multiplier is too small for finite RDP, got {noise_multiplier!r}"
        )
    return rdp


def rdp_to_epsilon(
    rdp: Sequence[float], orders: Sequence[float], delta: float
) -> tuple[float, float]:
    """The smallest ε, over ``orders``, such that RDP ``rdp`` implies (ε, δ)-DP, and its order.

    At order ``a`` with RDP ``r`` it takes the smaller of
    ``r + log((a-1)/a) - (log(delta) + log(a)) / (a-1)`` (Balle et al. 2020; Canonne, Kamath,
    Steinke 2020, Prop. 12) and the classic ``r + log(1/delta) / (a-1)`` (Mironov 2017), clamped
    at 0. RDP exactly 0 at some order means the two output distributions are equal, so ε = 0.
    """
    a_s = _orders(orders)
    d = _delta(delta)
    r_s = [float(r) for r in rdp]
    if len(r_s) != len(a_s):
        raise PrivacyError(f"rdp has {len(r_s)} values for {len(a_s)} orders")
    for r in r_s:
        if math.isnan(r) or r < 0:
            raise PrivacyError(f"every rdp value must be >= 0, got {r!r}")
    log_d = math.log(d)
    best_eps, best_order = math.inf, a_s[0]
    for a, r in zip(a_s, r_s, strict=True):
        if r == 0:
            eps = 0.0
        else:
            classic = r - log_d / (a - 1)
            tight = r + math.log1p(-1.0 / a) - (log_d + math.log(a)) / (a - 1)
            eps = max(0.0, min(classic, tight))
        if eps < best_eps:
            best_eps, best_order = eps, a
    return best_eps, best_order


class RdpAccountant:
    """Rényi-DP spent so far, per order, by composing Gaussian rounds.

    ``rounds`` (keyword-only) is how many rounds the given ``rdp`` already holds; it is restored by
    :meth:`from_tensor` and counts only, the guarantee comes from ``rdp``.
    """

    def __init__(
        self,
        orders: Sequence[float] = DEFAULT_ORDERS,
        rdp: Sequence[float] | None = None,
        *,
        rounds: int = 0,
    ) -> None:
        self._orders = _orders(orders)
        if rdp is None:
            self._rdp = [0.0] * len(self._orders)
        else:
            self._rdp = [_finite("rdp", r) for r in rdp]
            if len(self._rdp) != len(self._orders):
                raise PrivacyError(
                    f"rdp has {len(self._rdp)} values for {len(self._orders)} orders"
                )
            for r in self._rdp:
                if r < 0:
                    raise PrivacyError(f"every rdp value must be >= 0, got {r!r}")
        self._rounds = _count("rounds", rounds)

    @property
    def orders(self) -> tuple[float, ...]:
        """The Rényi orders tracked."""
        return self._orders

    @property
    def rdp(self) -> tuple[float, ...]:
        """RDP spent at each order."""
        return tuple(self._rdp)

    @property
    def rounds(self) -> int:
        """How many rounds have been composed."""
        return self._rounds

    def compose(self, noise_multiplier: float, rounds: int = 1) -> None:
        """Add ``rounds`` Gaussian rounds of noise ``noise_multiplier`` (RDP adds up)."""
        n = _count("rounds", rounds)
        step = gaussian_rdp(noise_multiplier, self._orders)
        rdp = [r + n * s for r, s in zip(self._rdp, step, strict=True)]
        if not all(math.isfinite(r) for r in rdp):
            raise PrivacyError(f"rdp overflows after {rounds!r} rounds of {noise_multiplier!r}")
        self._rdp = rdp
        self._rounds += n

    def after(self, noise_multiplier: float, rounds: int = 1) -> RdpAccountant:
        """A copy with ``rounds`` more rounds composed; ``self`` is unchanged."""
        out = RdpAccountant(self._orders, self._rdp, rounds=self._rounds)
        out.compose(noise_multiplier, rounds)
        return out

    def epsilon(self, delta: float) -> float:
        """ε of the (ε, δ)-DP guarantee spent so far (0.0 before any round)."""
        return rdp_to_epsilon(self._rdp, self._orders, delta)[0]

    def to_tensor(self) -> torch.Tensor:
        """The state as one float64 tensor of shape ``(3, len(orders))``: row 0 the orders, row 1
        the RDP, row 2 the round count in every column (one tensor for a safetensors checkpoint)."""
        import torch  # noqa: PLC0415

        n = len(self._orders)
        return torch.tensor(
            [list(self._orders), list(self._rdp), [float(self._rounds)] * n], dtype=torch.float64
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RdpAccountant:
        """The accountant :meth:`to_tensor` stored; :class:`PrivacyError` if ``t`` is malformed."""
        import torch  # noqa: PLC0415

        if not isinstance(t, torch.Tensor):
            raise PrivacyError(f"accountant state must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float64:
            raise PrivacyError(f"accountant state must be float64, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] != 3 or t.shape[1] < 1:
            raise PrivacyError(
                f"accountant state must have shape (3, n >= 1), got {tuple(t.shape)}"
            )
        if not bool(torch.isfinite(t).all()):
            raise PrivacyError("accountant state has non-finite values")
        orders, rdp, rounds = (row.tolist() for row in t.detach().cpu())
        if any(r < 0 for r in rdp):
            raise PrivacyError(f"accountant state has negative rdp: {min(rdp)!r}")
        n = rounds[0]
        if any(x != n for x in rounds) or n < 0 or n != math.floor(n) or n >= 2.0**53:
            raise PrivacyError(
                f"accountant state row 2 must repeat one round count, got {rounds!r}"
            )
        return cls(orders, rdp, rounds=int(n))

    def __repr__(self) -> str:
        return f"RdpAccountant(rounds={self._rounds}, orders={len(self._orders)})"


def max_rounds(
    noise_multiplier: float, epsilon: float, delta: float, spent: RdpAccountant | None = None
) -> int:
    """How many more rounds of noise ``noise_multiplier`` keep ε(δ) within ``epsilon``, on top of
    ``spent``: the largest ``n`` with ``spent.after(noise_multiplier, n).epsilon(delta) <=
    epsilon`` (0 if not even one round fits), by binary search, at most :data:`MAX_ROUNDS_CAP`."""
    _positive("noise_multiplier", noise_multiplier)
    budget = _finite("epsilon", epsilon)
    if budget < 0:
        raise PrivacyError(f"epsilon must be >= 0, got {epsilon!r}")
    _delta(delta)
    base = RdpAccountant() if spent is None else spent

    def fits(n: int) -> bool:
        return base.after(noise_multiplier, n).epsilon(delta) <= budget

    if not fits(1):
        return 0
    if fits(MAX_ROUNDS_CAP):
        return MAX_ROUNDS_CAP
    lo, hi = 1, MAX_ROUNDS_CAP  # fits(lo), not fits(hi); ε grows with n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def clip_factor(norm: float, clip: float) -> float:
    """The factor ``min(1, clip / norm)`` that scales an update of L2 norm ``norm`` to at most
    ``clip`` (1.0 for a zero update). :class:`PrivacyError` for a ``clip`` that is not finite and
    > 0, or a ``norm`` that is not finite and >= 0 (a NaN or infinite update cannot be clipped)."""
    c = _positive("clip", clip)
    n = _finite("norm", norm)
    if n < 0:
        raise PrivacyError(f"norm must be >= 0, got {norm!r}")
    if n <= c:
        return 1.0
    return c / n


_MASK53 = (1 << 53) - 1
_TWO_M53 = 2.0**-53


def add_secure_gaussian_(tensor: torch.Tensor, std: float, *, chunk: int = 1 << 20) -> torch.Tensor:
    """Add N(0, ``std**2``) noise to every element of ``tensor`` in place and return it.

    The randomness is a ChaCha20 keystream (a CSPRNG) under a fresh ``os.urandom(32)`` key per
    chunk, never torch's or Python's statistical generators, whose state an observer could
    recover and subtract. Each element takes 64 keystream bits, of which 53 become a uniform:
    ``(k + 1) * 2**-53`` in (0, 1] for the Box-Muller radius (never 0, so the log is finite) and
    ``k * 2**-53`` in [0, 1) for its angle. Box-Muller runs in float64 and the noise is cast to
    the tensor's dtype (any floating dtype; float32 and float64 are the ones meant).

    Work goes ``chunk`` elements at a time, so the memory used beyond the tensor is O(chunk)
    (about 60 bytes per chunk element, some 60 MiB at the default), except that a
    non-contiguous tensor is noised through one contiguous copy that is copied back. A tensor on
    an accelerator receives noise drawn on the CPU. ``std`` must be finite and >= 0; 0 leaves the
    tensor untouched. :class:`PrivacyError` for a non-floating tensor or one
    whose elements share memory (an expanded view).
    """
    import torch  # noqa: PLC0415

    s = _finite("std", std)
    if s < 0:
        raise PrivacyError(f"std must be >= 0, got {std!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PrivacyError(f"chunk must be an integer >= 1, got {chunk!r}")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise PrivacyError(f"tensor must be a floating-point tensor, got {what}")
    if any(st == 0 and sz > 1 for st, sz in zip(tensor.stride(), tensor.shape, strict=True)):
        raise PrivacyError("tensor must not have elements that share memory (an expanded view)")
    numel = tensor.numel()
    if s == 0 or numel == 0:
        return tensor
    with torch.no_grad():
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        pairs_max = (min(chunk, numel) + 1) // 2
        zeros = bytes(16 * pairs_max)
        buf = bytearray(16 * pairs_max)
        for start in range(0, numel, chunk):
            n = min(chunk, numel - start)
            pairs = (n + 1) // 2
            nbytes = 16 * pairs
            key = os.urandom(32)
            enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
            enc.update_into(memoryview(zeros)[:nbytes], memoryview(buf)[:nbytes])
            bits = torch.frombuffer(buf, dtype=torch.int64, count=2 * pairs)
            u = bits.bitwise_and_(_MASK53).to(torch.float64)
            radius = u[:pairs].add(1.0).mul_(_TWO_M53).log_().mul_(-2.0).sqrt_().mul_(s)
            theta = u[pairs:].mul_(2.0 * math.pi * _TWO_M53)
            noise = torch.cat((radius * torch.cos(theta), radius.mul_(torch.sin(theta))))
            flat[start : start + n].add_(noise[:n].to(device=flat.device, dtype=flat.dtype))
        if work is not tensor:
            tensor.copy_(work)
    return tensor
