"""``fedra demo``: a coordinator and three sites on localhost learn scikit-learn's digits.

The data is split across the sites by label skew (each site sees mostly a few digits).
Every committed global model is scored on a held-out test set that no site trains on,
and the final one is compared with the same model trained centrally on the pooled data
for the same number of samples.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedra.admin import provenance_dict
from fedra.config import READY_FILE, ConfigError
from fedra.local import LocalCluster
from fedra.protos.v1 import admin_pb2
from fedra.runspec import STRATEGY_PARAMS, RunSpec, TrainSpec

if TYPE_CHECKING:
    import torch

# torch and the digits example (seconds to import) come after the options are checked.

TASK = "fedra.examples.digits:task"
MAX_ROUNDS = 1_000_000  # what a run spec allows
MAX_SITES = 32  # each site is a process on this machine


@dataclass(frozen=True)
class DemoStrategy:
    """What ``--strategy NAME`` runs: a server strategy (its default parameters) and the
    sites' proximal term (FedProx's mu; 0: none)."""

    strategy: str
    proximal_mu: float = 0.0
    scaffold: bool = False
    momentum: str = "0.9"  # the digits task's inner SGD momentum


# Every server strategy by its own name; FedProx: FedAvg with mu = 0.01 at the sites;
# SCAFFOLD: FedAvg with control variates, whose correction assumes plain SGD inside.
DEMO_STRATEGIES = {name: DemoStrategy(name) for name in STRATEGY_PARAMS} | {
    "fedprox": DemoStrategy("fedavg", proximal_mu=0.01),
    "scaffold": DemoStrategy("fedavg", scaffold=True, momentum="0"),
}


@dataclass(frozen=True)
class DemoOptions:
    state_dir: Path | None = None
    out: Path | None = None
    rounds: int = 10
    sites: int = 3
    strategy: str = "fedavg"
    alpha: float = 0.5  # the label skew of the sites' split (Dirichlet; smaller: stronger)
    partition_seed: int = 0  # which split of that skew

    def validate(self) -> DemoOptions:
        """Raise ConfigError naming the command-line flag; returns self for chaining."""
        if self.strategy not in DEMO_STRATEGIES:
            raise ConfigError(
                f"--strategy: must be one of {', '.join(DEMO_STRATEGIES)}, got {self.strategy!r}"
            )
        if not (math.isfinite(self.alpha) and 0 < self.alpha <= 1000):
            raise ConfigError(f"--alpha: must be a number in (0, 1000], got {self.alpha}")
        if not 0 <= self.partition_seed < 2**31:
            raise ConfigError(
                f"--partition-seed: must be from 0 to {2**31 - 1}, got {self.partition_seed}"
            )
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ConfigError(f"--rounds: must be from 1 to {MAX_ROUNDS}, got {self.rounds}")
        if not 1 <= self.sites <= MAX_SITES:
            raise ConfigError(
                f"--sites: must be from 1 to {MAX_SITES} (each site is a process on this "
                f"machine), got {self.sites}"
            )
        for flag, path in (("--state-dir", self.state_dir), ("--out", self.out)):
            if path is not None and path.exists() and not path.is_dir():
                raise ConfigError(f"{flag}: {path} is not a directory")
        return self


def demo_spec(rounds: int, sites: int, strategy: str = "fedavg") -> RunSpec:
    chosen = DEMO_STRATEGIES[strategy]
    return RunSpec(
        name="digits-demo",
        task=TASK,
        rounds=rounds,
        sites_per_round=sites,
        min_sites=max(1, sites - 1),
        round_deadline_s=120.0,
        join_timeout_s=30.0,
        seed=0,
        train=TrainSpec(
            local_epochs=2,
            batch_size=32,
            learning_rate=0.05,
            params={"momentum": chosen.momentum},
            proximal_mu=chosen.proximal_mu,
            scaffold=chosen.scaffold,
        ),
        strategy=chosen.strategy,
    ).validate()


def tracking_flags() -> list[str]:
    """``--track`` for TensorBoard and MLflow where the tracking extra is installed
    (``make install`` installs it), into the state directory's defaults; none otherwise."""
    import importlib.util  # noqa: PLC0415

    wanted = (("tensorboard", "tensorboard"), ("mlflow", "mlflow"))
    return [f for kind, mod in wanted if importlib.util.find_spec(mod) for f in ("--track", kind)]


