"""Multi-process tests: a coordinator and sites as real processes, started through the CLI.

Every wait is on a condition with a deadline (readiness file, WatchRun stream, process
exit); every process is stopped by the ``cluster`` fixture, even when a test fails.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from fedra.admin import AdminClient
from fedra.local import LocalCluster
from fedra.metrics import format_bytes
from fedra.protos.v1 import admin_pb2
from fedra.runspec import CodecSpec, RunSpec, TrainSpec
from fedra.storage import Store
from tests.conftest import fedra_cli, postgres_database

pytestmark = pytest.mark.multiprocess

DIGITS = "fedra.examples.digits:task"
SYNTHETIC = "fedra.examples.synthetic:task"
# Short liveness settings so a dead site is noticed in seconds, not the default 20 s.
FAST = ["--heartbeat-s", "0.5", "--site-timeout-s", "3", "--poll-timeout-s", "5"]


def synthetic_spec(rounds: int, **kw: object) -> RunSpec:
    base: dict[str, object] = {
        "task": SYNTHETIC,
        "rounds": rounds,
        "sites_per_round": 3,
        "min_sites": 3,
        "round_deadline_s": 60.0,
        "join_timeout_s": 30.0,
        "seed": 7,
        # Stable for every site's data (inputs centred at 0, 1 and 2): the run learns.
        "train": TrainSpec(local_steps=5, batch_size=16, learning_rate=0.01),
        "strategy": "fedavgm",
    }
    base.update(kw)
    if base["strategy"] == "fedavgm":
        base.setdefault("strategy_params", {"momentum": 0.5})
    return RunSpec(**base).validate()  # type: ignore[arg-type]


def start_synthetic_sites(cluster: LocalCluster, n: int = 3, **env: dict[str, str]) -> list[str]:
    ids = [f"site-{i}" for i in range(n)]
    for i, site_id in enumerate(ids):
        data = {"shift": float(i), "seed": i, "samples": 128, "fit_delay_s": 0.2}
        cluster.start_site(site_id, [SYNTHETIC], data, extra_env=env.get(site_id))
    cluster.wait_for_sites(ids)
    return ids


def wait_until(
    admin: AdminClient, run_id: str, done, timeout_s: float = 240.0
) -> admin_pb2.RunStatus:  # type: ignore[no-untyped-def]
    """Follow WatchRun until ``done(status)``; the stream's deadline bounds the wait."""
    for status in admin.watch(run_id, timeout_s=timeout_s):
        if done(status):
            return status
    raise AssertionError(
        f"run {run_id} ended without reaching the condition: {status.state} {status.reason}"
    )


def finished(status: admin_pb2.RunStatus) -> bool:
    return status.state in ("completed", "failed", "cancelled")


def committed_rounds(state_dir: Path, run_id: str) -> list[int]:
    store = Store(f"sqlite:///{state_dir / 'fedra.db'}")
    try:
        return [c.round_number for c in store.list_checkpoints(run_id)]
    finally:
        store.close()


def kill_and_restart_coordinator(
    cluster: LocalCluster, port: int, db_url: str | None = None
) -> None:
    """SIGKILL the coordinator, then start it again on the same state, port and database."""
    assert cluster.coordinator is not None
    cluster.coordinator.signal(signal.SIGKILL)
    assert cluster.coordinator.popen.wait(30) == -signal.SIGKILL
    cluster.start_coordinator(port=port, db_url=db_url, flags=FAST)


