"""The round benchmark's smoke run (``bench/round_bench.py`` at ``--quick``'s sizes, two
models): a real coordinator and two sites, and every configuration judged against a
checked ceiling measured beside it, before and after, since this machine's speed drifts
within minutes."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "round_bench.py"


@pytest.mark.timeout(150)
def test_each_configuration_is_judged_against_the_ceiling_measured_beside_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "round.json"
    args = [str(BENCH), "--sites", "2", "--params", "10000", "20000", "--rounds", "2"]
    args += ["--raw-mib", "32", "--raw-repeats", "1", "--json", str(out)]  # --quick's sizes
    done = run_python(*args, env={"OMP_NUM_THREADS": "1"}, timeout_s=140)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    configs, beside = doc["configs"], doc["checked_beside_mixed_bps"]
    assert [c["params"] for c in configs] == [10_000, 20_000], configs
    assert len(beside) == len(configs) + 1 and all(b > 0 for b in beside), beside
    for i, c in enumerate(configs):  # the faster of the one before and the one after
        assert c["checked_bps"] == max(beside[i], beside[i + 1]), (i, c["checked_bps"], beside)
        assert c["fedra_bps"] > 0 and math.isfinite(c["checked_bps"]), c
    assert doc["checked"]["mixed_bps"] == max(beside)  # the context line's: the fastest
    judged = doc["targets"]["checked_fraction"]
    fractions = [c["fedra_bps"] / c["checked_bps"] for c in configs]
    assert list(judged["values"].values()) == [round(f, 3) for f in fractions], judged
    assert judged["met"] == all(f >= 0.9 for f in fractions) and judged["measured"], judged
    assert "at least 0.9 of a checked transfer measured beside it" in done.stdout, done.stdout
    assert done.stdout.count("checked gRPC after N=2") == 2, done.stdout
    # What caps each fraction: its training, fold tail and checkpoint, from each round's
    # ledger; and the pace its transfers would need for 0.9 with nothing else in a round.
    fixed_stages = ("compute_s", "fold_tail_s", "checkpoint_s")
    for c in configs:
        at = [r["bytes_moved"] / c["checked_bps"] for r in c["rounds"]]
        fixed = [sum(r["stages"][s] for s in fixed_stages) for r in c["rounds"]]
        assert all(f > 0 for f in fixed) and c["transfers_s"] > 0, c
        assert c["fixed_s"] == pytest.approx(statistics.median(fixed))
        bounds = [t / (t + f) for t, f in zip(at, fixed, strict=True)]
        assert c["ceiling_bound"] == pytest.approx(statistics.median(bounds))
        pairs = list(zip(at, fixed, strict=True))
        paces = [t / (t / 0.9 - f) if t / 0.9 > f else math.inf for t, f in pairs]
        assert c["needed_pace"] == pytest.approx(statistics.median(paces))
    assert list(judged["bounds"].values()) == [round(c["ceiling_bound"], 3) for c in configs]
    paced = [c["bytes_per_round"] / c["checked_bps"] / c["transfers_s"] for c in configs]
    assert list(judged["pace"].values()) == [round(p, 3) for p in paced]
    assert list(judged["needed_pace"].values()) == [round(c["needed_pace"], 3) for c in configs]
    assert done.stdout.count("durable checkpoint (") == 2, done.stdout
    # What the CPU allows: the CPU of rounds 1..R alone (a trace read at the first round's
    # opening and the last one's commit), over every core, and the fraction that leaves.
    # (At these sizes a process may use less than one of /proc's 10 ms ticks in a run.)
    for c in configs:
        assert 0 < c["steady_wall_s"] <= c["run_wall_s"], c
        for part in ("coordinator", "sites"):  # a span of the run: never more than all of it
            assert 0 <= c[f"steady_{part}_cpu_s"] <= c[f"{part}_cpu_s"] + 1e-9, (part, c)
        assert c["steady_cpu_s"] == c["steady_coordinator_cpu_s"] + c["steady_sites_cpu_s"]
        assert c["cpu_per_round_s"] == pytest.approx(c["steady_cpu_s"] / len(c["rounds"]))
        assert c["cpu_floor_s"] == pytest.approx(c["cpu_per_round_s"] / c["cpus"])
        assert c["steady_cores_busy"] == pytest.approx(c["steady_cpu_s"] / c["steady_wall_s"])
        if c["cpu_floor_s"] > 0:
            bound = c["bytes_per_round"] / c["checked_bps"] / c["cpu_floor_s"]
            assert c["cpu_bound"] == pytest.approx(bound), c
        else:
            assert math.isnan(c["cpu_bound"]), c
    shown = [round(c["cpu_bound"], 3) for c in configs]
    assert list(judged["cpu_bounds"].values()) == pytest.approx(shown, nan_ok=True)
    assert done.stdout.count("with every core busy all the time") == 2, done.stdout
    assert 0 < doc["checked_cpu_s_per_byte"] < 1e-6, doc["checked_cpu_s_per_byte"]
    assert done.stdout.count("the checked stream's") == 2, done.stdout
