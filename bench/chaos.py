"""Crash torture: kill the coordinator and sites at random instants and at every fault
point, and check that each run ends on the same bits as an uninterrupted one.

    python bench/chaos.py                   # every strategy with server state x every codec
    python bench/chaos.py --quick           # the bounded version CI runs (a few minutes)
    python bench/chaos.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test

For each configuration (a server strategy and a codec) the same run spec runs twice on
fresh state, as real processes over mTLS: once under torture (SIGKILLs of the coordinator
at random instants and at the fault points of ``fedra.faults``, SIGKILLs of sites at
random instants and after a download, each process restarted at once), and once
untouched (the reference). The tortured run is long enough never to end by itself: once
the whole plan is carried out and ``--settle-rounds`` more rounds have committed, it is
cancelled, and the reference runs that many rounds; so the plan never depends on how
fast rounds go. It prints, per configuration and in total: trials (kills),
resumes, committed rounds lost, duplicate rounds, the sites' lost work (tasks whose work
did not count, and the bytes they moved), rounds bit-identical to the reference and the
largest difference of the final model. Exit status 1 if anything was lost, duplicated
or differs. ``--out FILE`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

import torch
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from fedra.faults import ENV as FAULT_ENV
from fedra.local import ClusterError, LocalCluster
from fedra.runspec import CodecSpec, RunSpec, TrainSpec
from fedra.storage import Store

TASK = "fedra.examples.synthetic:task"
SITES = 3
# Liveness in seconds, not the defaults' tens: a killed site is noticed quickly, and a
# restarted one (a few seconds of imports) is usually back before it counts as gone.
FLAGS = ["--heartbeat-s", "0.5", "--site-timeout-s", "8", "--poll-timeout-s", "5"]
STRATEGIES = {
    "fedavgm": {"momentum": 0.5},
    "fedadam": {"server_lr": 0.05},
    "fedyogi": {"server_lr": 0.05},
    "diloco": {"momentum": 0.9, "server_lr": 0.7},
}
CODECS = {
    "none": CodecSpec(),
    "fp16": CodecSpec("fp16"),
    "bf16": CodecSpec("bf16"),
    "int8": CodecSpec("int8", block=64, download=True),
    "topk": CodecSpec("topk", fraction=0.1),
}
# Where the coordinator is killed on purpose, in the order a round meets them
# (fedra.faults; secure aggregation's after_unmask and after_attempt_failed need runs of
# their own kind and are covered by the tests that make them).
POINTS = (
    "mid_download",
    "mid_upload",
    "after_accept",
    "mid_fold",
    "before_reply",
    "before_commit",
    "after_commit",
    "during_startup",
)
QUICK = [("diloco", "int8"), ("fedadam", "topk")]
DONE = ("completed", "failed", "cancelled")


@dataclass
class Tally:
    config: str
    trials: int = 0  # kills of any process
    coordinator_kills: int = 0
    fault_points_hit: dict[str, int] = field(default_factory=dict)
    site_kills: int = 0
    resumes: int = 0  # coordinator restarts that resumed the run
    committed_rounds_lost: int = 0
    duplicate_rounds: int = 0
    lost_tasks: int = 0  # tasks whose work did not count (failed or expired)
    lost_bytes: int = 0
    rounds: int = 0
    identical_rounds: int = 0
    max_abs_diff: float = 0.0
    # The tortured run's state once its last compared round committed: still running
    # (then cancelled by the harness), or how it ended (failed: a defect).
    state: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.state == "running"
            and self.committed_rounds_lost == 0
            and self.duplicate_rounds == 0
            and self.identical_rounds == self.rounds
            and self.max_abs_diff == 0.0
        )


# The tortured run's length: never reached (it is cancelled once its rounds are compared).
LONG_RUN = 100_000


def spec_for(strategy: str, codec: str, rounds: int) -> RunSpec:
    return RunSpec(
        task=TASK,
        rounds=rounds,
        sites_per_round=SITES,
        min_sites=SITES,  # every site, every round: a kill can delay a round, never change it
        round_deadline_s=120.0,
        max_round_attempts=20,
        join_timeout_s=120.0,
        seed=11,
        train=TrainSpec(
            local_steps=4, batch_size=16, learning_rate=0.02, params={"extra_params": "20000"}
        ),
        strategy=strategy,
        strategy_params=dict(STRATEGIES[strategy]),
        codec=CODECS[codec],
    ).validate()


@contextmanager
def database(db: str | None, prefix: str = "chaos") -> Iterator[str | None]:
    """None (SQLite in the state directory), or a fresh PostgreSQL database under ``db``
    (named ``prefix`` and a random suffix), dropped at the end."""
    if db is None:
        yield None
        return
    url = make_url(db)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


class Federation:
    """A coordinator on a fixed port and SITES synthetic sites, as real processes."""

    def __init__(self, root: Path, db_url: str | None) -> None:
        self.cluster = LocalCluster(root)
        self.db_url = db_url
        self.store_url = db_url or f"sqlite:///{root / 'fedra.db'}"
        address = self.cluster.start_coordinator(db_url=db_url, flags=FLAGS)
        self.port = int(address.rsplit(":", 1)[1])
        self.site_ids = [f"site-{i}" for i in range(SITES)]
        for site_id in self.site_ids:
            self.start_site(site_id)
        self.cluster.wait_for_sites(self.site_ids)

    def start_site(self, site_id: str, env: dict[str, str] | None = None) -> None:
        i = self.site_ids.index(site_id)
        data = {"shift": float(i), "seed": i, "samples": 96, "fit_delay_s": 0.3}
        self.cluster.start_site(site_id, [TASK], data, extra_env=env, reconnect_max_s=1.0)

    def start_coordinator(self, env: dict[str, str] | None = None) -> bool:
        """Start the daemon; False if it was killed by a fault before it served."""
        try:
            self.cluster.start_coordinator(
                port=self.port, db_url=self.db_url, flags=FLAGS, extra_env=env
            )
        except ClusterError:
            proc = self.cluster.coordinator
            assert proc is not None
            if proc.popen.wait(30) != -signal.SIGKILL:
                raise
            return False
        return True

    def kill_coordinator(self) -> None:
        proc = self.cluster.coordinator
        assert proc is not None
        proc.signal(signal.SIGKILL)
        proc.popen.wait(30)

    def committed(self, run_id: str) -> dict[int, str]:
        """Round number -> model digest of every checkpoint in the database."""
        store = Store(self.store_url, migrate=False)
        try:
            return {c.round_number: c.model_sha256 for c in store.list_checkpoints(run_id)}
        finally:
            store.close()

    def state(self, run_id: str) -> str:
        store = Store(self.store_url, migrate=False)
        try:
            record = store.get_run(run_id)
            return record.state if record is not None else ""
        finally:
            store.close()

    def close(self) -> None:
        self.cluster.stop()


def _wait(probe: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)  # polling the database for a condition, with a deadline


def reference(
    root: Path, spec: RunSpec, db: str | None
) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    with database(db) as url:
        fed = Federation(root, url)
        try:
            with fed.cluster.admin() as admin:
                run_id = admin.submit(spec)
            _wait(lambda: fed.state(run_id) in DONE, 600, "the reference run")
            with fed.cluster.admin() as admin:
                model = admin.export_model(run_id)
            assert fed.state(run_id) == "completed", f"reference run {fed.state(run_id)}"
            return fed.committed(run_id), model
        finally:
            fed.close()


def plan(rng: random.Random, quick: bool) -> list[str]:
    """The torture's actions: every fault point once, and kills at random instants."""
    points = list(POINTS) if not quick else ["after_accept", "before_commit", "mid_fold"]
    actions = [f"point:{p}" for p in points]
    actions += ["coordinator"] * (2 if quick else 6) + ["site"] * (2 if quick else 6)
    actions += ["site_after_download"] * (1 if quick else 2)
    rng.shuffle(actions)
    return actions


