"""What one refresh of the status page's run view costs the coordinator, against reading
every participation as the page did before (``--sites``, ``--rounds``).

A run of N sites and R rounds, the last one open, is written to a SQLite file through
the store (every site sampled every round: accepted, with its measures, some failed and
declined), and the real engine opens it (its rounds are not driven). One refresh
(``StatusPages.run``: the rounds as a summary, the table of sites counted by the
database, both kept for the rounds that can change no more) is timed against the page's
former way, pages of every participation counted in Python, in the same process; both
in CPU time, the fastest of a few (the first fills the caches, as a page left open has
them).

    OMP_NUM_THREADS=1 .venv/bin/python bench/status_page_cost.py --sites 5000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from fedra.coordinator.ledger import DECLINED
from fedra.coordinator.server import CoordinatorConfig, build_engine
from fedra.coordinator.status import FinalRounds, run_page
from fedra.coordinator.web import StatusPages
from fedra.runspec import RunSpec
from fedra.storage.records import CheckpointRecord
from fedra.storage.store import Store

TASK = "fedra.examples.synthetic:task"
T0 = 1_700_000_000.0


def fill(url: str, sites: int, rounds: int, seed: int = 0) -> str:
    """A run of ``rounds`` rounds over ``sites`` sites, the last one still open (its
    updates in): what a page left open on a running run reads again at each refresh."""
    rng = random.Random(seed)
    store = Store(url)
    spec = RunSpec(name="page", task=TASK, rounds=rounds, sites_per_round=sites, min_sites=1)
    run_id = "bench-page"
    store.create_run(run_id, "page", TASK, spec.validate().to_json(), T0)
    names = [f"site-{i:05d}" for i in range(sites)]
    now = T0
    for number in range(rounds + 1):  # round 0: the initial model, one site's
        assignment = {s: f"t-{number}-{s}" for s in (names if number else names[:1])}
        store.open_round(run_id, number, 1, assignment, now, now + 600.0)
        for task in assignment.values():
            store.mark_downloaded(task, 4_000, rng.random() * 0.01)
            what = rng.random()
            if what < 0.02:
                store.fail_participation(task, "the update was refused: not finite", now)
            elif what < 0.04:
                store.fail_participation(task, DECLINED + "not on weekends", now)
            else:
                store.accept_update(
                    task, nonce=rng.randbytes(16), sha256=f"{rng.getrandbits(256):064x}",
                    num_samples=32, metrics={"compute_s": rng.random(), "loss": rng.random()},
                    bytes_up=4_000, upload_s=rng.random() * 0.01, now=now + rng.random(),
                )  # fmt: skip
        now += 10.0
        if number < rounds:
            ckpt = CheckpointRecord(run_id, number, f"{number:064x}", 1, None, now)
            store.commit_round(run_id, number, ckpt, {"loss": rng.random()}, now)
        now += 1.0
    store.set_run_state(run_id, "running", "", now)
    store.close()
    return run_id


def rows_way(pages: StatusPages, kept: FinalRounds, run_id: str) -> int:
    """The page's former way: pages of every participation, counted in Python."""
    engine, first, counted = pages.engine, 0, 0
    sites: dict[str, dict[str, Any]] = {}
    while True:
        page = run_page(engine, run_id, pages.insecure, first, kept=kept)
        for r in page.rounds:
            for p in r.participations:
                row = sites.setdefault(p.site_id, {"rounds": 0, "bytes": 0, "busy_s": 0.0})
                row["rounds"] += 1
                row["bytes"] += p.bytes_down + p.bytes_up + p.bytes_cut
                row["busy_s"] += p.metrics.get("compute_s", 0.0) + p.download_s + p.upload_s
                counted += 1
        if not page.more_rounds_follow or not page.rounds:
            return counted
        first = page.rounds[-1].number + 1


def cpu(fn: Any, times: int) -> float:
    """CPU seconds of the fastest of ``times`` calls (the first fills the caches)."""
    best = float("inf")
    for _ in range(times):
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedra-page-") as tmp:
        config = CoordinatorConfig(state_dir=Path(tmp), insecure=True)
        filled = time.perf_counter()
        run_id = fill(config.database_url, args.sites, args.rounds)
        filled = time.perf_counter() - filled
        engine = build_engine(config)
        try:
            pages = StatusPages(engine, insecure=True)
            view = pages.run(run_id)
            assert len(view["sites"]) == args.sites and len(view["rounds"]) == args.rounds + 1
            now_s = cpu(lambda: pages.run(run_id), args.repeat)
            kept = FinalRounds(max_bytes=256 << 20)
            before_s = cpu(lambda: rows_way(pages, kept, run_id), args.repeat)
        finally:
            engine.stop()
            engine.close()
    figures = {
        "sites": args.sites,
        "rounds": args.rounds,
        "fill_s": round(filled, 1),
        "refresh_cpu_s": now_s,
        "rows_way_cpu_s": before_s,
        "ratio": before_s / now_s if now_s else None,
    }
    print(
        f"N={args.sites} sites, {args.rounds} rounds: one refresh of the run view "
        f"{1000 * now_s:.1f} ms of CPU; every participation's row counted in Python "
        f"{1000 * before_s:.1f} ms ({figures['ratio']:.1f}x)"
    )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
