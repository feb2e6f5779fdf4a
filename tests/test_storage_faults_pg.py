"""PostgreSQL drops every connection of a running daemon (as a server restart does) while
a round's commit is under way: the commit fails, the driver goes back to the last
committed round and commits it again, the daemon takes its claim on the database back,
and the run completes with every round committed once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from fedra.coordinator.engine.storage_faults import FAULT_EVENT
from fedra.local import LocalCluster
from fedra.storage.store import _CLAIM_KEY
from tests.conftest import postgres_database
from tests.test_cluster import FAST, start_synthetic_sites, synthetic_spec

pytestmark = [pytest.mark.multiprocess, pytest.mark.postgres]
ROUNDS = 4


def _until(conn: Connection, what: str, probe: Callable[[], Any], timeout_s: float) -> Any:
    """Poll the database until ``probe()`` is truthy (each try in a fresh snapshot)."""
    deadline = time.monotonic() + timeout_s
    while not (result := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        conn.commit()
        time.sleep(0.05)  # polling a condition, with a deadline
    return result


def test_a_run_carries_on_when_postgresql_drops_its_connections_mid_commit(
    cluster: LocalCluster,
) -> None:
    with postgres_database("fedra_fault") as db_url:
        cluster.start_coordinator(db_url=db_url, flags=FAST)
        assert cluster.coordinator is not None
        daemon = cluster.coordinator
        start_synthetic_sites(cluster)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=ROUNDS))
        watcher = create_engine(db_url, poolclass=NullPool)
        try:
            with watcher.connect() as conn:
                _drop_connections_mid_commit(conn, run_id)
                state, reason = _until(conn, "the run to end", lambda: _ended(conn, run_id), 180)
                assert (state, reason) == ("completed", ""), daemon.log_tail(60)
                _check_every_round_committed_once(conn, run_id)
                faults = (
                    conn.execute(
                        text("SELECT message FROM events WHERE run_id = :r AND kind = :k"),
                        {"r": run_id, "k": FAULT_EVENT},
                    )
                    .scalars()
                    .all()
                )
                assert faults and all("the database is unavailable" in m for m in faults)
                # The claim's connection went too: the daemon took the claim back (nobody
                # else had it) instead of stopping.
                _until(conn, "the claim taken back", lambda: _claim_held_by(conn, daemon.pid), 30)
                conn.commit()
        finally:
            watcher.dispose()
        assert daemon.alive(), daemon.log_tail(60)
        cluster.stop()  # before the database is dropped
        assert daemon.popen.returncode == 0, daemon.log_tail(60)
        log = daemon.log_tail(400)
        assert "going back to its last committed state" in log
        assert "internal error" not in log and "lost its hold" not in log, log


def _drop_connections_mid_commit(conn: Connection, run_id: str) -> None:
    """Hold up the next commit inside its transaction, then end every connection the
    daemon has (its claim's included), then let go."""
    _until(conn, "round 1 committed", lambda: _rounds_completed(conn, run_id) >= 1, 120)
    conn.execute(text("LOCK TABLE checkpoints IN SHARE MODE"))  # a commit inserts one
    waiting = text(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'checkpoints'::regclass"
    )
    deadline = time.monotonic() + 60
    while not conn.execute(waiting).scalar():  # the transaction stays open: the lock holds
        assert time.monotonic() < deadline, "no commit came to wait for the lock"
        time.sleep(0.02)
    ended = conn.execute(
        text(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    ).scalar()
    assert ended is not None and ended >= 2  # the waiting commit and the claim, at least
    conn.commit()


def _rounds_completed(conn: Connection, run_id: str) -> int:
    query = text("SELECT rounds_completed FROM runs WHERE id = :r")
    return int(conn.execute(query, {"r": run_id}).scalar() or 0)


def _ended(conn: Connection, run_id: str) -> tuple[str, str] | None:
    row = conn.execute(text("SELECT state, reason FROM runs WHERE id = :r"), {"r": run_id}).one()
    return (row.state, row.reason) if row.state in ("completed", "failed", "cancelled") else None


def _check_every_round_committed_once(conn: Connection, run_id: str) -> None:
    rounds = conn.execute(
        text("SELECT number FROM rounds WHERE run_id = :r AND state = 'committed' ORDER BY 1"),
        {"r": run_id},
    ).scalars()
    assert list(rounds) == list(range(ROUNDS + 1))
    checkpoints = conn.execute(
        text("SELECT round_number FROM checkpoints WHERE run_id = :r ORDER BY 1"), {"r": run_id}
    ).scalars()
    assert list(checkpoints) == list(range(ROUNDS + 1))
    accepted = conn.execute(
        text(
            "SELECT round_number, count(*) FROM participations WHERE run_id = :r "
            "AND state = 'accepted' GROUP BY 1 ORDER BY 1"
        ),
        {"r": run_id},
    ).all()
    assert [tuple(row) for row in accepted] == [(0, 1)] + [(n, 3) for n in range(1, ROUNDS + 1)]


def _claim_held_by(conn: Connection, pid: int) -> bool:
    held = conn.execute(
        text(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.classid::bigint = :hi AND l.objid::bigint = :lo AND a.application_name LIKE :n"
        ),
        {
            "hi": (_CLAIM_KEY >> 32) & 0xFFFFFFFF,
            "lo": _CLAIM_KEY & 0xFFFFFFFF,
            "n": f"fedra coordinator pid {pid} %",
        },
    ).scalar()
    return bool(held)