def test_full_run_through_the_cli(cluster: LocalCluster, tmp_path: Path) -> None:
    address = cluster.start_coordinator(flags=FAST)
    ids = [f"site-{i}" for i in range(3)]
    for i, site_id in enumerate(ids):
        cluster.start_site(site_id, [DIGITS], {"partition": i, "num_partitions": 3})
    cluster.wait_for_sites(ids)
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(
        f'name = "cli"\ntask = "{DIGITS}"\nrounds = 4\nsites_per_round = 3\nmin_sites = 2\n'
        "round_deadline_s = 60\n[train]\nlocal_epochs = 2\nbatch_size = 32\nlearning_rate = 0.05\n"
    )
    submitted = fedra_cli(
        "run",
        "submit",
        str(run_toml),
        "--coordinator",
        address,
        "--state-dir",
        str(cluster.state_dir),
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "warning" not in submitted.stderr  # its sites are there
    run_id = submitted.stdout.strip()

    watched = fedra_cli(
        "run",
        "watch",
        run_id,
        "--coordinator",
        address,
        "--state-dir",
        str(cluster.state_dir),
        timeout_s=240,
    )
    assert watched.returncode == 0, watched.stderr
    assert "round   4" in watched.stdout and "completed" in watched.stdout
    lines = watched.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("round")] == list("01234")
    assert lines[-1] == f"run {run_id}: completed"  # the final state after the last round
    plain = fedra_cli("run", "status", run_id, "--state-dir", str(cluster.state_dir))
    assert plain.returncode == 0, plain.stderr
    totals = plain.stdout.splitlines()[-1]  # the same sum as the watch's, before its end
    assert lines[-2] == totals and "0 B (0%) of it for work that did not count" in totals

    listed = fedra_cli("run", "list", "--state-dir", str(cluster.state_dir))
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.splitlines()
    assert header.split() == ["run", "state", "rounds", "task", "name"]
    [line] = [x for x in lines if x.startswith(run_id)]
    assert line.split() == [run_id, "completed", "4/4", DIGITS, "cli"]

    shown = fedra_cli("run", "status", run_id, "--json", "--state-dir", str(cluster.state_dir))
    status = json.loads(shown.stdout)
    assert status["state"] == "completed" and status["rounds_completed"] == 4
    rounds = status["rounds"]
    assert [r["number"] for r in rounds] == [0, 1, 2, 3, 4]
    assert all(r["status"] == "committed" for r in rounds)
    assert all(r["updates"] == 3 for r in rounds[1:])
    # The global model learns: its accuracy on the sites' held-out data goes up.
    assert rounds[4]["metrics"]["eval_accuracy"] > rounds[1]["metrics"]["eval_accuracy"] + 0.3
    for r in rounds[1:]:  # a count adds up over the sites; a loss is their weighted mean
        seen = [p["metrics"]["samples_seen"] for p in r["participations"]]
        assert r["metrics"]["samples_seen"] == sum(seen) > max(seen), r
    assert all(int(r["bytes_up"]) > 0 for r in rounds[1:])
    # Round 1's model is the initial one: each site rebuilt it from the seed (same SHA-256)
    # instead of downloading it; later rounds download the new global model.
    assert int(rounds[1]["bytes_down"]) == 0
    assert all(int(r["bytes_down"]) > 0 for r in rounds[2:])
    summed = fedra_cli(
        "run", "status", run_id, "--json", "--summary", "--state-dir", str(cluster.state_dir)
    )
    assert summed.returncode == 0, summed.stderr
    summary = json.loads(summed.stdout)
    for whole, counted in zip(rounds, summary["rounds"], strict=True):
        assert counted.pop("participations", []) == [] and counted.pop("sampled_sites", []) == []
        assert counted["sampled_count"] == len(whole["sampled_sites"])
        assert counted["participation_counts"] == dict(
            Counter(p["status"] for p in whole["participations"])
        )
        rest = {k: v for k, v in whole.items() if k not in ("participations", "sampled_sites")}
        # The idle time is a mean worked out by the database: its last bits may differ.
        assert counted.pop("site_idle_s") == pytest.approx(rest.pop("site_idle_s"), rel=1e-9)
        assert counted == rest
    assert [r["participation_counts"] for r in summary["rounds"][1:]] == [{"accepted": 3}] * 4
    later = fedra_cli(
        "run", "status", run_id, "--from-round", "3", "--state-dir", str(cluster.state_dir)
    )
    assert later.returncode == 0, later.stderr
    assert [line.split()[1] for line in later.stdout.splitlines() if line.startswith("round")] == [
        "3", "4",
    ]  # fmt: skip
    negative = fedra_cli(
        "run", "status", run_id, "--from-round", "-1", "--state-dir", str(cluster.state_dir)
    )
    assert negative.returncode != 0 and "--from-round" in negative.stderr

    sites = json.loads(
        fedra_cli(
            "sites", "--json", "--coordinator", address, "--state-dir", str(cluster.state_dir)
        ).stdout
    )
    assert sorted(s["site_id"] for s in sites) == ids and all(s["online"] for s in sites)
    table = fedra_cli("sites", "--coordinator", address, "--state-dir", str(cluster.state_dir))
    header, *rows, summary = table.stdout.splitlines()
    assert header.split() == ["site", "state", "last", "seen", "tasks"]
    assert [row.split()[:2] for row in rows] == [[i, "online"] for i in ids]
    assert summary == f"{len(ids)} sites registered, {len(ids)} online"
    paged = fedra_cli(  # a page at a time: the same table
        "sites", "--page-size", "2", "--coordinator", address,
        "--state-dir", str(cluster.state_dir),
    )  # fmt: skip
    assert paged.returncode == 0, paged.stderr
    assert [line.split()[:2] for line in paged.stdout.splitlines()] == [
        line.split()[:2] for line in [header, *rows, summary]
    ]
    counted = fedra_cli(
        "sites", "--summary", "--json", "--coordinator", address,
        "--state-dir", str(cluster.state_dir),
    )  # fmt: skip
    assert json.loads(counted.stdout) == {"total": len(ids), "online": len(ids)}
    assert all(row.split()[-1] == DIGITS for row in rows)
    site = cluster.sites[ids[0]]
    assert site.stop() == 0  # SIGTERM: the site stops at once, and says so
    assert "stopped after" in site.log_tail(3), site.log_tail()

    out = tmp_path / "model.safetensors"
    exported = fedra_cli(
        "run",
        "export",
        run_id,
        "--out",
        str(out),
        "--coordinator",
        address,
        "--state-dir",
        str(cluster.state_dir),
    )
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    with cluster.admin() as admin:
        latest = admin.export_model(run_id)
    for name, tensor in load_file(str(out)).items():
        torch.testing.assert_close(tensor, latest[name], rtol=0, atol=0)

    bad = fedra_cli(
        "run", "status", "nope", "--coordinator", address, "--state-dir", str(cluster.state_dir)
    )
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr and "nope" in bad.stderr

    unserved = tmp_path / "unserved.toml"
    unserved.write_text('task = "pkg.mod:nobody"\nrounds = 1\n')
    waiting = fedra_cli("run", "submit", str(unserved), "--state-dir", str(cluster.state_dir))
    assert waiting.returncode == 0 and waiting.stdout.strip(), waiting.stderr
    assert "fedra: warning: no site known to this coordinator allows task pkg.mod:nobody" in (
        waiting.stderr
    )


