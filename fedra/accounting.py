"""Privacy accounting for ``[privacy]`` runs with Google's dp-accounting library.

One round of DP-FedAvg clips each update to ``clip`` and adds Gaussian noise of standard
deviation ``noise_multiplier * clip`` to their sum (``fedra.privacy``). What the round is
for an accountant depends on how the coordinator chose its sites (``sampling``):

- ``none``: no amplification is claimed. The round is ``GaussianDpEvent(z)``; neighbouring
  runs differ by one site's update added to or removed from a round's cohort (the sum moves
  by at most ``clip``). This is what fedra always did, and the default.
- ``poisson``: each eligible site joins a round independently with probability
  ``q = sites_per_round / population``. The round is ``PoissonSampledDpEvent(q,
  GaussianDpEvent(z))`` under add/remove one site (its presence in the population).
- ``fixed``: ``sites_per_round`` sites drawn uniformly without replacement from the declared
  ``population``. The round is ``SampledWithoutReplacementDpEvent(population,
  sites_per_round, GaussianDpEvent(z / 2))`` under replace one site: replacing one clipped
  update by another moves the sum by up to ``2 * clip``, and the library's Rényi bound
  (Wang, Balle, Kasiviswanathan, AISTATS 2019) takes the noise relative to that
  sensitivity. Only the RDP accountant supports it.

``accountant`` is ``rdp`` (``dp_accounting.rdp.RdpAccountant``, the library's orders) or
``pld`` (``dp_accounting.pld.PLDAccountant``, tighter, pessimistic rounding at
:data:`PLD_DISCRETIZATION`). A run's rounds are all the same event, so what it has spent is
the event and how many rounds composed it (:class:`Accountant`); that is what the round
checkpoint stores, as JSON in a uint8 tensor (:meth:`Accountant.to_tensor`).

dp-accounting (and SciPy under it) is imported on first use: a spec without ``[privacy]``
validates, and the CLI starts, without it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fedra.privacy import PrivacyError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACCOUNTANTS",
    "MAX_ROUNDS_CAP",
    "PLD_DISCRETIZATION",
    "RELATIONS",
    "SAMPLINGS",
    "Accountant",
    "RoundEvent",
    "epsilon_after",
    "max_rounds",
]

SAMPLINGS = ("none", "poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")
RELATIONS = {
    "none": "add/remove one site's update in a round's cohort",
    "poisson": "add/remove one site",
    "fixed": "replace one site",
}
"""The neighbouring relation each sampling's ε is stated in."""

PLD_DISCRETIZATION = 1e-3
"""The PLD accountant's value discretisation interval. Its rounding is pessimistic (ε is an
upper bound); against the library's default 1e-4 it moves ε by under 1e-4 relative on the
figures tested, at a tenth of the time."""

MAX_ROUNDS_CAP = 10**6
"""The most rounds :func:`max_rounds` reports."""

STATE_FORMAT = "fedra-privacy-accountant/1"
_MAX_STATE_BYTES = 4096


