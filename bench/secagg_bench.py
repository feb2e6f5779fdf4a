"""Secure aggregation's cost: SecAgg+ rounds against plain FedAvg rounds of the same run.

For each N in ``--sites`` it starts one coordinator and N synthetic sites as real processes
(``LocalCluster``, mTLS unless ``--plaintext``), then submits the same spec twice, one run
after the other on the same processes: plain FedAvg, then with a ``[secagg]`` table (SecAgg+;
``--degree`` 0 is the complete graph, classic SecAgg). Every round samples all N sites; the
model is the synthetic task's linear layer plus a ``--params``-float block, trained one local
step, so a round is the protocol and the transfers, not the training. From the coordinator's
RoundStatus of rounds 1..R (round 0, the initial model, is left out) it reads:

* the median and the mean round time (``duration_s``) of each run and the ratios secagg /
  plain, each round's time on the progress lines, and any round over 5x its run's fastest
  round plus 1 s as a stall. Read both: the median is the steady-state cost, the mean is what
  a run pays once occasional stalls are counted;
* bytes up and down per site per round (from the participations) and their ratios. These
  count the model transfers only: secagg's key, share and reveal messages are not in
  RoundStatus, so their payload sizes are taken from the in-process table below;
* the per-stage medians of the round ledger (``stages``). In a secagg round the key exchange
  happens between a site taking its task and its download, and the site's ``download_s``
  (hence ``distribute_s``) is measured from the task, so it includes the key exchange;
  masking happens after ``compute_s`` and before the upload, and waiting for the survivors'
  reveals, after the last upload: neither has a stage of its own, so they fall in ``rest``
  (round_s minus the other stages; rough, since those are the slowest site's and overlap);
  ``checkpoint_s`` starts before the mean update is formed, so it holds ``finish``
  (unmasking the sum) in a secagg round;
* CPU seconds per round of the coordinator and of all sites together (from /proc, over each
  whole run, round 0 included).

A second table, in one process with no transport, times the protocol library itself
(``fedra.secagg``) at each N for an update of the same length: a site's setup (keys,
shares out, shares in), its masking, the coordinator's fold of one masked vector, and the
coordinator's unmasking (``ServerSecAgg.finish``), and counts a site's control-message
payload bytes (the secagg messages RoundStatus does not count; no gRPC/protobuf framing).

    .venv/bin/python bench/secagg_bench.py [--sites 5 20] [--degree 6] [--json out.json]

Read the ratios, not the absolute times: on a machine with few cores (2 here) the N site
processes and the coordinator share them, so a round's time is dominated by CPU contention
and grows with N for plain FedAvg too. Children run with OMP_NUM_THREADS=1 and one torch
thread each. kB is 10**3 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from round_bench import wait_finished  # bench/ is the script's own folder on sys.path

from fedra.local import ClusterError, LocalCluster
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec, SecAggSpec, TrainSpec
from fedra.secagg import ServerSecAgg, SiteSecAgg, plan_round, quant_bits

SYNTHETIC = "fedra.examples.synthetic:task"
LINEAR_PARAMS = 9  # the synthetic task's nn.Linear(8, 1): weight and bias
KB = 1e3
# A round over STALL_X times its run's fastest round plus STALL_PLUS_S is reported as a stall.
STALL_X = 5.0
STALL_PLUS_S = 1.0
STAGES = ("distribute_s", "compute_s", "transfer_s", "aggregate_s", "checkpoint_s")


@dataclass(frozen=True)
class RoundSample:
    """One committed training round, as the coordinator recorded it."""

    number: int
    duration_s: float
    site_bytes_up: list[int]  # per accepted participation
    site_bytes_down: list[int]
    stages: dict[str, float]


@dataclass
class RunResult:
    """One run (plain or secagg) on one cluster; the medians are over rounds 1..R."""

    mode: str
    run_id: str
    rounds: list[RoundSample]
    run_wall_s: float  # submit to completion, round 0 included
    coordinator_cpu_s: float  # over the whole run, round 0 included
    sites_cpu_s: float
    median_round_s: float = field(init=False)
    mean_round_s: float = field(init=False)
    max_round_s: float = field(init=False)
    bytes_up_per_site: float = field(init=False)
    bytes_down_per_site: float = field(init=False)
    stage_medians: dict[str, float] = field(init=False)
    stalled_rounds: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.median_round_s = statistics.median(r.duration_s for r in self.rounds)
        self.mean_round_s = statistics.mean(r.duration_s for r in self.rounds)
        self.max_round_s = max(r.duration_s for r in self.rounds)
        self.bytes_up_per_site = statistics.median(b for r in self.rounds for b in r.site_bytes_up)
        self.bytes_down_per_site = statistics.median(
            b for r in self.rounds for b in r.site_bytes_down
        )
        self.stage_medians = {
            key: statistics.median(r.stages.get(key, 0.0) for r in self.rounds)
            for key in (*STAGES, "round_s", "rest_s")
        }
        # Against the fastest round, not the median: a stall in most rounds moves the median.
        fastest = min(r.duration_s for r in self.rounds)
        self.stalled_rounds = [
            r.number for r in self.rounds if r.duration_s > STALL_X * fastest + STALL_PLUS_S
        ]

    def cpu_per_round(self) -> tuple[float, float]:
        n = len(self.rounds) + 1  # round 0 is in the CPU totals
        return self.coordinator_cpu_s / n, self.sites_cpu_s / n


@dataclass
class ConfigResult:
    """Plain and secagg runs for one N, and their ratios (secagg / plain)."""

    sites: int
    params: int
    degree: int
    plain: RunResult
    secagg: RunResult
    wall_s: float  # cluster start-up, both runs, shutdown
    startup_s: float  # coordinator and all sites online
    ratios: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        p, s = self.plain, self.secagg
        self.ratios = {
            "round_time": s.median_round_s / p.median_round_s,
            "round_time_mean": s.mean_round_s / p.mean_round_s,
            "bytes_up": s.bytes_up_per_site / p.bytes_up_per_site,
            "bytes_down": s.bytes_down_per_site / p.bytes_down_per_site,
            "coordinator_cpu": s.coordinator_cpu_s / p.coordinator_cpu_s,
            "sites_cpu": s.sites_cpu_s / p.sites_cpu_s,
        }


@dataclass(frozen=True)
class MicroResult:
    """The protocol library in one process, one round, no dropouts; medians of repeats."""

    sites: int
    length: int
    degree: int
    neighbours: int  # per site
    threshold: int
    repeats: int
    site_setup_s: float  # keys, share_keys, receive_shares: one site
    site_mask_s: float  # quantise + self mask + one pairwise mask per neighbour: one site
    site_reveal_s: float
    server_fold_s: float  # add_masked of one site's vector
    server_finish_s: float  # rebuild the self-mask seeds, strip the masks, dequantise
    control_up_bytes: int  # one site's payloads: public keys, sealed shares, revealed shares
    control_down_bytes: int  # neighbours' keys, the inbox of sealed shares


def proc_cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_spec(args: argparse.Namespace, sites: int, secure: bool) -> RunSpec:
    secagg = None
    if secure:
        # A clip this large clamps nothing: the run's updates are far below it.
        secagg = SecAggSpec(
            degree=args.degree,
            clip=args.clip,
            setup_timeout_s=args.stage_timeout_s,
            unmask_timeout_s=args.stage_timeout_s,
        )
    return RunSpec(
        task=SYNTHETIC,
        rounds=args.rounds,
        name=f"secagg-bench-n{sites}-{'secagg' if secure else 'plain'}",
        sites_per_round=sites,
        min_sites=sites,
        round_deadline_s=args.round_deadline_s,
        join_timeout_s=args.round_deadline_s,
        max_round_attempts=1,  # a failed attempt is a failed measurement, not a retry
        seed=0,
        train=TrainSpec(
            local_steps=1,
            batch_size=16,
            learning_rate=0.05,
            params={"extra_params": str(args.params)},
        ),
        strategy="fedavg",
        secagg=secagg,
    ).validate()


def round_sample(r: admin_pb2.RoundStatus) -> RoundSample:
    parts = [p for p in r.participations if p.attempt == r.attempt and p.status == "accepted"]
    stages = dict(r.stages)
    stages["rest_s"] = stages.get("round_s", r.duration_s) - sum(stages.get(k, 0.0) for k in STAGES)
    return RoundSample(
        number=r.number,
        duration_s=r.duration_s,
        site_bytes_up=[p.bytes_up for p in parts],
        site_bytes_down=[p.bytes_down for p in parts],
        stages=stages,
    )


def measure_run(
    cluster: LocalCluster, spec: RunSpec, mode: str, timeout_s: float, sites: int
) -> RunResult:
    assert cluster.coordinator is not None
    pid = cluster.coordinator.pid
    site_pids = [proc.pid for proc in cluster.sites.values()]
    cpu_before = proc_cpu_s(pid), sum(map(proc_cpu_s, site_pids))
    submitted = time.monotonic()
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
    status = wait_finished(cluster, run_id, timeout_s)
    run_wall_s = time.monotonic() - submitted
    cpu_after = proc_cpu_s(pid), sum(map(proc_cpu_s, site_pids))
    if status.state != "completed":
        raise ClusterError(
            f"{mode} run {run_id} {status.state}: {status.reason}\n{cluster.coordinator.log_tail()}"
        )
    samples = [round_sample(r) for r in status.rounds if r.number >= 1]
    for s in samples:
        if len(s.site_bytes_up) != sites:
            raise ClusterError(
                f"{mode} run {run_id} round {s.number}: {len(s.site_bytes_up)} of {sites} "
                "updates accepted"
            )
    return RunResult(
        mode=mode,
        run_id=run_id,
        rounds=samples,
        run_wall_s=run_wall_s,
        coordinator_cpu_s=cpu_after[0] - cpu_before[0],
        sites_cpu_s=cpu_after[1] - cpu_before[1],
    )


def run_config(args: argparse.Namespace, sites: int, state_dir: Path) -> ConfigResult:
    """One coordinator and ``sites`` sites; a plain run, then the same run with [secagg]."""
    started = time.monotonic()
    with LocalCluster(state_dir, env={"OMP_NUM_THREADS": "1"}, secure=not args.plaintext) as c:
        c.start_coordinator(timeout_s=120.0)
        ids = [f"site-{i}" for i in range(sites)]
        for i, site_id in enumerate(ids):
            data = {"shift": 0.25 * i / max(1, sites - 1), "seed": i, "samples": 128}
            c.start_site(site_id, [SYNTHETIC], data, threads=1)
        c.wait_for_sites(ids, timeout_s=60.0 + 15.0 * sites)
        startup_s = time.monotonic() - started
        print(f"N={sites}: coordinator and {sites} sites online in {startup_s:.0f} s", flush=True)
        runs: dict[str, RunResult] = {}
        for mode in ("plain", "secagg"):
            spec = make_spec(args, sites, secure=mode == "secagg")
            runs[mode] = r = measure_run(c, spec, mode, args.run_timeout_s, sites)
            print(
                f"N={sites} {mode}: median round {r.median_round_s:.3f} s, rounds "
                f"{' '.join(f'{x.duration_s:.3f}' for x in r.rounds)} s, run "
                f"{r.run_wall_s:.1f} s (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    return ConfigResult(
        sites=sites,
        params=args.params,
        degree=args.degree,
        plain=runs["plain"],
        secagg=runs["secagg"],
        wall_s=time.monotonic() - started,
        startup_s=startup_s,
    )


# -- the protocol library in one process ------------------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def micro_round(sites: int, length: int, degree: int, clip: float) -> dict[str, float]:
    """One SecAgg+ round over ``sites`` in-process sites: per-site medians and server times."""
    names = [f"site-{i}" for i in range(sites)]
    plan = plan_round(names, degree=degree, threshold=0.5, seed=os.urandom(32))
    context = b"secagg-bench|" + os.urandom(8)
    bits = quant_bits(sites)
    server = ServerSecAgg(plan, context, length, clip=clip, bits=bits)
    gen = torch.Generator().manual_seed(sites)
    setup: dict[str, float] = {}
    up: dict[str, int] = {}
    down: dict[str, int] = {}
    maskers: dict[str, SiteSecAgg] = {}
    for s in names:
        started = time.perf_counter()
        maskers[s] = m = SiteSecAgg(s, plan.threshold, context)
        keys = m.public_keys()
        setup[s] = time.perf_counter() - started
        server.advertise(s, keys)
        up[s] = len(keys)
    server.close_advertise()
    for s in names:
        keys_in = server.neighbour_keys(s)
        started = time.perf_counter()
        sealed = maskers[s].share_keys(keys_in)
        setup[s] += time.perf_counter() - started
        server.post_shares(s, sealed)
        down[s] = sum(map(len, keys_in.values()))
        up[s] += sum(map(len, sealed.values()))
    server.close_shares()
    mask_s: list[float] = []
    fold_s: list[float] = []
    for s in names:
        inbox = server.inbox(s)
        setup[s] += _timed(lambda: maskers[s].receive_shares(inbox))  # noqa: B023
        down[s] += sum(map(len, inbox.values()))
        update = torch.randn(length, generator=gen) * 0.01
        started = time.perf_counter()
        masked = maskers[s].mask(update, clip=clip, bits=bits)
        mask_s.append(time.perf_counter() - started)
        fold_s.append(_timed(lambda: server.add_masked(s, [(0, masked)])))  # noqa: B023
    server.close_masked()
    reveal_s: list[float] = []
    for s in names:
        survivors, dropped = server.unmask_request(s)
        started = time.perf_counter()
        revealed = maskers[s].reveal(survivors, dropped)
        reveal_s.append(time.perf_counter() - started)
        server.post_reveal(s, revealed)
        up[s] += sum(map(len, revealed.values()))
    finish_s = _timed(server.finish)
    return {
        "neighbours": float(len(plan.neighbours[names[0]])),
        "threshold": float(plan.threshold),
        "site_setup_s": statistics.median(setup.values()),
        "site_mask_s": statistics.median(mask_s),
        "site_reveal_s": statistics.median(reveal_s),
        "server_fold_s": statistics.median(fold_s),
        "server_finish_s": finish_s,
        "control_up_bytes": statistics.median(up.values()),
        "control_down_bytes": statistics.median(down.values()),
    }


def run_micro(sites: int, length: int, degree: int, clip: float, repeats: int) -> MicroResult:
    runs = [micro_round(sites, length, degree, clip) for _ in range(repeats)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return MicroResult(
        sites=sites,
        length=length,
        degree=degree,
        neighbours=int(med("neighbours")),
        threshold=int(med("threshold")),
        repeats=repeats,
        site_setup_s=med("site_setup_s"),
        site_mask_s=med("site_mask_s"),
        site_reveal_s=med("site_reveal_s"),
        server_fold_s=med("server_fold_s"),
        server_finish_s=med("server_finish_s"),
        control_up_bytes=int(med("control_up_bytes")),
        control_down_bytes=int(med("control_down_bytes")),
    )


# -- output -----------------------------------------------------------------------------


def _print_table(head: list[str], rows: Iterable[list[str]]) -> None:
    rows = list(rows)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def print_tables(
    args: argparse.Namespace, results: list[ConfigResult], micro: list[MicroResult]
) -> None:
    transport = "plaintext gRPC" if args.plaintext else "mTLS"
    print(
        f"\nSecAgg+ (degree {args.degree or 'complete'}, clip {args.clip:g}) against plain "
        f"FedAvg: {args.params} float32 extra params, all N sites every round, "
        f"{args.rounds} rounds, {transport}, {os.cpu_count()} CPUs. Medians over rounds 1.."
        f"{args.rounds}; x = secagg / plain.\n"
    )
    head = ["N", "round s plain", "round s secagg", "x", "mean s plain", "mean s secagg", "x"]
    head += ["up kB/site plain", "up kB/site secagg", "x", "down kB/site plain"]
    head += ["down kB/site secagg", "x"]
    _print_table(
        head,
        (
            [
                str(r.sites),
                f"{r.plain.median_round_s:.3f}",
                f"{r.secagg.median_round_s:.3f}",
                f"{r.ratios['round_time']:.2f}",
                f"{r.plain.mean_round_s:.3f}",
                f"{r.secagg.mean_round_s:.3f}",
                f"{r.ratios['round_time_mean']:.2f}",
                f"{r.plain.bytes_up_per_site / KB:.1f}",
                f"{r.secagg.bytes_up_per_site / KB:.1f}",
                f"{r.ratios['bytes_up']:.3f}",
                f"{r.plain.bytes_down_per_site / KB:.1f}",
                f"{r.secagg.bytes_down_per_site / KB:.1f}",
                f"{r.ratios['bytes_down']:.3f}",
            ]
            for r in results
        ),
    )
    for r in results:
        for run in (r.plain, r.secagg):
            for x in run.rounds:
                if x.number in run.stalled_rounds:
                    print(
                        f"  stall: N={r.sites} {run.mode} round {x.number} took "
                        f"{x.duration_s:.2f} s, distribute {x.stages.get('distribute_s', 0):.2f} s"
                        f" (the run's fastest round: {min(y.duration_s for y in run.rounds):.3f} s)"
                    )
    print("\nWhere the round goes (stage medians, seconds; rest = round_s - the others):")
    head = ["N", "run", *(k.removesuffix("_s") for k in STAGES), "rest", "round"]
    head += ["coord CPU s/rnd", "sites CPU s/rnd"]
    rows = []
    for r in results:
        for run in (r.plain, r.secagg):
            coord_cpu, sites_cpu = run.cpu_per_round()
            rows.append(
                [str(r.sites), run.mode]
                + [f"{run.stage_medians[k]:.3f}" for k in (*STAGES, "rest_s", "round_s")]
                + [f"{coord_cpu:.2f}", f"{sites_cpu:.2f}"]
            )
    _print_table(head, rows)
    print(
        "  secagg: distribute includes the key exchange; rest holds the masking (after compute)"
        "\n  and the wait for the reveals; checkpoint holds the coordinator's unmasking. rest is"
        "\n  negative where the stages (each the slowest site's) overlap."
    )
    if not micro:
        return
    print(
        f"\nIn-process protocol library (fedra.secagg, no transport), one round, no dropouts, "
        f"update of {micro[0].length} values, median of {micro[0].repeats}; per site except "
        "fold and finish:"
    )
    head = ["N", "neighbours", "t", "setup ms", "mask ms", "reveal ms", "fold ms/site"]
    head += ["finish ms", "ctrl up kB", "ctrl down kB"]
    _print_table(
        head,
        (
            [
                str(m.sites),
                str(m.neighbours),
                str(m.threshold),
                f"{m.site_setup_s * 1e3:.1f}",
                f"{m.site_mask_s * 1e3:.1f}",
                f"{m.site_reveal_s * 1e3:.2f}",
                f"{m.server_fold_s * 1e3:.1f}",
                f"{m.server_finish_s * 1e3:.1f}",
                f"{m.control_up_bytes / KB:.2f}",
                f"{m.control_down_bytes / KB:.2f}",
            ]
            for m in micro
        ),
    )
    print(
        "  ctrl: one site's secagg message payloads (keys, sealed shares, revealed shares),\n"
        "  which RoundStatus bytes do not count; without gRPC and protobuf framing."
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--params", type=int, default=100_000, help="extra float32 params")
    parser.add_argument("--rounds", type=int, default=3, help="training rounds after round 0")
    parser.add_argument("--degree", type=int, default=0, help="SecAgg+ graph (0: complete)")
    parser.add_argument("--clip", type=float, default=64.0, help="secagg per-coordinate clip")
    parser.add_argument("--round-deadline-s", type=float, default=180.0)
    parser.add_argument("--stage-timeout-s", type=float, default=120.0, help="secagg stages")
    parser.add_argument("--run-timeout-s", type=float, default=300.0, help="per run")
    parser.add_argument("--micro-repeats", type=int, default=3, help="0: no in-process table")
    parser.add_argument("--plaintext", action="store_true", help="run without mTLS")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--work-dir", type=Path, help="keep state and logs here (default: temp)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)  # the in-process table, like one site process
    length = args.params + LINEAR_PARAMS
    micro = [
        run_micro(n, length, args.degree, args.clip, args.micro_repeats)
        for n in args.sites
        if args.micro_repeats > 0
    ]
    results: list[ConfigResult] = []
    with tempfile.TemporaryDirectory(prefix="fedra-secagg-bench-") as tmp:
        root = args.work_dir or Path(tmp)
        for sites in args.sites:
            results.append(run_config(args, sites, root / f"n{sites}"))
    print_tables(args, results, micro)
    wall_s = time.monotonic() - started
    print(f"\nwall time {wall_s:.0f} s")
    if args.json:
        doc = {
            "configs": [asdict(r) for r in results],
            "micro": [asdict(m) for m in micro],
            "params": args.params,
            "rounds": args.rounds,
            "degree": args.degree,
            "clip": args.clip,
            "tls": not args.plaintext,
            "cpus": os.cpu_count(),
            "wall_s": wall_s,
            "load_average_before_after": [load_before, os.getloadavg()[0]],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
