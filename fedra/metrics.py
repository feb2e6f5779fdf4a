"""How a round combines the metrics its sites report.

Metrics that count something (samples, steps, tokens) add up over the sites: a mean of
them would say how much an average site did, not how much the round did. The rest
(losses, accuracies, timings) are means weighted by each site's sample count.
"""

from __future__ import annotations

COUNT_METRICS = frozenset({"samples_seen", "steps", "tokens"})
COUNT_SUFFIXES = ("_count", "_total")


def is_count_metric(name: str) -> bool:
    """Whether metric ``name`` is a count: summed over sites, shown as a whole number."""
    return name in COUNT_METRICS or name.endswith(COUNT_SUFFIXES)


def format_metric(name: str, value: float) -> str:
    """``value`` as a person reads it: counts whole, the rest to four decimals."""
    return f"{value:.0f}" if is_count_metric(name) else f"{value:.4f}"


def format_bytes(n: float) -> str:
    """A byte count as a person reads it: B, kB or MB (10**3 and 10**6 bytes)."""
    if n < 1e3:
        return f"{n:.0f} B"
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.3f} MB"