class _QuietConvergence(logging.Filter):
    """The RDP accountant logs a warning each time a fractional order's series does not
    converge; it then leaves that order out, which keeps ε an upper bound. Once per
    computation, for every round, that is noise in the coordinator's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@functools.cache
def _library() -> Any:
    import dp_accounting  # noqa: PLC0415 - SciPy underneath: only for runs with [privacy]

    logging.getLogger("absl").addFilter(_QuietConvergence())
    return dp_accounting


@dataclass(frozen=True)
class RoundEvent:
    """What one round of a private run is: its noise, how its sites were sampled, and the
    accountant that composes it. ``sample_size`` is ``sites_per_round`` (the expected cohort
    with ``poisson``); ``population`` is 0 with ``none``."""

    noise_multiplier: float
    sampling: str = "none"
    sample_size: int = 0
    population: int = 0
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if isinstance(z, bool) or not isinstance(z, int | float) or not math.isfinite(z) or z <= 0:
            raise PrivacyError(f"noise_multiplier must be finite and > 0, got {z!r}")
        if self.sampling not in SAMPLINGS:
            raise PrivacyError(f"sampling must be one of {', '.join(SAMPLINGS)}, got "
                               f"{self.sampling!r}")  # fmt: skip
        if self.accountant not in ACCOUNTANTS:
            raise PrivacyError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got "
                               f"{self.accountant!r}")  # fmt: skip
        for name in ("sample_size", "population"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PrivacyError(f"{name} must be an integer >= 0, got {v!r}")
        if self.sampling != "none" and not 1 <= self.sample_size <= self.population:
            raise PrivacyError(
                f"sampling {self.sampling!r} needs 1 <= sample_size <= population, got "
                f"{self.sample_size} of {self.population}"
            )
        if self.sampling == "none" and self.population:
            raise PrivacyError("population is only used with sampling 'poisson' or 'fixed'")
        if self.sampling == "fixed" and self.accountant == "pld":
            raise PrivacyError(
                "the PLD accountant does not support fixed-size sampling (dp-accounting "
                "has no PLD for it); use accountant 'rdp' or sampling 'poisson'"
            )

    @property
    def sampling_probability(self) -> float:
        """Each site's chance to be in a round: 1 without sampling (none is claimed)."""
        return self.sample_size / self.population if self.sampling != "none" else 1.0

    @property
    def relation(self) -> str:
        """The neighbouring relation ε is stated in, in words."""
        return RELATIONS[self.sampling]

    def dp_event(self) -> Any:
        """One round as a ``dp_accounting.DpEvent``."""
        dpa = _library()
        gaussian = dpa.GaussianDpEvent(self.noise_multiplier)
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.sampling_probability, gaussian)
        if self.sampling == "fixed":  # replace-one: the clipped sum moves by up to 2 * clip
            half = dpa.GaussianDpEvent(self.noise_multiplier / 2)
            return dpa.SampledWithoutReplacementDpEvent(self.population, self.sample_size, half)
        return gaussian

    def neighboring_relation(self) -> Any:
        """The library's ``NeighboringRelation`` for :attr:`relation`."""
        rel = _library().NeighboringRelation
        return rel.REPLACE_ONE if self.sampling == "fixed" else rel.ADD_OR_REMOVE_ONE

    def library_accountant(self) -> Any:
        """A fresh ``dp_accounting`` accountant of the kind and relation this event needs."""
        dpa = _library()
        if self.accountant == "pld":
            return dpa.pld.PLDAccountant(self.neighboring_relation(), PLD_DISCRETIZATION)
        return dpa.rdp.RdpAccountant(neighboring_relation=self.neighboring_relation())


