"""``fedra bench compare``: the same task trained centrally, synchronously every step, and
with DiLoCo, over an emulated wide-area link, in one run.

Configurations (all on ``fedra.examples.charlm:task``, the same model, seed, batch size,
learning rate and number of inner steps per site):

- ``centralised``: one process, the pooled data of every site, one AdamW for all steps;
- ``ddp``: what a team would run instead, PyTorch DDP across the same sites (a process
  each, gloo all-reduce of the gradients every step) over the same emulated link
  (``fedra.compare_ddp``);
- ``every-step``: FedAvg with ``local_steps = 1``, one round per inner step;
- ``diloco-h{H}`` and ``diloco-h{H}-int8``: DiLoCo with H local steps per round, updates
  sent as fp32, or as int8 both ways (``[codec] download``: the sites fetch only the
  coordinator's int8 outer step).

The federated runs share one coordinator and ``sites`` site processes on localhost (mTLS),
each site dialling through its own ``fedra.wan.WanProxy``. Measures are in
``fedra.compare_metrics``, the written report in ``fedra.compare_report``.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from fedra import compare_ddp, compare_report
from fedra import compare_metrics as m
from fedra.admin import AdminClient, provenance_dict
from fedra.client.task import FitSettings
from fedra.config import ConfigError, require
from fedra.examples import charlm
from fedra.local import LocalCluster
from fedra.runspec import STRATEGY_PARAMS, CodecSpec, RunSpec, TrainSpec
from fedra.wan import Link, WanProxy

TASK = "fedra.examples.charlm:task"
CENTRALISED, EVERY_STEP, DDP = "centralised", "every-step", "ddp"
DEFAULT_MODEL = {"seq_len": "64", "d_model": "128", "n_layers": "2", "n_heads": "4", "d_ff": "512"}
QUICK_MODEL = {"seq_len": "32", "d_model": "32", "n_layers": "1", "n_heads": "2", "d_ff": "64"}
Log = Callable[[str], None]


@dataclass(frozen=True)
class CompareConfig:
    """What to compare and under which link; errors name the command-line option (or the
    field, for those the command does not expose)."""

    out: Path = Path("compare-out")
    steps: int = 512  # inner steps per site, the same in every configuration
    h_values: tuple[int, ...] = (8, 32, 128)
    overlap_h: tuple[int, ...] = (32,)  # the H values also run with [train] overlap
    only: tuple[str, ...] = ()  # run only these configurations (empty: all)
    sites: int = 2
    bandwidth_mbit: float = 100.0
    latency_ms: float = 50.0
    target_loss: float | None = None  # None: 1.1 x the centralised final eval loss
    batch_size: int = 32
    learning_rate: float = 3e-3  # the inner AdamW's, every configuration
    params: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    max_bytes: int = 1_000_000  # of the corpus per site (90 % train, 10 % held out)
    seed: int = 0
    state_dir: Path | None = None  # None: a temporary directory, removed afterwards
    round_deadline_s: float = 600.0
    run_timeout_s: float = 3600.0  # per federated configuration
    # The cost line: what a compute-hour (one site's process for an hour) and a GB moved
    # over the link cost, in any currency; the report states them.
    price_compute_hour: float = 1.0
    price_gb: float = 0.09

    def __post_init__(self) -> None:
        require(self.steps >= 1, "--steps", "must be >= 1", self.steps)
        require(len(self.h_values) > 0, "--h", "give at least one H", self.h_values)
        for h in self.h_values:
            require(h >= 1, "--h", "every H must be >= 1", h)
            require(
                self.steps % h == 0,
                "--h",
                f"must divide --steps {self.steps} (rounds = steps/H)",
                h,
            )
        require(
            len(set(self.h_values)) == len(self.h_values),
            "--h",
            "must not repeat a value",
            self.h_values,
        )
        for h in self.overlap_h:
            require(h in self.h_values, "--overlap-h", "every value must be one of --h", h)
        names = [c.name for c in configurations(self, every=True)]
        for name in self.only:
            require(name in names, "--only", f"must name configurations of {names}", name)
        require(1 <= self.sites <= 16, "--sites", "must be in [1, 16]", self.sites)
        try:
            Link(self.bandwidth_mbit, self.latency_ms)
        except ValueError as exc:
            raise ConfigError("--" + str(exc).replace("_", "-", 1)) from exc
        for flag, price in (
            ("--price-compute-hour", self.price_compute_hour), ("--price-gb", self.price_gb)
        ):  # fmt: skip
            ok = math.isfinite(price) and price >= 0
            require(ok, flag, "must be a finite number >= 0", price)
        if self.target_loss is not None:
            ok = math.isfinite(self.target_loss) and self.target_loss > 0
            require(ok, "--target-loss", "must be a finite number > 0", self.target_loss)
        require(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        ok = math.isfinite(self.learning_rate) and self.learning_rate > 0
        require(ok, "learning_rate", "must be a finite number > 0", self.learning_rate)
        require(self.max_bytes >= 10_000, "max_bytes", "must be >= 10000", self.max_bytes)
        try:
            charlm.model_config(self.params)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def build(cls, quick: bool = False, **options: Any) -> CompareConfig:
        """The default (or ``quick``) set-up with the options that are not None."""
        given = {k: v for k, v in options.items() if v is not None}
        base = cls.quick_defaults() if quick else {}
        if "h_values" in given and "overlap_h" not in given:  # the default, where it is run
            given["overlap_h"] = tuple(h for h in cls.overlap_h if h in given["h_values"])
        return cls(**{**base, **given})

    @staticmethod
    def quick_defaults() -> dict[str, Any]:
        """A set-up that finishes in a minute or two on 2 cores: for tests."""
        return {
            "steps": 16,
            "h_values": (4, 16),
            "overlap_h": (4,),
            "bandwidth_mbit": 1000.0,
            "latency_ms": 5.0,
            "params": dict(QUICK_MODEL),
            "max_bytes": 50_000,
            "batch_size": 8,
            "round_deadline_s": 120.0,
            "run_timeout_s": 240.0,
        }

    @property
    def eval_every(self) -> int:
        """The centralised run's evaluation cadence: the most frequent federated one
        apart from every-step's (which evaluates every step)."""
        return min(self.h_values)

    def settings(self, local_steps: int, seed: int) -> FitSettings:
        return FitSettings(
            local_steps=local_steps,
            local_epochs=1,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            seed=seed,
            params=dict(self.params),
        )


