"""A long run's memory: does a daemon that runs for thousands of rounds keep growing?

One coordinator and N sites as real processes (``LocalCluster``, plaintext), one run of R
rounds of the synthetic task with a P-element model, while an operator reads the run's
whole status (``GetRun``, page after page, and its summary) every ``--status-s`` seconds
through the site port (the daemon's own reads and caches; the operators' read process
behind ``--admin-port`` is neither read nor sampled).
Every ``--sample-s`` seconds it samples the RSS of the daemon and of the largest site, and
the rounds committed. It prints the samples and, per process, the growth per round from
the first sample past a quarter of the rounds (by then the caches and the allocator's
arenas are at their working size) to the last: the figure a daemon that runs for months
must keep near zero, and the growth over that span against the RSS at its start.

Every checkpoint stays on disk: the run writes R times the model (4P bytes) and more; the
state directory goes at the end.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_run.py [--rounds 3000] [--json out.json]

MB is 10**6 bytes throughout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from round_bench import SYNTHETIC, make_spec, proc_status_bytes

from fedra.local import ClusterError, LocalCluster

MB = 1e6
TERMINAL = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class Sample:
    at_s: float
    rounds: int
    daemon_rss: int
    site_rss: int  # the largest site's


@dataclass(frozen=True)
class Growth:
    """One process's RSS from the first sample past a quarter of the rounds to the last."""

    rounds: int  # rounds between the two samples
    start_bytes: int
    end_bytes: int

    @property
    def per_round_bytes(self) -> float:
        return (self.end_bytes - self.start_bytes) / self.rounds if self.rounds else float("nan")

    @property
    def fraction(self) -> float:
        return (self.end_bytes - self.start_bytes) / self.start_bytes


def growth(samples: list[Sample], total_rounds: int, rss: str) -> Growth:
    """The growth of ``rss`` (a Sample field) over the run's last three quarters."""
    start = next((s for s in samples if s.rounds >= total_rounds // 4), samples[-1])
    end = samples[-1]
    first, last = getattr(start, rss), getattr(end, rss)
    return Growth(end.rounds - start.rounds, first, last)


@dataclass
class Reader:
    """An operator reading the whole run (every page, then its summary) every ``every_s``,
    through the site port's admin service: the daemon's own reads and caches."""

    every_s: float
    reads: int = 0
    error: str = ""

    def run(self, cluster: LocalCluster, run_id: str, stop: threading.Event) -> None:
        try:
            with cluster.admin() as admin:
                while not stop.wait(self.every_s):
                    admin.status(run_id)
                    done = admin.status(run_id, summary=True).state in TERMINAL
                    self.reads += 1
                    if done:
                        return
        except Exception as exc:  # reported: growth without the reads would mislead
            self.error = f"{type(exc).__name__}: {exc}"


def run(args: argparse.Namespace, root: Path) -> list[Sample]:
    env = {"OMP_NUM_THREADS": "1"}
    with LocalCluster(root, env=env, secure=False) as cluster:
        cluster.start_coordinator(timeout_s=120.0, flags=["--stream-window-mb", "0.25"])
        assert cluster.coordinator is not None
        daemon = cluster.coordinator.pid
        ids = [f"site-{i}" for i in range(args.sites)]
        for i, site_id in enumerate(ids):
            data = {"shift": 0.5 * i / args.sites, "seed": i, "samples": 128}
            cluster.start_site(site_id, [SYNTHETIC], data, threads=1)
        cluster.wait_for_sites(ids, timeout_s=60.0 + 20.0 * args.sites)
        sites = [proc.pid for proc in cluster.sites.values()]
        stop = threading.Event()
        samples: list[Sample] = []
        started = time.monotonic()
        with cluster.admin() as admin:
            run_id = admin.submit(make_spec(args.sites, args.params, args.rounds))
            operator = Reader(args.status_s)
            reader = threading.Thread(
                target=operator.run, args=(cluster, run_id, stop), daemon=True
            )
            reader.start()
            try:
                while True:
                    status = admin.status(run_id, summary=True)
                    sample = Sample(
                        at_s=time.monotonic() - started,
                        rounds=status.rounds_completed,
                        daemon_rss=proc_status_bytes(daemon, "VmRSS"),
                        site_rss=max(proc_status_bytes(p, "VmRSS") for p in sites),
                    )
                    samples.append(sample)
                    print(
                        f"{sample.at_s:7.1f} s  round {sample.rounds:6d}  "
                        f"daemon {sample.daemon_rss / MB:7.1f} MB  "
                        f"site {sample.site_rss / MB:7.1f} MB",
                        flush=True,
                    )
                    if status.state in TERMINAL:
                        if status.state != "completed":
                            raise ClusterError(f"run {run_id} {status.state}: {status.reason}")
                        break
                    if time.monotonic() - started > args.timeout_s:
                        raise ClusterError(f"run {run_id} not done within {args.timeout_s:g} s")
                    time.sleep(args.sample_s)  # a sampling interval, not a readiness wait
            finally:
                stop.set()
                reader.join(timeout=60.0)
    if operator.error or not operator.reads:
        raise ClusterError(f"the status reads failed: {operator.error or 'none was made'}")
    print(f"the whole status read {operator.reads} times while the run ran")
    return samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--status-s", type=float, default=5.0, help="between status reads")
    parser.add_argument("--sample-s", type=float, default=10.0, help="between RSS samples")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.sites < 1 or args.params < 1 or args.rounds < 8:
        parser.error("--sites and --params must be >= 1, --rounds >= 8")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedra-long-run-") as tmp:
        samples = run(args, Path(tmp))
    print(f"\n{args.sites} sites, {args.params:,} parameters, {args.rounds} rounds:")
    figures: dict[str, object] = {"args": vars(args) | {"json": None}, "samples": []}
    for name, field in (("daemon", "daemon_rss"), ("largest site", "site_rss")):
        g = growth(samples, args.rounds, field)
        print(
            f"  {name}: {g.start_bytes / MB:.1f} MB -> {g.end_bytes / MB:.1f} MB over "
            f"{g.rounds} rounds: {g.per_round_bytes / 1e3:+.2f} kB a round "
            f"({g.fraction:+.1%} of its RSS)"
        )
        figures[field] = asdict(g) | {"per_round_bytes": g.per_round_bytes}
    figures["samples"] = [asdict(s) for s in samples]
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