def run_demo(options: DemoOptions) -> int:
    """Run the demo; returns the process exit code."""
    options.validate()  # and the spec: both before a directory is made
    spec = demo_spec(options.rounds, options.sites, options.strategy)
    import torch  # noqa: PLC0415 - after the options are checked

    from fedra.examples import digits  # noqa: PLC0415

    torch.set_num_threads(1)
    state_dir = options.state_dir or Path(tempfile.mkdtemp(prefix="fedra-demo-"))
    site_ids = [f"site-{i}" for i in range(options.sites)]
    (_, _), (x_test, y_test) = digits.pooled_split(0)
    print(
        f"fedra demo: state in {state_dir} "
        f"(SQLite: {state_dir / 'fedra.db'}, logs: {state_dir / 'logs'})"
    )
    started = time.monotonic()
    with LocalCluster(state_dir) as cluster:
        print("making a certificate authority and certificates; starting the coordinator...")
        track = tracking_flags()
        address = cluster.start_coordinator(flags=["--http", "127.0.0.1:0", *track])
        page = json.loads((state_dir / READY_FILE).read_text())["http_url"]
        print(f"coordinator ready on {address}; starting {len(site_ids)} sites", flush=True)
        for i, site_id in enumerate(site_ids):
            split = {"alpha": options.alpha, "seed": options.partition_seed}
            data = {"partition": i, "num_partitions": options.sites, **split}
            cluster.start_site(site_id, [TASK], data)
        print("waiting for the sites to load their data and register...", flush=True)
        cluster.wait_for_sites(site_ids)
        print(f"all {len(site_ids)} sites online; submitting the run", flush=True)
        with cluster.admin() as admin:
            run_id = admin.submit(spec)
            print(
                f"run {run_id}: {spec.rounds} rounds of {options.strategy}, "
                f"{options.sites} sites, label-skewed data (alpha {options.alpha:g}, "
                f"split {options.partition_seed})\n"
                f"watch it at {page}?run={run_id} (metrics: {page}metrics)\n"
            )
            print(
                f"{'round':>5}  {'sites':>5}  {'test loss':>9}  {'test acc':>8}  "
                f"{'MB moved':>8}  {'seconds':>7}  {'idle':>4}"
            )
            rounds: list[dict[str, Any]] = []
            final = None
            for status in admin.watch(run_id, changed_rounds_only=True):
                final = status
                for r in status.rounds:
                    if r.status == "committed" and r.number >= len(rounds):
                        model = admin.export_model(run_id, r.number)
                        rounds.append(_round_summary(r, _score(model, x_test, y_test)))
                        _print_round(rounds[-1])
            assert final is not None
            if final.state != "completed":
                print(f"\nrun {run_id} {final.state}: {final.reason}")
                return 1
            model = admin.export_model(run_id)
            # As the rounds ended up: a download counted after its round's commit, say.
            final_status = admin.status(run_id)
            latest = {r.number: r for r in final_status.rounds}
    for summary in rounds:
        r = latest[summary["round"]]
        summary.update(
            bytes_down=r.bytes_down,
            bytes_up=r.bytes_up,
            cut_bytes=r.cut_bytes,
            lost_bytes=r.lost_bytes,
            site_idle_s=r.site_idle_s,
        )
    if track:  # written out by now: the coordinator closes its trackers as it stops
        print(
            f"the run in TensorBoard: tensorboard --logdir {state_dir / 'tensorboard'}"
            if "tensorboard" in track
            else "",
            f"\nthe run in MLflow: sqlite:///{state_dir / 'mlruns' / 'mlflow.db'} (experiment "
            "'fedra'; `mlflow ui --backend-store-uri` it with the full mlflow package)"
            if "mlflow" in track
            else "",
            sep="",
        )
    provenance = provenance_dict(final_status.provenance)
    return _finish(
        options, spec, run_id, rounds, _score(model, x_test, y_test), started, provenance
    )


