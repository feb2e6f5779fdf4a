"""A worse model is never promoted: the ``[promotion]`` gate, decided at each commit.

Round N's sites evaluate their incoming global model, the one round N-1 committed, on
their held-out data; round N's weighted metrics therefore judge candidate N-1. The state
(the promoted round, the best metric, the candidates judged in a row without promotion)
is written into each committed round's metrics, durable with its commit, so a resumed
run goes on from the same state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fedra.runspec import PromotionSpec

# In a committed round's metrics, after its commit's decision:
PROMOTED_ROUND = "promoted_round"  # the round whose model is the run's result (-1: none yet)
PROMOTION_BEST = "promotion_best"  # its metric, the best promoted (absent: none yet)
UNPROMOTED = "rounds_unpromoted"  # candidates judged in a row without promotion


@dataclass(frozen=True)
class PromotionState:
    promoted_round: int = -1
    best: float = math.nan
    unpromoted: int = 0

    @staticmethod
    def from_metrics(metrics: Mapping[str, float]) -> PromotionState:
        """As of a committed round (its metrics hold the state it committed)."""
        if PROMOTED_ROUND not in metrics:
            return PromotionState()
        return PromotionState(
            int(metrics[PROMOTED_ROUND]),
            float(metrics.get(PROMOTION_BEST, math.nan)),
            int(metrics.get(UNPROMOTED, 0)),
        )

    def as_metrics(self) -> dict[str, float]:
        out = {PROMOTED_ROUND: float(self.promoted_round), UNPROMOTED: float(self.unpromoted)}
        if not math.isnan(self.best):
            out[PROMOTION_BEST] = self.best
        return out


@dataclass(frozen=True)
class Decision:
    state: PromotionState  # after this commit
    promoted: bool  # the candidate was promoted
    rollback: bool  # patience ran out and the run rolls back to state.promoted_round
    stop: str  # patience ran out and the run stops: why ("" otherwise)
    why: str = ""  # why patience ran out


def decide(
    spec: PromotionSpec, state: PromotionState, number: int, metrics: Mapping[str, float]
) -> Decision:
    """Round ``number`` is committing with the sites' ``metrics``: judge candidate
    ``number - 1``. Without the metric (no site reported it) nothing is judged."""
    value = metrics.get(spec.metric)
    candidate = number - 1
    if value is None or not math.isfinite(value) or candidate < 0:
        return Decision(state, False, False, "")
    better = min if spec.goal == "min" else max
    if state.promoted_round < 0:
        within = True  # the first candidate judged is the baseline
    elif spec.goal == "min":
        within = value <= state.best + spec.max_regression
    else:
        within = value >= state.best - spec.max_regression
    if within:
        best = value if state.promoted_round < 0 else better(state.best, value)
        return Decision(PromotionState(candidate, best, 0), True, False, "")
    waited = state.unpromoted + 1
    if waited < spec.patience:
        return Decision(PromotionState(state.promoted_round, state.best, waited), False, False, "")
    why = (
        f"{waited} candidates in a row without promotion: {spec.metric} {value:.6g} against "
        f"the best {state.best:.6g} (max_regression {spec.max_regression:g})"
    )
    # After a rollback the next round's sites judge the promoted model again: its count
    # starts over.
    kept = PromotionState(state.promoted_round, state.best, 0)
    if spec.on_patience == "stop":
        return Decision(kept, False, False, f"promotion: stopped: {why}", why)
    return Decision(kept, False, True, "", why)