@dataclass(frozen=True)
class Configuration:
    name: str
    strategy: str  # "centralised", or the federated run's strategy
    local_steps: int  # H: inner steps per round
    codec: str = "none"
    overlap: bool = False  # [train] overlap: the next round trains while the update goes


def configurations(config: CompareConfig, every: bool = False) -> list[Configuration]:
    """Centralised, DDP, every-step, then DiLoCo at each H without and with int8, and
    with its communication overlapped with the next round's compute."""
    out = [
        Configuration(CENTRALISED, CENTRALISED, config.steps),
        Configuration(DDP, DDP, 1),
        Configuration(EVERY_STEP, "fedavg", 1),
    ]
    for h in sorted(config.h_values):
        out.append(Configuration(f"diloco-h{h}", "diloco", h))
        out.append(Configuration(f"diloco-h{h}-int8", "diloco", h, "int8"))
        if h in config.overlap_h:
            out.append(Configuration(f"diloco-h{h}-overlap", "diloco", h, overlap=True))
    if config.only and not every:
        out = [c for c in out if c.name in config.only]
    return out


def headline_configuration(config: CompareConfig) -> str:
    return f"diloco-h{max(config.h_values)}-int8"


def run_compare(config: CompareConfig, log: Log = print) -> dict[str, Any]:
    """Run every configuration; returns the JSON-able report (see ``write_report``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each site: one thread per process
    try:
        setup = describe_setup(config)
        data = pooled_data(config)
        plan = {c.name for c in configurations(config)}
        results = [run_centralised(config, data, log)] if CENTRALISED in plan else []
        if DDP in plan:
            results.append(run_ddp(config, log))
        federated = [c for c in configurations(config) if c.strategy not in (CENTRALISED, DDP)]
        if federated:
            with federation(config, log) as admin:
                results += [run_federated(admin, config, c, data, log) for c in federated]
    finally:
        torch.set_num_threads(threads)
    centralised = [r for r in results if r["name"] == CENTRALISED]
    target = config.target_loss or (
        1.1 * centralised[0]["final_eval_loss"] if centralised else math.nan
    )
    for result in results:
        points = [(p["seconds"], p["eval_loss"]) for p in result["curve"]]
        result["time_to_target_s"] = m.time_to_target(points, target)
        processes = 1 if result["strategy"] == CENTRALISED else config.sites
        result["cost"] = m.cost(processes, result, config.price_compute_hour, config.price_gb)
    setup["target_loss"] = target
    setup["target_loss_rule"] = "given" if config.target_loss else "1.1 x centralised final"
    setup["prices"] = {"compute_hour": config.price_compute_hour, "gb": config.price_gb}
    setup["elapsed_s"] = time.time() - setup["started_unix_s"]
    setup["load_average_end"] = list(os.getloadavg())
    by_name = {r["name"]: r for r in results}
    return {
        "setup": setup,
        "configurations": results,
        "headline": m.headline(by_name, EVERY_STEP, headline_configuration(config)),
    }


def write_report(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """report.md, report.json, loss_vs_time.png and loss_vs_bytes.png in ``out_dir``."""
    return compare_report.write(report, out_dir)


def describe_setup(config: CompareConfig) -> dict[str, Any]:
    model = charlm.task.create_model(config.seed, config.params)
    n = sum(p.numel() for p in model.parameters())
    return {
        "task": TASK,
        "model": dict(config.params),
        "parameters": n,
        "model_bytes_fp32": 4 * n,
        "sites": config.sites,
        "link": {"bandwidth_mbit": config.bandwidth_mbit, "latency_ms": config.latency_ms},
        "steps": config.steps,
        "h_values": list(config.h_values),
        "batch_size": config.batch_size,
        "learning_rate": config.learning_rate,
        "diloco": {k: p.default for k, p in STRATEGY_PARAMS["diloco"].items()},
        "max_bytes_per_site": config.max_bytes,
        "centralised_eval_every": config.eval_every,
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "started_unix_s": time.time(),
        "load_average_start": list(os.getloadavg()),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def site_data(config: CompareConfig, part: int) -> dict[str, Any]:
    """A site's ``[data]`` table."""
    return {"part": part, "num_parts": config.sites, "max_bytes": config.max_bytes}


