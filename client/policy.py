"""What a site agrees to: the ``[policy]`` table of ``site.toml``, enforced on every task.

The coordinator proposes; the site decides. A task its policy refuses is declined (the
coordinator records a decline, not a failure, and samples other sites): a run not
approved here (``approve = "manual"`` until ``fedra site approve RUN_ID``), a round past
the site's cap of rounds per run, more local steps or epochs than it allows, a model
larger than it takes, a time outside its hours, or no secure aggregation where the site
requires it.

Runs that asked this site for work are kept in ``state_dir/runs/``: ``RUN_ID.json``
(what the run asks: its task, training settings, codec, secure aggregation, model size),
written by the agent when a run first asks, and ``RUN_ID.approved``, written by
``fedra site approve``; two writers, never of the same file.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedra.config import ConfigError, check_keys, get, require
from fedra.files import write_atomic

if TYPE_CHECKING:
    from fedra.client.connection import Assignment

RUNS_DIR = "runs"  # in the site's state_dir
APPROVALS = ("auto", "manual")
_KEYS = {
    "approve", "max_rounds", "max_local_steps", "max_local_epochs", "max_model_bytes",
    "hours", "require_secagg", "min_noise_multiplier", "max_epsilon", "min_sites",
}  # fmt: skip
_HOURS = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # what a file name may safely be


@dataclass(frozen=True)
class PolicyConfig:
    """The ``[policy]`` table; every cap 0 (or empty) means none."""

    approve: str = "auto"  # manual: a run waits for `fedra site approve RUN_ID`
    max_rounds: int = 0  # training rounds of one run this site takes part in, by number
    max_local_steps: int = 0
    max_local_epochs: int = 0
    max_model_bytes: int = 0
    hours: str = ""  # "HH:MM-HH:MM", this machine's local time; may wrap past midnight
    require_secagg: bool = False  # train only where updates are securely aggregated
    # Privacy minimums: a run without [privacy] or with less is declined (0: none).
    min_noise_multiplier: float = 0.0
    max_epsilon: float = 0.0  # the run's whole budget, with its delta
    min_sites: int = 0  # sites sampled into a round with this one: small cohorts leak

    @staticmethod
    def from_toml(t: dict[str, Any]) -> PolicyConfig:
        check_keys(t, _KEYS, "policy")
        config = PolicyConfig(
            approve=get(t, "approve", str, "policy", "auto"),
            max_rounds=get(t, "max_rounds", int, "policy", 0),
            max_local_steps=get(t, "max_local_steps", int, "policy", 0),
            max_local_epochs=get(t, "max_local_epochs", int, "policy", 0),
            max_model_bytes=get(t, "max_model_bytes", int, "policy", 0),
            hours=get(t, "hours", str, "policy", ""),
            require_secagg=get(t, "require_secagg", bool, "policy", False),
            min_noise_multiplier=get(t, "min_noise_multiplier", float, "policy", 0.0),
            max_epsilon=get(t, "max_epsilon", float, "policy", 0.0),
            min_sites=get(t, "min_sites", int, "policy", 0),
        )
        config.validate()
        return config

    def validate(self) -> None:
        require(
            self.approve in APPROVALS, "policy.approve", f"must be one of {APPROVALS}",
            self.approve,
        )  # fmt: skip
        for key in ("max_rounds", "max_local_steps", "max_local_epochs", "max_model_bytes",
                    "min_sites"):  # fmt: skip
            require(getattr(self, key) >= 0, f"policy.{key}", "must be >= 0 (0: no cap)",
                    getattr(self, key))  # fmt: skip
        for key in ("min_noise_multiplier", "max_epsilon"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"policy.{key}",
                    "must be finite and >= 0 (0: none)", value)  # fmt: skip
        require(
            not self.hours or _HOURS.match(self.hours) is not None, "policy.hours",
            'must be "HH:MM-HH:MM" in 24-hour local time, e.g. "20:00-06:00"', self.hours,
        )  # fmt: skip


@dataclass(frozen=True)
class RunRequest:
    """What a run asks of this site, as its first task said: kept for the operator."""

    run_id: str
    task: str
    first_seen_unix_s: float
    train: dict[str, Any] = field(default_factory=dict)
    codec: str = "none"
    secagg: bool = False
    model_bytes: int = 0


class Policy:
    """Decides each task; with ``approve = "manual"`` it needs the site's state_dir."""

    def __init__(
        self,
        config: PolicyConfig,
        state_dir: Path | None,
        now: Callable[[], dt.datetime] = dt.datetime.now,
    ) -> None:
        if config.approve == "manual" and state_dir is None:
            raise ConfigError('policy.approve: "manual" needs a state_dir to keep the runs in')
        self.config = config
        self.runs = state_dir / RUNS_DIR if state_dir is not None else None
        self.now = now  # local wall-clock time, for the hours

    def decline_reason(self, task: Assignment) -> str | None:
        """Why this site declines ``task``, or None to take it."""
        c = self.config
        self.remember(task)
        if c.approve == "manual" and not self.approved(task.run_id):
            return (
                f"run {task.run_id} is not approved at this site; its operator approves it "
                f"with `fedra site approve {task.run_id}`"
            )
        if c.hours and not _within(c.hours, self.now().time()):
            return f"outside the hours this site trains ({c.hours} local time)"
        if task.init:
            return None  # an initial model is built from the run's seed: no data involved
        if c.max_rounds and task.round > c.max_rounds:
            return f"round {task.round} is past this site's cap of {c.max_rounds} rounds a run"
        if c.max_local_steps and task.train.local_steps > c.max_local_steps:
            return (
                f"{task.train.local_steps} local steps a round, more than this site's "
                f"{c.max_local_steps}"
            )
        if c.max_local_epochs and task.train.local_epochs > c.max_local_epochs:
            return (
                f"{task.train.local_epochs} local epochs a round, more than this site's "
                f"{c.max_local_epochs}"
            )
        if c.max_model_bytes and task.model_bytes > c.max_model_bytes:
            return (
                f"a model of {task.model_bytes} bytes, larger than this site's {c.max_model_bytes}"
            )
        if c.require_secagg and task.secagg is None:
            return "this site trains only for runs with secure aggregation ([secagg])"
        return self._privacy_reason(task)

    def _privacy_reason(self, task: Assignment) -> str | None:
        c, p = self.config, task.privacy
        if (c.min_noise_multiplier or c.max_epsilon) and p is None:
            return "this site trains only for runs with differential privacy ([privacy])"
        if p is not None and c.min_noise_multiplier and p.noise_multiplier < c.min_noise_multiplier:
            return (
                f"privacy.noise_multiplier {p.noise_multiplier:g} is below this site's "
                f"minimum {c.min_noise_multiplier:g}"
            )
        if p is not None and c.max_epsilon and p.epsilon > c.max_epsilon:
            return f"privacy.epsilon {p.epsilon:g} is above this site's maximum {c.max_epsilon:g}"
        if c.min_sites and task.sites_in_round < c.min_sites:
            return (
                f"{task.sites_in_round} sites in this round, fewer than this site's minimum "
                f"{c.min_sites} (small cohorts leak)"
            )
        return None

    def remember(self, task: Assignment) -> None:
        """Keep what the run asks, the first time it asks (for `fedra site runs`)."""
        if self.runs is None or not _RUN_ID.match(task.run_id):
            return
        path = self.runs / f"{task.run_id}.json"
        if path.exists():
            return
        request = RunRequest(
            run_id=task.run_id, task=task.entry_point,
            first_seen_unix_s=dt.datetime.now(dt.timezone.utc).timestamp(),
            train=asdict(task.train), codec=task.codec.name, secagg=task.secagg is not None,
            model_bytes=task.model_bytes,
        )  # fmt: skip
        self.runs.mkdir(parents=True, exist_ok=True)
        write_atomic(path, [json.dumps(asdict(request), indent=2).encode() + b"\n"])

    def approved(self, run_id: str) -> bool:
        return self.runs is not None and (self.runs / f"{run_id}.approved").exists()


