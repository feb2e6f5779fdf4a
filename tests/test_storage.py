"""Contract tests for fedra.storage: the Store against SQLite and PostgreSQL, and the BlobStore.

Every Store test runs once per backend through the ``db_url`` fixture. PostgreSQL cases
use a throw-away database created for the session (reset to an empty schema before each
test); they skip when the server does not answer, except under ``CI=true``, where a
missing database is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from fedra.coordinator.status import round_statuses
from fedra.storage import CheckpointRecord, DuplicateError, Store
from fedra.storage.blobs import (
    BlobCorruptError,
    BlobDigestError,
    BlobNotFoundError,
    BlobStore,
    BlobWriter,
)
from fedra.storage.migrate import current_revision, head_revision
from fedra.storage.models import Base, Site
from fedra.storage.spool import SmallWriter, UpdateSpool
from fedra.storage.store import NotFoundError, make_engine
from fedra.storage.writes import WriteOp
from tests.conftest import postgres_database

PG_URL = os.environ.get(
    "FEDRA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
RUN = "run-1"
T0 = 1_700_000_000.25

# -- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this session, dropped at the end."""
    with postgres_database("fedra_test") as url:
        yield url


def _reset_postgres(url: str) -> None:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database (no tables, no alembic_version) on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/fedra.db"
    url: str = request.getfixturevalue("pg_database_url")
    _reset_postgres(url)
    return url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def run_store(store: Store) -> Store:
    """A store holding run RUN in state 'running'."""
    store.create_run(RUN, "demo", "examples.digits", '{"rounds": 3}', T0)
    store.set_run_state(RUN, "running", "", T0)
    return store


# -- helpers ----------------------------------------------------------------------


def _task(number: int, attempt: int, site: str) -> str:
    return f"t{number}-{attempt}-{site}"


def _open(store: Store, number: int, attempt: int, sites: list[str], at: float = T0) -> None:
    store.open_round(
        RUN, number, attempt, {s: _task(number, attempt, s) for s in sites}, at, at + 60.0
    )


def _accept(store: Store, task_id: str, nonce: bytes, sha: str = "a" * 64) -> None:
    store.accept_update(
        task_id,
        nonce=nonce,
        sha256=sha,
        num_samples=128,
        metrics={"loss": 0.5},
        bytes_up=4096,
        upload_s=1.5,
        now=T0 + 10,
    )


def _checkpoint(number: int, sha: str = "c" * 64) -> CheckpointRecord:
    return CheckpointRecord(RUN, number, sha, 1000 + number, None, T0 + number)


def _states(store: Store, number: int | None = None) -> dict[str, str]:
    return {p.task_id: p.state for p in store.list_participations(RUN, number)}


def _nonce(store: Store, task_id: str) -> bytes | None:
    with store.engine.connect() as conn:
        value = conn.execute(
            text("SELECT nonce FROM participations WHERE task_id = :t"), {"t": task_id}
        ).scalar_one()
    return None if value is None else bytes(value)


def _schema_diffs(conn: Connection) -> list[object]:
    ctx = MigrationContext.configure(
        conn, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(ctx, Base.metadata))


# -- migrations -------------------------------------------------------------------


def test_fresh_database_upgrades_to_head(db_url: str) -> None:
    probe = make_engine(db_url)
    try:
        assert current_revision(probe) is None
        assert inspect(probe).get_table_names() == []
        store = Store(db_url)
        store.close()
        assert current_revision(probe) == head_revision()
        tables = set(inspect(probe).get_table_names())
        assert tables == set(Base.metadata.tables) | {"alembic_version"}
    finally:
        probe.dispose()


def test_migrated_schema_matches_models(store: Store) -> None:
    with store.engine.connect() as conn:
        assert _schema_diffs(conn) == []


def test_schema_comparison_detects_drift(store: Store) -> None:
    """Guards the test above: the comparison is not vacuous."""
    with store.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_runs_state"))
    with store.engine.connect() as conn:
        diffs = _schema_diffs(conn)
    assert [d[0] for d in diffs if isinstance(d, tuple)] == ["add_index"]