def _score(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    from fedra.examples import digits  # noqa: PLC0415

    model = digits.task.create_model(0, {})
    model.load_state_dict(state)
    return digits.evaluate_on(model, x, y)


def _round_summary(r: admin_pb2.RoundStatus, test: dict[str, float]) -> dict[str, Any]:
    return {
        "round": r.number,
        "sites": [p.site_id for p in r.participations if p.status == "accepted"],
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
        "site_metrics": dict(r.metrics),
        "bytes_down": r.bytes_down,
        "bytes_up": r.bytes_up,
        "cut_bytes": r.cut_bytes,  # of transfers cut off or refused midway
        "lost_bytes": r.lost_bytes,  # moved for work that did not count (cut_bytes too)
        "seconds": r.duration_s,
        "site_idle_s": r.site_idle_s,  # the mean site's time in the round not spent working
        "samples_seen": r.metrics.get("samples_seen", 0.0),  # a count: summed over the sites
    }


def _print_round(r: dict[str, Any]) -> None:
    mb = (r["bytes_down"] + r["bytes_up"] + r["cut_bytes"]) / 1e6
    idle = f"{r['site_idle_s'] / r['seconds']:4.0%}" if r["round"] > 0 and r["seconds"] else ""
    print(
        f"{r['round']:>5}  {len(r['sites']):>5}  {r['test_loss']:>9.4f}  "
        f"{r['test_accuracy']:>8.3f}  "
        f"{mb:>8.3f}  {r['seconds']:>7.2f}  {idle:>4}",
        flush=True,
    )


def _finish(
    options: DemoOptions,
    spec: RunSpec,
    run_id: str,
    rounds: list[dict[str, Any]],
    final: dict[str, float],
    started: float,
    provenance: dict[str, Any],
) -> int:
    from fedra.examples import digits  # noqa: PLC0415

    samples = sum(r["samples_seen"] for r in rounds)
    steps = max(1, math.ceil(samples / spec.train.batch_size))
    # The sites' training data pooled: not the rows each site holds out to evaluate on.
    pooled = digits.sites_training_data(options.sites, options.alpha, options.partition_seed)
    print(
        f"\ntraining the centralised baseline: the same {int(samples)} samples "
        f"({steps} steps) on the sites' training data pooled ({len(pooled[1])} rows)...",
        flush=True,
    )
    baseline_model = digits.train_centralised(
        0, steps, spec.train.batch_size, spec.train.learning_rate, {}, pooled
    )
    (_, _), (x_test, y_test) = digits.pooled_split(0)
    baseline = digits.evaluate_on(baseline_model, x_test, y_test)
    wire = sum(r["bytes_down"] + r["bytes_up"] + r["cut_bytes"] for r in rounds)
    lost = sum(r["lost_bytes"] for r in rounds)
    timed = [r for r in rounds if r["round"] > 0]
    seconds = sum(r["seconds"] for r in timed)
    idle = sum(r["site_idle_s"] for r in timed) / seconds if seconds else 0.0
    print(
        f"final global model: test accuracy {final['accuracy']:.3f} (loss {final['loss']:.4f})\n"
        f"centralised baseline, same {int(samples)} samples ({steps} steps) on the sites' data: "
        f"test accuracy {baseline['accuracy']:.3f}\n"
        f"total {wire / 1e6:.2f} MB on the wire ({lost / 1e6:.2f} MB for work that did not "
        f"count), sites idle {idle:.0%} of their rounds, "
        f"{time.monotonic() - started:.1f} s wall clock"
    )
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        summary = {
            "run_id": run_id,
            "spec": json.loads(spec.to_json()),
            "strategy": options.strategy,
            "alpha": options.alpha,
            "partition_seed": options.partition_seed,
            "sites": sorted({s for r in rounds for s in r["sites"]}),  # those that took part
            "provenance": provenance["sites"],  # by site id: what its updates came from
            "run_provenance": provenance["run"],
            "rounds": rounds,
            "final": {
                "accuracy": final["accuracy"],
                "loss": final["loss"],
                "baseline_accuracy": baseline["accuracy"],
                "baseline_loss": baseline["loss"],
                "baseline_steps": steps,
                "samples_seen": samples,
                "bytes_on_wire": wire,
                "lost_bytes": lost,
                "site_idle_fraction": idle,
            },
        }
        (options.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {options.out / 'summary.json'}")
    return 0
