"""The long-run memory benchmark's smoke run (``bench/long_run.py`` with a few rounds): a
real coordinator and two sites, status read while they run, and its growth figures
worked out from its own samples."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_python

BENCH = Path(__file__).resolve().parents[1] / "bench" / "long_run.py"
sys.path.insert(0, str(BENCH.parent))

from long_run import Sample, growth  # noqa: E402


def test_growth_spans_the_last_three_quarters_of_the_rounds() -> None:
    samples = [Sample(float(i), r, 100 + r, 50) for i, r in enumerate([0, 10, 30, 60, 100])]
    g = growth(samples, 100, "daemon_rss")
    assert (g.rounds, g.start_bytes, g.end_bytes) == (70, 130, 200)  # from round 30 on
    assert g.per_round_bytes == 1.0 and g.fraction == pytest.approx(70 / 130)
    flat = growth(samples, 100, "site_rss")
    assert flat.per_round_bytes == 0.0 and flat.fraction == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_short_run_samples_every_process_until_the_end(tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    args = [str(BENCH), "--rounds", "12", "--params", "1000", "--sample-s", "0.5"]
    args += ["--status-s", "0.2", "--json", str(out)]
    done = run_python(*args, env={"OMP_NUM_THREADS": "1"}, timeout_s=140)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    samples = doc["samples"]
    assert samples[-1]["rounds"] == 12, samples  # sampled once the run had completed
    rounds = [s["rounds"] for s in samples]
    assert rounds == sorted(rounds), rounds
    assert all(s["daemon_rss"] > 10_000_000 and s["site_rss"] > 10_000_000 for s in samples)
    daemon = doc["daemon_rss"]
    assert daemon["end_bytes"] == samples[-1]["daemon_rss"]
    start = next(s for s in samples if s["rounds"] >= 3)
    assert daemon["start_bytes"] == start["daemon_rss"]
    assert daemon["rounds"] == 12 - start["rounds"]
    assert "kB a round" in done.stdout and "daemon:" in done.stdout, done.stdout
    assert "the whole status read" in done.stdout, done.stdout
