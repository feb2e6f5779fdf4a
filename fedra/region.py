"""A regional coordinator: to its own sites a coordinator, to the one above it one site.

``fedra coordinator --upstream ADDR ...`` starts, beside the daemon's engine, a site agent
(the same ``SiteAgent`` every site runs) that registers with the upstream coordinator
under the region's own identity (from the upstream project's CA) and serves the tasks
the region allows. For each upstream task it runs one round of its own:

- a regional run of the same task, training settings, seed and codec, whose model is
  the upstream's global model given to it as the checkpoint of the round before
  (``Engine.submit(start=GivenModel)``), so its one round carries the upstream round's
  number: its sites train exactly as they would under the upstream directly;
- FedAvg over the region's sites, weighted by their samples;
- the region's update is that round's model minus the upstream's global model, with
  the sample count summed over the sites that counted, and their weighted metrics.

Under FedAvg the upstream's weighted mean of the regions' updates is then the mean
of every site's update weighted by samples: the flat federation's round, up to the
rounding of a mean taken in two steps.

The regional run is named after the upstream task (``upstream:<task id>``) and is
durable like any run: a region that crashes resumes it with the rest of its engine,
and its agent, registering again, picks the upstream task back up and waits for that
run instead of starting another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedra.client.agent import SiteAgent, delta, load_tasks
from fedra.client.config import SiteConfig
from fedra.client.connection import Assignment
from fedra.client.task import Task
from fedra.config import SITE_ID_RULE, ConfigError, is_valid_site_id
from fedra.coordinator.engine import Engine, GivenModel, RoundOutcome
from fedra.runspec import CodecSpec, RunSpec, SecAggSpec

log = logging.getLogger("fedra.region")
RUN_PREFIX = "upstream:"  # a regional run's name: this, then the upstream task's id
_WAIT_S = 1.0  # the longest a wait for the regional run goes without looking again


@dataclass(frozen=True)
class RegionConfig:
    """``fedra coordinator --upstream``: how the region takes part upstream."""

    upstream: str  # HOST:PORT of the coordinator above
    region_id: str  # the region's site id upstream (its certificate's, with TLS)
    tasks: tuple[str, ...]  # the task entry points it serves upstream
    state_dir: Path  # its site-side state: STATE_DIR/upstream
    tls_dir: Path | None = None  # the region's folder from the upstream's `fedra provision`
    insecure: bool = False
    sites_per_round: int = 0  # each regional round's sites; 0: every site known to allow it
    min_sites: int = 0  # the regional round's quorum; 0: sites_per_round
    secagg: bool = False  # regional rounds use secure aggregation: the region sees a sum

    def __post_init__(self) -> None:
        if not is_valid_site_id(self.region_id):
            raise ConfigError(f"--region-id: must be {SITE_ID_RULE}, got {self.region_id!r}")
        if not self.tasks:
            raise ConfigError("--region-task: name at least one task the region serves upstream")
        if (self.tls_dir is None) == (not self.insecure):
            raise ConfigError(
                "--upstream-tls-dir: give the region's folder from the upstream's "
                "`fedra provision`, or --upstream-insecure (not both)"
            )
        if self.sites_per_round < 0 or self.min_sites < 0:
            raise ConfigError("--region-sites and --region-min-sites: must be >= 0")
        if self.sites_per_round and self.min_sites > self.sites_per_round:
            raise ConfigError(
                f"--region-min-sites: {self.min_sites} is more than --region-sites "
                f"{self.sites_per_round}"
            )

    def site_config(self) -> SiteConfig:
        """The region as a site of the upstream."""
        return SiteConfig(
            site_id=self.region_id,
            coordinator=self.upstream,
            allowed_tasks=self.tasks,
            tls_dir=self.tls_dir,
            insecure=self.insecure,
            state_dir=self.state_dir,
        )


class RegionError(RuntimeError):
    """The region's own round did not give an update (its run failed or was cancelled)."""