class Torture:
    def __init__(self, fed: Federation, run_id: str, tally: Tally, rng: random.Random) -> None:
        self.fed, self.run_id, self.tally, self.rng = fed, run_id, tally, rng
        self.snapshots: list[dict[int, str]] = []

    def finished(self) -> bool:
        return self.fed.state(self.run_id) in DONE

    def next_round(self) -> int:
        return max(self.fed.committed(self.run_id), default=-1) + 1

    def _kill_coordinator(self) -> None:
        self.snapshots.append(self.fed.committed(self.run_id))
        self.fed.kill_coordinator()
        self.tally.trials += 1
        self.tally.coordinator_kills += 1

    def _restart(self, env: dict[str, str] | None = None) -> bool:
        served = self.fed.start_coordinator(env)
        self.tally.resumes += 1
        return served

    def random_coordinator_kill(self) -> None:
        time.sleep(self.rng.uniform(0.1, 2.0))  # a random instant of the run
        self._kill_coordinator()
        self._restart()

    def fault_point(self, point: str) -> None:
        """Restart the daemon armed to kill itself at ``point`` of the next round."""
        target = self.next_round()
        if point == "during_startup":
            target = self.next_round()  # the round a restart resumes
        assert self.fed.cluster.coordinator is not None
        self.snapshots.append(self.fed.committed(self.run_id))
        self.fed.cluster.coordinator.stop()  # graceful: only the armed kill counts
        env = {FAULT_ENV: f"{point}:{target}"}
        if self._restart(env):
            proc = self.fed.cluster.coordinator

            def ended() -> bool:
                return not proc.alive() or self.next_round() > target + 1 or self.finished()

            _wait(ended, 240, f"the coordinator to reach {point} of round {target}")
            if proc.alive():  # the point was not reached in that round: disarm
                proc.stop()
                self._restart()
                return
        assert self.fed.cluster.coordinator.popen.wait(30) == -signal.SIGKILL, point
        self.snapshots.append(self.fed.committed(self.run_id))
        self.tally.trials += 1
        self.tally.fault_points_hit[point] = self.tally.fault_points_hit.get(point, 0) + 1
        while not self._restart():  # a fault met again while resuming (mid_fold, startup)
            self.tally.trials += 1

    def site_kill(self, after_download: bool) -> None:
        site_id = self.rng.choice(self.fed.site_ids)
        proc = self.fed.cluster.sites[site_id]
        if after_download:
            proc.stop()
            target = self.next_round()
            self.fed.start_site(site_id, {FAULT_ENV: f"after_download:{target}"})
            proc = self.fed.cluster.sites[site_id]

            def ended() -> bool:  # a round past it: the site had that round's work already
                return not proc.alive() or self.next_round() > target + 1 or self.finished()

            _wait(ended, 240, f"{site_id}'s fault in round {target}")
            if proc.alive():  # not met: disarmed, the site restarted without it
                proc.stop()
                self.fed.start_site(site_id)
                return
        else:
            time.sleep(self.rng.uniform(0.1, 2.0))
            proc.signal(signal.SIGKILL)
        proc.popen.wait(30)
        self.tally.trials += 1
        self.tally.site_kills += 1
        self.fed.start_site(site_id)

    def act(self, action: str) -> None:
        if action == "coordinator":
            self.random_coordinator_kill()
        elif action.startswith("point:"):
            self.fault_point(action.removeprefix("point:"))
        else:
            self.site_kill(after_download=action == "site_after_download")