def list_runs(state_dir: Path) -> list[tuple[RunRequest, bool]]:
    """The runs that asked this site, oldest first, with whether each is approved."""
    runs = state_dir / RUNS_DIR
    found = []
    for path in sorted(runs.glob("*.json")) if runs.is_dir() else []:
        try:
            request = RunRequest(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            continue  # not one of ours
        found.append((request, (runs / f"{request.run_id}.approved").exists()))
    return sorted(found, key=lambda f: f[0].first_seen_unix_s)


def approve(state_dir: Path, run_id: str, who: str) -> RunRequest:
    """Approve a run that has asked this site; ConfigError naming it otherwise."""
    runs = state_dir / RUNS_DIR
    if not _RUN_ID.match(run_id) or not (runs / f"{run_id}.json").exists():
        raise ConfigError(
            f"RUN_ID {run_id!r}: no such run has asked this site for work yet "
            "(`fedra site runs` lists those that have)"
        )
    request = RunRequest(**json.loads((runs / f"{run_id}.json").read_text()))
    stamp = {"approved_by": who, "approved_unix_s": dt.datetime.now(dt.timezone.utc).timestamp()}
    write_atomic(runs / f"{run_id}.approved", [json.dumps(stamp).encode() + b"\n"])
    return request


def _within(hours: str, at: dt.time) -> bool:
    start, end = (dt.time(int(x[:2]), int(x[3:])) for x in hours.split("-"))
    if start <= end:
        return start <= at < end
    return at >= start or at < end  # past midnight: "20:00-06:00"