def test_second_store_on_migrated_database_is_a_no_op(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Store(db_url)
    first.create_run(RUN, "demo", "task", "{}", T0)
    first.close()

    def _no_upgrade(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an up-to-date database must not be migrated again")

    monkeypatch.setattr("fedra.storage.migrate.command.upgrade", _no_upgrade)
    second = Store(db_url)
    try:
        assert current_revision(second.engine) == head_revision()
        run = second.get_run(RUN)
        assert run is not None and run.name == "demo"
    finally:
        second.close()


def test_newer_schema_revision_is_refused(db_url: str) -> None:
    Store(db_url).close()
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
        with pytest.raises(RuntimeError, match=r"'9999_from_the_future' is newer than this fedra"):
            Store(db_url)
        assert current_revision(engine) == "9999_from_the_future"
    finally:
        engine.dispose()


def test_sqlite_connections_use_wal_full_sync_and_foreign_keys(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path}/fedra.db")
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        store.close()


def test_foreign_keys_are_enforced(store: Store) -> None:
    with pytest.raises(IntegrityError):
        store.add_event("no-such-run", "created", "orphan", T0)
    with pytest.raises(IntegrityError):
        store.open_round("no-such-run", 1, 1, {"a": "t-orphan"}, T0, T0 + 1)
    assert store.list_events("no-such-run") == []


# -- sites ------------------------------------------------------------------------


def test_upsert_site_creates_then_updates(store: Store) -> None:
    store.upsert_site("site-b", ["digits"], "0.1.0", T0)
    [site] = store.list_sites()
    assert (site.id, site.tasks, site.version) == ("site-b", ("digits",), "0.1.0")
    assert site.registered_at == site.last_seen_at == T0

    store.upsert_site("site-b", ["digits", "mnist"], "0.2.0", T0 + 5)
    [site] = store.list_sites()
    assert site.tasks == ("digits", "mnist")
    assert site.version == "0.2.0"
    assert site.registered_at == T0
    assert site.last_seen_at == T0 + 5


def test_a_site_registered_twice_in_one_batch_ends_as_its_second_registration(
    store: Store,
) -> None:
    ops = [
        store.upsert_site_op("site-b", ["digits"], "0.1.0", T0),
        store.upsert_site_op("site-a", ["digits"], "0.1.0", T0),
        store.upsert_site_op("site-b", ["mnist"], "0.2.0", T0 + 5),
    ]
    assert store.write_batch(ops) == [None, None, None]
    site_a, site_b = store.list_sites()
    assert (site_b.tasks, site_b.version, site_b.registered_at) == (("mnist",), "0.2.0", T0)
    assert site_b.last_seen_at == T0 + 5 and site_a.version == "0.1.0"


def test_touch_sites_and_list_order(store: Store) -> None:
    for site_id in ("site-c", "site-a", "site-b"):
        store.upsert_site(site_id, [], "v", T0)
    store.touch_sites({"site-a": T0 + 1, "site-c": T0 + 3, "unknown": T0 + 9})
    sites = store.list_sites()
    assert [s.id for s in sites] == ["site-a", "site-b", "site-c"]
    assert [s.last_seen_at for s in sites] == [T0 + 1, T0, T0 + 3]
    assert [s.registered_at for s in sites] == [T0, T0, T0]


# -- runs -------------------------------------------------------------------------


def test_create_get_and_list_runs(store: Store) -> None:
    created = store.create_run("r2", "second", "task.b", '{"x": 1}', T0 + 1)
    store.create_run("r1", "first", "task.a", "{}", T0)
    store.create_run("r0", "tie", "task.a", "{}", T0 + 1)
    assert created.state == "pending" and created.rounds_completed == 0
    assert store.get_run("r2") == created
    assert created.spec_json == '{"x": 1}' and created.reason == ""
    assert created.created_at == created.updated_at == T0 + 1
    assert store.get_run("nope") is None
    # Ordered by creation time, then id.
    assert [r.id for r in store.list_runs()] == ["r1", "r0", "r2"]


def test_set_run_state_and_filter(store: Store) -> None:
    for run_id in ("a", "b", "c"):
        store.create_run(run_id, run_id, "task", "{}", T0)
    store.set_run_state("a", "running", "", T0 + 1)
    store.set_run_state("b", "failed", "site quorum lost", T0 + 2)
    b = store.get_run("b")
    assert b is not None
    assert (b.state, b.reason, b.updated_at, b.created_at) == (
        "failed",
        "site quorum lost",
        T0 + 2,
        T0,
    )
    assert b.finished
    assert [r.id for r in store.list_runs(["running", "pending"])] == ["a", "c"]
    assert [r.id for r in store.list_runs(["failed"])] == ["b"]
    assert store.list_runs([]) == []


def test_set_run_state_of_unknown_run_raises(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.set_run_state("ghost", "running", "", T0)
    assert store.get_run("ghost") is None


# -- rounds -----------------------------------------------------------------------


def test_open_round_creates_round_and_participations(run_store: Store) -> None:
    run_store.open_round(RUN, 1, 1, {"b": "tb", "a": "ta", "c": "tc"}, T0, T0 + 60)
    rnd = run_store.get_open_round(RUN)
    assert rnd is not None
    assert (rnd.run_id, rnd.number, rnd.attempt, rnd.state) == (RUN, 1, 1, "open")
    assert rnd.sampled == ("a", "b", "c")
    assert (rnd.opened_at, rnd.deadline_at, rnd.closed_at, rnd.metrics) == (
        T0,
        T0 + 60,
        None,
        {},
    )
    parts = run_store.list_participations(RUN, 1)
    assert [(p.site_id, p.task_id, p.attempt) for p in parts] == [
        ("a", "ta", 1),
        ("b", "tb", 1),
        ("c", "tc", 1),
    ]
    assert all(p.state == "assigned" and p.assigned_at == T0 for p in parts)
    assert all(p.bytes_down == 0 and p.update_sha256 is None for p in parts)


def test_reopen_for_next_attempt_keeps_earlier_participations(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    run_store.expire_attempt(RUN, 1, 1, "quorum not reached", T0 + 60)
    _open(run_store, 1, 2, ["b", "c"], at=T0 + 61)

    [rnd] = run_store.list_rounds(RUN)
    assert (rnd.attempt, rnd.sampled, rnd.state) == (2, ("b", "c"), "open")
    assert (rnd.opened_at, rnd.deadline_at) == (T0 + 61, T0 + 121)
    assert _states(run_store, 1) == {
        _task(1, 1, "a"): "expired",
        _task(1, 1, "b"): "expired",
        _task(1, 2, "b"): "assigned",
        _task(1, 2, "c"): "assigned",
    }
    assert [p.site_id for p in run_store.list_participations(RUN, 1, attempt=2)] == ["b", "c"]


def test_open_round_on_committed_round_raises(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0 + 30)
    with pytest.raises(DuplicateError):
        _open(run_store, 1, 2, ["a", "b"])
    [rnd] = run_store.list_rounds(RUN)
    assert (rnd.state, rnd.attempt) == ("committed", 1)
    assert list(_states(run_store)) == [_task(1, 1, "a")]


def test_get_open_round_list_rounds_and_extend_deadline(run_store: Store) -> None:
    assert run_store.get_open_round(RUN) is None
    assert run_store.list_rounds(RUN) == []
    _open(run_store, 2, 1, ["a"])
    run_store.commit_round(RUN, 2, _checkpoint(2), {"loss": 0.25}, T0 + 30)
    assert run_store.get_open_round(RUN) is None
    _open(run_store, 1, 1, ["a"])
    run_store.extend_deadline(RUN, 1, T0 + 500)
    rnd = run_store.get_open_round(RUN)
    assert rnd is not None and (rnd.number, rnd.deadline_at) == (1, T0 + 500)
    rounds = run_store.list_rounds(RUN)
    assert [(r.number, r.state) for r in rounds] == [(1, "open"), (2, "committed")]
    assert rounds[1].deadline_at == T0 + 60  # extend_deadline touched round 1 only
    assert run_store.list_rounds("other-run") == []


# -- participations ---------------------------------------------------------------


def test_mark_downloaded_accumulates(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    task = _task(1, 1, "a")
    run_store.mark_downloaded(task, 1000, 0.5)
    run_store.mark_downloaded(task, 24, 0.25)
    p, other = run_store.list_participations(RUN, 1)
    assert (p.state, p.bytes_down, p.download_s) == ("downloaded", 1024, 0.75)
    assert (other.state, other.bytes_down) == ("assigned", 0)
    with pytest.raises(NotFoundError):
        run_store.mark_downloaded("no-such-task", 1, 0.1)


def test_byte_counts_beyond_32_bits_are_kept(run_store: Store) -> None:
    """A model of several GB: counts are 64-bit in the database, bound as such too."""
    _open(run_store, 1, 1, ["a", "b"])
    big = 3 * 2**31 + 5
    run_store.mark_downloaded_many([(_task(1, 1, "a"), big, 1.0, 0)])
    run_store.mark_downloaded(_task(1, 1, "a"), big, 1.0)
    run_store.accept_update(
        _task(1, 1, "b"),
        nonce=b"n" * 16,
        sha256="a" * 64,
        num_samples=1,
        metrics={},
        bytes_up=big,
        upload_s=1.0,
        now=T0,
    )
    a, b = run_store.list_participations(RUN, 1)
    assert (a.bytes_down, b.bytes_up) == (2 * big, big)


def test_cut_transfers_are_counted_apart_from_completed_ones(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    missing = run_store.mark_downloaded_many(
        [(_task(1, 1, "a"), 100, 0.5, 0)],
        [(_task(1, 1, "a"), 30), (_task(1, 1, "b"), 7), ("no-such-task", 1)],
    )
    assert missing == ["no-such-task"]
    run_store.mark_downloaded_many([], [(_task(1, 1, "b"), 2**33)])  # 64-bit, added up
    a, b = run_store.list_participations(RUN, 1)
    assert (a.state, a.bytes_down, a.bytes_cut) == ("downloaded", 100, 30)
    assert (b.state, b.bytes_down, b.bytes_cut) == ("assigned", 0, 7 + 2**33)
    assert run_store.mark_downloaded_many([], []) == []


def test_mark_downloaded_many_writes_all_in_one_transaction(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    commits: list[str] = []
    event.listen(run_store.engine, "commit", lambda _conn: commits.append("commit"))
    missing = run_store.mark_downloaded_many(
        [
            (_task(1, 1, "a"), 10, 0.5, 1),
            ("no-such-task", 1, 0.1, None),
            (_task(1, 1, "b"), 20, 1.0, 0),
        ]
    )
    assert missing == ["no-such-task"] and commits == ["commit"]
    a, b = run_store.list_participations(RUN, 1)
    assert (a.state, a.bytes_down, a.download_s, a.base_round) == ("downloaded", 10, 0.5, 1)
    assert (b.state, b.bytes_down, b.base_round) == ("downloaded", 20, 0)


def test_reads_do_not_wait_for_a_writer(run_store: Store, db_url: str) -> None:
    """A status read must neither wait for a write in progress nor hold one up: on SQLite
    a read that took the write lock as writes do queued behind every writer (and writers
    behind it), sleeping up to 100 ms at a time in SQLite's busy handler."""
    _open(run_store, 1, 1, ["a"])
    other = make_engine(db_url)
    try:
        with other.begin() as conn:  # a writer in another connection, mid-transaction
            conn.execute(
                text("UPDATE participations SET bytes_down = 7 WHERE task_id = :t"),
                {"t": _task(1, 1, "a")},
            )
            done = threading.Event()
            seen: list[int] = []

            def _read() -> None:
                seen.append(run_store.list_participations(RUN, 1)[0].bytes_down)
                assert run_store.get_run(RUN) is not None
                done.set()

            reader = threading.Thread(target=_read, daemon=True)
            reader.start()
            assert done.wait(5), "a read waited for the writer's transaction"
        assert seen == [0]  # the snapshot before the write committed
    finally:
        other.dispose()


def test_mark_downloaded_does_not_lose_concurrent_increments(run_store: Store, db_url: str) -> None:
    """A download recorded while another transaction holds the row adds, not overwrites."""
    _open(run_store, 1, 1, ["a"])
    task = _task(1, 1, "a")
    about_to_update = threading.Event()

    def _signal(_c: object, _cur: object, statement: str, *_rest: object) -> None:
        # SQLite's BEGIN IMMEDIATE waits for the write lock before the UPDATE is sent.
        if statement.lstrip().upper().startswith(("UPDATE PARTICIPATIONS", "BEGIN IMMEDIATE")):
            about_to_update.set()

    errors: list[BaseException] = []

    def _download() -> None:
        try:
            run_store.mark_downloaded(task, 10, 0.5)
        except BaseException as exc:
            errors.append(exc)
            about_to_update.set()

    worker = threading.Thread(target=_download, daemon=True)
    event.listen(run_store.engine, "before_cursor_execute", _signal)
    other = make_engine(db_url)
    try:
        with other.begin() as conn:  # holds the row (PG) / the write lock (SQLite)
            conn.execute(
                text("UPDATE participations SET bytes_down = bytes_down + 100 WHERE task_id = :t"),
                {"t": task},
            )
            worker.start()
            # Once the worker is about to write, commit: its write must see ours.
            assert about_to_update.wait(10)
    finally:
        if worker.ident is not None:
            worker.join(20)
        event.remove(run_store.engine, "before_cursor_execute", _signal)
        other.dispose()
    assert not worker.is_alive()
    assert errors == []
    [p] = run_store.list_participations(RUN, 1)
    assert (p.bytes_down, p.state) == (110, "downloaded")


def test_accept_update_records_the_update(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    task = _task(1, 1, "a")
    run_store.mark_downloaded(task, 50, 0.1)
    nonce = bytes(range(32))
    _accept(run_store, task, nonce, sha="d" * 64)
    [p] = run_store.list_participations(RUN, 1)
    assert p.state == "accepted"
    assert p.update_sha256 == "d" * 64
    assert (p.num_samples, p.bytes_up, p.upload_s) == (128, 4096, 1.5)
    assert p.metrics == {"loss": 0.5}
    assert p.finished_at == T0 + 10
    assert p.bytes_down == 50
    assert _nonce(run_store, task) == nonce
    assert run_store.get_participation(task) == p
    assert run_store.get_participation("no-such-task") is None


def test_second_accept_for_same_task_raises(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    task = _task(1, 1, "a")
    _accept(run_store, task, b"\x01" * 32, sha="1" * 64)
    with pytest.raises(DuplicateError):
        _accept(run_store, task, b"\x02" * 32, sha="2" * 64)
    [p] = run_store.list_participations(RUN, 1)
    assert (p.state, p.update_sha256) == ("accepted", "1" * 64)
    assert _nonce(run_store, task) == b"\x01" * 32


def _accept_op(store: Store, task_id: str, nonce: bytes, sha: str = "a" * 64) -> WriteOp:
    return store.accept_op(
        task_id, nonce=nonce, sha256=sha, num_samples=128, metrics={"loss": 0.5},
        bytes_up=4096, upload_s=1.5, now=T0 + 10,
    )  # fmt: skip


def test_a_batch_runs_each_statement_once_whatever_the_writes_between(run_store: Store) -> None:
    sites = [f"s{i}" for i in range(6)]
    _open(run_store, 1, 1, sites)
    ops: list[WriteOp] = []
    for i, site in enumerate(sites):  # as the coordinator queues them: an event, an accept
        ops.append(run_store.add_event_op(RUN, "note", f"n{i}", T0 + i, 1, {"i": i}))
        ops.append(_accept_op(run_store, _task(1, 1, site), bytes([i]) * 32))
    ops.append(run_store.touch_sites_op({"s0": T0}))  # a write of another kind, run as it is
    statements: list[str] = []

    def record(conn: Any, cursor: Any, sql: str, params: Any, context: Any, many: bool) -> None:
        statements.append(sql)

    event.listen(run_store.engine, "before_cursor_execute", record)
    try:
        assert run_store.write_batch(ops) == [None] * len(ops)
    finally:
        event.remove(run_store.engine, "before_cursor_execute", record)
    assert sum(sql.lstrip().startswith("UPDATE participations") for sql in statements) == 1
    assert sum(sql.lstrip().startswith("INSERT INTO events") for sql in statements) == 1
    assert [p.state for p in run_store.list_participations(RUN, 1)] == ["accepted"] * 6
    assert [_nonce(run_store, _task(1, 1, s)) for s in sites] == [bytes([i]) * 32 for i in range(6)]
    notes = [e for e in run_store.list_events(RUN) if e.kind == "note"]
    assert [(e.message, e.data) for e in notes] == [(f"n{i}", {"i": i}) for i in range(6)]


def test_a_refused_accept_in_a_batch_is_named_and_the_rest_are_written(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b", "c", "d"])
    _accept(run_store, _task(1, 1, "b"), b"\x01" * 32)  # b's task is accepted already
    ops = [
        _accept_op(run_store, _task(1, 1, "a"), b"\x02" * 32),
        _accept_op(run_store, _task(1, 1, "b"), b"\x03" * 32),  # refused: already accepted
        _accept_op(run_store, _task(1, 1, "c"), b"\x01" * 32),  # refused: b's nonce
        _accept_op(run_store, "no-such-task", b"\x04" * 32),  # refused: no such task
        _accept_op(run_store, _task(1, 1, "d"), b"\x05" * 32),
    ]
    errors = run_store.write_batch(ops)
    assert errors[0] is None and errors[4] is None
    assert isinstance(errors[1], DuplicateError) and "already accepted" in str(errors[1])
    assert isinstance(errors[2], DuplicateError) and "nonce" in str(errors[2])
    assert isinstance(errors[3], NotFoundError)
    states = {p.site_id: p.state for p in run_store.list_participations(RUN, 1)}
    assert states == {"a": "accepted", "b": "accepted", "c": "assigned", "d": "accepted"}
    assert _nonce(run_store, _task(1, 1, "b")) == b"\x01" * 32


def test_reused_nonce_on_another_task_raises_and_changes_nothing(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    nonce = b"\x07" * 32
    _accept(run_store, _task(1, 1, "a"), nonce)
    with pytest.raises(DuplicateError, match="nonce"):
        _accept(run_store, _task(1, 1, "b"), nonce, sha="e" * 64)
    _, b = run_store.list_participations(RUN, 1)
    assert (b.state, b.update_sha256, b.num_samples, b.finished_at) == ("assigned", None, 0, None)
    assert _nonce(run_store, b.task_id) is None
    # The task is still usable with a fresh nonce.
    _accept(run_store, b.task_id, b"\x08" * 32, sha="e" * 64)
    assert _states(run_store, 1)[b.task_id] == "accepted"


def test_fail_participation(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b"])
    accepted, failing = _task(1, 1, "a"), _task(1, 1, "b")
    _accept(run_store, accepted, b"\x03" * 32)
    run_store.fail_participation(failing, "out of memory", T0 + 20)
    run_store.fail_participation(accepted, "late failure report", T0 + 21)
    a, b = run_store.list_participations(RUN, 1)
    assert (a.state, a.error, a.finished_at) == ("accepted", "", T0 + 10)
    assert (b.state, b.error, b.finished_at) == ("failed", "out of memory", T0 + 20)
    run_store.fail_participation(failing, "second report", T0 + 22)
    assert run_store.list_participations(RUN, 1)[1].error == "out of memory"
    with pytest.raises(NotFoundError):
        run_store.fail_participation("no-such-task", "x", T0)


def test_fail_participations_fails_the_unfinished_of_many_in_one_go(run_store: Store) -> None:
    """More tasks than one IN list holds: the unfinished ones fail with the reason, the
    final ones (accepted, failed before) and those not named keep what they had."""
    sites = [f"s{i:04d}" for i in range(1203)]
    _open(run_store, 1, 1, sites)
    run_store.mark_downloaded(_task(1, 1, sites[1]), 10, 0.1)
    _accept(run_store, _task(1, 1, sites[0]), b"\x05" * 32)
    run_store.fail_participation(_task(1, 1, sites[2]), "crashed", T0 + 5)
    named = [_task(1, 1, s) for s in sites[:-1]]  # the last one is left alone
    run_store.fail_participations(named, "site went silent for more than 20 s", T0 + 30)
    run_store.fail_participations([], "nothing", T0 + 31)
    parts = {p.site_id: p for p in run_store.list_participations(RUN, 1)}
    assert (parts[sites[0]].state, parts[sites[0]].error) == ("accepted", "")
    assert (parts[sites[2]].state, parts[sites[2]].error) == ("failed", "crashed")
    assert parts[sites[-1]].state == "assigned"
    failed = [parts[s] for s in (sites[1], *sites[3:-1])]
    assert {(p.state, p.error, p.finished_at) for p in failed} == {
        ("failed", "site went silent for more than 20 s", T0 + 30)
    }
    assert len(failed) == 1200


def test_failed_since_finds_each_site_s_latest_failure_of_one_kind(run_store: Store) -> None:
    """What a restart reads back to hold declined sites out of sampling: per site its
    latest failure of that kind since a time; other kinds, older ones, other states and a
    prefix's own wildcard characters do not count."""
    _open(run_store, 1, 1, ["a", "b", "c", "d", "e"])
    declined = "site declined: "
    run_store.fail_participation(_task(1, 1, "a"), declined + "not approved", T0 + 10)
    run_store.fail_participation(_task(1, 1, "b"), declined + "cohort too small", T0 + 2)
    run_store.fail_participation(_task(1, 1, "c"), "site reported: disk full", T0 + 10)
    run_store.fail_participation(_task(1, 1, "d"), "site declined_ 100% sure", T0 + 10)
    _open(run_store, 2, 1, ["a"], at=T0 + 20)
    run_store.fail_participation(_task(2, 1, "a"), declined + "not approved", T0 + 25)
    assert run_store.failed_since(RUN, declined, T0 + 5) == {"a": T0 + 25}
    assert run_store.failed_since(RUN, declined, T0) == {"a": T0 + 25, "b": T0 + 2}
    assert run_store.failed_since(RUN, "site declined_ 100%", T0) == {"d": T0 + 10}
    assert run_store.failed_since(RUN, "site declined_", T0) == {"d": T0 + 10}  # _ as itself
    assert run_store.failed_since("another-run", declined, T0) == {}


def test_expire_attempt_touches_only_unfinished_of_that_attempt(run_store: Store) -> None:
    _open(run_store, 1, 1, ["acc", "asg", "dl", "fail"])
    run_store.mark_downloaded(_task(1, 1, "dl"), 10, 0.1)
    _accept(run_store, _task(1, 1, "acc"), b"\x04" * 32)
    run_store.fail_participation(_task(1, 1, "fail"), "crashed", T0 + 5)
    run_store.expire_attempt(RUN, 1, 1, "deadline passed", T0 + 60)
    _open(run_store, 1, 2, ["asg", "new"], at=T0 + 61)
    run_store.expire_attempt(RUN, 1, 1, "again", T0 + 99)  # attempt 2 must not be touched

    by_task = {p.task_id: p for p in run_store.list_participations(RUN, 1)}
    assert {t: p.state for t, p in by_task.items()} == {
        _task(1, 1, "acc"): "accepted",
        _task(1, 1, "asg"): "expired",
        _task(1, 1, "dl"): "expired",
        _task(1, 1, "fail"): "failed",
        _task(1, 2, "asg"): "assigned",
        _task(1, 2, "new"): "assigned",
    }
    expired = by_task[_task(1, 1, "dl")]
    assert (expired.error, expired.finished_at, expired.bytes_down) == (
        "deadline passed",
        T0 + 60,
        10,
    )
    assert by_task[_task(1, 1, "fail")].error == "crashed"
    assert by_task[_task(1, 2, "new")].finished_at is None


# -- commit_round and checkpoints -------------------------------------------------


def test_commit_round_is_one_atomic_step(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a", "b", "c"])
    _accept(run_store, _task(1, 1, "a"), b"\x05" * 32)
    run_store.mark_downloaded(_task(1, 1, "b"), 10, 0.1)
    ckpt = CheckpointRecord(RUN, 1, "f" * 64, 12345, "0" * 64, T0 + 40)
    run_store.commit_round(RUN, 1, ckpt, {"loss": 0.125, "accuracy": 0.9}, T0 + 41)

    assert run_store.get_checkpoint(RUN, 1) == ckpt
    assert run_store.latest_checkpoint(RUN) == ckpt
    [rnd] = run_store.list_rounds(RUN)
    assert (rnd.state, rnd.closed_at) == ("committed", T0 + 41)
    assert rnd.metrics == {"loss": 0.125, "accuracy": 0.9}
    assert run_store.get_open_round(RUN) is None
    parts = run_store.list_participations(RUN, 1)
    assert [p.state for p in parts] == ["accepted", "expired", "expired"]
    assert all(p.finished_at == T0 + 41 and p.error for p in parts[1:])
    run = run_store.get_run(RUN)
    assert run is not None
    assert (run.state, run.rounds_completed, run.updated_at) == ("running", 1, T0 + 41)


def test_commit_round_expires_earlier_attempts_and_sets_final_state(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    _open(run_store, 1, 2, ["b"], at=T0 + 61)  # attempt 1 was never expired explicitly
    _accept(run_store, _task(1, 2, "b"), b"\x06" * 32)
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0 + 90, final_state="completed")
    assert _states(run_store, 1) == {_task(1, 1, "a"): "expired", _task(1, 2, "b"): "accepted"}
    run = run_store.get_run(RUN)
    assert run is not None and (run.state, run.rounds_completed) == ("completed", 1)
    assert run.finished


def test_async_tasks_carry_over_into_the_next_round(run_store: Store) -> None:
    """An async round commits with some tasks still training: they are kept, then move
    into the next round with the round in their task and the model they downloaded."""
    _open(run_store, 1, 1, ["a", "b", "c"])
    _accept(run_store, _task(1, 1, "a"), b"\x07" * 32)
    run_store.mark_downloaded(_task(1, 1, "b"), 10, 0.1, base_round=1)
    carried = [_task(1, 1, "b"), _task(1, 1, "c")]
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0 + 30, keep=carried)
    assert _states(run_store, 1) == {
        _task(1, 1, "a"): "accepted", _task(1, 1, "b"): "downloaded", _task(1, 1, "c"): "assigned"
    }  # fmt: skip
    run_store.open_round(RUN, 2, 1, {"a": _task(2, 1, "a")}, T0 + 31, T0 + 90, carry=carried)
    assert _states(run_store, 1) == {_task(1, 1, "a"): "accepted"}  # the others moved on
    parts = {p.task_id: p for p in run_store.list_participations(RUN, 2, 1)}
    assert sorted(parts) == sorted([*carried, _task(2, 1, "a")])
    assert (parts[_task(1, 1, "b")].issued_round, parts[_task(1, 1, "b")].base_round) == (1, 1)
    assert (parts[_task(1, 1, "c")].state, parts[_task(1, 1, "c")].base_round) == ("assigned", None)
    assert parts[_task(2, 1, "a")].issued_round == 2
    # A failed attempt keeps them too; a crash between commit and open loses them cleanly.
    run_store.expire_attempt(RUN, 2, 1, "no quorum", T0 + 95, keep=[_task(1, 1, "c")])
    assert _states(run_store, 2)[_task(1, 1, "c")] == "assigned"
    assert _states(run_store, 2)[_task(1, 1, "b")] == "expired"
    assert run_store.expire_unfinished_before(RUN, 3, "restarted", T0 + 99) == 1
    assert _states(run_store, 2)[_task(1, 1, "c")] == "expired"


def test_second_commit_of_a_round_raises_and_changes_nothing(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    first = _checkpoint(1, sha="1" * 64)
    run_store.commit_round(RUN, 1, first, {"loss": 1.0}, T0 + 30)
    run_before = run_store.get_run(RUN)
    rounds_before = run_store.list_rounds(RUN)

    with pytest.raises(DuplicateError):
        run_store.commit_round(
            RUN, 1, _checkpoint(1, sha="2" * 64), {"loss": 0.0}, T0 + 99, final_state="failed"
        )
    assert run_store.list_checkpoints(RUN) == [first]
    assert run_store.get_run(RUN) == run_before
    assert run_store.list_rounds(RUN) == rounds_before


def test_failed_commit_round_rolls_everything_back(run_store: Store) -> None:
    """If any part of the commit fails (here the checkpoint insert), nothing is written."""
    _open(run_store, 1, 1, ["a"])
    with run_store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO checkpoints (run_id, round_number, model_sha256, model_bytes,"
                " created_at) VALUES (:r, 1, :sha, 1, 0)"
            ),
            {"r": RUN, "sha": "9" * 64},
        )
    run_before = run_store.get_run(RUN)
    with pytest.raises((IntegrityError, DuplicateError)):
        run_store.commit_round(RUN, 1, _checkpoint(1), {"loss": 0.5}, T0 + 30, "completed")
    rnd = run_store.get_open_round(RUN)
    assert rnd is not None and (rnd.closed_at, rnd.metrics) == (None, {})
    assert _states(run_store, 1) == {_task(1, 1, "a"): "assigned"}
    assert run_store.get_run(RUN) == run_before
    assert [c.model_sha256 for c in run_store.list_checkpoints(RUN)] == ["9" * 64]


def test_checkpoint_queries(run_store: Store) -> None:
    assert run_store.latest_checkpoint(RUN) is None
    assert run_store.list_checkpoints(RUN) == []
    for number in (1, 2, 3):
        _open(run_store, number, 1, ["a"])
        run_store.commit_round(RUN, number, _checkpoint(number, sha=str(number) * 64), {}, T0)
    run_store.create_run("other", "other", "task", "{}", T0)
    latest = run_store.latest_checkpoint(RUN)
    assert latest is not None and (latest.round_number, latest.model_sha256) == (3, "3" * 64)
    assert [c.round_number for c in run_store.list_checkpoints(RUN)] == [1, 2, 3]
    second = run_store.get_checkpoint(RUN, 2)
    assert second == CheckpointRecord(RUN, 2, "2" * 64, 1002, None, T0 + 2)
    assert run_store.get_checkpoint(RUN, 4) is None
    assert run_store.latest_checkpoint("other") is None
    run = run_store.get_run(RUN)
    assert run is not None and run.rounds_completed == 3


def test_read_run_from_a_round_on(run_store: Store) -> None:
    """``since``: what a run watch reads, the rounds that can still change, and no others."""
    for number in (1, 2, 3):
        _open(run_store, number, 1, ["a", "b"])
        run_store.commit_round(RUN, number, _checkpoint(number), {}, T0)
    run_store.create_run("other", "other", "task", "{}", T0)
    run_store.open_round("other", 3, 1, {"a": "other-3-a"}, T0, T0 + 60)
    view = run_store.read_run(RUN, since=2)  # one transaction
    assert view is not None and view.run.id == RUN
    assert [r.number for r in view.rounds] == [2, 3]
    assert [(p.round_number, p.site_id) for p in view.participations] == [
        (2, "a"), (2, "b"), (3, "a"), (3, "b"),
    ]  # fmt: skip
    assert [c.round_number for c in view.checkpoints] == [2, 3]
    assert run_store.read_run("no-such-run") is None
    whole, past = run_store.read_run(RUN), run_store.read_run(RUN, since=4)
    assert whole is not None and [r.number for r in whole.rounds] == [1, 2, 3]
    assert len(whole.participations) == 6 and len(whole.checkpoints) == 3
    assert past is not None and (past.rounds, past.participations, past.checkpoints) == ([], [], [])


def test_read_run_at_most_limit_rounds(run_store: Store) -> None:
    """``limit``: a page of a long run's status; the rest of the run is not read."""
    for number in (1, 2, 3, 4):
        _open(run_store, number, 1, ["a", "b"])
        run_store.commit_round(RUN, number, _checkpoint(number), {}, T0)
    page = run_store.read_run(RUN, since=2, limit=2)
    assert page is not None and page.more_rounds
    assert [r.number for r in page.rounds] == [2, 3]
    assert sorted({p.round_number for p in page.participations}) == [2, 3]
    assert [c.round_number for c in page.checkpoints] == [2, 3]
    last = run_store.read_run(RUN, since=4, limit=2)
    assert last is not None and not last.more_rounds
    assert [r.number for r in last.rounds] == [4] and len(last.participations) == 2
    exact = run_store.read_run(RUN, since=1, limit=4)  # no round after the fourth
    assert exact is not None and not exact.more_rounds and len(exact.rounds) == 4
    past = run_store.read_run(RUN, since=9, limit=1)
    assert past is not None and not past.more_rounds and past.rounds == []
    whole = run_store.read_run(RUN)
    assert whole is not None and not whole.more_rounds and len(whole.rounds) == 4
    with pytest.raises(ValueError, match="limit"):
        run_store.read_run(RUN, limit=0)


def _rounds(store: Store, since: int) -> tuple[dict[int, Any], set[int]]:
    view = store.read_run(RUN, since=since)
    assert view is not None
    return round_statuses(view)


def test_a_round_is_final_once_no_task_of_it_can_change(run_store: Store) -> None:
    """An async run carries a task still training into the next round: until it has moved,
    its committed round still changes, so a run watch must keep reading it."""
    _open(run_store, 1, 1, ["a", "b"])
    _accept(run_store, _task(1, 1, "a"), b"\x01" * 16)
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0, keep=[_task(1, 1, "b")])
    rounds, final = _rounds(run_store, 0)
    assert (sorted(rounds), final) == ([1], set())  # committed, but b's task is still open
    run_store.open_round(
        RUN, 2, 1, {"a": _task(2, 1, "a")}, T0 + 1, T0 + 60, carry=[_task(1, 1, "b")]
    )
    rounds, final = _rounds(run_store, 0)
    assert final == {1}  # b's task moved on: nothing of round 1 can change now
    assert [p.site_id for p in rounds[1].participations] == ["a"]
    assert [p.site_id for p in rounds[2].participations] == ["a", "b"]
    rounds, final = _rounds(run_store, 2)
    assert (sorted(rounds), final) == ([2], set())  # open


# -- events -----------------------------------------------------------------------


def test_events_keep_order_and_data(run_store: Store) -> None:
    run_store.create_run("other", "other", "task", "{}", T0)
    run_store.add_event(RUN, "created", "run submitted", T0)
    run_store.add_event("other", "created", "not mine", T0)
    data: dict[str, float | int | str] = {"loss": 0.1, "sites": 3, "note": "näive ✓"}
    run_store.add_event(RUN, "round_committed", "round 1 done", T0 + 1, round_number=1, data=data)
    run_store.add_event(RUN, "created", "earlier clock, later id", T0 - 5)

    events = run_store.list_events(RUN)
    assert [e.message for e in events] == [
        "run submitted",
        "round 1 done",
        "earlier clock, later id",
    ]
    assert events[0].id < events[1].id < events[2].id
    assert (events[0].round_number, events[0].data, events[0].created_at) == (None, {}, T0)
    assert (events[1].kind, events[1].round_number, events[1].data) == ("round_committed", 1, data)
    assert events[1].created_at == T0 + 1
    assert [e.message for e in run_store.list_events("other")] == ["not mine"]


def test_opening_and_committing_a_round_write_their_event_in_the_same_transaction(
    run_store: Store,
) -> None:
    run_store.open_round(
        RUN, 1, 1, {"a": _task(1, 1, "a")}, T0, T0 + 60, event=("round_opened", "with a")
    )
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0 + 5, event=("round_committed", "1/1"))
    with pytest.raises(DuplicateError):  # refused: nothing of it is written, its event neither
        run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0 + 6, event=("round_committed", "x"))
    with pytest.raises(DuplicateError):
        run_store.open_round(RUN, 1, 2, {"b": "t-b"}, T0 + 7, T0 + 60, event=("round_opened", "x"))
    events = [(e.kind, e.message, e.round_number, e.created_at) for e in run_store.list_events(RUN)]
    assert events == [
        ("round_opened", "with a", 1, T0),
        ("round_committed", "1/1", 1, T0 + 5),
    ]


# -- durability -------------------------------------------------------------------

_CHILD = """
import json, os, sys
from fedra.storage import Store

store = Store(sys.argv[1])
run = store.get_run("run-1")
events = [e.message for e in store.list_events("run-1")]
print(json.dumps({"state": run.state, "events": events, "pid": os.getpid()}))
store.add_event("run-1", "note", "written by the child", 2.0, data={"pid": os.getpid()})
sys.stdout.flush()
os._exit(0)  # no close() and no interpreter teardown: only what was committed survives
"""


def test_data_survives_close_and_other_processes(db_url: str) -> None:
    first = Store(db_url)
    first.create_run(RUN, "demo", "task", "{}", T0)
    first.set_run_state(RUN, "running", "", T0)
    first.add_event(RUN, "note", "written by the parent", 1.0)
    first.close()

    child = subprocess.run(
        [sys.executable, "-c", _CHILD, db_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert (seen["state"], seen["events"]) == ("running", ["written by the parent"])

    reopened = Store(db_url)
    try:
        run = reopened.get_run(RUN)
        assert run is not None and run.state == "running"
        events = reopened.list_events(RUN)
        assert [e.message for e in events] == ["written by the parent", "written by the child"]
        assert events[1].data == {"pid": seen["pid"]}
    finally:
        reopened.close()


# -- blob store -------------------------------------------------------------------


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def test_blob_put_read_size_exists_delete(blobs: BlobStore) -> None:
    data = b"model weights" * 1000
    digest = blobs.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert blobs.exists(digest)
    assert blobs.read(digest) == data
    assert blobs.size(digest) == len(data)
    assert blobs.path(digest) == blobs.root / digest[:2] / digest
    blobs.delete(digest)
    assert not blobs.exists(digest)
    blobs.delete(digest)  # deleting a missing blob is not an error
    with pytest.raises(BlobNotFoundError):
        blobs.read(digest)
    with pytest.raises(BlobNotFoundError):
        blobs.size(digest)


def test_a_blob_taken_out_leaves_the_store_at_once_and_a_start_clears_it(
    blobs: BlobStore,
) -> None:
    data = os.urandom(3000)
    digest = blobs.put(data)
    gone = blobs.take_out(digest)
    assert gone is not None and gone.read_bytes() == data  # still there, for its unlink
    assert not blobs.exists(digest) and list(blobs.digests()) == []
    with pytest.raises(BlobNotFoundError):
        blobs.read(digest)
    assert blobs.take_out(digest) is None  # nothing left to take
    assert blobs.put(data) == digest and blobs.read(digest) == data  # the same bytes again
    assert blobs.clear_tmp() == 1 and not gone.exists()  # as a start after a crash does
    assert blobs.read(digest) == data


def _tamper_in_place(path: Path) -> None:
    """Change a byte of ``path`` and give it back its size, mtime and inode: what a
    blob's record (``_verified``) compares is then all unchanged."""
    before = path.stat()
    with path.open("r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_ino == before.st_ino and path.stat().st_size == before.st_size


def test_a_blob_gone_or_evicted_is_forgotten_and_read_again_is_hashed_again(
    blobs: BlobStore,
) -> None:
    """A store remembers a blob hashed right (a read then skips the hash); the record
    goes with the blob, or when its pages are dropped as not to be read again soon: a
    coordinator's store writes a blob a site a round, and records of blobs long gone
    were its memory growing round after round. An evicted blob read again is hashed
    again: changed on disk meanwhile, it reads as damaged."""
    data = [os.urandom(5000) for _ in range(3)]
    digests = [blobs.put(d) for d in data]
    assert all(blobs.read(d) == x for d, x in zip(digests, data, strict=True))
    blobs.delete(digests[0])
    assert blobs.take_out(digests[1]) is not None
    blobs.evict(digests[2])
    assert blobs._verified == {}  # nothing outlives its blob
    _tamper_in_place(blobs.path(digests[2]))
    with pytest.raises(BlobCorruptError):
        blobs.read(digests[2])


def test_a_read_that_ends_after_its_blob_was_taken_out_records_nothing(
    blobs: BlobStore,
) -> None:
    reading = blobs.put(os.urandom(3 * 4096))
    blobs.evict(reading)  # forgotten: the read below hashes it
    chunks = blobs.read_chunks(reading, chunk_bytes=4096)
    next(chunks)
    gone = blobs.take_out(reading)  # while a read of it is under way
    assert gone is not None and len(b"".join(chunks)) == 2 * 4096
    assert blobs._verified == {}  # the read that ended after it went recorded nothing


def test_blob_empty(blobs: BlobStore) -> None:
    digest = blobs.put(b"")
    assert digest == hashlib.sha256(b"").hexdigest()
    assert (blobs.read(digest), blobs.size(digest)) == (b"", 0)
    assert list(blobs.read_chunks(digest, 4)) == []


def test_blob_content_addressing_stores_once(blobs: BlobStore) -> None:
    first = blobs.put(b"same bytes")
    second = blobs.put_chunks([b"same ", b"", b"bytes"])
    assert first == second
    assert _files(blobs.root) == [blobs.path(first)]
    assert blobs.put(b"other bytes") != first
    assert len(_files(blobs.root)) == 2


def test_put_chunks_with_wrong_digest_leaves_nothing(blobs: BlobStore) -> None:
    data = b"tampered update"
    wrong = hashlib.sha256(b"declared update").hexdigest()
    with pytest.raises(BlobDigestError, match=wrong):
        blobs.put_chunks([data[:5], data[5:]], expected_digest=wrong)
    assert _files(blobs.root) == []
    assert not blobs.exists(hashlib.sha256(data).hexdigest())
    assert not blobs.exists(wrong)
    right = hashlib.sha256(data).hexdigest()
    assert blobs.put_chunks([data], expected_digest=right) == right


def test_writer_without_commit_leaves_nothing(blobs: BlobStore) -> None:
    with blobs.writer() as w:
        w.write(b"partial ")
        w.write(b"upload")
        assert w.bytes_written == 14
        assert w.hexdigest() == hashlib.sha256(b"partial upload").hexdigest()
    assert _files(blobs.root) == []

    with pytest.raises(ConnectionError), blobs.writer() as w:
        w.write(b"dropped mid-stream")
        raise ConnectionError("peer went away")
    assert _files(blobs.root) == []


def test_writer_commit(blobs: BlobStore) -> None:
    with blobs.writer() as w:
        w.write(b"abc")
        digest = w.commit()
    assert digest == hashlib.sha256(b"abc").hexdigest()
    assert _files(blobs.root) == [blobs.path(digest)]


def test_clear_tmp_removes_leftovers(blobs: BlobStore, tmp_path: Path) -> None:
    kept = blobs.put(b"keep me")
    (blobs.root / "tmp" / "blob-crashed1").write_bytes(b"half")
    (blobs.root / "tmp" / "blob-crashed2").write_bytes(b"written")
    reopened = BlobStore(tmp_path / "blobs")
    assert reopened.clear_tmp() == 2
    assert reopened.clear_tmp() == 0
    assert _files(blobs.root) == [blobs.path(kept)]
    assert reopened.read(kept) == b"keep me"


@pytest.mark.parametrize(
    "digest",
    [
        "",
        "abc",
        "a" * 63,
        "a" * 65,
        "A" * 64,
        "g" * 64,
        "../" + "a" * 61,
        hashlib.sha256(b"x").hexdigest().upper(),
    ],
)
def test_invalid_digests_raise_value_error(blobs: BlobStore, digest: str) -> None:
    with pytest.raises(ValueError, match="not a lower-case hex SHA-256 digest"):
        blobs.path(digest)
    for call in (blobs.exists, blobs.read, blobs.size, blobs.delete):
        with pytest.raises(ValueError):
            call(digest)
    with pytest.raises(ValueError):
        list(blobs.read_chunks(digest, 4))


def test_read_chunks(blobs: BlobStore) -> None:
    data = bytes(range(256)) * 40 + b"tail"  # 10244 bytes
    digest = blobs.put(data)
    chunks = list(blobs.read_chunks(digest, 1024))
    assert [len(c) for c in chunks] == [1024] * 10 + [4]
    assert b"".join(chunks) == data
    assert list(blobs.read_chunks(digest, len(data) + 1)) == [data]
    framed = list(blobs.read_chunks(digest, 1024, frame=lambda n: n.to_bytes(2, "big")))
    assert framed == [len(c).to_bytes(2, "big") + c for c in chunks]  # each led by its frame
    with pytest.raises(BlobNotFoundError):
        list(blobs.read_chunks(hashlib.sha256(b"missing").hexdigest(), 1024))


def test_upgrading_from_the_first_revision_keeps_existing_rounds(tmp_path: Path) -> None:
    """A database made by the first schema upgrades in place; old rounds get an empty ledger."""
    from alembic import command

    from fedra.storage.migrate import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    command.upgrade(alembic_config(engine), "0001")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (id, name, task, spec_json, state, reason, rounds_completed,"
                " created_at, updated_at) VALUES ('r', 'r', 'm:t', '{}', 'running', '', 0, 1, 1)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO rounds (run_id, number, attempt, state, sampled_json, opened_at,"
                " deadline_at, metrics_json) VALUES ('r', 0, 1, 'open', '[]', 1, 2, '{}')"
            )
        )
    engine.dispose()
    store = Store(url)
    try:
        assert current_revision(store.engine) == head_revision()
        (rnd,) = store.list_rounds("r")
        assert rnd.stages == {} and rnd.state == "open"
    finally:
        store.close()


def test_one_coordinator_holds_a_database_at_a_time(db_url: str, store: Store) -> None:
    """A second coordinator on the same database would drive the same runs: its claim
    fails, naming why, until the first lets go (close; the end of its process)."""
    from fedra.storage.store import InUseError

    store.claim()
    store.claim()  # claiming again is a no-op
    second = Store(db_url)
    try:
        with pytest.raises(InUseError, match="in use by another coordinator"):
            second.claim()
        assert second.get_run("nothing") is None  # refused to claim, it still reads
        store.close()
        # PostgreSQL lets a closed connection's advisory lock go as its backend exits:
        # a moment after the close, not at once.
        deadline = time.monotonic() + 10
        while True:
            try:
                second.claim()
                break
            except InUseError:
                assert time.monotonic() < deadline, "closing did not let the database go"
                time.sleep(0.05)
    finally:
        second.close()
    third = Store(db_url)
    try:
        third.claim()  # closing let it go
    finally:
        third.close()


def test_a_run_that_ends_failed_or_cancelled_ends_its_open_round(run_store: Store) -> None:
    _open(run_store, 1, 1, ["a"])
    run_store.commit_round(RUN, 1, _checkpoint(1), {}, T0)
    _open(run_store, 2, 2, ["a"])
    run_store.set_run_state(RUN, "running", "", T0 + 5)  # not an end: the round stays open
    assert [r.state for r in run_store.list_rounds(RUN)] == ["committed", "open"]
    run_store.set_run_state(RUN, "failed", "round 2 attempt 2: no quorum", T0 + 9)
    committed, ended = run_store.list_rounds(RUN)
    assert (committed.state, committed.closed_at) == ("committed", T0)
    assert (ended.number, ended.state, ended.attempt, ended.closed_at) == (2, "failed", 2, T0 + 9)
    run_store.create_run("other", "other", "task", "{}", T0)
    run_store.open_round("other", 0, 1, {"a": "other-0-a"}, T0, T0 + 60)
    run_store.set_run_state("other", "cancelled", "cancelled by an operator", T0 + 3)
    [cancelled] = run_store.list_rounds("other")
    assert (cancelled.state, cancelled.closed_at) == ("cancelled", T0 + 3)


def test_a_run_ends_with_its_event_in_one_transaction(
    run_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``end_run``: the run's end state, its open round's end and the event that says why
    are one commit. Whoever reads the run ended reads the event too; an event that cannot
    be written leaves the run as it was."""
    _open(run_store, 1, 1, ["a"])
    run_store.set_run_state(RUN, "running", "", T0 + 1)

    def broken(*_: object, **__: object) -> object:
        def write(_s: object) -> None:
            raise RuntimeError("event write failed")

        return write

    with monkeypatch.context() as patch:
        patch.setattr(run_store, "add_event_op", broken)
        with pytest.raises(RuntimeError, match="event write failed"):
            run_store.end_run(RUN, "failed", "round 1 attempt 1: no quorum", T0 + 5, 1)
    run = run_store.get_run(RUN)
    assert run is not None and (run.state, run.reason) == ("running", "")
    assert [r.state for r in run_store.list_rounds(RUN)] == ["open"]
    assert not [e for e in run_store.list_events(RUN) if e.kind == "failed"]

    run_store.end_run(RUN, "failed", "round 1 attempt 1: no quorum", T0 + 5, 1)
    run = run_store.get_run(RUN)
    assert run is not None and (run.state, run.reason) == ("failed", "round 1 attempt 1: no quorum")
    assert [(r.state, r.closed_at) for r in run_store.list_rounds(RUN)] == [("failed", T0 + 5)]
    [event] = [e for e in run_store.list_events(RUN) if e.kind == "failed"]
    assert (event.message, event.round_number, event.created_at) == (
        "round 1 attempt 1: no quorum", 1, T0 + 5,
    )  # fmt: skip
    with pytest.raises(NotFoundError):
        run_store.end_run("ghost", "failed", "never ran", T0, None)
    assert run_store.get_run("ghost") is None


def test_a_refused_coordinator_leaves_the_schema_alone(db_url: str, tmp_path: Path) -> None:
    """The daemon claims its database before it migrates: a second coordinator (a newer
    fedra, say) refused on a live database has changed nothing in it."""
    from fedra.coordinator.server import CoordinatorConfig, build_engine
    from fedra.storage.store import InUseError

    holder = Store(db_url, migrate=False)  # holds the empty database, schema untouched
    try:
        holder.claim()
        config = CoordinatorConfig(state_dir=tmp_path / "second", db_url=db_url, insecure=True)
        with pytest.raises(InUseError):
            build_engine(config, claim=True)
        assert inspect(holder.engine).get_table_names() == []  # no migration ran
    finally:
        holder.close()
    engine = build_engine(config, claim=True)  # free now: claimed, then migrated
    try:
        assert "alembic_version" in inspect(engine._store.engine).get_table_names()
    finally:
        engine.close()


def _drop_claim_connection(admin: Any, store: Store) -> None:
    """What a server restart or a dropped idle connection does to a claim: its session
    ends (and with it the lock), as the server sees it once this returns."""
    assert store._claim_conn is not None
    with admin.begin() as conn:
        assert conn.execute(
            text("SELECT pg_terminate_backend(:p, 10000)"), {"p": store._claim_pid}
        ).scalar()


@pytest.mark.postgres
def test_a_claim_whose_connection_dropped_is_taken_again_unless_another_took_it(
    pg_database_url: str,
) -> None:
    """PostgreSQL lets an advisory lock go with its connection (a server restart, an idle
    connection dropped): the check takes it again if it is free, and says so if another
    coordinator took it meanwhile; a refused claim names who holds it."""
    from sqlalchemy.pool import NullPool

    from fedra.storage.store import ClaimLostError, InUseError

    _reset_postgres(pg_database_url)
    admin = create_engine(pg_database_url, poolclass=NullPool)

    first, second = Store(pg_database_url), Store(pg_database_url)
    try:
        first.claim()
        with pytest.raises(InUseError, match=rf"\(fedra coordinator pid {os.getpid()} on "):
            second.claim()
        assert first.check_claim()
        _drop_claim_connection(admin, first)
        assert first.check_claim()  # free: taken again
        with pytest.raises(InUseError):
            second.claim()
        _drop_claim_connection(admin, first)
        first.upsert_site("site-a", ["pkg.mod:task"], "1", 1.0)  # a write takes it again too
        with pytest.raises(InUseError):
            second.claim()
        _drop_claim_connection(admin, first)
        second.claim()  # another coordinator takes it while the first is cut off
        assert not first.fenced
        # The first's next write finds that out itself, before the periodic check does:
        # it writes nothing more (it may still read), and the second goes on.
        with pytest.raises(ClaimLostError, match="another coordinator took the database"):
            first.upsert_site("late", ["pkg.mod:task"], "1", 1.0)
        assert first.fenced and not second.fenced
        assert not first.check_claim()
        assert second.check_claim()
        assert [s.id for s in first.list_sites()] == ["site-a"]
        second.upsert_site("site-b", ["pkg.mod:task"], "1", 1.0)
        assert [s.id for s in first.list_sites()] == ["site-a", "site-b"]
    finally:
        first.close()
        second.close()
        admin.dispose()


@pytest.mark.postgres
def test_a_claim_completes_only_after_the_previous_holder_s_writes_have_ended(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that passed its claim check before another coordinator took the database
    lands before that claim completes, never beside the new holder's writes; and a claim
    that a previous holder's open write keeps waiting too long is refused, holding nothing."""
    from fedra.storage import store as store_module
    from fedra.storage.store import _WRITE_KEY, InUseError, _key_parts

    _reset_postgres(pg_database_url)
    admin = create_engine(pg_database_url, poolclass=NullPool)

    def claim_waits_for_writes() -> bool:
        with admin.begin() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted AND classid::bigint = :hi AND objid::bigint = :lo "
                        "AND database = (SELECT oid FROM pg_database "
                        "WHERE datname = current_database()))"
                    ),
                    _key_parts(_WRITE_KEY),
                ).scalar()
            )

    first, second, third = Store(pg_database_url), Store(pg_database_url), Store(pg_database_url)
    claimed: list[BaseException | None] = []

    def claim(store: Store) -> None:
        try:
            store.claim()
            claimed.append(None)
        except BaseException as exc:
            claimed.append(exc)

    try:
        first.claim()
        with first._tx() as session:  # its check passes: a write of the first holder's
            _drop_claim_connection(admin, first)
            taker = threading.Thread(target=claim, args=(second,), daemon=True)
            taker.start()
            deadline = time.monotonic() + 30
            while not claim_waits_for_writes():  # the second has the lock and waits
                assert time.monotonic() < deadline and taker.is_alive(), claimed
                time.sleep(0.02)
            assert not claimed
            session.add(Site(id="in-flight", tasks_json="[]", registered_at=1.0, last_seen_at=1.0))
        taker.join(30)
        assert claimed == [None]  # after the write ended
        assert [s.id for s in second.list_sites()] == ["in-flight"]
        with pytest.raises(store_module.ClaimLostError):
            first.upsert_site("late", ["pkg.mod:task"], "1", 1.0)

        monkeypatch.setattr(store_module, "FENCE_WAIT_S", 1)
        with second._tx():  # a write that does not end
            _drop_claim_connection(admin, second)
            with pytest.raises(InUseError, match="still has a write open on it after 1 s"):
                third.claim()
        # The refused claim let go of the lock: the second's next write takes it again.
        second.upsert_site("after", ["pkg.mod:task"], "1", 1.0)
        assert not second.fenced
    finally:
        for store in (first, second, third):
            store.close()
        admin.dispose()


@pytest.mark.postgres
def test_the_server_probes_every_connection_of_a_coordinator(pg_database_url: str) -> None:
    """A coordinator whose host vanishes must not hold a write open (which the next
    holder's claim waits for) for the server's default two hours: every connection, not
    only the claim's, has the server's keepalives at about a minute."""
    engine = make_engine(pg_database_url)
    try:
        with engine.connect() as conn:
            settings = [
                conn.execute(text(f"SHOW tcp_keepalives_{name}")).scalar()
                for name in ("idle", "interval", "count")
            ]
        assert settings == ["30", "10", "3"]
    finally:
        engine.dispose()


def test_upgrading_ends_the_open_rounds_of_ended_runs(db_url: str) -> None:
    """Runs that ended failed or cancelled before their open round ended with them: the
    migration ends those rounds in the run's state, and leaves running runs' rounds open."""
    from alembic import command

    from fedra.storage.migrate import alembic_config

    engine = make_engine(db_url)
    command.upgrade(alembic_config(engine), "0004")
    with engine.begin() as conn:
        for run, state in (("f", "failed"), ("c", "cancelled"), ("r", "running")):
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, task, spec_json, state, reason, "
                    "rounds_completed, created_at, updated_at) VALUES "
                    "(:id, :id, 'm:t', '{}', :state, '', 1, 1, 7)"
                ),
                {"id": run, "state": state},
            )
            for number, round_state in ((0, "committed"), (1, "open")):
                conn.execute(
                    text(
                        "INSERT INTO rounds (run_id, number, attempt, state, sampled_json, "
                        "opened_at, deadline_at, metrics_json, stages_json, closed_at) VALUES "
                        "(:id, :n, 1, :s, '[]', 1, 2, '{}', '{}', :closed)"
                    ),
                    {"id": run, "n": number, "s": round_state,
                     "closed": 3.0 if round_state == "committed" else None},
                )  # fmt: skip
    engine.dispose()
    store = Store(db_url)
    try:
        ended = {run: [(r.state, r.closed_at) for r in store.list_rounds(run)] for run in "fcr"}
    finally:
        store.close()
    assert ended == {
        "f": [("committed", 3.0), ("failed", 7.0)],
        "c": [("committed", 3.0), ("cancelled", 7.0)],
        "r": [("committed", 3.0), ("open", None)],
    }


def test_a_database_that_cannot_be_locked_counts_as_claimed() -> None:
    """An in-memory database (or a server fedra has no lock for) cannot be shared by
    two daemons anyway: claiming it succeeds, and the daemon's check keeps saying so."""
    store = Store("sqlite://")
    try:
        assert not store.check_claim()  # not claimed yet
        store.claim()
        assert store.check_claim()
    finally:
        store.close()


# -- the update spool: small updates in their rows ------------------------------------


def test_a_small_update_lives_in_its_row_until_its_round_lets_go(
    run_store: Store, tmp_path: Path
) -> None:
    _open(run_store, 1, 1, ["s1", "s2"])
    spool = UpdateSpool(BlobStore(tmp_path / "updates"), run_store)
    data = os.urandom(100)
    digest = hashlib.sha256(data).hexdigest()
    writer = spool.writer(len(data))
    assert isinstance(writer, SmallWriter)
    writer.write(data[:40])
    writer.write(data[40:])
    assert writer.commit(digest) == digest and writer.data == data
    assert not spool.exists(digest)  # nothing is durable before its accept
    task = _task(1, 1, "s1")
    run_store.accept_update(
        task, nonce=b"n" * 16, sha256=digest, num_samples=1, metrics={}, bytes_up=len(data),
        upload_s=0.1, now=T0, data=data,
    )  # fmt: skip
    assert run_store.update_data(digest) == data
    assert run_store.holding_update_data() == [task]
    # Read back from the database (nothing cached), in the chunks asked for.
    assert spool.exists(digest) and list(spool.read_chunks(digest, 64)) == [data[:64], data[64:]]
    assert not any((tmp_path / "updates").rglob(f"{digest}*"))  # no file for it
    run_store.clear_update_data([task, _task(1, 1, "s2")])
    assert run_store.update_data(digest) is None and run_store.holding_update_data() == []
    assert not spool.exists(digest)
    with pytest.raises(BlobNotFoundError):
        list(spool.read_chunks(digest))
    # The participation's record is as before: the bytes were never part of it.
    record = run_store.get_participation(task)
    assert record is not None and record.state == "accepted" and record.update_sha256 == digest


def test_a_larger_update_is_a_spool_file_and_a_cached_one_is_read_from_memory(
    run_store: Store, tmp_path: Path
) -> None:
    spool = UpdateSpool(BlobStore(tmp_path / "updates"), run_store, small_bytes=64)
    big = os.urandom(65)
    writer = spool.writer(len(big))
    assert isinstance(writer, BlobWriter)
    writer.write(big)
    digest = writer.commit()
    assert spool.blobs.path(digest).is_file() and b"".join(spool.read_chunks(digest)) == big
    small = os.urandom(10)
    small_digest = hashlib.sha256(small).hexdigest()
    spool.accepted(small_digest, small)  # as after its accept's commit
    assert spool.exists(small_digest) and b"".join(spool.read_chunks(small_digest)) == small
    spool.delete(small_digest)
    assert not spool.exists(small_digest)
    spool.delete(digest)
    assert not spool.exists(digest)


def test_a_held_spool_file_outlives_deletes_and_a_sweep_keeps_what_it_is_told(
    run_store: Store, tmp_path: Path
) -> None:
    spool = UpdateSpool(BlobStore(tmp_path / "updates"), run_store, small_bytes=0)
    kept, held, orphan = (spool.put(os.urandom(100)) for _ in range(3))
    spool.hold(held)
    spool.hold(held)  # two uploads of the same bytes
    assert not spool.delete(held) and spool.exists(held)
    spool.release(held)
    assert not spool.delete(held)  # the other still holds it
    (tmp_path / "updates" / "spill").mkdir()  # not blobs: never swept
    (tmp_path / "updates" / orphan[:2] / "notes").write_text("x")
    with spool.writer() as unfinished:  # a write in progress is not in place
        unfinished.write(b"partial")
        assert sorted(spool.blobs.digests()) == sorted((kept, held, orphan))
        assert spool.sweep(keep={kept}) == 1  # the orphan; the held one stays
    assert spool.exists(kept) and spool.exists(held) and not spool.exists(orphan)
    assert (tmp_path / "updates" / orphan[:2] / "notes").exists()
    spool.release(held)
    with pytest.raises(RuntimeError, match="released more often than held"):
        spool.release(held)
    assert spool.sweep(keep={kept}) == 1 and not spool.exists(held)
    taken_out: list[Path] = []
    spool.hold(kept)
    assert not spool.delete(kept, taken_out) and taken_out == []  # held: nothing taken
    spool.release(kept)
    assert spool.delete(kept, taken_out) and not spool.exists(kept)
    assert len(taken_out) == 1 and taken_out[0].exists()  # the caller unlinks it
    assert spool.delete(kept, taken_out) and len(taken_out) == 1  # gone already


def test_a_row_whose_update_bytes_changed_reads_as_damaged(
    run_store: Store, tmp_path: Path
) -> None:
    _open(run_store, 1, 1, ["s1"])
    spool = UpdateSpool(BlobStore(tmp_path / "updates"), run_store)
    data = os.urandom(50)
    digest = hashlib.sha256(data).hexdigest()
    run_store.accept_update(
        _task(1, 1, "s1"), nonce=b"m" * 16, sha256=digest, num_samples=1, metrics={},
        bytes_up=50, upload_s=0.1, now=T0, data=data[:-1] + b"\0",
    )  # fmt: skip
    with pytest.raises(BlobCorruptError):
        list(spool.read_chunks(digest))


def test_identical_updates_each_keep_a_copy_and_a_damaged_or_failed_one_is_passed_over(
    run_store: Store,
) -> None:
    _open(run_store, 1, 1, ["s1", "s2"])
    data = os.urandom(64)
    digest = hashlib.sha256(data).hexdigest()
    for site, stored, nonce in (("s1", data[:-1] + b"\0", b"p" * 16), ("s2", data, b"q" * 16)):
        run_store.accept_update(
            _task(1, 1, site), nonce=nonce, sha256=digest, num_samples=1, metrics={},
            bytes_up=64, upload_s=0.1, now=T0, data=stored,
        )  # fmt: skip
    assert run_store.update_data(digest) == data  # the copy that hashes right
    run_store.fail_participation(_task(1, 1, "s2"), "lost", T0, accepted_too=True)
    assert run_store.holding_update_data() == [_task(1, 1, "s1")]  # failed: let go
    assert run_store.update_data(digest) == data[:-1] + b"\0"  # only the damaged one left