class RegionAgent(SiteAgent):
    """A site agent whose training is a round of the region's own federation."""

    def __init__(self, region: RegionConfig, engine: Engine) -> None:
        config = region.site_config()
        tasks: dict[str, Task] = load_tasks(config)
        super().__init__(config, tasks=tasks, data=dict.fromkeys(tasks))
        self.region, self.engine = region, engine
        self.tag = f"region {region.region_id}"

    def _train(
        self, impl: Task, task: Assignment, global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        if task.train.keep_optimizer_state or task.train.scaffold:
            raise RegionError(
                "a region keeps no site state across rounds: train.keep_optimizer_state and "
                "train.scaffold are for sites that train"
            )
        run_id = self._regional_run(task, global_state)
        outcome = self._wait(run_id, task.round)
        metrics = dict(outcome.metrics)
        metrics["region_sites"] = float(outcome.sites)
        log.info(
            "%s: round %d of upstream run %s: regional run %s committed with %d site(s), "
            "%d samples", self.tag, task.round, task.run_id, run_id, outcome.sites,
            outcome.num_samples,
        )  # fmt: skip
        return delta(dict(outcome.tensors), global_state), outcome.num_samples, metrics

    def _regional_run(self, task: Assignment, global_state: Mapping[str, torch.Tensor]) -> str:
        """The regional run of ``task``: the one started before a restart, or a new one
        (any other still going, for an upstream task that is over, is cancelled)."""
        name = RUN_PREFIX + task.task_id
        found = None
        for record in self.engine.runs_named_from(RUN_PREFIX):
            if record.name == name:
                found = record.id
            elif not record.finished:
                log.info("%s: cancelling regional run %s (%s): its upstream task is over",
                         self.tag, record.id, record.name)  # fmt: skip
                self.engine.cancel(record.id, who=self.tag)
        if found is not None:
            log.info("%s: upstream task %s: carrying on with regional run %s",
                     self.tag, task.task_id, found)  # fmt: skip
            return found
        spec = self._spec(task, name)
        start = GivenModel(global_state, after_round=task.round - 1)
        run_id, warnings = self.engine.submit(spec, who=self.tag, start=start)
        for warning in warnings:
            log.warning("%s: regional run %s: %s", self.tag, run_id, warning)
        return run_id

    def _spec(self, task: Assignment, name: str) -> RunSpec:
        """The regional run: the upstream task's round, settings, seed and codec."""
        n = self.region.sites_per_round or self._sites_serving(task)
        if n == 0:
            raise RegionError(f"no site of this region allows task {task.entry_point}")
        # Top-k error feedback would start afresh every round (a run a round): send whole.
        # Secure aggregation, here or upstream (its wire codec), takes the masked integers.
        whole = task.codec.name in ("topk", "secagg") or self.region.secagg
        codec = CodecSpec() if whole else task.codec
        deadline = max(task.deadline_in_s, 1.0)
        try:
            return RunSpec(
                task=task.entry_point, rounds=task.round, name=name, sites_per_round=n,
                min_sites=self.region.min_sites, round_deadline_s=deadline,
                join_timeout_s=min(60.0, deadline / 2), seed=task.seed, train=task.train,
                codec=codec, max_round_attempts=1,
                secagg=SecAggSpec() if self.region.secagg else None,
            ).validate()  # fmt: skip
        except ConfigError as exc:  # e.g. too few sites for secure aggregation
            raise RegionError(f"the region's own round cannot run: {exc}") from exc

    def _sites_serving(self, task: Assignment) -> int:
        """The region's sites that allow ``task``'s entry point; if none has registered
        yet (a region that has just started), as many as there are once one has, waiting
        at most half the task's deadline."""
        deadline = time.monotonic() + max(task.deadline_in_s, 1.0) / 2
        version = -1
        while (n := self.engine.sites_serving(task.entry_point)) == 0:
            if self.stop.is_set() or time.monotonic() > deadline:
                break
            version = self.engine.wait_for_change(version, _WAIT_S)
        return n

    def _wait(self, run_id: str, number: int) -> RoundOutcome:
        version = -1
        while True:
            record = self.engine.get_run_record(run_id)
            if record.finished:
                break
            if self.stop.is_set():
                raise RegionError(f"the region is stopping; regional run {run_id} goes on")
            version = self.engine.wait_for_change(version, _WAIT_S)
        if record.state != "completed":
            raise RegionError(f"regional run {run_id} {record.state}: {record.reason}")
        return self.engine.round_outcome(run_id, number)


class Region:
    """The region's agent on a thread of its own, for as long as the daemon serves."""

    def __init__(self, config: RegionConfig, engine: Engine) -> None:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.agent = RegionAgent(config, engine)
        self._thread = threading.Thread(target=self._serve, name="region", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.agent.run()
        except Exception:  # an identity the upstream refuses, a task not installed
            log.exception("%s: stopped serving the upstream", self.agent.tag)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.agent.stop.set()
        self.agent.conn.close()
        self._thread.join(timeout_s)