def torture(
    root: Path,
    spec: RunSpec,
    db: str | None,
    rng: random.Random,
    quick: bool,
    tally: Tally,
    settle_rounds: int,
) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """Carry out the whole plan on a run that outlasts it, let ``settle_rounds`` more
    rounds commit, cancel it; its rounds up to the last of those, and that round's model."""
    with database(db) as url:
        fed = Federation(root, url)
        try:
            with fed.cluster.admin() as admin:
                run_id = admin.submit(spec)
            t = Torture(fed, run_id, tally, rng)
            for action in plan(rng, quick):
                if t.finished():  # failed under torture: what is left would prove nothing
                    break
                t.act(action)
            last = t.next_round() + settle_rounds - 1
            _wait(lambda: t.finished() or t.next_round() > last, 600, f"round {last} to commit")
            tally.state = fed.state(run_id)
            with fed.cluster.admin() as admin:
                if not t.finished():
                    admin.cancel(run_id)
                _wait(t.finished, 120, "the tortured run to be cancelled")
                model = admin.export_model(run_id, last) if last in fed.committed(run_id) else {}
            final = {n: d for n, d in fed.committed(run_id).items() if n <= last}
            for snapshot in t.snapshots:  # what was committed before a kill is still there
                tally.committed_rounds_lost += sum(
                    final.get(n) != digest for n, digest in snapshot.items()
                )
            _count_waste(fed, run_id, tally)
            return final, model
        finally:
            fed.close()


def _count_waste(fed: Federation, run_id: str, tally: Tally) -> None:
    store = Store(fed.store_url, migrate=False)
    try:
        commits = [e.round_number for e in store.list_events(run_id) if e.kind == "round_committed"]
        tally.duplicate_rounds = len(commits) - len(set(commits))
        parts = store.list_participations(run_id)
        tally.lost_tasks = sum(p.state in ("failed", "expired") for p in parts)
    finally:
        store.close()
    with fed.cluster.admin() as admin:
        tally.lost_bytes = sum(r.lost_bytes for r in admin.status(run_id).rounds)


