"""The one retry policy: exponential backoff with jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Failure n waits a random time in ``[c/2, c]``, ``c = min(cap_s, base_s * 2**n)``."""

    base_s: float = 0.2
    cap_s: float = 30.0
    attempts: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def next_delay_s(self) -> float:
        # The exponent is bounded: base_s * 2**n raises OverflowError past n ~ 1024, which a
        # site retrying through a multi-hour outage would reach.
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 1000))
        self.attempts += 1
        # Jitter keeps a fleet of sites that
        # lost the coordinator together from reconnecting in lock step.
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempts = 0