def pooled_data(config: CompareConfig) -> charlm.CharLMData:
    """Every site's train and held-out data, concatenated (what centralised training sees)."""
    parts = [charlm.task.load_data(site_data(config, i)) for i in range(config.sites)]
    return charlm.CharLMData(
        train=torch.cat([p.train for p in parts]), eval=torch.cat([p.eval for p in parts])
    )


def evaluate_state(
    config: CompareConfig, state: Mapping[str, torch.Tensor], data: charlm.CharLMData
) -> float:
    """The task's own evaluation of a global model on the pooled held-out data."""
    model = charlm.task.create_model(config.seed, config.params)
    model.load_state_dict(dict(state))
    return charlm.task.evaluate(model, data)["loss"]


def train_centralised(
    config: CompareConfig,
    data: charlm.CharLMData,
    on_eval: Callable[[int, torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """``charlm.task.fit`` for ``config.steps`` steps, step for step (the same batches and
    one AdamW throughout), calling ``on_eval(step, model)`` every ``eval_every`` steps.

    Not ``fit`` itself: a fit per evaluation would restart AdamW each time.
    """
    task = charlm.task
    settings = config.settings(config.steps, config.seed)
    model = task.create_model(config.seed, config.params)
    model.train()
    opt = task.optimizer(list(model.parameters()), settings)
    for step in range(config.steps):
        x, y = task.batch(data, settings, step)
        loss = task.loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if on_eval is not None and (
            (step + 1) % config.eval_every == 0 or step + 1 == config.steps
        ):
            on_eval(step + 1, model)
    return model


def run_centralised(config: CompareConfig, data: charlm.CharLMData, log: Log) -> dict[str, Any]:
    """(a): one process on the pooled data; its clock includes its evaluations."""
    log(f"{CENTRALISED}: {config.steps} steps on the pooled data of {config.sites} sites")
    load_before = os.getloadavg()[0]
    initial = charlm.task.create_model(config.seed, config.params)
    curve = [{"seconds": 0.0, "bytes_per_site": 0.0, "eval_loss": _loss(initial, data), "step": 0}]
    started = time.perf_counter()

    def record(step: int, model: torch.nn.Module) -> None:
        seconds, loss = time.perf_counter() - started, _loss(model, data)
        curve.append({"seconds": seconds, "bytes_per_site": 0.0, "eval_loss": loss, "step": step})

    train_centralised(config, data, record)
    wall = time.perf_counter() - started
    final = curve[-1]["eval_loss"]
    log(f"{CENTRALISED}: final eval loss {final:.4f} after {wall:.1f} s")
    return {
        **_identity(Configuration(CENTRALISED, CENTRALISED, config.steps), rounds=0),
        "state": "completed",
        "final_eval_loss": final,
        "wall_s": wall,
        "curve": curve,
        "rounds": [],
        "load_average": [load_before, os.getloadavg()[0]],
    }


def run_ddp(config: CompareConfig, log: Log) -> dict[str, Any]:
    """(a'): DDP across the sites, every step, over the emulated link."""
    log(f"{DDP}: {config.steps} steps on {config.sites} sites, gloo all-reduce every step")
    load_before = os.getloadavg()[0]
    got = compare_ddp.run(config, config.run_timeout_s)
    c = Configuration(DDP, DDP, 1)
    result: dict[str, Any] = {
        **_identity(c, rounds=config.steps),
        "state": got["state"],
        "reason": got["reason"],
        "load_average": [load_before, os.getloadavg()[0]],
        "rounds": [],
    }
    ranks = got["ranks"]
    if not ranks:
        log(f"{DDP}: {got['state']}: {got['reason']}")
        nan = math.nan
        return {**result, "final_eval_loss": None, "wall_s": nan, "curve": [],
                "bytes_per_site": {"down": nan, "up": nan, "total": nan}, "bytes_by_site": {},
                "bytes_per_inner_step": nan, "compute_s_by_site": {},
                "utilisation": {"mean": nan, "min": nan, "by_site": {}},
                "round_time_s": m.percentiles([]),
                "failures": {"failed": config.sites, "participations": config.sites, "rate": 1.0},
                "rounds_committed": 0}  # fmt: skip
    wall = max(r["wall_s"] for r in ranks)
    sites = [f"site-{i}" for i in range(config.sites)]
    # A rank sends and receives the same: 2 (n - 1) / n of the gradients every step.
    by_site = {s: {"down": int(r["wire_bytes"]), "up": int(r["wire_bytes"])}
               for s, r in zip(sites, ranks, strict=True)}  # fmt: skip
    per_site = m.mean_bytes_per_site(by_site)
    compute = {s: r["compute_s"] for s, r in zip(sites, ranks, strict=True)}
    util = m.utilisation(compute, wall)
    final = got["curve"][-1]["eval_loss"]
    result.update(
        rounds_committed=config.steps,
        final_eval_loss=final,
        wall_s=wall,
        bytes_per_site=per_site,
        bytes_by_site=by_site,
        bytes_per_inner_step=m.bytes_per_step(per_site["total"], config.steps),
        compute_s_by_site=compute,
        utilisation={
            "mean": sum(util.values()) / len(util),
            "min": min(util.values()),
            "by_site": util,
        },
        round_time_s=m.percentiles([t for r in ranks for t in r["steps_s"]]),  # a step
        failures={"failed": 0, "participations": config.sites, "rate": 0.0},
        curve=got["curve"],
    )
    log(
        f"{DDP}: final eval loss {final:.4f} after {wall:.1f} s, "
        f"{result['bytes_per_inner_step']:.0f} B per inner step, "
        f"utilisation {result['utilisation']['mean']:.1%}"
    )
    return result


def _loss(model: torch.nn.Module, data: charlm.CharLMData) -> float:
    return charlm.task.evaluate(model, data)["loss"]


@contextlib.contextmanager
def federation(config: CompareConfig, log: Log) -> Iterator[AdminClient]:
    """A coordinator and ``config.sites`` sites, each behind its own emulated link.

    Without ``config.state_dir`` the state (every round's checkpoint: GBs for a long
    every-step run) lives in a temporary directory removed at the end.
    """
    site_ids = [f"site-{i}" for i in range(config.sites)]
    link = Link(config.bandwidth_mbit, config.latency_ms)
    with contextlib.ExitStack() as stack:  # closed in reverse: sites, links, then the state
        state_dir = config.state_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="fedra-compare-"))
        )
        kept = "" if config.state_dir else " (removed at the end; --state-dir keeps them)"
        log(f"federation: state and logs in {state_dir}{kept}")
        cluster = stack.enter_context(LocalCluster(state_dir))
        address = cluster.start_coordinator()
        links = [stack.enter_context(WanProxy(address, link)) for _ in site_ids]
        stack.callback(cluster.stop)  # before the links close: the sites talk through them
        for i, (site_id, proxy) in enumerate(zip(site_ids, links, strict=True)):
            cluster.start_site(site_id, [TASK], site_data(config, i), coordinator=proxy.address)
        cluster.wait_for_sites(site_ids, timeout_s=120.0)
        yield stack.enter_context(cluster.admin())


