"""The range of every number in a run spec, in one table (``RANGES``), and the check
that names the key of a value outside it.

The bounds are generous for real runs and refuse what can only be a mistake: a
deadline of 1e308 s, 2**31 sites per round, a NaN anywhere. Limits that depend on
other fields (``min_sites <= sites_per_round``, ...) are checked in ``runspec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedra.config import ConfigError

MAX_SITES = 10_000  # per round: sites sampled, quorum, buffer, byzantine, neighbours
MAX_POPULATION = 10_000_000  # the sites a private run's rounds are sampled from
WEEK_S = 7 * 24 * 3600.0
DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class Bound:
    """A closed range ``[low, high]``, either end open with ``low_open``/``high_open``;
    ``integer``: only ints (never bools) fall in it, else any finite int or float."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):  # (10**400 is an int)
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        def show(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(x)

        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        span = f"{left}{show(self.low)}, {show(self.high)}{right}"
        return f"an integer in {span}" if self.integer else f"a finite number in {span}"

    def check(self, name: str, value: object) -> None:
        """ConfigError('name: must be ... in [low, high], got value') unless it falls in."""
        if not self.contains(value):
            raise ConfigError(f"{name}: must be {self.describe()}, got {value!r}")


def _int(low: int, high: int) -> Bound:
    return Bound(low, high, integer=True)


def _positive(high: float) -> Bound:
    return Bound(0.0, high, low_open=True)


_FRACTION = Bound(0.0, 1.0, high_open=True)  # momenta and betas: [0, 1)

# Every number of a run spec, by its dotted key in run.toml. The proto and TOML paths
# both end in RunSpec.validate, which checks each one against this table.
RANGES: dict[str, Bound] = {
    "rounds": _int(1, 1_000_000),
    "sites_per_round": _int(1, MAX_SITES),
    "min_sites": _int(0, MAX_SITES),  # 0: sites_per_round; at most sites_per_round
    "round_deadline_s": _positive(WEEK_S),
    "max_round_attempts": _int(1, 1000),
    "join_timeout_s": _positive(WEEK_S),
    "seed": _int(0, 2**63 - 1),
    "train.local_steps": _int(0, 1_000_000),
    "train.local_epochs": _int(0, 10_000),
    "train.batch_size": _int(1, 2**20),
    "train.learning_rate": _positive(100.0),
    "train.proximal_mu": Bound(0.0, 1e4),  # 0: no proximal term
    "train.reset_optimizer_every": _int(0, 1_000_000),  # rounds; 0: never
    "train.scaffold_population": _int(0, MAX_POPULATION),  # 0: sites_per_round
    "strategy.server_lr": _positive(100.0),
    "strategy.momentum": _FRACTION,
    "strategy.beta1": _FRACTION,
    "strategy.beta2": _FRACTION,
    "strategy.tau": _positive(10.0),
    "strategy.bias_correction": Bound(0.0, 1.0),  # a bool: 1.0 (true) or 0.0 (false)
    "codec.block": _int(1, 2**24),
    "codec.fraction": _positive(1.0),
    "aggregation.trim": Bound(0.0, 0.5, high_open=True),
    "aggregation.byzantine": _int(0, MAX_SITES),
    "aggregation.select": _int(0, MAX_SITES),  # 0: n - byzantine
    "aggregation.norm_bound": Bound(0.0, 1e6),  # 0: no bound
    "aggregation.spill_mb": _int(0, 2**20),  # up to 1 TiB in memory before spilling
    "privacy.clip": _positive(1e6),
    # Below 0.01 not even the largest epsilon allowed holds one round (and the RDP of
    # noise near 0 overflows).
    "privacy.noise_multiplier": Bound(0.01, 1000.0),
    "privacy.epsilon": _positive(1000.0),
    "privacy.delta": Bound(0.0, 1.0, low_open=True, high_open=True),
    "privacy.population": _int(0, MAX_POPULATION),  # 0: not declared (sampling none)
    "secagg.threshold": _positive(1.0),
    "secagg.degree": _int(0, MAX_SITES),  # 0: every other site
    "secagg.clip": _positive(1e6),
    "secagg.setup_timeout_s": _positive(DAY_S),
    "secagg.unmask_timeout_s": _positive(DAY_S),
    "async.buffer": _int(1, MAX_SITES),  # at most sites_per_round
    "async.max_staleness": _int(0, 1000),
    "promotion.max_regression": Bound(0.0, 1e9),  # absolute, in the metric's units
    "promotion.patience": _int(1, 10_000),
}


def check(name: str, value: object) -> None:
    """Check ``value`` against ``RANGES[name]``; ConfigError naming ``name`` if outside."""
    RANGES[name].check(name, value)
