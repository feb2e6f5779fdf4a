"""The scale benchmark's smoke run (``bench/scale_bench.py`` at N = 8): a real coordinator
and real site agents in two worker processes must report every figure, with every round
committed on its first attempt. The real runs are ``python bench/scale_bench.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "scale_bench.py"
SITES, ROUNDS = 8, 2
SITE_CPU = min(os.sched_getaffinity(0))  # the workers are pinned to it


def _bench(tmp_path: Path) -> tuple[dict[str, Any], str]:
    out = tmp_path / "scale.json"
    args = [str(BENCH), "--sites", str(SITES), "--rounds", str(ROUNDS)]
    args += ["--procs", "2", "--timeout-s", "75", "--out", str(out)]
    args += ["--site-cpus", str(SITE_CPU), "--site-turns", "1"]  # a worker's sites one by one
    (tmp_path / "tmp").mkdir()
    env = {"TMPDIR": str(tmp_path / "tmp")}  # its temporary directories
    done = run_python(*args, env=env, timeout_s=100)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["sites_run"] == {"nice": 19, "cpus": str(SITE_CPU), "transport": "aio"}, doc
    (result,) = doc["results"]
    return result, done.stdout


@pytest.mark.timeout(110)
def test_scale_bench_reports_every_figure(tmp_path: Path) -> None:
    r, printed = _bench(tmp_path)
    assert "failure" not in r, r
    assert r["online_seen"] == SITES and r["register_s"] >= 0, r
    run = r["run"]
    assert run["state"] == "completed" and run["finished_in_time"], run
    assert run["committed"] == run["first_attempt"] == ROUNDS, run
    training = [x for x in run["rounds"] if x["number"] >= 1]
    assert [x["status"] for x in training] == ["committed"] * ROUNDS, training
    assert all(x["updates"] == SITES for x in training), training
    assert 0 < run["round_s_median"] <= run["round_s_max"], run
    assert run["cpu_ms_per_site_round"] > 0, run
    assert 0 <= r["coordinator_gc_s"] <= run["coordinator_cpu_s"], r
    assert "the coordinator's garbage collections:" in printed, printed
    assert r["sites_cpu_s"] > 0 and r["sites_cpu_ms_per_site_attempt"] > 0, r
    assert "the emulated sites (the workers):" in printed, printed
    for sample in (r["idle"], r["connected"], run["peak"]):
        assert sample["rss_kb"] > 0 and sample["threads"] > 0, sample
    assert isinstance(r["rss_growth_kb_per_site"], float), r
    for name in ("ListSites", "GetRun"):
        admin = run["admin"][name]
        assert admin["calls"] >= 1 and 0 < admin["p50_ms"] <= admin["p99_ms"], admin
    assert run["admin_errors"] == {}, run
    wake = run["wake"]  # the machine's floor under those calls, from a process of its own
    assert wake["wakes"] > 0 and 0 <= wake["p50_ms"] <= wake["p99_ms"] <= wake["max_ms"], wake
    assert "an idle process at the coordinator's priority woke late by" in printed, printed
    assert run["status_probe"] == "summary", run
    sites = r["site_calls"]
    assert sites["errors_by_code"] == {} and sites["agents_crashed"] == {}, sites
    assert sites["calls"]["register OK"] == SITES, sites
    calls = sites["calls"]
    with_task = calls.get("upload+next-task OK", 0)
    assert calls.get("upload OK", 0) + with_task >= SITES * ROUNDS, sites  # and round 0's model
    # Each update is held as its site's next poll: from round 2 on, every site's task
    # comes back with its update before (a site's first task is its only poll's).
    assert with_task >= SITES * (ROUNDS - 1) and calls["poll OK"] <= 2 * SITES, sites
    assert sites["rounds_done"] >= SITES * ROUNDS and sites["workers_missing_figures"] == 0
    assert [a["aim"] for a in r["aims"]] == ["first_attempt", "cpu", "admin_p99", "rss"]
    assert all(a["value"] is not None for a in r["aims"]), r["aims"]
    assert printed.count("aim: ") == 4, printed
    assert list((tmp_path / "tmp").iterdir()) == []  # removed
    assert len(r["pids"]) == 3  # the coordinator and two workers: all gone
    for pid in [*r["pids"], wake["pid"]]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(110)
def test_scale_bench_runs_the_sites_under_regions(tmp_path: Path) -> None:
    """--regions 2: an upstream, two regional coordinators, the sites spread over them;
    the upstream's rounds commit, and the regions' CPU and the projection are reported."""
    out = tmp_path / "scale.json"
    args = [str(BENCH), "--sites", str(SITES), "--rounds", "1", "--regions", "2"]
    args += ["--procs", "2", "--timeout-s", "75", "--out", str(out), "--admin-hz", "1"]
    (tmp_path / "tmp").mkdir()
    done = run_python(*args, env={"TMPDIR": str(tmp_path / "tmp")}, timeout_s=100)
    assert done.returncode == 0, done.stdout + done.stderr
    (r,) = json.loads(out.read_text())["results"]
    assert r["regions"] == 2 and "failure" not in r, r
    assert r["online_seen"] == SITES, r  # each region's half of them
    run = r["run"]
    assert run["state"] == "completed" and run["committed"] == run["first_attempt"] == 1, run
    training = [x for x in run["rounds"] if x["number"] >= 1]
    assert [x["updates"] for x in training] == [2], training  # one update a region
    assert run["cpu_ms_per_site_round"] > 0 and run["regions_cpu_ms_per_site_round"] > 0, run
    expected = (1000 / run["cpu_ms_per_site_round"]) * (1000 / run["regions_cpu_ms_per_site_round"])
    assert run["projected_sites"] == pytest.approx(expected), run
    assert "in 2 regions under one upstream" in done.stdout, done.stdout
    assert r["site_calls"]["calls"]["register OK"] == SITES, r["site_calls"]
    assert len(r["pids"]) == 5  # the upstream, two regions, two workers: all gone
    for pid in [*r["pids"], run["wake"]["pid"]]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("regions", "needle"), [("x", "not a list"), ("-1", "0 (flat)"), ("9", "a site")]
)
def test_scale_bench_refuses_bad_region_counts(regions: str, needle: str) -> None:
    done = run_python(str(BENCH), "--sites", "8", "--regions", regions, timeout_s=60)
    assert done.returncode == 2 and needle in done.stderr, done.stderr


def test_scale_bench_refuses_negative_site_turns() -> None:
    done = run_python(str(BENCH), "--site-turns", "-1", timeout_s=60)
    assert done.returncode == 2 and "--site-turns" in done.stderr, done.stderr


@pytest.mark.parametrize("cpus", ["one", "1-x", "3-1", "99999"])
def test_scale_bench_refuses_a_bad_cpu_list(cpus: str) -> None:
    done = run_python(str(BENCH), "--site-cpus", cpus, timeout_s=60)
    assert done.returncode == 2 and "--site-cpus" in done.stderr, done.stderr


class _Beat:
    """A heartbeat's answer as a worker's tally sees it (a done future)."""

    def __init__(self, error: Exception | None = None, cancelled: bool = False) -> None:
        self.error, self.was_cancelled = error, cancelled

    def cancelled(self) -> bool:
        return self.was_cancelled

    def exception(self) -> Exception | None:
        return self.error

    def add_done_callback(self, callback: Any) -> None:
        callback(self)


def test_the_tally_counts_heartbeats_when_their_answers_come() -> None:
    """Heartbeats go without waiting for their answers: the workers' tally counts each by
    its answer's code when it comes, leaves out those cancelled at the task's end, and
    times the gap between two of a task's."""
    import importlib.util
    import sys

    import grpc

    spec = importlib.util.spec_from_file_location("scale_bench_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)

    class Expired(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    class CutByServer(grpc.RpcError):  # gRPC's core gave up on it: not the caller's doing
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.CANCELLED

        def details(self) -> str:
            return "CANCELLED"

    answers = iter([_Beat(), _Beat(Expired()), _Beat(cancelled=True), _Beat(CutByServer())])

    class Conn:
        def heartbeat_future(self, task_id: str, timeout_s: float = 10.0) -> _Beat:
            return next(answers)

    tally = bench.SiteTally()
    conn = Conn()
    for name in bench.COUNTED_CALLS:  # hook wraps these too
        setattr(conn, name, lambda *a, **k: None)
    tally.hook(conn)
    for _ in range(4):
        conn.heartbeat_future("task-1", 10.0)
    assert tally.calls == {
        "heartbeat OK": 1,
        "heartbeat DEADLINE_EXCEEDED": 1,
        "heartbeat CANCELLED (CANCELLED)": 1,  # who cancelled it, in gRPC's words
    }
    assert tally.heartbeat_gap_s >= 0.0