@functools.lru_cache(maxsize=4096)
def epsilon_after(event: RoundEvent, rounds: int, delta: float) -> float:
    """ε at ``delta`` of ``rounds`` rounds of ``event`` (0.0 for none), by the library's
    accountant: ``accountant.compose(event.dp_event(), rounds).get_epsilon(delta)``."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise PrivacyError(f"rounds must be an integer >= 0, got {rounds!r}")
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    if rounds == 0:
        return 0.0
    if event.accountant == "rdp":
        # RDP composes by multiplication (the library's compose(event, n) adds n times the
        # event's RDP): the event's RDP is computed once per run, then converted by the
        # library's own conversion, which equals compose(event, n).get_epsilon(delta).
        orders, one = _rdp_of_one_round(event)
        rdp_module = _library().rdp.rdp_privacy_accountant
        eps = rdp_module.compute_epsilon(orders, [rounds * r for r in one], delta)[0]
    else:
        eps = event.library_accountant().compose(event.dp_event(), rounds).get_epsilon(delta)
    return float(eps)


@functools.lru_cache(maxsize=256)
def _rdp_of_one_round(event: RoundEvent) -> tuple[tuple[float, ...], tuple[float, ...]]:
    acc = event.library_accountant().compose(event.dp_event())
    return tuple(float(a) for a in acc.orders), tuple(float(r) for r in acc.rdp)


@dataclass(frozen=True)
class Accountant:
    """The privacy a run has spent: ``rounds`` committed rounds of ``event``."""

    event: RoundEvent
    rounds: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise PrivacyError(f"rounds must be an integer >= 0, got {self.rounds!r}")

    def after(self, rounds: int = 1) -> Accountant:
        """The accountant with ``rounds`` more rounds composed."""
        return Accountant(self.event, self.rounds + rounds)

    def epsilon(self, delta: float) -> float:
        """ε of the (ε, δ)-DP guarantee spent so far, in the event's relation."""
        return epsilon_after(self.event, self.rounds, delta)

    def to_tensor(self) -> torch.Tensor:
        """The state for the round checkpoint: UTF-8 JSON (format, rounds, the event's
        parameters) as a uint8 tensor, a plain safetensors entry."""
        import torch  # noqa: PLC0415

        doc = {"format": STATE_FORMAT, "rounds": self.rounds, "event": asdict(self.event)}
        data = json.dumps(doc, sort_keys=True).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()

    @classmethod
    def from_tensor(cls, t: torch.Tensor, expected: RoundEvent) -> Accountant:
        """The accountant :meth:`to_tensor` stored. :class:`PrivacyError` if ``t`` is not
        such a state or was kept for another event than the run's ``expected`` one."""
        import torch  # noqa: PLC0415

        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            raise PrivacyError("accountant state must be a 1-d uint8 tensor")
        if t.numel() > _MAX_STATE_BYTES:
            raise PrivacyError(f"accountant state is too long ({t.numel()} bytes)")
        try:
            doc = json.loads(bytes(t.tolist()).decode())
            ok = isinstance(doc, dict) and doc.get("format") == STATE_FORMAT
            stored = RoundEvent(**doc["event"]) if ok else None
            rounds = doc["rounds"] if ok else None
        except (ValueError, KeyError, TypeError) as exc:
            raise PrivacyError(f"accountant state is malformed: {exc}") from exc
        if stored is None or not isinstance(rounds, int) or isinstance(rounds, bool):
            raise PrivacyError(f"accountant state is not in format {STATE_FORMAT}")
        if stored != expected:
            raise PrivacyError(
                f"accountant state was kept for {stored}, but the run's rounds are {expected}"
            )
        return cls(stored, rounds)

    @classmethod
    def from_legacy_tensor(cls, t: torch.Tensor, expected: RoundEvent) -> Accountant:
        """The accountant of a checkpoint written before dp-accounting: a float64 tensor of
        shape (3, n), orders, Rényi DP and the round count repeated. Its rounds were plain
        Gaussian ones (no sampling), so the count rebuilds it; the RDP row is not needed."""
        import torch  # noqa: PLC0415

        if not isinstance(t, torch.Tensor) or t.dtype != torch.float64:
            raise PrivacyError("legacy accountant state must be a float64 tensor")
        if t.dim() != 2 or t.shape[0] != 3 or t.shape[1] < 1:
            raise PrivacyError(
                f"legacy accountant state must have shape (3, n >= 1), got {tuple(t.shape)}"
            )
        if not bool(torch.isfinite(t).all()):
            raise PrivacyError("legacy accountant state has non-finite values")
        counts = t[2].tolist()
        n = counts[0]
        if any(x != n for x in counts) or n < 0 or n != math.floor(n) or n >= 2.0**53:
            raise PrivacyError(f"legacy accountant state row 2 must repeat one round count, "
                               f"got {counts!r}")  # fmt: skip
        if expected.sampling != "none":
            raise PrivacyError("a legacy accountant state holds unsampled rounds only, but "
                               f"the run samples with {expected.sampling!r}")  # fmt: skip
        return cls(expected, int(n))


def max_rounds(event: RoundEvent, epsilon: float, delta: float, spent: int = 0) -> int:
    """How many more rounds of ``event`` keep ε(δ) within ``epsilon`` after ``spent``: the
    largest ``n`` with ``epsilon_after(event, spent + n, delta) <= epsilon`` (0 if not one
    round fits), at most :data:`MAX_ROUNDS_CAP`. ε grows with the rounds, so the search
    doubles ``n`` and then bisects."""
    if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon >= 0):
        raise PrivacyError(f"epsilon must be finite and >= 0, got {epsilon!r}")

    def fits(n: int) -> bool:
        return epsilon_after(event, spent + n, delta) <= epsilon

    if not fits(1):
        return 0
    lo, hi = 1, 2  # fits(lo)
    while fits(hi):
        if hi >= MAX_ROUNDS_CAP:
            return MAX_ROUNDS_CAP
        lo, hi = hi, min(2 * hi, MAX_ROUNDS_CAP)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