def run_spec(config: CompareConfig, c: Configuration) -> RunSpec:
    return RunSpec(
        task=TASK,
        name=f"compare-{c.name}",
        rounds=config.steps // c.local_steps,
        sites_per_round=config.sites,
        min_sites=config.sites,  # every round has every site: bytes per site are comparable
        round_deadline_s=config.round_deadline_s,
        join_timeout_s=120.0,
        seed=config.seed,
        train=TrainSpec(
            local_steps=c.local_steps,
            batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            params=dict(config.params),
            # Each site's AdamW goes on from round to round, as DiLoCo's inner optimiser
            # does (and as DDP's and the centralised run's do).
            keep_optimizer_state=True,
            overlap=c.overlap,
        ),
        strategy=c.strategy,
        codec=CodecSpec(name=c.codec, download=c.codec != "none"),
    ).validate()


def run_federated(
    admin: AdminClient,
    config: CompareConfig,
    c: Configuration,
    data: charlm.CharLMData,
    log: Log,
) -> dict[str, Any]:
    """(b) or (c): submit, follow to the end, export the last model and evaluate it."""
    spec = run_spec(config, c)
    load_before = os.getloadavg()[0]
    run_id = admin.submit(spec)
    log(f"{c.name}: run {run_id}, {spec.rounds} rounds of {c.local_steps} steps, codec {c.codec}")
    state, reason, rows = follow(admin, run_id, spec.rounds, config.run_timeout_s, c.name, log)
    final: float | None = None
    if m.training_rounds(rows):
        final = evaluate_state(config, admin.export_model(run_id), data)
    result = summarise(config, c, rows, final)
    result.update(run_id=run_id, state=state, reason=reason)
    result["provenance"] = provenance_dict(admin.status(run_id).provenance)
    result["load_average"] = [load_before, os.getloadavg()[0]]
    loss = "n/a" if final is None else f"{final:.4f}"
    log(
        f"{c.name}: {state}, final eval loss {loss}, "
        f"{result['bytes_per_inner_step']:.0f} B per inner step, "
        f"utilisation {result['utilisation']['mean']:.1%}"
    )
    return result


