"""What `fedra bench compare` measures, as pure functions over a run's committed rounds.

Rows are plain dataclasses built once from the admin API's ``RunStatus`` (see
``rows_from_status``), so every number in the report can be recomputed by hand from
``report.json``. Round 0 only builds the initial model (every configuration, the
centralised one included, needs one), so the measures cover the training rounds, 1 on.
``headline`` compares two configurations against the targets of the evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedra.protos.v1 import admin_pb2

FAILED = ("failed", "expired")
BYTES_RATIO_TARGET = 400.0  # every-step bytes per inner step / DiLoCo int8 at the largest H
LOSS_GAP_TARGET = 0.03  # DiLoCo's final eval loss at most 3 % above every-step's
UTILISATION_TARGET = 0.90  # DiLoCo's compute utilisation under the emulated link
OVERLAP_UTILISATION_TARGET = 0.95  # with [train] overlap
OVERLAP_LOSS_GAP_TARGET = 0.01  # its final eval loss at most 1 % above the same H without
OVERLAP_SUFFIX = "-overlap"


@dataclass(frozen=True)
class ParticipationRow:
    site_id: str
    attempt: int
    status: str  # assigned | downloaded | accepted | failed | expired
    bytes_down: int
    bytes_up: int
    download_s: float
    upload_s: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundRow:
    number: int
    attempt: int
    status: str  # open | committed
    opened_unix_s: float
    closed_unix_s: float
    duration_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    participations: list[ParticipationRow] = field(default_factory=list)

    @property
    def round_s(self) -> float:
        """The ledger's end-to-end seconds, or the open-to-close duration without one."""
        return self.stages.get("round_s", self.duration_s)


def rows_from_status(status: admin_pb2.RunStatus) -> list[RoundRow]:
    """The run's rounds as plain rows, in round order."""
    return [
        RoundRow(
            number=r.number,
            attempt=r.attempt,
            status=r.status,
            opened_unix_s=r.opened_unix_s,
            closed_unix_s=r.closed_unix_s,
            duration_s=r.duration_s,
            metrics=dict(r.metrics),
            stages=dict(r.stages),
            participations=[
                ParticipationRow(
                    site_id=p.site_id,
                    attempt=p.attempt,
                    status=p.status,
                    bytes_down=p.bytes_down,
                    bytes_up=p.bytes_up,
                    download_s=p.download_s,
                    upload_s=p.upload_s,
                    metrics=dict(p.metrics),
                )
                for p in r.participations
            ],
        )
        for r in sorted(status.rounds, key=lambda r: r.number)
    ]


def training_rounds(rounds: Iterable[RoundRow]) -> list[RoundRow]:
    """Committed rounds from 1 on, in order."""
    return sorted(
        (r for r in rounds if r.number >= 1 and r.status == "committed"), key=lambda r: r.number
    )


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    ordered = sorted(values)
    out: dict[str, float] = {}
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {q}")
        if not ordered:
            out[f"p{q:g}"] = math.nan
            continue
        rank = q / 100 * (len(ordered) - 1)
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{q:g}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


def wall_time_s(rounds: Sequence[RoundRow]) -> float:
    """From the first training round's opening to the last one's commit."""
    trained = training_rounds(rounds)
    if not trained:
        return 0.0
    return max(0.0, trained[-1].closed_unix_s - trained[0].opened_unix_s)


def compute_by_site(rounds: Sequence[RoundRow]) -> dict[str, float]:
    """Each site's summed ``compute_s`` over the training rounds (accepted updates only:
    a failed participation's work did not count)."""
    total: dict[str, float] = {}
    for r in training_rounds(rounds):
        for p in r.participations:
            if p.status == "accepted":
                total[p.site_id] = total.get(p.site_id, 0.0) + p.metrics.get("compute_s", 0.0)
    return total


def utilisation(compute_s: Mapping[str, float], wall_s: float) -> dict[str, float]:
    """Per site: the share of the run's wall time it spent computing."""
    if wall_s <= 0:
        return {site: math.nan for site in compute_s}
    return {site: seconds / wall_s for site, seconds in compute_s.items()}


def bytes_by_site(rounds: Sequence[RoundRow]) -> dict[str, dict[str, int]]:
    """Per site, ``{"down": ..., "up": ...}`` over every participation of the training
    rounds (failed attempts moved their bytes too)."""
    out: dict[str, dict[str, int]] = {}
    for r in training_rounds(rounds):
        for p in r.participations:
            site = out.setdefault(p.site_id, {"down": 0, "up": 0})
            site["down"] += p.bytes_down
            site["up"] += p.bytes_up
    return out


