"""The repository: every database read and write fedra makes, behind one class.

Each method is one transaction. SQLite (the default, a file in the state directory)
and PostgreSQL are both supported through the SQLAlchemy URL.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    Select,
    bindparam,
    case,
    cast,
    create_engine,
    event,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from fedra.files import LockHeld, ProcessLock
from fedra.storage import models as m
from fedra.storage import rows
from fedra.storage.migrate import upgrade
from fedra.storage.records import (
    FINAL_PARTICIPATION_STATES,
    MAX_MEASURED_S,
    PENDING_PARTICIPATION_STATES,
    CheckpointRecord,
    EventRecord,
    ParticipationRecord,
    ParticipationState,
    ParticipationTally,
    RoundRecord,
    RoundState,
    RunRecord,
    RunState,
    RunSummaryView,
    RunView,
    SiteRecord,
    SiteTally,
)
from fedra.storage.writes import DuplicateError, StatementWrite, WriteOp, run_batch

# A run that ends so ends its open round so; a run that completes has none open.
_ROUND_ENDED_BY = {RunState.FAILED: RoundState.FAILED, RunState.CANCELLED: RoundState.CANCELLED}


class NotFoundError(KeyError):
    """The row a write needs does not exist."""


def _nothing_to_release() -> None:
    pass


class InUseError(Exception):
    """Another coordinator holds the database (``Store.claim``)."""


class ClaimLostError(Exception):
    """Another coordinator took the database while this one's hold was down (found by
    ``Store.check_claim`` or by a write): this store writes nothing more."""

    def __init__(self) -> None:
        super().__init__(
            "another coordinator took the database while this one's hold on it was down; "
            "this one writes nothing more"
        )


def transient_fault(exc: BaseException) -> str:
    """What storage fault ``exc`` is, if it is one worth waiting out: a full disk (a blob,
    SQLite's file), a database that cannot be reached or dropped the connection (a
    PostgreSQL restart); '' for any other error."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text = str(exc.strerror or exc)
        return text if text.startswith("disk full") else f"disk full ({text})"
    invalidated = isinstance(exc, DBAPIError) and exc.connection_invalidated
    if isinstance(exc, OperationalError) and not invalidated and _is_schema_error(exc):
        return ""  # a broken schema or a read-only file does not heal by waiting
    if isinstance(exc, OperationalError | InterfaceError) or invalidated:
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return f"the database is unavailable ({cause[0] if cause else type(exc).__name__})"
    return ""


_SCHEMA_ERRORS = ("no such table", "no such column", "has no column", "readonly", "syntax error")


def _is_schema_error(exc: OperationalError) -> bool:
    text = str(getattr(exc, "orig", None) or exc).lower()
    return any(marker in text for marker in _SCHEMA_ERRORS)


# The PostgreSQL advisory lock a coordinator holds on its database: b"fedra-co" as an int.
_CLAIM_KEY = int.from_bytes(b"fedra-co", "big", signed=True)
# Taken shared by every writing transaction, until it ends, before it checks the claim; and
# exclusive, for a moment, by a coordinator that has just claimed the database: its claim
# completes only once every write that passed its check under the previous holder has
# ended, and each later one fails its check. b"fedra-wr" as an int.
_WRITE_KEY = int.from_bytes(b"fedra-wr", "big", signed=True)
FENCE_WAIT_S = 30  # how long a claim waits for the previous holder's writes to end
_IN_BATCH = 500  # ids in one IN (...) list (SQLite's limit on parameters was 999 before 3.32)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers (status calls) run beside the writer; FULL makes every
    # commit durable before it returns, which recovery relies on.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()
    # Take transaction control from the sqlite3 module, which would otherwise run
    # SELECTs and DDL outside any transaction (see _sqlite_begin).
    dbapi_conn.isolation_level = None


_READ_ONLY = "fedra_read_only"  # the execution option of the Store's read transactions