def compare(
    tally: Tally,
    ref: tuple[dict[int, str], dict[str, torch.Tensor]],
    got: tuple[dict[int, str], dict[str, torch.Tensor]],
) -> None:
    (ref_rounds, ref_model), (rounds, model) = ref, got
    tally.rounds = len(ref_rounds)
    tally.identical_rounds = sum(rounds.get(n) == d for n, d in ref_rounds.items())
    diffs = [
        float((model[k].double() - v.double()).abs().max()) if k in model else float("inf")
        for k, v in ref_model.items()
        if v.numel()
    ]
    tally.max_abs_diff = max(diffs, default=0.0)


def run_config(
    workdir: Path,
    strategy: str,
    codec: str,
    settle_rounds: int,
    db: str | None,
    seed: int,
    quick: bool,
) -> Tally:
    name = f"{strategy}+{codec}"
    tally = Tally(name)
    long_run = spec_for(strategy, codec, LONG_RUN)
    got = torture(
        workdir / f"{name}-torture", long_run, db, random.Random(seed), quick, tally, settle_rounds
    )
    # Rounds do not depend on how many a run has: the reference stops where the torture did.
    last = max(got[0], default=1)
    ref = reference(workdir / f"{name}-reference", spec_for(strategy, codec, max(last, 1)), db)
    compare(tally, ref, got)
    return tally


def report(tallies: list[Tally]) -> str:
    head = (
        f"{'config':<16}{'kills':>6}{'coord':>6}{'points':>7}{'sites':>6}{'resumes':>8}"
        f"{'lost':>5}{'dups':>5}{'wasted':>7}{'identical':>10}{'max diff':>10}  ok"
    )
    lines = [head]
    for t in tallies:
        lines.append(
            f"{t.config:<16}{t.trials:>6}{t.coordinator_kills:>6}"
            f"{sum(t.fault_points_hit.values()):>7}{t.site_kills:>6}{t.resumes:>8}"
            f"{t.committed_rounds_lost:>5}{t.duplicate_rounds:>5}{t.lost_tasks:>7}"
            f"{f'{t.identical_rounds}/{t.rounds}':>10}{t.max_abs_diff:>10.3g}  "
            f"{'yes' if t.ok else 'NO (' + t.state + ')'}"
        )
    hit = sorted({p for t in tallies for p in t.fault_points_hit})
    lines.append(f"fault points hit: {', '.join(hit) or 'none'}")
    lines.append(
        f"total: {sum(t.trials for t in tallies)} kills, "
        f"{sum(t.resumes for t in tallies)} resumes, "
        f"{sum(t.committed_rounds_lost for t in tallies)} committed rounds lost, "
        f"{sum(t.duplicate_rounds for t in tallies)} duplicate rounds, "
        f"{sum(t.identical_rounds for t in tallies)}/{sum(t.rounds for t in tallies)} rounds "
        f"bit-identical, largest difference {max(t.max_abs_diff for t in tallies):.3g}"
    )
    return "\n".join(lines)


def _interrupted(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt  # SIGTERM stops the federation's processes as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bounded version CI runs")
    parser.add_argument(
        "--settle-rounds", type=int, default=2,
        help="rounds committed after the plan is carried out, before the run is compared",
    )  # fmt: skip
    parser.add_argument("--db", default=None, help="a PostgreSQL URL (default: SQLite)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kills' instants")
    parser.add_argument("--configs", default="", help="strategy+codec,... (default: all)")
    parser.add_argument("--workdir", type=Path, default=None, help="kept, for the logs")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.settle_rounds < 1:
        parser.error("--settle-rounds: must be at least 1")
    if args.configs:
        configs = [tuple(c.split("+", 1)) for c in args.configs.split(",")]
        for config in configs:
            if len(config) != 2 or config[0] not in STRATEGIES or config[1] not in CODECS:
                parser.error(
                    f"--configs: {'+'.join(config)!r} is not strategy+codec, a strategy of "
                    f"{', '.join(STRATEGIES)} and a codec of {', '.join(CODECS)}"
                )
    elif args.quick:
        configs = QUICK
    else:
        configs = [(s, c) for s in STRATEGIES for c in CODECS]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedra-chaos-"))
    tallies = []
    for i, (strategy, codec) in enumerate(configs):
        tally = run_config(
            workdir, strategy, codec, args.settle_rounds, args.db, args.seed + i, args.quick
        )
        tallies.append(tally)
        print(report([tally]).splitlines()[1], flush=True)
    print(report(tallies))
    print(f"logs: {workdir}")
    if args.out:
        figures = [{**asdict(t), "ok": t.ok} for t in tallies]
        args.out.write_text(json.dumps({"configs": figures, "db": args.db or "sqlite"}, indent=1))
    return 0 if all(t.ok for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