def mean_bytes_per_site(by_site: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """``{"down", "up", "total"}`` averaged over the sites."""
    n = max(1, len(by_site))
    down = sum(b["down"] for b in by_site.values()) / n
    up = sum(b["up"] for b in by_site.values()) / n
    return {"down": down, "up": up, "total": down + up}


def bytes_per_step(bytes_per_site: float, inner_steps: int) -> float:
    """Bytes a site moves per inner (optimiser) step."""
    if inner_steps <= 0:
        raise ValueError(f"inner_steps must be > 0, got {inner_steps}")
    return bytes_per_site / inner_steps


def failures(rounds: Sequence[RoundRow]) -> dict[str, float]:
    """Failed (or expired) participations out of all participations, training rounds only
    (including the attempts of rounds that were retried)."""
    parts = [p for r in rounds if r.number >= 1 for p in r.participations]
    failed = sum(p.status in FAILED for p in parts)
    return {
        "failed": failed,
        "participations": len(parts),
        "rate": failed / len(parts) if parts else 0.0,
    }


@dataclass(frozen=True)
class CurvePoint:
    seconds: float  # wall clock from the first training round's opening
    bytes_per_site: float  # what one site had moved (down + up) when this model existed
    eval_loss: float


def loss_curve(rounds: Sequence[RoundRow], final_eval_loss: float | None) -> list[CurvePoint]:
    """The global model's eval loss over time and bytes.

    Round r's ``eval_loss`` is the model committed by round r - 1, measured by the sites
    at the start of round r: it is placed at round r - 1's commit. The last model, which
    no round evaluates, gets ``final_eval_loss`` at the last commit.
    """
    trained = training_rounds(rounds)
    if not trained:
        return []
    t0 = trained[0].opened_unix_s
    points: list[CurvePoint] = []
    moved, ready_at = 0.0, t0
    for r in trained:
        if "eval_loss" in r.metrics:
            points.append(CurvePoint(max(0.0, ready_at - t0), moved, r.metrics["eval_loss"]))
        moved += mean_bytes_per_site(bytes_by_site([r]))["total"]
        ready_at = r.closed_unix_s
    if final_eval_loss is not None:
        points.append(CurvePoint(ready_at - t0, moved, final_eval_loss))
    return points


def cost(
    processes: int, result: Mapping[str, Any], price_compute_hour: float, price_gb: float
) -> dict[str, float | None]:
    """What a configuration cost: its processes' compute-hours over its wall time, and
    the GB every site moved, at the stated prices; and the same up to the time it first
    reached the target (``time_to_target_s``; None if it never did): the useful result."""
    wall = result["wall_s"]
    hours = processes * wall / 3600 if math.isfinite(wall) else math.nan
    total_bytes = result.get("bytes_per_site", {}).get("total", 0.0) * (
        len(result.get("bytes_by_site", {})) or 0
    )
    gb = total_bytes / 1e9
    whole = hours * price_compute_hour + gb * price_gb
    reached = result.get("time_to_target_s")
    share = reached / wall if reached is not None and wall and math.isfinite(wall) else None
    return {
        "compute_hours": hours,
        "gb": gb,
        "total": whole,
        "to_target": None if share is None else whole * min(1.0, share),
    }


def time_to_target(points: Iterable[tuple[float, float]], target: float) -> float | None:
    """The first time (of ``(seconds, loss)`` points, in time order) the loss is at or
    below ``target``; None if it never is."""
    for seconds, loss in sorted(points):
        if loss <= target:
            return seconds
    return None


def overlap_headlines(by_name: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each ``...-overlap`` configuration against the same one without overlap: its
    utilisation and its final eval loss, against their targets."""
    out = []
    for name, with_ in by_name.items():
        without = by_name.get(name.removesuffix(OVERLAP_SUFFIX))
        if not name.endswith(OVERLAP_SUFFIX) or without is None:
            continue
        u, loss, base = (
            with_["utilisation"]["mean"],
            with_["final_eval_loss"],
            without["final_eval_loss"],
        )
        gap = (loss - base) / base if base and loss is not None else math.nan
        out.append({
            "configuration": name,
            "without": without["name"],
            "utilisation": {name: u, without["name"]: without["utilisation"]["mean"],
                            "target": OVERLAP_UTILISATION_TARGET,
                            "met": u >= OVERLAP_UTILISATION_TARGET},
            "final_eval_loss": {name: loss, without["name"]: base, "relative_difference": gap,
                                "target": OVERLAP_LOSS_GAP_TARGET,
                                "met": gap <= OVERLAP_LOSS_GAP_TARGET},
        })  # fmt: skip
    return out


def headline(
    by_name: Mapping[str, Mapping[str, Any]], every_name: str, diloco_name: str
) -> dict[str, Any]:
    """The two headline comparisons, from the configurations' own numbers."""
    every, diloco = by_name.get(every_name), by_name.get(diloco_name)
    if every is None or diloco is None:
        return {
            "every_step_configuration": every_name,
            "diloco_configuration": diloco_name,
            "error": "a configuration is missing",
            "overlap": overlap_headlines(by_name),
        }
    d_bytes = diloco["bytes_per_inner_step"]
    ratio = every["bytes_per_inner_step"] / d_bytes if d_bytes else math.nan
    e_loss, d_loss = every["final_eval_loss"], diloco["final_eval_loss"]
    gap = (d_loss - e_loss) / e_loss if e_loss and d_loss is not None else math.nan
    u_diloco, u_every = diloco["utilisation"]["mean"], every["utilisation"]["mean"]
    bytes_met = ratio >= BYTES_RATIO_TARGET  # comparisons with NaN are False
    loss_met = gap <= LOSS_GAP_TARGET
    return {
        "every_step_configuration": every_name,
        "diloco_configuration": diloco_name,
        "bytes_per_inner_step": {
            every_name: every["bytes_per_inner_step"],
            diloco_name: diloco["bytes_per_inner_step"],
            "ratio": ratio,
            "target": BYTES_RATIO_TARGET,
            "met": bytes_met,
        },
        "final_eval_loss": {
            every_name: e_loss,
            diloco_name: d_loss,
            "relative_difference": gap,
            "target": LOSS_GAP_TARGET,
            "met": loss_met,
        },
        "bytes_target_met": bytes_met and loss_met,
        "utilisation": {
            every_name: u_every,
            diloco_name: u_diloco,
            "target": UTILISATION_TARGET,
            "met": u_diloco >= UTILISATION_TARGET,
        },
        "overlap": overlap_headlines(by_name),
    }