def follow(
    admin: AdminClient, run_id: str, rounds: int, timeout_s: float, name: str, log: Log
) -> tuple[str, str, list[m.RoundRow]]:
    """Watch the run to its end (bounded by ``timeout_s``): state, reason and rounds."""
    every = max(1, rounds // 4)
    reported = 0
    try:
        for status in admin.watch(run_id, timeout_s=timeout_s):
            done = status.rounds_completed
            if done // every > reported // every and done < rounds:
                log(f"{name}: {done}/{rounds} rounds")
            reported = done
            if status.state in ("completed", "failed", "cancelled"):
                return status.state, status.reason, m.rows_from_status(status)
    except grpc.RpcError as exc:  # the deadline, or a lost stream: give up on this run
        log(f"{name}: {exc.code().name} while following run {run_id}; cancelling it")
        with contextlib.suppress(grpc.RpcError):
            admin.cancel(run_id)
    status = admin.status(run_id)
    reason = status.reason or f"not finished within {timeout_s:g} s"
    return "timed out", reason, m.rows_from_status(status)


def summarise(
    config: CompareConfig, c: Configuration, rows: list[m.RoundRow], final: float | None
) -> dict[str, Any]:
    """Every measure of one federated configuration, from its rounds."""
    wall = m.wall_time_s(rows)
    by_site = m.bytes_by_site(rows)
    per_site = m.mean_bytes_per_site(by_site)
    compute = m.compute_by_site(rows)
    util = m.utilisation(compute, wall)
    trained = m.training_rounds(rows)
    return {
        **_identity(c, rounds=config.steps // c.local_steps),
        "rounds_committed": len(trained),
        "final_eval_loss": final,
        "wall_s": wall,
        "bytes_per_site": per_site,
        "bytes_by_site": by_site,
        "bytes_per_inner_step": m.bytes_per_step(per_site["total"], config.steps),
        "compute_s_by_site": compute,
        "utilisation": {
            "mean": sum(util.values()) / len(util) if util else math.nan,
            "min": min(util.values(), default=math.nan),
            "by_site": util,
        },
        "round_time_s": m.percentiles([r.round_s for r in trained]),
        "failures": m.failures(rows),
        "curve": [asdict(p) for p in m.loss_curve(rows, final)],
        "rounds": [asdict(r) for r in rows],
    }


def _identity(c: Configuration, rounds: int) -> dict[str, Any]:
    return {
        "name": c.name,
        "strategy": c.strategy,
        "local_steps": c.local_steps,
        "codec": c.codec,
        "overlap": c.overlap,
        "num_rounds": rounds,
    }