def test_a_second_coordinator_on_the_same_state_or_database_is_refused(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Two daemons on one state directory (or one database) would drive the same runs,
    and the second would take the first's readiness file: it exits at once instead,
    naming the first's pid, and the first serves on untouched."""
    cluster.start_coordinator(flags=FAST)
    assert cluster.coordinator is not None
    ready = cluster.state_dir / "coordinator.json"
    before = ready.read_text()
    second = fedra_cli(
        "coordinator", "--state-dir", str(cluster.state_dir), "--insecure", "--port", "0",
        timeout_s=60,
    )  # fmt: skip
    assert second.returncode == 2, second.stderr
    assert (
        f"--state-dir {cluster.state_dir}: in use by another coordinator "
        f"(pid {cluster.coordinator.pid})" in second.stderr
    )
    assert "Traceback" not in second.stderr
    db = f"sqlite:///{cluster.state_dir / 'fedra.db'}"
    elsewhere = fedra_cli(
        "coordinator", "--state-dir", str(tmp_path / "other"), "--db", db, "--insecure",
        "--port", "0", timeout_s=60,
    )  # fmt: skip
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert "--db" in elsewhere.stderr and "database is in use by another coordinator" in (
        elsewhere.stderr
    )
    assert not (tmp_path / "other" / "coordinator.json").exists()
    assert ready.read_text() == before
    with cluster.admin() as admin:
        assert admin.runs() == []  # the first still serves


@pytest.mark.postgres
def test_a_coordinator_that_loses_its_database_to_another_stops(cluster: LocalCluster) -> None:
    """PostgreSQL drops the daemon's lock connection mid-run, sites still training and
    uploading, and another coordinator takes the database meanwhile: from the moment that
    claim completes the daemon writes nothing (its rounds, uploads, downloads, heartbeats
    and shutdown are all refused), and it stops (exit 2), so that one coordinator drives the
    runs; its run stays running for the other one. A second start is refused, naming the
    holder."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from fedra.storage.store import _CLAIM_KEY

    def written(conn: Any) -> dict[str, list[Any]]:
        queries = {
            "runs": "SELECT id, state, reason FROM runs",
            "rounds": "SELECT number, attempt, state, closed_at FROM rounds",
            "participations": "SELECT task_id, state, bytes_down, bytes_up FROM participations",
            "checkpoints": "SELECT round_number, model_sha256 FROM checkpoints",
            "sites": "SELECT id, last_seen_at FROM sites",
            "events": "SELECT count(*) FROM events",
        }
        rows = {k: sorted(conn.execute(text(q)).all()) for k, q in queries.items()}
        conn.commit()
        return rows

    with postgres_database("fedra_claim") as db_url:
        flags = ["--heartbeat-s", "0.5", "--poll-timeout-s", "5"]
        cluster.start_coordinator(db_url=db_url, flags=flags)
        assert cluster.coordinator is not None
        refused = fedra_cli(
            "coordinator", "--state-dir", str(cluster.state_dir.parent / "second"), "--db",
            db_url, "--insecure", "--port", "0", timeout_s=60,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert f"(fedra coordinator pid {cluster.coordinator.pid} on " in refused.stderr
        start_synthetic_sites(cluster)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=1000))
            wait_until(admin, run_id, lambda s: s.rounds_completed >= 2)
        watcher = create_engine(db_url, poolclass=NullPool)
        taker = watcher.connect()  # another coordinator's claim, made as Store.claim makes it
        try:
            with watcher.connect() as conn:
                taker_pid = taker.execute(text("SELECT pg_backend_pid()")).scalar()
                taker.execute(text("SET lock_timeout = '60s'"))  # bounded, should this fail
                taker.commit()
                waiting = threading.Thread(
                    target=taker.execute,
                    args=(text("SELECT pg_advisory_lock(:k)"), {"k": _CLAIM_KEY}),
                    daemon=True,
                )
                waiting.start()  # queued first, it gets the lock when the daemon's goes
                queued = text(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = :p AND NOT granted)"
                )
                deadline = time.monotonic() + 30
                while not conn.execute(queued, {"p": taker_pid}).scalar():
                    assert time.monotonic() < deadline
                    conn.commit()
                    time.sleep(0.02)
                daemon_pid = conn.execute(
                    text("SELECT pid FROM pg_stat_activity WHERE application_name LIKE :name"),
                    {"name": f"fedra coordinator pid {cluster.coordinator.pid} %"},
                ).scalar_one()
                assert conn.execute(
                    text("SELECT pg_terminate_backend(:p, 10000)"), {"p": daemon_pid}
                ).scalar()
                conn.commit()
                waiting.join(30)
                assert not waiting.is_alive()
                taker.commit()
                Store._fence(taker)  # returns once the daemon's writes under way have ended
                before = written(conn)
                rc = cluster.coordinator.popen.wait(60)
                assert rc == 2, cluster.coordinator.log_tail()
                log = cluster.coordinator.log_tail(200)
                assert "lost its hold on the database" in log, log
                assert "Traceback" not in log, log
                assert written(conn) == before  # nothing after the claim, its shutdown included
                assert before["runs"] == [(run_id, "running", "")]  # the other one's to drive
        finally:
            taker.close()
            watcher.dispose()


@pytest.mark.postgres
def test_a_run_on_postgresql_survives_a_coordinator_kill(cluster: LocalCluster) -> None:
    """The production set-up: the daemon's state in PostgreSQL, killed and restarted."""
    with postgres_database("fedra_e2e") as db_url:
        address = cluster.start_coordinator(db_url=db_url, flags=FAST)
        port = int(address.rsplit(":", 1)[1])
        start_synthetic_sites(cluster)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=4))
            wait_until(admin, run_id, lambda s: s.rounds_completed >= 2)
        kill_and_restart_coordinator(cluster, port, db_url=db_url)
        with cluster.admin() as admin:
            status = wait_until(admin, run_id, finished)
        cluster.stop()  # before the database is dropped
        assert status.state == "completed", status.reason
        assert [r.number for r in status.rounds] == list(range(5))
        store = Store(db_url)
        try:
            assert [c.round_number for c in store.list_checkpoints(run_id)] == list(range(5))
        finally:
            store.close()
        assert not (cluster.state_dir / "fedra.db").exists()  # nothing went to SQLite