# Who holds the claim: its session's name and address, where this user may see them.
_CLAIM_HOLDER = text(
    "SELECT a.application_name, a.client_addr FROM pg_locks l "
    "JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
    "AND l.classid::bigint = :hi AND l.objid::bigint = :lo "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def _discard(conn: Connection) -> None:
    """Close a claim's connection for good: its session's advisory locks go with it (back
    in the pool, the session would live on, and hold them)."""
    with suppress(DBAPIError):  # a connection already lost has let go already
        conn.invalidate()
        conn.close()


def _key_parts(key: int) -> dict[str, int]:
    """A bigint advisory lock key as pg_locks shows it: classid (high half), objid (low)."""
    return {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF}


def _advisory_holder(conn: Connection) -> str:
    """' (NAME from ADDRESS)' for the session holding the claim; '' if not to be seen."""
    try:
        row = conn.execute(_CLAIM_HOLDER, _key_parts(_CLAIM_KEY)).first()
    except DBAPIError:
        return ""
    if row is None or not row[0]:
        return ""
    return f" ({row[0]} from {row[1]})" if row[1] else f" ({row[0]})"


def _sqlite_begin(conn: Any) -> None:
    # A writing transaction takes the write lock up front (IMMEDIATE): it can then never
    # fail to upgrade its lock, and each Store method is really one transaction. A read
    # takes none: with WAL it reads a snapshot while a writer goes on, and never makes a
    # writer wait (SQLite's busy handler sleeps up to 100 ms at a time while it waits).
    conn.exec_driver_sql(
        "BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE"
    )


def make_engine(url: str) -> Engine:
    """An Engine for ``url`` with the settings fedra relies on."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    connect_args: dict[str, Any] = {}
    if make_url(url).get_driver_name() in ("psycopg", "psycopg2"):
        # libpq probes an idle connection, so a server that vanished is noticed in about a
        # minute (a claim's check, a query) instead of hanging on TCP for many minutes.
        connect_args = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                        "keepalives_count": 3}  # fmt: skip
    engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    if engine.dialect.name == "postgresql":
        event.listen(engine, "connect", _server_keepalives)
    return engine


def _server_keepalives(dbapi_conn: Any, _record: Any) -> None:
    # And the server probes each of ours: a coordinator whose host vanished lets go, in
    # about a minute, of its claim and of a write it had open (which a new holder's claim
    # waits for: Store._fence), instead of after the server's default of two hours.
    cursor = dbapi_conn.cursor()
    cursor.execute(
        "SELECT set_config('tcp_keepalives_idle', '30', false), "
        "set_config('tcp_keepalives_interval', '10', false), "
        "set_config('tcp_keepalives_count', '3', false)"
    )
    cursor.close()
    dbapi_conn.commit()


# The writes every site makes every round, built once: each call then binds its values
# and reuses the statement and its compiled form, instead of building an expression
# (about half of such a write's time; a coordinator with many sites makes thousands).
_p = m.Participation
# Added in the database, not in Python: two downloads of one task recorded at once must
# both count, and a read-modify-write would lose one of them.
_ADD_DOWNLOAD = (
    update(_p)
    .where(_p.task_id == bindparam("tid"))
    .values(
        bytes_down=_p.bytes_down + bindparam("nbytes", type_=BigInteger),  # as the column
        download_s=_p.download_s + bindparam("seconds", type_=Float),
        state=case(
            (_p.state == ParticipationState.ASSIGNED, ParticipationState.DOWNLOADED), else_=_p.state
        ),
        base_round=func.coalesce(bindparam("base", type_=Integer), _p.base_round),
    )
)
_ADD_CUT = (
    update(_p)
    .where(_p.task_id == bindparam("tid"))
    .values(bytes_cut=_p.bytes_cut + bindparam("nbytes", type_=BigInteger))
)
_KNOWN_TASKS = select(_p.task_id).where(_p.task_id.in_(bindparam("tids", expanding=True)))


def _site_upsert(dialect: str) -> Any:
    """A site's registration as one statement (insert, or update the row there), for the
    dialects that have one (None for others): no read before the write, no ORM object."""
    values: dict[str, Any] = {
        "id": bindparam("sid"), "tasks_json": bindparam("tasks"), "version": bindparam("ver"),
        "registered_at": bindparam("ts"), "last_seen_at": bindparam("ts"),
    }  # fmt: skip
    again = ("tasks_json", "version", "last_seen_at")
    key = [m.Site.__table__.c.id]
    if dialect == "sqlite":
        lite = sqlite.insert(m.Site).values(values)
        return lite.on_conflict_do_update(
            index_elements=key, set_={c: lite.excluded[c] for c in again}
        )
    if dialect == "postgresql":
        pg = postgresql.insert(m.Site).values(values)
        return pg.on_conflict_do_update(index_elements=key, set_={c: pg.excluded[c] for c in again})
    return None


_TOUCH_SITE = (
    update(m.Site).where(m.Site.id == bindparam("sid")).values(last_seen_at=bindparam("ts"))
)
_ACCEPT = (
    update(_p)
    # Not NOT IN: an expanding parameter, which an executemany cannot take.
    .where(_p.task_id == bindparam("tid"), *(_p.state != s for s in FINAL_PARTICIPATION_STATES))
    .values(
        state=ParticipationState.ACCEPTED,
        nonce=bindparam("new_nonce"),
        update_sha256=bindparam("new_sha256"),
        num_samples=bindparam("new_num_samples"),
        metrics_json=bindparam("new_metrics_json"),
        bytes_up=bindparam("new_bytes_up"),
        upload_s=bindparam("new_upload_s"),
        finished_at=bindparam("new_now"),
        update_data=bindparam("new_data"),
    )
)
del _p


def _rounds_since(run_id: str, since: int) -> Select[m.Round]:
    r = m.Round
    return select(r).where(r.run_id == run_id, r.number >= since).order_by(r.number)


def _rounds_read(
    s: Session, run_id: str, since: int, limit: int | None
) -> tuple[m.Run, list[m.Round], int | None] | None:
    """The run and its rounds numbered ``since`` or higher, at most ``limit`` of them,
    and the number below which they end when more follow (None: none follow); None if
    there is no such run."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    run = s.get(m.Run, run_id)
    if run is None:
        return None
    rounds_q = _rounds_since(run_id, since)
    if limit is not None:
        rounds_q = rounds_q.limit(limit + 1)  # one more says whether more follow
    rounds = list(s.scalars(rounds_q))
    if limit is not None and len(rounds) > limit:
        del rounds[limit:]
        return run, rounds, rounds[-1].number + 1
    return run, rounds, None


class _IdleTerms(NamedTuple):
    """A participation's time in its round as ``ledger.idle_s`` works it out, as SQL."""

    idle: Any  # ``span`` less ``busy`` (may be below 0)
    span: Any  # from its task, or the round's opening if that came first, to the commit
    busy: Any  # its own download, compute and upload (its measures, where it sent them)
    last: Any  # the join to its round's row, in the round's last attempt


def _idle_terms(dialect: str) -> _IdleTerms:
    """``_IdleTerms`` of a participation (each of its measures within [0, bound])."""
    t, r = m.Participation.__table__.c, m.Round.__table__.c

    def metric(name: str) -> Any:
        if dialect == "postgresql":
            return cast(cast(t.metrics_json, postgresql.JSON)[name].astext, Float)
        return func.json_extract(t.metrics_json, f'$."{name}"')

    def measured(seconds: Any) -> Any:  # as ledger.idle_s counts it: within [0, bound]
        bound = MAX_MEASURED_S
        return case((seconds < 0.0, 0.0), (seconds > bound, bound), else_=seconds)

    busy = (
        measured(func.coalesce(metric("download_s"), t.download_s))
        + measured(func.coalesce(metric("compute_s"), 0.0))
        + measured(t.upload_s)
    )
    start = case((t.assigned_at < r.opened_at, t.assigned_at), else_=r.opened_at)
    span = r.closed_at - start
    last = (r.run_id == t.run_id) & (r.number == t.round_number) & (r.attempt == t.attempt)
    return _IdleTerms(span - busy, span, busy, last)


def _idle_in_last_attempts(run_id: str, numbers: list[int], dialect: str) -> Select[Any]:
    """Per committed round of ``numbers``, the mean over the accepted participations of
    its last attempt of the time each sat idle (``_idle_terms``)."""
    t, r = m.Participation.__table__.c, m.Round.__table__.c
    idle, _, _, last = _idle_terms(dialect)
    return (
        select(t.round_number, func.avg(case((idle > 0.0, idle), else_=0.0)))
        .join_from(m.Participation.__table__, m.Round.__table__, last)
        .where(
            t.run_id == run_id,
            t.state == ParticipationState.ACCEPTED,
            t.round_number >= min(numbers),
            t.round_number <= max(numbers),
            r.state == RoundState.COMMITTED,
            r.closed_at.is_not(None),
        )
        .group_by(t.round_number)
    )


def _participation_rows_between(run_id: str, since: int, until: int | None) -> Select[Any]:
    """The run's participations in rounds ``since`` to ``until`` (excluded), in round,
    attempt and site order, as plain rows of ``PARTICIPATION_COLUMNS`` (no ORM objects
    built: rounds of thousands of sites read fast)."""
    t = m.Participation.__table__.c
    q = select(*(t[name] for name in rows.PARTICIPATION_COLUMNS)).where(t.run_id == run_id)
    if since:
        q = q.where(t.round_number >= since)
    if until is not None:
        q = q.where(t.round_number < until)
    return q.order_by(t.round_number, t.attempt, t.site_id)


def _checkpoints_between(run_id: str, since: int, until: int | None) -> Select[m.Checkpoint]:
    c = m.Checkpoint
    q = select(c).where(c.run_id == run_id, c.round_number >= since)
    if until is not None:
        q = q.where(c.round_number < until)
    return q.order_by(c.round_number)


def _set_run_state(s: Session, run_id: str, state: RunState, reason: str, now: float) -> None:
    row = s.get(m.Run, run_id)
    if row is None:
        raise NotFoundError(run_id)
    row.state, row.reason, row.updated_at = state, reason, now
    ends = _ROUND_ENDED_BY.get(state)
    if ends is not None:  # failed or cancelled: its open round ends so too
        r = m.Round
        ended = update(r).where(r.run_id == run_id, r.state == RoundState.OPEN)
        s.execute(ended.values(state=ends, closed_at=now))


def _event_values(
    run_id: str,
    round_number: int | None,
    at: float,
    event: tuple[str, str],
    data: dict[str, float | int | str] | None = None,
) -> dict[str, Any]:
    """A ledger row's columns: ``event`` is (kind, message)."""
    kind, message = event
    return {
        "run_id": run_id,
        "round_number": round_number,
        "kind": kind,
        "message": message,
        "data_json": json.dumps(data or {}),
        "created_at": at,
    }


_ADD_EVENT = insert(m.Event)


class Store:
    """Runs, sites, rounds, participations, checkpoints and the event ledger."""

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._upsert_site = _site_upsert(self.engine.dialect.name)
        if migrate:
            try:
                upgrade(self.engine)
            except Exception:
                self.engine.dispose()
                raise
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        reader = self.engine.execution_options(**{_READ_ONLY: True})
        if self.engine.dialect.name == "postgresql":
            # A read of several statements sees one snapshot, as SQLite's read transaction
            # does (PostgreSQL's default gives each statement its own); a transaction that
            # only reads is never refused for it.
            reader = reader.execution_options(isolation_level="REPEATABLE READ")
        self._read_sessions = sessionmaker(reader, expire_on_commit=False)
        # SQLite has one writer at a time, and a writer that finds the lock taken polls
        # for it, sleeping up to 100 ms between tries: this process's writers queue here
        # instead and go the moment it is free. (PostgreSQL locks rows; no queue there.)
        self._claim: Callable[[], None] | None = None  # lets go of ``claim``'s hold
        self._claim_conn: Connection | None = None  # PostgreSQL: the one holding it
        self._claim_pid: int | None = None  # PostgreSQL: the server process holding it
        self._claim_lock = threading.RLock()  # the claim's connection is one thread's at a time
        self._fenced = False  # another coordinator took the database: no more writes
        self._write_queue: AbstractContextManager[Any] = (
            threading.Lock() if self.engine.dialect.name == "sqlite" else nullcontext()
        )

    def upgrade(self) -> None:
        """Bring the schema to the newest revision (done at construction unless
        ``migrate=False``: a coordinator claims the database first)."""
        upgrade(self.engine)

    def claim(self) -> None:
        """Hold the database for this process until ``close``: one coordinator drives a
        database's runs, and a second one started on it raises InUseError instead of
        driving the same runs beside it. PostgreSQL: a session advisory lock on a
        connection kept for it (the server lets it go if this process dies; keepalives
        bound how long a vanished host keeps it); ``check_claim`` says whether it still
        holds. SQLite: a lock on a file beside the database file (the kernel lets it go
        when the process ends)."""
        if self._claim is not None:
            return
        if self.engine.dialect.name == "postgresql":
            self._claim_postgres(fence=True)
        elif self.engine.dialect.name == "sqlite" and self.engine.url.database not in (
            None, "", ":memory:",
        ):  # fmt: skip
            path = Path(f"{self.engine.url.database}.coordinator-lock")
            try:
                lock = ProcessLock(path)
            except LockHeld as exc:
                raise InUseError(
                    f"the database is in use by another coordinator{exc.who}; stop it first, "
                    "or give each coordinator its own database"
                ) from None
            self._claim = lock.release
        else:  # no way to hold it here (an in-memory database, another server): trusted
            self._claim = _nothing_to_release

    def _claim_postgres(self, fence: bool = False) -> None:
        """Take the advisory lock; with ``fence``, then wait for the writes a previous
        holder still has under way (``_WRITE_KEY``). A claim taken again after this
        process's own connection dropped does not wait: the holder before it was this
        process, whose writes may be waiting for this very claim (``_still_holding``).
        (Were another coordinator to take the database and let it go again while this
        one's connection was down, a write it still had under way would not be waited
        for: two failures within moments of each other.)"""
        conn = self.engine.connect()
        try:
            # Named, so that a refused coordinator can say who holds the lock. The server
            # probes it, as it does every connection of ours (make_engine), so a host that
            # vanished lets it go in about a minute, not after the kernel's two hours.
            who = f"fedra coordinator pid {os.getpid()} on {socket.gethostname()}"
            conn.execute(select(func.set_config("application_name", who[:63], False)))
            held = conn.execute(select(func.pg_try_advisory_lock(_CLAIM_KEY))).scalar()
            holder = "" if held else _advisory_holder(conn)
            pid = conn.execute(select(func.pg_backend_pid())).scalar()
            conn.commit()  # the lock outlives the transaction; the connection idles
            if held and fence:
                self._fence(conn)
        except BaseException:
            _discard(conn)
            raise
        if not held:
            _discard(conn)
            raise InUseError(
                f"the database is in use by another coordinator{holder} (it holds fedra's "
                "PostgreSQL advisory lock); stop it first, or give each coordinator its own "
                "database"
            )
        self._claim_conn, self._claim_pid = conn, pid
        self._claim = self._release_postgres

    @staticmethod
    def _fence(conn: Connection) -> None:
        """Wait until no write of a previous holder is under way (each holds ``_WRITE_KEY``
        shared until it ends): those that passed their check before this claim land
        before it completes, and every later one finds the claim gone and writes nothing."""
        conn.execute(select(func.set_config("lock_timeout", f"{FENCE_WAIT_S}s", True)))
        try:
            conn.execute(select(func.pg_advisory_lock(_WRITE_KEY)))
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", getattr(exc.orig, "pgcode", None)) != "55P03":
                raise  # not the lock's timeout (lock_not_available): the connection, say
            raise InUseError(
                "the coordinator that held the database before still has a write open on it "
                f"after {FENCE_WAIT_S} s; stop that coordinator first (a vanished host's "
                "connections are dropped by the server within about a minute)"
            ) from exc
        conn.execute(select(func.pg_advisory_unlock(_WRITE_KEY)))
        conn.commit()

    def _release_postgres(self) -> None:
        conn, self._claim_conn = self._claim_conn, None
        if conn is not None:
            _discard(conn)

    def check_claim(self) -> bool:
        """Whether this process still holds the database. A PostgreSQL claim whose
        connection was lost (a server restart, an idle connection dropped on the way) is
        taken again if no other coordinator took it meanwhile; False if one did. A
        server that cannot be reached now counts as held: nobody else can use it either,
        and the next check tries again."""
        with self._claim_lock:
            return self._check_claim()

    def _check_claim(self) -> bool:
        if self.engine.dialect.name != "postgresql" or self._claim is None:
            return self._claim is not None
        conn = self._claim_conn
        if conn is not None:
            try:
                conn.execute(select(literal(1)))
                conn.commit()
                return True
            except DBAPIError:
                self._release_postgres()
        try:
            self._claim_postgres()
        except InUseError:
            self._claim = None
            self._fenced = True  # its runs are the other coordinator's to write now
            return False
        except DBAPIError:
            return True
        return True

    @property
    def fenced(self) -> bool:
        """Whether this store found the database taken by another coordinator (at a claim
        check, or at a write): every write then raises ClaimLostError, so nothing this
        process still has under way (a commit, an accepted upload, its shutdown) lands
        beside the other's."""
        return self._fenced

    def close(self) -> None:
        if self._claim is not None:
            self._claim()
            self._claim = None
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """One writing transaction."""
        if self._fenced:
            raise ClaimLostError()
        with self._write_queue, self._sessions.begin() as session:
            if self._claim_pid is not None:
                self._still_holding(session)
            yield session

    def _still_holding(self, session: Session) -> None:
        """PostgreSQL: check, inside the writing transaction, that this process still holds
        the claim, so that a write never lands after another coordinator took the database
        (between two of the daemon's periodic checks). A claim whose connection dropped is
        taken again here if it is free."""
        # First the write key, shared until this transaction ends: a coordinator claiming
        # the database now waits for this write, which (if it passes) lands before it.
        session.execute(select(func.pg_advisory_xact_lock_shared(_WRITE_KEY)))
        held = session.execute(
            text(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
                "AND granted AND pid = :pid AND objsubid = 1 "
                "AND classid::bigint = :hi AND objid::bigint = :lo)"
            ),
            {"pid": self._claim_pid, **_key_parts(_CLAIM_KEY)},
        ).scalar()
        if not held and not self.check_claim():
            raise ClaimLostError()

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """One reading transaction, one snapshot: it never holds up a writer."""
        with self._read_sessions.begin() as session:
            yield session

    # -- sites ---------------------------------------------------------------

    def upsert_site(self, site_id: str, tasks: Sequence[str], version: str, now: float) -> None:
        [error] = self.write_batch([self.upsert_site_op(site_id, tasks, version, now)])
        if error is not None:
            raise error

    def upsert_site_op(
        self, site_id: str, tasks: Sequence[str], version: str, now: float
    ) -> WriteOp:
        """The write of ``upsert_site``, for ``write_batch``."""
        if self._upsert_site is not None:
            values = {"sid": site_id, "tasks": json.dumps(list(tasks)), "ver": version, "ts": now}
            return StatementWrite(self._upsert_site, values)

        def upsert(s: Session) -> None:  # the other dialects' way: read, then write
            row = s.get(m.Site, site_id)
            if row is None:
                s.add(
                    m.Site(
                        id=site_id,
                        tasks_json=json.dumps(list(tasks)),
                        version=version,
                        registered_at=now,
                        last_seen_at=now,
                    )
                )
            else:
                row.tasks_json = json.dumps(list(tasks))
                row.version = version
                row.last_seen_at = now
            s.flush()

        return upsert

    def touch_sites(self, last_seen: dict[str, float]) -> None:
        [error] = self.write_batch([self.touch_sites_op(last_seen)])
        if error is not None:
            raise error

    def touch_sites_op(self, last_seen: dict[str, float]) -> WriteOp:
        """The write of ``touch_sites`` (one statement for every site), for ``write_batch``."""
        rows = [{"sid": site_id, "ts": ts} for site_id, ts in last_seen.items()]

        def touch(s: Session) -> None:
            if rows:
                s.connection().execute(_TOUCH_SITE, rows)

        return touch

    def list_sites(self, after: str = "", limit: int | None = None) -> list[SiteRecord]:
        """Sites in id order: those after ``after``, at most ``limit`` of them."""
        t = m.Site.__table__.c
        query = select(*t).order_by(t.id)
        if after:
            query = query.where(t.id > after)
        if limit is not None:
            query = query.limit(limit)
        with self._read() as s:  # plain rows, not ORM objects: thousands of sites read fast
            return [rows.site_record(r) for r in s.execute(query)]  # type: ignore[arg-type]

    def count_sites(self) -> int:
        """How many sites are registered."""
        with self._read() as s:
            return int(s.execute(select(func.count()).select_from(m.Site)).scalar_one())

    # -- runs ----------------------------------------------------------------

    def create_run(
        self,
        run_id: str,
        name: str,
        task: str,
        spec_json: str,
        now: float,
        start: CheckpointRecord | None = None,
        event: tuple[str, str] | None = None,
    ) -> RunRecord:
        """A new run, pending; ``event`` (kind, message) written with it. ``start``: the
        run begins after that checkpoint's round (a model given to it, its blobs durable
        already): that round is recorded committed with it, with no participations, and
        the run is running, all in the same transaction."""
        with self._tx() as s:
            row = m.Run(
                id=run_id,
                name=name,
                task=task,
                spec_json=spec_json,
                state=RunState.PENDING if start is None else RunState.RUNNING,
                reason="",
                rounds_completed=0 if start is None else start.round_number,
                created_at=now,
                updated_at=now,
            )
            s.add(row)
            s.flush()  # the rows below refer to it
            if event is not None:
                s.add(
                    m.Event(
                        **_event_values(run_id, start.round_number if start else None, now, event)
                    )
                )
            if start is not None:
                s.add(
                    m.Round(
                        run_id=run_id, number=start.round_number, attempt=1,
                        state=RoundState.COMMITTED, sampled_json="[]", opened_at=now,
                        deadline_at=now, closed_at=now,
                    )
                )  # fmt: skip
                s.add(
                    m.Checkpoint(
                        run_id=run_id, round_number=start.round_number,
                        model_sha256=start.model_sha256, model_bytes=start.model_bytes,
                        optimizer_sha256=start.optimizer_sha256, created_at=start.created_at,
                        delta_sha256=start.delta_sha256,
                    )
                )  # fmt: skip
            s.flush()
            return rows.run_record(row)

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._read() as s:
            row = s.get(m.Run, run_id)
            return None if row is None else rows.run_record(row)

    def list_runs(self, states: Sequence[RunState] | None = None) -> list[RunRecord]:
        with self._read() as s:
            q = select(m.Run).order_by(m.Run.created_at, m.Run.id)
            if states is not None:
                q = q.where(m.Run.state.in_(list(states)))
            return [rows.run_record(r) for r in s.scalars(q).all()]

    def count_runs_by_state(self) -> dict[str, int]:
        """How many runs are in each state (one grouped count, for metrics)."""
        t = m.Run.__table__.c
        query = select(t.state, func.count()).group_by(t.state)
        with self._read() as s:
            return {str(state): int(n) for state, n in s.execute(query)}

    def set_run_state(self, run_id: str, state: RunState, reason: str, now: float) -> None:
        """Set the run's state; a run that ends failed or cancelled ends its open round
        too (the round then shows that state, closed now), in the same transaction."""
        with self._tx() as s:
            _set_run_state(s, run_id, state, reason, now)

    def end_run(
        self, run_id: str, state: RunState, reason: str, now: float, round_number: int | None
    ) -> None:
        """End the run in ``state`` (as ``set_run_state``) and record the event of that
        name with ``reason``, in one transaction: whoever sees the run ended sees why, and
        a crash leaves both or neither."""
        with self._tx() as s:
            _set_run_state(s, run_id, state, reason, now)
            self.add_event_op(run_id, state, reason, now, round_number)(s)

    # -- rounds and participations -------------------------------------------

    def open_round(
        self,
        run_id: str,
        number: int,
        attempt: int,
        assignments: dict[str, str],
        opened_at: float,
        deadline_at: float,
        carry: Sequence[str] = (),
        event: tuple[str, str] | None = None,
    ) -> None:
        """Open (or re-open for a new attempt) a round and assign tasks: site_id -> task_id;
        ``event`` (kind, message): a ledger event written in the same transaction.

        ``carry``: unfinished tasks of the previous attempt or round that move into this
        one (async runs: sites still training when a new global model was committed).
        """
        sampled = json.dumps(sorted(assignments))
        with self._tx() as s:
            row = s.scalars(
                select(m.Round).where(m.Round.run_id == run_id, m.Round.number == number)
            ).one_or_none()
            if row is None:
                s.add(
                    m.Round(
                        run_id=run_id,
                        number=number,
                        attempt=attempt,
                        state=RoundState.OPEN,
                        sampled_json=sampled,
                        opened_at=opened_at,
                        deadline_at=deadline_at,
                    )
                )
            elif row.state != RoundState.OPEN:
                raise DuplicateError(f"round {number} of run {run_id} is already {row.state}")
            else:
                row.attempt, row.sampled_json = attempt, sampled
                row.opened_at, row.deadline_at = opened_at, deadline_at
            if assignments:  # one executemany, no ORM objects: a round may have thousands
                s.flush()  # the round's row before its participations
                s.connection().execute(
                    insert(m.Participation),
                    [
                        {
                            "task_id": task_id,
                            "run_id": run_id,
                            "round_number": number,
                            "attempt": attempt,
                            "site_id": site_id,
                            "state": ParticipationState.ASSIGNED,
                            "assigned_at": opened_at,
                            "issued_round": number,
                        }
                        for site_id, task_id in assignments.items()
                    ],
                )
            if carry:
                s.execute(
                    update(m.Participation)
                    .where(
                        m.Participation.task_id.in_(list(carry)),
                        m.Participation.run_id == run_id,
                        m.Participation.state.in_(PENDING_PARTICIPATION_STATES),
                    )
                    .values(round_number=number, attempt=attempt)
                )
            if event is not None:
                s.add(m.Event(**_event_values(run_id, number, opened_at, event)))

    def extend_deadline(self, run_id: str, number: int, deadline_at: float) -> None:
        with self._tx() as s:
            s.execute(
                update(m.Round)
                .where(m.Round.run_id == run_id, m.Round.number == number)
                .values(deadline_at=deadline_at)
            )

    def get_open_round(self, run_id: str) -> RoundRecord | None:
        with self._read() as s:
            row = s.scalars(
                select(m.Round).where(m.Round.run_id == run_id, m.Round.state == RoundState.OPEN)
            ).one_or_none()
            return None if row is None else rows.round_record(row)

    def get_round(self, run_id: str, number: int) -> RoundRecord | None:
        with self._read() as s:
            row = s.scalars(
                select(m.Round).where(m.Round.run_id == run_id, m.Round.number == number)
            ).one_or_none()
            return None if row is None else rows.round_record(row)

    def list_rounds(self, run_id: str) -> list[RoundRecord]:
        with self._read() as s:
            return [rows.round_record(r) for r in s.scalars(_rounds_since(run_id, 0)).all()]

    def list_participations(
        self,
        run_id: str,
        round_number: int | None = None,
        attempt: int | None = None,
    ) -> list[ParticipationRecord]:
        t = m.Participation.__table__.c
        q = _participation_rows_between(run_id, 0, None)
        if round_number is not None:
            q = q.where(t.round_number == round_number)
        if attempt is not None:
            q = q.where(t.attempt == attempt)
        with self._read() as s:  # plain rows: a round of thousands of sites reads fast
            return [rows.participation_from_values(r) for r in s.execute(q)]

    def read_run(self, run_id: str, *, since: int = 0, limit: int | None = None) -> RunView | None:
        """The run and its rounds numbered ``since`` or higher (at most ``limit`` of them),
        with their participations and checkpoints, in one transaction (one snapshot, on
        SQLite): what a status needs."""
        with self._read() as s:
            found = _rounds_read(s, run_id, since, limit)
            if found is None:
                return None
            run, rounds, until = found
            return RunView(
                rows.run_record(run),
                [rows.round_record(r) for r in rounds],
                [  # plain tuples, not ORM objects: a status of thousands of sites reads fast
                    rows.participation_from_values(p)
                    for p in s.execute(_participation_rows_between(run_id, since, until))
                ],
                [
                    rows.checkpoint_record(c)
                    for c in s.scalars(_checkpoints_between(run_id, since, until))
                ],
                more_rounds=until is not None,
            )

    def read_run_summary(
        self,
        run_id: str,
        *,
        since: int = 0,
        limit: int | None = None,
        flag_error: str = "",
        tasks: Collection[str] = (),
    ) -> RunSummaryView | None:
        """``read_run`` with the participations counted by the database instead of read:
        per round, attempt and state, how many and the bytes they moved (``flagged``:
        whether the error starts with ``flag_error``, when one is given), plus the
        mean idle time of each committed round's sites (``ledger.idle_s``); ``held``
        names the closed rounds that have one of ``tasks``. One transaction."""
        with self._read() as s:
            found = _rounds_read(s, run_id, since, limit)
            if found is None:
                return None
            run, rounds, until = found
            t = m.Participation.__table__.c
            between = [t.run_id == run_id, t.round_number >= since]
            if until is not None:
                between.append(t.round_number < until)
            keys: list[Any] = [t.round_number, t.attempt, t.state]
            if flag_error:  # (no constant in a GROUP BY: SQLite reads one as a column's place)
                # Not LIKE: SQLite's ignores case.
                prefix = func.substr(t.error, 1, len(flag_error)) == flag_error
                keys.append(case((prefix, 1), else_=0))
            sums = [func.coalesce(func.sum(c), 0) for c in (t.bytes_down, t.bytes_up, t.bytes_cut)]
            query = select(*keys, func.count(), *sums).where(*between).group_by(*keys)
            tallies = []
            for row in s.execute(query):
                n, a, st, *flag = row[: len(keys)]
                k, d, u, c = row[len(keys) :]
                tallies.append(
                    ParticipationTally(
                        round_number=n,
                        attempt=a,
                        state=rows.PARTICIPATION_STATE[st],
                        flagged=bool(flag and flag[0]),
                        count=int(k),
                        bytes_down=int(d),
                        bytes_up=int(u),
                        bytes_cut=int(c),
                    )
                )
            committed = [r.number for r in rounds if r.state == RoundState.COMMITTED]
            idle = (
                {
                    n: float(mean)
                    for n, mean in s.execute(
                        _idle_in_last_attempts(run_id, committed, self.engine.dialect.name)
                    )
                }
                if committed
                else {}
            )
            held: set[int] = set()
            closed = {
                r.number for r in rounds if r.state != RoundState.OPEN
            }  # an open one is not final
            wanted = list(tasks) if closed else []
            for at in range(0, len(wanted), _IN_BATCH):
                q = select(t.round_number).where(
                    *between, t.task_id.in_(wanted[at : at + _IN_BATCH])
                )
                held.update(n for n in s.scalars(q.distinct()) if n in closed)
            return RunSummaryView(
                rows.run_record(run),
                [rows.round_record(r) for r in rounds],
                tallies,
                idle,
                [
                    rows.checkpoint_record(c)
                    for c in s.scalars(_checkpoints_between(run_id, since, until))
                ],
                held=frozenset(held),
                more_rounds=until is not None,
            )

    def read_site_tallies(
        self,
        run_id: str,
        *,
        since: int = 0,
        until: int | None = None,
        flag_error: str = "",
        failures: int = 5,
    ) -> list[SiteTally]:
        """Per site of the run (by site id), its participations in rounds ``since`` to
        ``until`` (excluded) counted and summed by the database, with its latest task's
        state and the errors of its first ``failures`` failed tasks (``flag_error``: the
        prefix of an error that says the site declined). Three statements in one
        transaction; no participation is read into Python. The tallies of two ranges of
        rounds add up (``SiteTally.then``)."""
        t, r = m.Participation.__table__.c, m.Round.__table__.c
        between = [t.run_id == run_id, t.round_number >= since]
        if until is not None:
            between.append(t.round_number < until)
        idle, span, busy, last = _idle_terms(self.engine.dialect.name)
        flagged: Any = literal(False)
        if flag_error:  # Not LIKE: SQLite's ignores case.
            flagged = func.substr(t.error, 1, len(flag_error)) == flag_error
        is_flagged = (t.state == ParticipationState.FAILED) & flagged
        failing = t.state.in_((ParticipationState.FAILED, ParticipationState.EXPIRED))
        counts = (
            (t.state == ParticipationState.ACCEPTED)
            & (r.state == RoundState.COMMITTED)
            & r.closed_at.is_not(None)
        )

        def total(condition: Any, value: Any = 1, zero: Any = 0) -> Any:
            return func.coalesce(func.sum(case((condition, value), else_=zero)), zero)

        sums = (
            select(
                t.site_id,
                func.count(),
                total(t.state == ParticipationState.ACCEPTED),
                total(failing & ~is_flagged),
                total(is_flagged),
                func.coalesce(func.sum(t.bytes_down + t.bytes_up + t.bytes_cut), 0),
                func.coalesce(func.sum(busy), 0.0),
                total(counts & (idle > 0.0), idle, 0.0),
                total(counts, span, 0.0),
            )
            .select_from(m.Participation.__table__.outerjoin(m.Round.__table__, last))
            .where(*between)
            .group_by(t.site_id)
        )
        newest = func.row_number().over(
            partition_by=t.site_id,
            order_by=(t.round_number.desc(), t.attempt.desc(), t.assigned_at.desc()),
        )
        ranked = select(t.site_id, t.state, case((is_flagged, 1), else_=0).label("flag"))
        latest = ranked.add_columns(newest.label("nth")).where(*between).subquery()
        first = func.row_number().over(
            partition_by=t.site_id, order_by=(t.round_number, t.attempt, t.assigned_at)
        )
        failed = (
            select(t.site_id, t.round_number, t.error, first.label("nth"))
            .where(*between, failing, t.error != "")
            .subquery()
        )
        with self._read() as s:
            states = {
                site: (state, bool(flag))
                for site, state, flag in s.execute(
                    select(latest.c.site_id, latest.c.state, latest.c.flag).where(latest.c.nth == 1)
                )
            }
            errors: dict[str, list[tuple[int, str]]] = {}
            if failures > 0:
                q = (
                    select(failed.c.site_id, failed.c.round_number, failed.c.error)
                    .where(failed.c.nth <= failures)
                    .order_by(failed.c.site_id, failed.c.nth)
                )
                for site, number, error in s.execute(q):
                    errors.setdefault(site, []).append((int(number), error))
            out = []
            for site, n, ok, bad, declined, moved, busy_s, idle_s, counted_s in s.execute(sums):
                state, latest_flagged = states.get(site, ("", False))
                out.append(
                    SiteTally(
                        site_id=site,
                        participations=int(n),
                        accepted=int(ok),
                        failed=int(bad),
                        declined=int(declined),
                        bytes=int(moved),
                        busy_s=float(busy_s),
                        idle_s=float(idle_s),
                        counted_s=float(counted_s),
                        latest_state=rows.PARTICIPATION_STATE[state],
                        latest_flagged=latest_flagged,
                        failures=tuple(errors.get(site, ())),
                    )
                )
            out.sort(key=lambda t: t.site_id)  # as Python orders them, whatever the collation
            return out

    def update_data(self, sha256: str) -> bytes | None:
        """The bytes of a small accepted update with this digest (``accept_op``'s
        ``data``), from a row of an accepted task that still holds them: one whose bytes
        hash to the digest if any does (identical updates of two tasks each have a copy),
        else a damaged one, for the caller to find so; None if no row holds them."""
        p = m.Participation
        q = select(p.update_data).where(
            p.update_sha256 == sha256,
            p.state == ParticipationState.ACCEPTED,
            p.update_data.is_not(None),
        )
        with self._read() as s:
            copies = [data for data in s.scalars(q) if data is not None]
        for data in copies:
            if hashlib.sha256(data).hexdigest() == sha256:
                return data
        return copies[0] if copies else None

    def holding_update_data(self) -> list[str]:
        """The tasks whose rows still hold their update's bytes."""
        p = m.Participation
        with self._read() as s:
            return list(s.scalars(select(p.task_id).where(p.update_data.is_not(None))))

    def clear_update_data(self, task_ids: Sequence[str]) -> None:
        """Let these tasks' rows go of their updates' bytes (their round has ended), in
        one transaction."""
        ids = list(task_ids)
        if not ids:
            return
        p = m.Participation
        with self._tx() as s:
            for start in range(0, len(ids), _IN_BATCH):
                batch = ids[start : start + _IN_BATCH]
                s.execute(
                    update(p)
                    .where(p.task_id.in_(batch), p.update_data.is_not(None))
                    .values(update_data=None)
                )

    def get_participation(self, task_id: str) -> ParticipationRecord | None:
        with self._read() as s:
            row = s.get(m.Participation, task_id)
            return None if row is None else rows.participation_record(row)

    def mark_downloaded(
        self, task_id: str, bytes_down: int, download_s: float, base_round: int | None = None
    ) -> None:
        if self.mark_downloaded_many([(task_id, bytes_down, download_s, base_round)]):
            raise NotFoundError(task_id)

    def mark_downloaded_many(
        self,
        downloads: Sequence[tuple[str, int, float, int | None]],
        cuts: Sequence[tuple[str, int]] = (),
    ) -> list[str]:
        """Count finished downloads, (task_id, bytes, seconds, base round) each, and the
        bytes of transfers cut off or refused, (task_id, bytes) each, in one transaction;
        returns the task ids that do not exist."""
        if not downloads and not cuts:
            return []
        rows_ = [
            {"tid": t, "nbytes": n, "seconds": sec, "base": base} for t, n, sec, base in downloads
        ]
        cut_rows = [{"tid": t, "nbytes": n} for t, n in cuts]
        named = [t for t, *_ in downloads] + [t for t, _ in cuts]
        with self._tx() as s:
            conn = s.connection()
            found = set(conn.scalars(_KNOWN_TASKS, {"tids": sorted(set(named))}))
            known = [r for r in rows_ if r["tid"] in found]
            if known:  # one statement for all of them
                conn.execute(_ADD_DOWNLOAD, known)
            known_cuts = [r for r in cut_rows if r["tid"] in found]
            if known_cuts:
                conn.execute(_ADD_CUT, known_cuts)
        return [t for t in dict.fromkeys(named) if t not in found]

    def accept_update(self, task_id: str, **fields: Any) -> None:
        """Record an accepted update (``accept_op``'s fields) in a transaction of its own;
        DuplicateError on a reused nonce or a final task. The coordinator batches these
        writes instead (``coordinator.commits``)."""
        [error] = self.write_batch([self.accept_op(task_id, **fields)])
        if error is not None:
            raise error

    def accept_op(
        self,
        task_id: str,
        *,
        nonce: bytes,
        sha256: str,
        num_samples: int,
        metrics: dict[str, float],
        bytes_up: int,
        upload_s: float,
        now: float,
        data: bytes | None = None,
    ) -> WriteOp:
        """The write of ``accept_update``, for ``write_batch``; with ``data``, the update's
        own bytes are written into its row (a small one: ``storage.spool``)."""
        values = {
            "tid": task_id,
            "new_nonce": nonce,
            "new_sha256": sha256,
            "new_num_samples": num_samples,
            "new_metrics_json": json.dumps(metrics),
            "new_bytes_up": bytes_up,
            "new_upload_s": upload_s,
            "new_now": now,
            "new_data": data,
        }

        def accept(s: Session) -> None:
            try:
                result = s.connection().execute(_ACCEPT, values)
            except IntegrityError as exc:
                raise DuplicateError(f"nonce {nonce.hex()} was already used") from exc
            if result.rowcount == 0:
                row = self._participation_row(s, task_id)  # NotFoundError if none
                raise DuplicateError(f"task {task_id} is already {row.state}")

        # One prebuilt statement, no ORM unit of work: this runs once per update, on the
        # path every site waits on, and a batch's accepts run as one executemany.
        return StatementWrite(_ACCEPT, values, rows=1, alone=accept)

    def write_batch(self, ops: Sequence[WriteOp]) -> list[Exception | None]:
        """Run ``ops`` in one writing transaction, one synced commit for all of them (group
        commit). Each runs in a savepoint of its own: one refused (DuplicateError,
        NotFoundError) is undone alone, and its error is returned in its place. Any other
        error undoes the whole batch and is raised: none of it was written."""
        errors: list[Exception | None] = [None] * len(ops)
        try:  # first as one: refusals are rare, and a savepoint per write costs statements
            with self._tx() as s:
                run_batch(s, ops)
            return errors
        except (DuplicateError, NotFoundError) as exc:
            if len(ops) == 1:
                return [exc]
        with self._tx() as s:  # one was refused: again, each in a savepoint of its own
            for i, op in enumerate(ops):
                try:
                    with s.begin_nested():
                        op(s)
                except (DuplicateError, NotFoundError) as exc:
                    errors[i] = exc
        return errors

    def fail_participation(
        self, task_id: str, error: str, now: float, *, accepted_too: bool = False
    ) -> None:
        """Fail an unfinished task (with ``accepted_too``, also an accepted one whose
        update was lost before its round committed)."""
        with self._tx() as s:
            row = self._participation_row(s, task_id)
            if row.state not in FINAL_PARTICIPATION_STATES or (
                accepted_too and row.state == ParticipationState.ACCEPTED
            ):
                row.state, row.error, row.finished_at = ParticipationState.FAILED, error, now
                row.update_data = None  # a failed task's update is no one's copy

    def fail_participations(self, task_ids: Sequence[str], error: str, now: float) -> None:
        """Fail the unfinished tasks among ``task_ids``, all for ``error``, in one
        transaction: a round that finds thousands of its sites silent at one look writes
        one statement a few hundred tasks, not a transaction each (``fail_participation``)."""
        if not task_ids:
            return
        with self._tx() as s:
            for start in range(0, len(task_ids), _IN_BATCH):
                s.execute(
                    update(m.Participation)
                    .where(
                        m.Participation.task_id.in_(task_ids[start : start + _IN_BATCH]),
                        m.Participation.state.not_in(FINAL_PARTICIPATION_STATES),
                    )
                    .values(
                        state=ParticipationState.FAILED,
                        error=error,
                        finished_at=now,
                        update_data=None,
                    )
                )

    def expire_attempt(
        self,
        run_id: str,
        number: int,
        attempt: int,
        reason: str,
        now: float,
        keep: Sequence[str] = (),
        event: str = "",
    ) -> None:
        """Close a failed attempt: its unfinished participations become 'expired'
        (except the tasks in ``keep``, which an async run carries on). With ``event`` (a
        kind), the ledger records it in the same transaction, naming the attempt, so a
        restart knows the attempt is over (``failed_attempt``)."""
        with self._tx() as s:
            if event:
                s.add(
                    m.Event(
                        **_event_values(run_id, number, now, (event, reason), {"attempt": attempt})
                    )
                )
            s.execute(
                update(m.Participation)
                .where(
                    m.Participation.run_id == run_id,
                    m.Participation.round_number == number,
                    m.Participation.attempt == attempt,
                    m.Participation.state.in_(PENDING_PARTICIPATION_STATES),
                    m.Participation.task_id.not_in(list(keep)),
                )
                .values(state=ParticipationState.EXPIRED, error=reason, finished_at=now)
            )

    def commit_round(
        self,
        run_id: str,
        number: int,
        checkpoint: CheckpointRecord,
        metrics: dict[str, float],
        now: float,
        final_state: RunState | None = None,
        stages: dict[str, float] | None = None,
        keep: Sequence[str] = (),
        event: tuple[str, str] | None = None,
        final_reason: str = "",
    ) -> None:
        """Atomically: record the checkpoint, close the round, advance the run (and write
        ``event``, (kind, message), to the ledger); with ``final_state``, end the run so,
        with ``final_reason``.

        Call only once the checkpoint's blobs are durable. Unfinished tasks expire,
        except those in ``keep`` (an async run carries them into the next round).
        """
        with self._tx() as s:
            rnd = s.scalars(
                select(m.Round).where(m.Round.run_id == run_id, m.Round.number == number)
            ).one()
            if rnd.state != RoundState.OPEN:
                raise DuplicateError(f"round {number} of run {run_id} is already {rnd.state}")
            rnd.state, rnd.closed_at, rnd.metrics_json = (
                RoundState.COMMITTED,
                now,
                json.dumps(metrics),
            )
            rnd.stages_json = json.dumps(stages or {})
            s.execute(
                update(m.Participation)
                .where(
                    m.Participation.run_id == run_id,
                    m.Participation.round_number == number,
                    m.Participation.state.in_(PENDING_PARTICIPATION_STATES),
                    m.Participation.task_id.not_in(list(keep)),
                )
                .values(
                    state=ParticipationState.EXPIRED,
                    error="round closed before an update arrived",
                    finished_at=now,
                )
            )
            s.add(
                m.Checkpoint(
                    run_id=run_id,
                    round_number=number,
                    model_sha256=checkpoint.model_sha256,
                    model_bytes=checkpoint.model_bytes,
                    optimizer_sha256=checkpoint.optimizer_sha256,
                    created_at=checkpoint.created_at,
                    delta_sha256=checkpoint.delta_sha256,
                )
            )
            run = s.get(m.Run, run_id)
            assert run is not None
            run.rounds_completed, run.updated_at = number, now
            if final_state is not None:
                run.state = final_state
                run.reason = final_reason
            if event is not None:
                s.add(m.Event(**_event_values(run_id, number, now, event)))

    # -- checkpoints -----------------------------------------------------------

    def expire_unfinished_before(self, run_id: str, number: int, reason: str, now: float) -> int:
        """Expire unfinished tasks of rounds before ``number`` (an async run's carried tasks
        left behind by a crash between a commit and the next round's opening)."""
        with self._tx() as s:
            result = s.connection().execute(
                update(m.Participation)
                .where(
                    m.Participation.run_id == run_id,
                    m.Participation.round_number < number,
                    m.Participation.state.in_(PENDING_PARTICIPATION_STATES),
                )
                .values(state=ParticipationState.EXPIRED, error=reason, finished_at=now)
            )
            return result.rowcount

    def latest_checkpoint(self, run_id: str) -> CheckpointRecord | None:
        with self._read() as s:
            row = s.scalars(
                select(m.Checkpoint)
                .where(m.Checkpoint.run_id == run_id)
                .order_by(m.Checkpoint.round_number.desc())
                .limit(1)
            ).one_or_none()
            return None if row is None else rows.checkpoint_record(row)

    def get_checkpoint(self, run_id: str, round_number: int) -> CheckpointRecord | None:
        with self._read() as s:
            row = s.scalars(
                select(m.Checkpoint).where(
                    m.Checkpoint.run_id == run_id, m.Checkpoint.round_number == round_number
                )
            ).one_or_none()
            return None if row is None else rows.checkpoint_record(row)

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        with self._read() as s:
            q = _checkpoints_between(run_id, 0, None)
            return [rows.checkpoint_record(r) for r in s.scalars(q)]

    # -- ledger ----------------------------------------------------------------

    def add_event(
        self,
        run_id: str,
        kind: str,
        message: str,
        now: float,
        round_number: int | None = None,
        data: dict[str, float | int | str] | None = None,
    ) -> None:
        with self._tx() as s:
            self.add_event_op(run_id, kind, message, now, round_number, data)(s)

    def add_event_op(
        self,
        run_id: str,
        kind: str,
        message: str,
        now: float,
        round_number: int | None = None,
        data: dict[str, float | int | str] | None = None,
    ) -> WriteOp:
        """The write of ``add_event``, for a group commit (``write_batch``)."""
        values = _event_values(run_id, round_number, now, (kind, message), data)
        return StatementWrite(_ADD_EVENT, values)

    def failed_since(self, run_id: str, error_prefix: str, since: float) -> dict[str, float]:
        """The run's sites with a task failed for an error starting ``error_prefix`` at or
        after ``since``, each with its latest such failure's time (the engine's clock)."""
        with self._read() as s:
            q = (
                select(m.Participation.site_id, func.max(m.Participation.finished_at))
                .where(
                    m.Participation.run_id == run_id,
                    m.Participation.state == ParticipationState.FAILED,
                    m.Participation.error.startswith(error_prefix, autoescape=True),
                    m.Participation.finished_at >= since,
                )
                .group_by(m.Participation.site_id)
            )
            return {site: float(at) for site, at in s.execute(q) if at is not None}

    def failed_attempt(self, run_id: str, number: int, attempt: int, kind: str) -> bool:
        """Whether the ledger holds an event ``kind`` closing that attempt of that round."""
        with self._read() as s:
            q = select(m.Event.data_json).where(
                m.Event.run_id == run_id, m.Event.round_number == number, m.Event.kind == kind
            )
            return any(json.loads(d).get("attempt") == attempt for d in s.scalars(q))

    def list_events(self, run_id: str, kinds: tuple[str, ...] = ()) -> list[EventRecord]:
        """The run's events in order; with ``kinds``, only those."""
        with self._read() as s:
            q = select(m.Event).where(m.Event.run_id == run_id).order_by(m.Event.id)
            if kinds:
                q = q.where(m.Event.kind.in_(kinds))
            return [rows.event_record(r) for r in s.scalars(q).all()]

    def last_event_id(self, run_id: str, kinds: tuple[str, ...]) -> int:
        """The id of the run's latest event of ``kinds`` (0: none): whether they changed."""
        with self._read() as s:
            q = select(func.max(m.Event.id)).where(
                m.Event.run_id == run_id, m.Event.kind.in_(kinds)
            )
            return int(s.execute(q).scalar_one() or 0)

    @staticmethod
    def _participation_row(s: Session, task_id: str) -> m.Participation:
        row = s.get(m.Participation, task_id)
        if row is None:
            raise NotFoundError(task_id)
        return row
