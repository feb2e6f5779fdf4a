"""Coordinator CPU, flat against two-level: sites per second of a coordinator's CPU.

One run of the synthetic task (FedAvg, every site every round) on a flat federation
(one coordinator, N sites) and on a two-level one (an upstream, R regions, N / R sites
under each), the same sites and seeds, each coordinator a real process (``LocalCluster``,
mutual TLS, ``--admin-port none``). Each coordinator's CPU (/proc utime + stime) is read
just before the run is submitted and once it is seen finished. It prints:

- flat: coordinator CPU per site-round, and site-rounds per CPU-second;
- two-level: the upstream's CPU per region-round, each region's per site-round;
- the projected limit of each: sites one coordinator serves at one CPU-second per second
  of round time, against what R_max regions x S_max sites a region serve;
- the largest difference between the two final models (they must agree).

    OMP_NUM_THREADS=1 .venv/bin/python bench/region_bench.py --sites 4 --regions 2 --rounds 5

Small N on purpose: every site is a process of its own here; the per-site costs it
measures are what ``bench/scale_bench.py`` measures at scale on the flat coordinator.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from fedra.local import LocalCluster
from fedra.runspec import RunSpec, TrainSpec

SYNTHETIC = "fedra.examples.synthetic:task"
FLAGS = ["--heartbeat-s", "0.5", "--site-timeout-s", "30", "--poll-timeout-s", "5",
         "--admin-port", "none"]  # fmt: skip
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def spec(rounds: int, sites: int) -> RunSpec:
    return RunSpec(
        task=SYNTHETIC, rounds=rounds, sites_per_round=sites, round_deadline_s=120.0,
        join_timeout_s=60.0, seed=3, strategy="fedavg",
        train=TrainSpec(local_steps=4, batch_size=16, learning_rate=0.05),
    ).validate()  # fmt: skip


def data(i: int) -> dict[str, object]:
    # Inputs centred at 0, 0.5 and 1: training stays stable whatever N (a diverging run
    # would make the two models' comparison meaningless).
    return {"shift": 0.5 * (i % 3), "seed": i, "samples": 64 * (1 + i % 4)}


def run(top: LocalCluster, rounds: int, n: int, pids: list[int]) -> tuple[list[float], dict]:
    """Submit to ``top``; the CPU each of ``pids`` spent, and the final model."""
    before = [cpu_s(p) for p in pids]
    with top.admin() as admin:
        run_id = admin.submit(spec(rounds, n))
        status = next(s for s in admin.watch(run_id, timeout_s=600)
                      if s.state in ("completed", "failed", "cancelled"))  # fmt: skip
        if status.state != "completed":
            raise SystemExit(f"the run {status.state}: {status.reason}")
        model = admin.export_model(run_id)
    return [cpu_s(p) - b for p, b in zip(pids, before, strict=True)], model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, r, rounds = args.sites, args.regions, args.rounds
    if n % r:
        raise SystemExit("--sites must be a multiple of --regions")
    ids = [f"site-{i}" for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="fedra-region-bench-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        flat = stack.enter_context(LocalCluster(root / "flat"))
        flat.start_coordinator(flags=FLAGS)
        for i, site_id in enumerate(ids):
            flat.start_site(site_id, [SYNTHETIC], data(i))
        flat.wait_for_sites(ids)
        assert flat.coordinator is not None
        started = time.monotonic()
        (flat_cpu,), flat_model = run(flat, rounds, n, [flat.coordinator.pid])
        flat_s = time.monotonic() - started
        stack.close()  # the flat federation's processes go before the next one's start

        upstream = stack.enter_context(LocalCluster(root / "upstream"))
        upstream.start_coordinator(flags=FLAGS)
        regions = []
        per = n // r
        for k in range(r):
            region = stack.enter_context(LocalCluster(root / f"region-{k}"))
            region.start_coordinator(flags=[
                *FLAGS, "--upstream", upstream.address, "--region-id", f"region-{k}",
                "--region-task", SYNTHETIC,
                "--upstream-tls-dir", str(upstream.site_tls_folder(f"region-{k}")),
            ])  # fmt: skip
            mine = ids[k * per : (k + 1) * per]
            for site_id in mine:
                region.start_site(site_id, [SYNTHETIC], data(int(site_id.split("-")[1])))
            region.wait_for_sites(mine)
            regions.append(region)
        upstream.wait_for_sites([f"region-{k}" for k in range(r)])
        pids = [c.coordinator.pid for c in (upstream, *regions) if c.coordinator is not None]
        started = time.monotonic()
        (up_cpu, *region_cpu), two_model = run(upstream, rounds, r, pids)
        two_s = time.monotonic() - started
    diff = max(
        float((flat_model[k] - two_model[k]).abs().max() / flat_model[k].abs().max().clamp(min=1))
        for k in flat_model
    )
    site_rounds = n * (rounds + 1)  # round 0 included: one site builds the model
    flat_ms = 1e3 * flat_cpu / site_rounds
    up_ms = 1e3 * up_cpu / (r * (rounds + 1))
    reg_ms = 1e3 * sum(region_cpu) / (n * rounds)
    flat_limit = 1e3 / flat_ms
    up_limit, reg_limit = 1e3 / up_ms, 1e3 / reg_ms
    print(
        f"flat, {n} sites x {rounds} rounds: {flat_s:.1f} s; coordinator CPU {flat_cpu:.2f} s,"
        f" {flat_ms:.1f} ms a site-round, {flat_limit:.0f} site-rounds per CPU-second"
    )
    print(
        f"two-level, {r} regions x {per} sites: {two_s:.1f} s; upstream CPU {up_cpu:.2f} s, "
        f"{up_ms:.1f} ms a region-round; regions' CPU {sum(region_cpu):.2f} s, {reg_ms:.1f} ms "
        "a site-round (a regional run a round included)"
    )
    print(
        f"projected, at one CPU-second per second of round: flat {flat_limit:.0f} sites a "
        f"coordinator; two-level {up_limit:.0f} regions x {reg_limit:.0f} sites = "
        f"{up_limit * reg_limit:.0f} sites ({up_limit * reg_limit / flat_limit:.0f}x flat)"
    )
    print(
        f"final models: largest difference {diff:.2e}, relative to the largest weight "
        "(flat against two-level)"
    )
    if not torch.isfinite(torch.tensor(diff)) or diff > 1e-4:
        raise SystemExit("the two federations' models disagree")


if __name__ == "__main__":
    main()