def test_coordinator_sigkill_mid_run_then_restart_completes(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The run finishes after the kill, and `fedra run watch` follows it across the restart."""
    address = cluster.start_coordinator(flags=FAST)
    port = int(address.rsplit(":", 1)[1])
    start_synthetic_sites(cluster)
    with cluster.admin() as admin:
        run_id = admin.submit(synthetic_spec(rounds=8))
        out, err = tmp_path / "watch.out", tmp_path / "watch.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            watch = subprocess.Popen(
                [sys.executable, "-m", "fedra", "run", "watch", run_id, "--coordinator", address,
                 "--state-dir", str(cluster.state_dir), "--reconnect-s", "120"],
                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            wait_until(admin, run_id, lambda s: s.rounds_completed >= 3)
            deadline = time.monotonic() + 60
            while "round   1" not in out.read_text():  # the watch is connected and printing
                assert watch.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            kill_and_restart_coordinator(cluster, port)
            with cluster.admin() as again:
                status = wait_until(again, run_id, finished)
            assert watch.wait(60) == 0, err.read_text()
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
    assert status.state == "completed", status.reason
    assert status.rounds_completed == 8
    numbers = [r.number for r in status.rounds]
    assert numbers == list(range(9)), "a round is missing or was run twice"
    assert committed_rounds(cluster.state_dir, run_id) == list(range(9))
    loss = [r.metrics["eval_loss"] for r in status.rounds[1:]]
    assert loss[-1] < loss[0] / 4, loss  # it learns across the restart (server momentum too)
    printed = [line.split()[1] for line in out.read_text().splitlines() if line.startswith("round")]
    assert printed == [str(n) for n in range(9)], "the watch lost or repeated a round"
    lines = out.read_text().splitlines()
    assert lines[-1] == f"run {run_id}: completed"  # after the last round
    running = lines.index(f"run {run_id}: running")
    assert all(not line.startswith("round") for line in lines[:running])  # before the first
    assert "reconnecting" in err.read_text() and "reconnected after" in err.read_text()
    # The open round as it goes (plain lines: not a terminal), never taken for a commit.
    assert any(line.startswith("open round ") and "updates in" in line for line in lines), lines


def test_crash_between_checkpoint_and_commit_loses_nothing(cluster: LocalCluster) -> None:
    """Kill the coordinator after round 2's checkpoint is durable but before its commit.

    The restarted coordinator re-folds the spooled updates (no site sends again) and the
    run ends with the same model as an uninterrupted run of the same spec.
    """
    address = cluster.start_coordinator(flags=FAST)
    port = int(address.rsplit(":", 1)[1])
    start_synthetic_sites(cluster)
    spec = synthetic_spec(rounds=4, strategy="diloco")  # outer Nesterov momentum in the checkpoint
    with cluster.admin() as admin:
        reference_id = admin.submit(spec)
        assert wait_until(admin, reference_id, finished).state == "completed"
        reference = admin.export_model(reference_id)
    assert cluster.coordinator is not None
    assert cluster.coordinator.stop() == 0  # SIGTERM: a graceful stop
    assert not (cluster.state_dir / "coordinator.json").exists(), "stale readiness file"

    cluster.start_coordinator(
        port=port, flags=FAST, extra_env={"FEDRA_FAULT_CRASH": "before_commit:2"}
    )
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
    assert cluster.coordinator.popen.wait(120) == -signal.SIGKILL  # it killed itself at the fault
    store = Store(f"sqlite:///{cluster.state_dir / 'fedra.db'}")
    try:
        open_round = store.get_open_round(run_id)
        assert open_round is not None and open_round.number == 2
        before = {p.task_id: p.state for p in store.list_participations(run_id, 2)}
    finally:
        store.close()
    assert list(before.values()) == ["accepted"] * 3

    cluster.start_coordinator(port=port, flags=FAST)
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished)
        resumed = admin.export_model(run_id)
    assert status.state == "completed", status.reason
    r2 = next(r for r in status.rounds if r.number == 2)
    assert r2.attempt == 1 and r2.updates == 3
    assert {p.status for p in r2.participations} == {"accepted"}  # the same three tasks
    assert [r.number for r in status.rounds] == list(range(5))
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6)


def test_site_killed_mid_round_round_closes_with_quorum_and_site_rejoins(
    cluster: LocalCluster,
) -> None:
    cluster.start_coordinator(flags=FAST)
    ids = start_synthetic_sites(cluster, **{"site-2": {"FEDRA_FAULT_CRASH": "after_download:2"}})
    spec = synthetic_spec(rounds=4, min_sites=2, round_deadline_s=120.0)
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        assert cluster.sites["site-2"].popen.wait(120) == -signal.SIGKILL
        wait_until(admin, run_id, lambda s: s.rounds_completed >= 2)
        # Bring it back: it registers again and is sampled in later rounds.
        cluster.start_site("site-2", [SYNTHETIC], {"shift": 2.0, "seed": 2, "samples": 128})
        status = wait_until(admin, run_id, finished)
    shown = fedra_cli("run", "status", run_id, "--state-dir", str(cluster.state_dir))
    assert status.state == "completed", status.reason
    r2 = next(r for r in status.rounds if r.number == 2)
    assert r2.status == "committed" and r2.updates == 2
    dead = next(p for p in r2.participations if p.site_id == "site-2")
    assert dead.status == "failed" and "silent" in dead.error
    # Closed when the dead site went silent, long before the 120 s deadline.
    assert r2.duration_s < 60
    # The dead site's download is lost; the live sites sat idle while the round waited
    # for it to go silent (3 s), longer than their own work took.
    assert r2.lost_bytes == dead.bytes_down > 0
    assert r2.site_idle_s > 0.5 * r2.duration_s, (r2.site_idle_s, r2.duration_s)
    assert all(r.lost_bytes == 0 for r in status.rounds if r.number != 2)
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("round   2 "))
    assert line.endswith(f"lost {format_bytes(r2.lost_bytes)}") and " idle " in line, line
    assert "of it for work that did not count; sites sat idle" in shown.stdout.splitlines()[-1]
    later = [r for r in status.rounds if r.number > 2]
    assert any(
        "site-2" in [p.site_id for p in r.participations if p.status == "accepted"] for r in later
    )
    assert sorted(ids) == sorted({p.site_id for r in status.rounds for p in r.participations})


def test_a_cancelled_run_s_watch_counts_the_bytes_its_last_round_lost(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The round a run is cancelled in never commits: the watch prints no line for it, but
    its downloads are lost, and the watch's closing sum says so, as `run status` does."""
    address = cluster.start_coordinator(flags=FAST)
    ids = [f"site-{i}" for i in range(2)]
    for i, site_id in enumerate(ids):  # slow training: round 2 stays open a while
        data = {"shift": float(i), "seed": i, "samples": 64, "fit_delay_s": 2.0}
        cluster.start_site(site_id, [SYNTHETIC], data)
    cluster.wait_for_sites(ids)
    with cluster.admin() as admin:
        run_id = admin.submit(synthetic_spec(rounds=5, sites_per_round=2, min_sites=2))
        out = tmp_path / "watch.out"
        with out.open("w") as stdout:
            watch = subprocess.Popen(
                [sys.executable, "-m", "fedra", "run", "watch", run_id, "--coordinator", address,
                 "--state-dir", str(cluster.state_dir)],
                stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        try:

            def downloaded_round_2(s: admin_pb2.RunStatus) -> bool:
                r2 = [r for r in s.rounds if r.number == 2]
                return bool(r2) and r2[0].bytes_down > 0 and r2[0].status == "open"

            wait_until(admin, run_id, downloaded_round_2)
            cancelled = fedra_cli("run", "cancel", run_id, "--state-dir", str(cluster.state_dir))
            assert cancelled.returncode == 0, cancelled.stderr
            assert watch.wait(60) == 1, out.read_text()  # the run did not complete
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
        status = admin.status(run_id)
    r2 = next(r for r in status.rounds if r.number == 2)
    assert status.state == "cancelled" and r2.status == "cancelled"
    assert r2.lost_bytes == r2.bytes_down + r2.bytes_up > 0
    lines = out.read_text().splitlines()
    assert lines[-1].startswith(f"run {run_id}: cancelled")
    assert not any(line.startswith("round   2") for line in lines)
    plain = fedra_cli("run", "status", run_id, "--state-dir", str(cluster.state_dir))
    assert plain.returncode == 0, plain.stderr
    assert lines[-2] == plain.stdout.splitlines()[-1]
    assert f"{format_bytes(r2.lost_bytes)} (" in lines[-2], lines[-2]


def test_site_restarted_mid_round_is_given_its_current_task(cluster: LocalCluster) -> None:
    # The killed site is given its task again only if it is back before it counts as
    # silent: a restart (torch's import) takes seconds on a loaded 2-core machine.
    patient = ["--heartbeat-s", "0.5", "--site-timeout-s", "30", "--poll-timeout-s", "5"]
    cluster.start_coordinator(flags=patient)
    start_synthetic_sites(cluster, **{"site-1": {"FEDRA_FAULT_CRASH": "after_download:1"}})
    with cluster.admin() as admin:
        run_id = admin.submit(synthetic_spec(rounds=2, min_sites=3, round_deadline_s=120.0))
        assert cluster.sites["site-1"].popen.wait(120) == -signal.SIGKILL
        cluster.start_site("site-1", [SYNTHETIC], {"shift": 1.0, "seed": 1, "samples": 128})
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    r1 = next(r for r in status.rounds if r.number == 1)
    # One attempt, all three sampled sites delivered: the restarted site finished its task.
    assert (r1.attempt, r1.updates) == (1, 3)
    assert [p.status for p in r1.participations] == ["accepted"] * 3


@pytest.mark.parametrize(("codec", "max_share"), [("int8", 0.3), ("topk", 0.06)])
def test_diloco_with_compressed_updates(
    cluster: LocalCluster, codec: str, max_share: float
) -> None:
    """DiLoCo's outer step on int8 / top-k updates: fewer bytes up, and it still learns."""
    cluster.start_coordinator(flags=FAST)
    ids = [f"site-{i}" for i in range(3)]
    for i, site_id in enumerate(ids):
        # Mild shifts: DiLoCo's aggressive outer step (lr 0.7, Nesterov 0.9) stays stable.
        data = {"shift": 0.25 * i, "seed": i, "samples": 128, "dim": 8}
        cluster.start_site(site_id, [SYNTHETIC], data)
    cluster.wait_for_sites(ids)
    params = {"extra_params": "20000"}
    train = TrainSpec(local_steps=10, batch_size=16, learning_rate=0.02, params=params)
    spec = synthetic_spec(
        rounds=4, strategy="diloco", train=train, codec=CodecSpec(codec, fraction=0.02)
    )
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    rounds = [r for r in status.rounds if r.number > 0]
    model_bytes = 4 * (20000 + 8 + 1)
    for r in rounds:
        for p in r.participations:
            assert p.status == "accepted"
            assert p.bytes_up < max_share * model_bytes, (codec, p.bytes_up)
    assert rounds[-1].metrics["eval_loss"] < rounds[0].metrics["eval_loss"]
    if codec == "topk":  # the error-feedback residual is kept on disk across restarts
        for site_id in ids:
            assert (
                cluster.state_dir / "sites" / site_id / f"residual-{run_id}.safetensors"
            ).exists()


def test_demo_writes_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = fedra_cli(
        "demo",
        "--rounds",
        "3",
        "--state-dir",
        str(tmp_path / "demo"),
        "--out",
        str(out),
        *("--strategy", "fedprox", "--alpha", "1.0", "--partition-seed", "2"),
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["strategy"], summary["alpha"], summary["partition_seed"]) == ("fedprox", 1, 2)
    assert summary["spec"]["strategy"] == "fedavg"  # FedProx: FedAvg, the term at the sites
    assert summary["spec"]["train"]["proximal_mu"] == 0.01
    assert summary["sites"] == ["site-0", "site-1", "site-2"]
    for site_id in summary["sites"]:  # what each site's updates came from
        p = summary["provenance"][site_id]
        assert p["task"] == "fedra.examples.digits:task" and not p["changed"]
        assert len(p["task_source_sha256"]) == 64 and p["data_fingerprint"].startswith("config:")
        assert set(p["versions"]) == {"fedra", "torch", "python"}
    assert len(summary["run_provenance"]["spec_sha256"]) == 64
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2, 3]
    for r in summary["rounds"][1:]:  # what the sites trained on: the round's count, summed
        assert r["samples_seen"] == r["site_metrics"]["samples_seen"] > 0, r
    final = summary["final"]
    assert 0.5 < final["accuracy"] <= 1.0 and 0.5 < final["baseline_accuracy"] <= 1.0
    assert summary["rounds"][3]["test_accuracy"] > summary["rounds"][0]["test_accuracy"]
    assert "final global model: test accuracy" in result.stdout
    steps = ["starting the coordinator", "waiting for the sites", "all 3 sites online",
             "training the centralised baseline"]  # fmt: skip
    said = [result.stdout.find(step) for step in steps]
    assert -1 not in said and said == sorted(said), result.stdout  # each step, in order
    # Nothing failed: nothing lost; the sites did some waiting, never more than the rounds.
    wire = sum(r["bytes_down"] + r["bytes_up"] + r["cut_bytes"] for r in summary["rounds"])
    assert final["bytes_on_wire"] == wire > 0 and final["lost_bytes"] == 0
    assert all(0 <= r["site_idle_s"] <= r["seconds"] for r in summary["rounds"])
    assert 0 < final["site_idle_fraction"] < 1
    assert "sites idle" in result.stdout
    # Watchable while it runs; its rounds in TensorBoard and MLflow once it ends.
    assert re.search(
        r"watch it at http://127\.0\.0\.1:\d+/\?run=" + summary["run_id"], result.stdout
    )
    board = tmp_path / "demo" / "tensorboard" / summary["run_id"]
    assert list(board.glob("events.out.tfevents.*")), result.stdout
    assert f"tensorboard --logdir {tmp_path / 'demo' / 'tensorboard'}" in result.stdout
    assert (tmp_path / "demo" / "mlruns" / "mlflow.db").stat().st_size > 0


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_compressed_downloads_rebuild_the_model_across_a_coordinator_restart(
    cluster: LocalCluster, codec: str
) -> None:
    """[codec] download: after their first round, sites fetch only the compressed outer
    step and rebuild the global model bit for bit (a mismatch would make them fetch the
    whole model, which the byte counts below would show), also after the coordinator is
    killed and restarted (the step, its base and the top-k residual are in the checkpoint)."""
    address = cluster.start_coordinator(flags=FAST)
    port = int(address.rsplit(":", 1)[1])
    ids = [f"site-{i}" for i in range(3)]
    for i, site_id in enumerate(ids):
        cluster.start_site(site_id, [SYNTHETIC], {"shift": 0.25 * i, "seed": i, "samples": 128})
    cluster.wait_for_sites(ids)
    params = {"extra_params": "20000"}
    train = TrainSpec(local_steps=10, batch_size=16, learning_rate=0.02, params=params)
    spec = synthetic_spec(
        rounds=5,
        strategy="diloco",
        train=train,
        codec=CodecSpec(codec, fraction=0.05, download=True),
    )
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        wait_until(admin, run_id, lambda s: s.rounds_completed >= 3)
    kill_and_restart_coordinator(cluster, port)
    with cluster.admin() as admin:
        status = wait_until(admin, run_id, finished)
    assert status.state == "completed", status.reason
    model_bytes = 4 * (20000 + 8 + 1)
    for r in (r for r in status.rounds if r.number >= 2 and r.status == "committed"):
        for p in r.participations:
            if p.status == "accepted":  # every site held the previous round's model
                assert p.bytes_down < 0.35 * model_bytes, (r.number, p.site_id, p.bytes_down)
    rounds = [r for r in status.rounds if r.number > 0]
    assert rounds[-1].metrics["eval_loss"] < rounds[0].metrics["eval_loss"]


def test_run_watch_gives_up_on_an_absent_coordinator_after_its_reconnect_time(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    gone = fedra_cli(
        "run", "watch", "r1", "--coordinator", "127.0.0.1:1", "--insecure", "--reconnect-s", "1"
    )
    assert gone.returncode == 2 and "giving up" in gone.stderr, gone.stderr
    assert "reconnecting" in gone.stderr and time.monotonic() - started < 60
    # A stopped local daemon has no readiness file: waited for in the same way.
    stopped = fedra_cli(
        "run", "watch", "r1", "--state-dir", str(tmp_path), "--insecure", "--reconnect-s", "1"
    )
    assert stopped.returncode == 2 and "coordinator.json: not found" in stopped.stderr
    bad = fedra_cli("run", "watch", "r1", "--insecure", "--reconnect-s", "-1")
    assert bad.returncode != 0 and "--reconnect-s: must be >= 0" in bad.stderr


def test_a_plaintext_caller_does_not_fill_a_tls_daemon_s_log_with_grpc_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's C core logs each failed handshake at INFO by default; a site that dials a
    TLS coordinator without TLS retries for ever, so the daemon keeps gRPC to errors."""
    import grpc

    from fedra.protos.v1 import site_pb2, site_pb2_grpc

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # the default is what is tested
    with LocalCluster(tmp_path, secure=True) as cluster:
        cluster.start_coordinator(flags=FAST)
        assert cluster.coordinator is not None
        with grpc.insecure_channel(cluster.address) as channel:
            stub = site_pb2_grpc.SiteServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:  # a refused handshake on the daemon
                stub.Register(site_pb2.RegisterRequest(site_id="site-a"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with cluster.admin() as admin:  # still serving those who speak TLS
            assert admin.sites() == []
        assert cluster.coordinator.stop() == 0
        log = cluster.coordinator.log_path.read_text(errors="replace")
    assert "serving" in log.lower() or "listening" in log.lower(), log[-2000:]
    assert "Handshake failed" not in log, log[-2000:]


def test_an_insecure_coordinators_state_dir_is_all_its_admin_commands_need(
    tmp_path: Path,
) -> None:
    """Its coordinator.json says it serves without TLS: no --insecure to repeat."""
    with LocalCluster(tmp_path / "plain", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        listed = fedra_cli("run", "list", "--state-dir", str(cluster.state_dir))
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == ["run", "state", "rounds", "task", "name"]  # none yet
        # Told another address, it trusts no file about that daemon: it asks for identity.
        elsewhere = fedra_cli(
            "run", "list", "--state-dir", str(cluster.state_dir), "--coordinator", cluster.address
        )
        assert elsewhere.returncode == 2 and "--tls-dir" in elsewhere.stderr, elsewhere.stderr
    # A state dir with neither an admin identity nor an insecure daemon still asks for one.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "coordinator.json").write_text('{"address": "127.0.0.1:1"}')
    refused = fedra_cli("run", "list", "--state-dir", str(tmp_path / "other"))
    assert refused.returncode == 2 and "--tls-dir" in refused.stderr, refused.stderr


def test_sites_lists_a_revoked_site_at_once_and_a_polling_site_as_seen_now(
    cluster: LocalCluster,
) -> None:
    """`fedra sites` tells the truth: a site waiting in a long poll was seen now (not when
    its poll began), and a revoked site is revoked and offline from the revoke on, not
    once its liveness runs out."""
    cluster.start_coordinator(flags=["--poll-timeout-s", "20", "--site-timeout-s", "20"])
    start_synthetic_sites(cluster, n=2)
    with cluster.admin() as admin:
        # Not a wait for a condition: the age the sites' last call (the poll they now wait
        # in, 20 s long) reaches. Without a task they make no other call meanwhile.
        time.sleep(3.0)
        now = time.time()
        sites = {s.site_id: s for s in admin.sites()}
        assert all(s.online and not s.revoked for s in sites.values())
        ages = [now - s.last_seen_unix_s for s in sites.values()]
        assert max(ages) < 1.0, f"last seen {ages} s ago while in a long poll"
        out = fedra_cli(
            "revoke", "--state-dir", str(cluster.state_dir),
            str(cluster.pki_dir / "sites" / "site-1"),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        sites = {s.site_id: s for s in admin.sites()}  # the next listing, no wait
        assert sites["site-1"].revoked and not sites["site-1"].online
        assert sites["site-0"].online and not sites["site-0"].revoked
        assert admin.site_counts() == (2, 1)
    admin_tls = {"FEDRA_TLS_DIR": str(cluster.pki_dir / "admins" / "admin")}
    listing = fedra_cli("sites", "--state-dir", str(cluster.state_dir), env=admin_tls)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split()[1] for line in listing.stdout.splitlines()[1:3]}
    assert rows == {"site-0": "online", "site-1": "revoked"}
