"""The operators' reads in a process of their own: the admin port.

The daemon drives its rounds in one Python process, whose interpreter lock its event
loop, its executor and its group commit take in turn; while a round of a thousand sites
moves, a call waits tens of milliseconds for each pass of the loop, and an operator's
``fedra run status`` waits seconds. So the daemon also starts this process (``fedra
coordinator --admin-port``), which serves every admin call on a port of its own:

- **reads** (``GetRun``, ``ListRuns``, ``WatchRun``, ``ListSites``) from the database
  (SQLite in WAL mode, or PostgreSQL: a read never waits for the rounds' writes) and from
  a snapshot of what only the daemon's memory holds, which the daemon writes every
  ``SNAPSHOT_S``, less often where that would take over ``SNAPSHOT_SHARE`` of a CPU
  (``LiveSnapshot``): each site's liveness, each driven run's waiting
  reason and a count of its changes, the downloads not yet written;
- **writes** (``SubmitRun``, ``CancelRun``, ``ExportModel``) forwarded to the daemon
  over a Unix socket in the state directory, naming the admin this process verified,
  so the audit log names the same admin as a call to the site port would.

Its edge is the site port's: each caller's calls in flight bounded (``CallLimiter``,
``--max-calls-per-admin``), stalled request streams ended, every identity refused written
to the audit log, and its refusals counted in the daemon's ``/metrics`` (``RefusalTally``,
read by the daemon from ``reads/refusals.json``).

It imports neither torch nor the engine. It stops when the daemon does (and if the daemon
dies: ``PR_SET_PDEATHSIG``); the daemon starts it again if it exits (``ReadsProcess``),
and names the admin port in ``coordinator.json`` only while it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedra import logformat, pki
from fedra.audit import AUDIT_FILE, AuditLog
from fedra.coordinator.admin_reads import AdminReads, SiteRow
from fedra.coordinator.audit import AuditTrail
from fedra.coordinator.auth import Guard
from fedra.coordinator.edge import decline, mapped, mapped_stream
from fedra.coordinator.errors import PermissionDenied
from fedra.coordinator.gctune import quieter_gc
from fedra.coordinator.ledger import page_limit
from fedra.coordinator.limits import (
    DEFAULT_ADMIN_CALLS,
    DEFAULT_STREAM_IDLE_S,
    CallLimiter,
    EdgeLimits,
)
from fedra.coordinator.observers import Observer, Observers
from fedra.lifetime import die_with_parent
from fedra.protos import wire
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc
from fedra.storage.records import RunReads, SiteRecord
from fedra.storage.store import Store

if TYPE_CHECKING:
    from fedra.coordinator.engine import Engine

log = logging.getLogger("fedra.coordinator")
T = TypeVar("T")

READS_DIR = "reads"  # in the state directory, this user's only (0700)
SNAPSHOT_FILE = "live.json"
SPEC_FILE = "spec.json"
READY_FILE = "ready.json"
REFUSALS_FILE = "refusals.json"
ENGINE_SOCKET = "engine.sock"
SNAPSHOT_S = 0.5  # how often the daemon writes its snapshot: what the reads lag behind
SNAPSHOT_SHARE = 0.02  # of a CPU, the most writing the snapshot takes (it is written less often)
SNAPSHOT_MAX_S = 5.0  # ... but at least this often (and four times a liveness timeout)
FORWARDED_ADMIN = "fedra-forwarded-admin"  # metadata: the admin a forwarded call is from
READER_THREADS = 4
READY_TIMEOUT_S = 60.0
BIND_WAIT_S = 20.0  # how long a fixed admin port may stay held by a read process ending
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 elsewhere


def reads_dir(state_dir: Path) -> Path:
    path = state_dir / READS_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def engine_socket_path(state_dir: Path) -> Path:
    """Where the daemon takes forwarded admin calls: in the state directory, or, if that
    path is too long for a Unix socket, in a private temporary directory."""
    path = reads_dir(state_dir) / ENGINE_SOCKET
    if len(os.fsencode(path)) <= _SOCKET_PATH_MAX:
        return path
    return Path(tempfile.mkdtemp(prefix="fedra-")) / ENGINE_SOCKET  # 0700, this user's


def release_socket(path: Path, state_dir: Path) -> None:
    """Remove the daemon's socket, and the temporary directory it was in, if any."""
    path.unlink(missing_ok=True)
    if path.parent != state_dir / READS_DIR:
        shutil.rmtree(path.parent, ignore_errors=True)


# -- the daemon's side ---------------------------------------------------------------


class ForwardedGuard(Guard):
    """The guard of the daemon's Unix socket: only the read process reaches it (the socket
    is in this user's private directory), and it forwards admin calls whose admin it
    verified itself, named in the call's metadata."""

    def admin(self, context: Any) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == FORWARDED_ADMIN and isinstance(value, str) and 0 < len(value) <= 256:
                return value
        raise PermissionDenied(f"a forwarded admin call must name its admin ({FORWARDED_ADMIN})")


class LiveSnapshot:
    """Writes what the read process needs from the daemon's memory to
    ``reads/live.json`` every ``SNAPSHOT_S`` (or as often as ``SNAPSHOT_SHARE`` of a CPU
    allows), on a thread of its own, without the engine's lock (the reads it serves are
    as current as the file). Each site is written as the milliseconds since it was heard
    from, the offline ones listed apart: at thousands of sites that costs less than half
    of writing each one's presence as a pair."""

    def __init__(self, engine: Engine, guard: Guard, state_dir: Path) -> None:
        self.engine, self.guard = engine, guard
        self.path = reads_dir(state_dir) / SNAPSHOT_FILE
        self._seq = 0
        self._encode = json.JSONEncoder(separators=(",", ":")).encode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-snapshot", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.path.unlink(missing_ok=True)  # what it said is no longer so

    def build(self) -> dict[str, Any]:
        engine = self.engine
        now = engine.clock()
        ages, offline = engine.presence_ages(now)
        runs = {}
        for run_id in engine.active_run_ids():
            runs[run_id] = {
                "waiting": engine.waiting_reason(run_id),
                "phase": list(engine.run_phase(run_id)),
                "changes": engine.run_changes.get(run_id, 0),
            }
        return {
            "pid": os.getpid(),  # a daemon's before a restart is not this one's
            "seq": self._seq,
            "written_unix_s": now,
            "registrations": engine.registrations,
            "site_timeout_s": engine.settings.site_timeout_s,
            "sites": ages,  # ms since each was heard from
            "offline": offline,
            "serials": self.guard.site_serials(),
            "runs": runs,
            "pending": sorted(engine.downloads_pending()),
        }

    def write(self) -> float:
        """Write the snapshot; the CPU seconds it took."""
        began = time.thread_time()
        self._seq += 1
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(self._encode(self.build()))
        os.replace(tmp, self.path)  # never seen half-written; no fsync: it is rebuilt
        return time.thread_time() - began

    def _run(self) -> None:
        # Every SNAPSHOT_S, or less often where writing it takes more than SNAPSHOT_SHARE
        # of a CPU (it grows with the sites: milliseconds at thousands of them), but
        # never so seldom that the read process takes it as stale (``Replica.fresh``).
        longest = min(SNAPSHOT_MAX_S, self.engine.settings.site_timeout_s / 4)
        interval = SNAPSHOT_S
        while not self._stop.wait(interval):
            try:
                interval = min(longest, max(SNAPSHOT_S, self.write() / SNAPSHOT_SHARE))
            except Exception:  # a full disk, a torn read of a dict: the next one may do
                log.exception("could not write the operators' snapshot")


@dataclass(frozen=True)
class ReplicaSpec:
    """What the read process is started with (written to ``reads/spec.json``, 0600)."""

    state_dir: str
    db_url: str
    host: str
    port: int
    engine_socket: str
    parent_pid: int
    tls_dir: str | None = None
    deny_list: str | None = None
    max_message_bytes: int = 64 * 2**20
    log_level: str = "INFO"
    calls_per_admin: int = DEFAULT_ADMIN_CALLS  # --max-calls-per-admin
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S  # --stream-idle-s


class ReadsProcess:
    """Starts the read process, starts it again whenever it exits while the daemon runs
    (on the port it had), and stops it with the daemon; ``serving`` is told each time it
    stops or starts serving again (``coordinator.json`` names the admin port only while
    it serves, so that the CLI goes to the site port meanwhile)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.folder = reads_dir(Path(spec.state_dir))
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()  # ends a restart's backoff at once
        self._port = spec.port
        self._watcher: threading.Thread | None = None
        self.serving: Callable[[bool], None] = lambda up: None

    def start(self) -> None:
        """Start it (``wait_ready`` waits until it serves): it starts up while the daemon
        does."""
        self._spawn()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Wait until it serves, then watch it (started again if it exits); its port."""
        self._port = self._ready(timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="reads-process", daemon=True)
        self._watcher.start()
        return self._port

    def _spawn_and_wait(self, timeout_s: float) -> int:
        self._spawn()
        return self._ready(timeout_s)

    def _spawn(self) -> None:
        (self.folder / READY_FILE).unlink(missing_ok=True)
        spec_path = self.folder / SPEC_FILE
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds --db
        with os.fdopen(fd, "w") as f:
            json.dump({**asdict(self.spec), "port": self._port}, f)
        with self._lock:
            if self._stopping:
                raise RuntimeError("stopping")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fedra.coordinator.replica", str(spec_path)],
                stdin=subprocess.DEVNULL,
                # A session of its own: Linux shares CPU between sessions first
                # (autogroups), then between the threads of each, so the daemon's busy
                # threads do not crowd out its few. It still ends with the daemon.
                start_new_session=True,
            )

    def _ready(self, timeout_s: float) -> int:
        ready, proc = self.folder / READY_FILE, self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:  # a readiness check with a deadline: the file names the process's pid
            try:
                info = json.loads(ready.read_text())
                if info.get("pid") == proc.pid:
                    return int(info["port"])
            except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the operators' read process exited ({proc.returncode}) before it "
                    "served: see the coordinator's log"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the operators' read process did not serve in {timeout_s:g} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def _watch(self) -> None:
        attempt = 0
        while True:
            proc = self._proc
            assert proc is not None
            code = proc.wait()
            with self._lock:
                if self._stopping:
                    return
            if attempt == 0:
                self._tell(False)
            delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            log.error(
                "the operators' read process (admin port %d) exited with %s: starting it "
                "again in %.1f s",
                self._port, code, delay,
            )  # fmt: skip
            if self._stopped.wait(delay):  # a backoff before the restart
                return
            try:
                self._spawn_and_wait(READY_TIMEOUT_S)
                self._tell(True)
                attempt = 0
            except RuntimeError as exc:
                if str(exc) == "stopping":
                    return
                log.error("%s", exc)
                attempt += 1
            except Exception:  # a full disk, no fork: try again after the next backoff
                log.exception("could not start the operators' read process again")
                attempt += 1

    def _tell(self, up: bool) -> None:
        try:
            self.serving(up)
        except Exception:  # the watcher goes on: a restart matters more than the file
            log.exception("could not announce the admin port %s", "up" if up else "down")

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            proc = self._proc
        self._stopped.set()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(timeout_s)
        (self.folder / READY_FILE).unlink(missing_ok=True)


class RefusalTally(Observer):
    """The read process's refusals by gRPC status, since it started; ``write`` puts them
    in ``reads/refusals.json`` (with the process's pid) for the daemon's ``/metrics``."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._written: dict[str, int] | None = None

    def refused(self, status: str) -> None:
        with self._lock:
            self._counts[status] += 1

    def write(self, folder: Path) -> None:
        """Write the counts if they changed since the last write."""
        with self._lock:
            counts = dict(self._counts)
        if counts == self._written:
            return
        path = folder / REFUSALS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "refusals": counts}))
        os.replace(tmp, path)
        self._written = counts


class RefusalsRead:
    """The daemon's side: the refusals the read process counted since the last ``new``
    (a new read process counts from 0 again), to be added to the daemon's own."""

    def __init__(self, state_dir: Path) -> None:
        self.path = reads_dir(state_dir) / REFUSALS_FILE
        self._lock = threading.Lock()
        self._pid = 0
        self._seen: dict[str, int] = {}

    def new(self) -> Mapping[str, int]:
        try:
            doc = json.loads(self.path.read_text())
            pid = int(doc["pid"])
            counts = {str(k): int(v) for k, v in dict(doc["refusals"]).items()}
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or being replaced
            return {}
        with self._lock:
            seen = self._seen if pid == self._pid else {}
            self._pid, self._seen = pid, counts
        return {k: n - seen.get(k, 0) for k, n in counts.items() if n > seen.get(k, 0)}


# -- the read process's side -----------------------------------------------------------


class Replica:
    """The read process's ``ReadSide`` and ``StatusSource``: the database, and the
    daemon's latest snapshot (read again when the file changes)."""

    def __init__(
        self, store: Store, snapshot: Path, readers: ThreadPoolExecutor, daemon_pid: int
    ) -> None:
        self._store, self.path, self._readers = store, snapshot, readers
        self.daemon_pid = daemon_pid  # a snapshot another daemon wrote is not used
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._read_at = 0.0
        self._live: dict[str, Any] = {}
        # The sites' rows, read again when the daemon says a site registered since.
        self._rows: tuple[object, list[SiteRecord], list[str]] | None = None

    # StatusSource
    @property
    def records(self) -> RunReads:
        return self._store

    @property
    def source(self) -> Replica:
        return self

    @property
    def readers(self) -> ThreadPoolExecutor:
        return self._readers

    def live(self) -> dict[str, Any]:
        """The daemon's latest snapshot ({} before its first)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        stamp, now = (st.st_mtime_ns, st.st_size), time.monotonic()
        with self._lock:
            # Read again when the file changed, or a snapshot's interval after the last
            # read (a file system with a coarse clock may show two snapshots the same).
            if stamp != self._stamp or now - self._read_at >= SNAPSHOT_S:
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    live = json.loads(self.path.read_text())
                    live["offline"] = frozenset(live.get("offline", ()))
                    self._live = live if live.get("pid") == self.daemon_pid else {}
                    self._stamp, self._read_at = stamp, now
            return self._live

    def settled_before(self) -> float:
        """Rounds closed before this may be final: the snapshot's pending downloads were
        taken then (the daemon's own reads take them after the database's)."""
        return float(self.live().get("written_unix_s", 0.0))

    def fresh(self, live: dict[str, Any]) -> bool:
        """Whether ``live`` is recent enough to say who is online: written within one
        liveness timeout (a daemon that stopped writing knows no better than the
        database)."""
        written = float(live.get("written_unix_s", 0.0))
        return time.time() - written <= float(live.get("site_timeout_s", 20.0))

    def waiting_reason(self, run_id: str) -> str:
        return str(self.live().get("runs", {}).get(run_id, {}).get("waiting", ""))

    def downloads_pending(self) -> set[str]:
        return set(self.live().get("pending", ()))

    def run_phase(self, run_id: str) -> tuple[object, ...]:
        run = self.live().get("runs", {}).get(run_id)
        return ("not driven",) if run is None else tuple(run.get("phase", ()))

    def change_mark(self, run_id: str) -> tuple[object, ...]:
        run = self.live().get("runs", {}).get(run_id)
        return ("not driven",) if run is None else (run.get("changes"), *run.get("phase", ()))

    # ReadSide
    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._readers, fn, *args)

    async def changes(self, run_id: str, interval_s: float, gap_s: float) -> AsyncIterator[None]:
        """At once, then when the daemon's snapshot says the run changed (or ended), at
        most once per ``gap_s``, or every ``interval_s``."""
        while True:
            mark, looked = self.change_mark(run_id), time.monotonic()
            yield
            while True:
                await asyncio.sleep(max(gap_s, SNAPSHOT_S / 2))
                if self.change_mark(run_id) != mark or time.monotonic() - looked >= interval_s:
                    break

    def _presence(self, live: dict[str, Any], s: SiteRecord, now: float) -> tuple[bool, float]:
        age_ms = live.get("sites", {}).get(s.id) if self.fresh(live) else None
        if age_ms is not None:
            seen = float(live["written_unix_s"]) - float(age_ms) / 1000.0
            return s.id not in live["offline"], seen
        timeout = float(live.get("site_timeout_s", 20.0))  # not in it yet: from the row
        return now - s.last_seen_at <= timeout, s.last_seen_at

    def listing_key(self) -> object | None:
        """What a ListSites reply is built from: the same key, the same reply."""
        live = self.live()
        if not self.fresh(live):  # the rows and the clock decide: build each time
            return None
        return live.get("seq"), live.get("registrations")

    def _registry(self, live: dict[str, Any]) -> tuple[list[SiteRecord], list[str]]:
        """Every site's row in id order, and their ids: read again only once the daemon's
        snapshot counts a registration since (or without a snapshot to say so)."""
        mark = (live.get("pid"), live.get("registrations")) if self.fresh(live) else None
        with self._lock:
            rows = self._rows
        if rows is not None and mark is not None and rows[0] == mark:
            return rows[1], rows[2]
        # In Python's order, as the daemon pages them: a database's collation may differ
        # (PostgreSQL's locales order case, '-', '_' and '.' otherwise), and paging bisects.
        found = sorted(self._store.list_sites(), key=lambda s: s.id)
        ids = [s.id for s in found]
        with self._lock:
            self._rows = (mark, found, ids)
        return found, ids

    def site_counts(self, offline: Collection[str] = ()) -> tuple[int, int]:
        live, now = self.live(), time.time()
        found, _ = self._registry(live)
        online = sum(self._presence(live, s, now)[0] and s.id not in offline for s in found)
        return len(found), online

    def list_sites(self, after: str, limit: int) -> tuple[list[SiteRow], str]:
        limit = page_limit(limit)
        live, now = self.live(), time.time()
        found, ids = self._registry(live)
        first = bisect.bisect_right(ids, after)
        chosen = found[first : first + limit + 1]
        page = [(s, *self._presence(live, s, now)) for s in chosen[:limit]]
        return page, (chosen[limit - 1].id if len(chosen) > limit else "")


class ReplicaAdmin(AdminReads):
    """The admin service of the read process: reads served here, writes forwarded."""

    def __init__(
        self,
        replica: Replica,
        guard: Guard,
        channel: grpc.aio.Channel,
        observers: Observers | None = None,
    ) -> None:
        super().__init__(replica, guard, observers)
        self.replica = replica
        self._submit = channel.unary_unary(
            f"/{wire.ADMIN_SERVICE}/SubmitRun",
            request_serializer=admin_pb2.SubmitRunRequest.SerializeToString,
            response_deserializer=admin_pb2.SubmitRunResponse.FromString,
        )
        self._cancel = channel.unary_unary(
            f"/{wire.ADMIN_SERVICE}/CancelRun",
            request_serializer=admin_pb2.CancelRunRequest.SerializeToString,
            response_deserializer=admin_pb2.CancelRunResponse.FromString,
        )
        self._export: grpc.aio.UnaryStreamMultiCallable[admin_pb2.ExportModelRequest, bytes]
        self._export = channel.unary_stream(
            f"/{wire.ADMIN_SERVICE}/ExportModel",
            request_serializer=admin_pb2.ExportModelRequest.SerializeToString,
            response_deserializer=None,  # the daemon's frames, passed on as they are
        )

    def revoked(self) -> frozenset[str]:
        self.guard.know_serials(
            {s: int(n) for s, n in self.replica.live().get("serials", {}).items()}
        )
        return self.guard.revoked_sites()

    def _forwarded(self, context: Any) -> tuple[tuple[str, str], ...]:
        return ((FORWARDED_ADMIN, self.guard.admin(context)),)

    async def _forward(self, method: Any, request: Any, context: Any) -> Any:
        """``request`` to the daemon's ``method`` as the admin verified here; its reply, or
        the daemon's status as it gave it."""
        call = method(request, metadata=self._forwarded(context), timeout=_left(context))
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(*_relayed_status(exc))

    @mapped
    async def SubmitRun(
        self, request: admin_pb2.SubmitRunRequest, context: Any
    ) -> admin_pb2.SubmitRunResponse:
        reply: admin_pb2.SubmitRunResponse = await self._forward(self._submit, request, context)
        return reply

    @mapped
    async def CancelRun(
        self, request: admin_pb2.CancelRunRequest, context: Any
    ) -> admin_pb2.CancelRunResponse:
        reply: admin_pb2.CancelRunResponse = await self._forward(self._cancel, request, context)
        return reply

    @mapped_stream
    async def ExportModel(  # type: ignore[override]  # the daemon's framed ModelChunks
        self, request: admin_pb2.ExportModelRequest, context: Any
    ) -> AsyncIterator[bytes]:
        call = self._export(request, metadata=self._forwarded(context), timeout=_left(context))
        try:
            async for frame in call:
                yield frame
        except grpc.aio.AioRpcError as exc:
            await context.abort(*_relayed_status(exc))


def _left(context: Any) -> float | None:
    """The caller's deadline, passed on as it is (none: none)."""
    left = context.time_remaining()
    return None if left is None else max(0.0, left)


def _relayed_status(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The daemon's status, as it gave it; the socket not answering said as such (its
    path and gRPC's words stay in this log)."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and (
        not details or "failed to connect" in details or "unix:" in details
    ):
        log.warning("a forwarded admin call found the daemon away: %s", details)
        return exc.code(), "the coordinator's daemon is not answering (restarting?): try again"
    return exc.code(), details


def _server(
    spec: ReplicaSpec,
    admin: ReplicaAdmin,
    health_servicer: health.aio.HealthServicer,
    limiter: CallLimiter,
) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=[limiter],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 4 * 2**20),
            ("grpc.max_send_message_length", max(spec.max_message_bytes, wire.MAX_STATUS_BYTES)),
        ],
    )
    wire.add_service(
        server,
        admin_pb2_grpc.add_AdminServiceServicer_to_server,
        admin,
        wire.ADMIN_SERVICE,
        {"ExportModel": {"response": bytes}},
        registered=(),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


async def _serve(spec: ReplicaSpec) -> None:
    folder = Path(spec.state_dir) / READS_DIR
    tls = pki.load_folder(Path(spec.tls_dir), role="coordinator") if spec.tls_dir else None
    deny = pki.DenyList(Path(spec.deny_list)) if spec.deny_list else None
    trail = AuditTrail(AuditLog(Path(spec.state_dir) / AUDIT_FILE))
    guard = Guard(deny, insecure=tls is None, on_refused=trail.identity_refused)
    tally, observers = RefusalTally(), Observers()
    observers.add(tally)
    # calls_per_site: a site's certificate is refused by every admin method anyway.
    limits = EdgeLimits(calls_per_admin=spec.calls_per_admin, stream_idle_s=spec.stream_idle_s)
    limiter = CallLimiter(guard, limits, functools.partial(decline, told=observers))
    store = Store(spec.db_url, migrate=False)
    readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="reads")
    replica = Replica(store, folder / SNAPSHOT_FILE, readers, spec.parent_pid)
    channel = grpc.aio.insecure_channel(
        f"unix:{spec.engine_socket}",
        options=[("grpc.max_receive_message_length", spec.max_message_bytes)],
    )
    admin = ReplicaAdmin(replica, guard, channel, observers)
    health_servicer = health.aio.HealthServicer()
    for name in ("", wire.ADMIN_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # A fixed port may still be held a moment by the process this one replaces (it ends
    # when its daemon does, which may have just been killed): bound again until it is free.
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        server = _server(spec, admin, health_servicer, limiter)
        address = f"{spec.host}:{spec.port}"
        try:
            if tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, pki.server_credentials(tls))
        except RuntimeError:  # grpc.aio: "Failed to bind"
            port = 0
        if port:
            break
        if time.monotonic() > deadline:
            raise OSError(f"cannot bind the admin port {address} (in use?)")
        await asyncio.sleep(0.2)  # a retry with a deadline, not a wait for a condition
    quieter_gc()  # what is built so far lives as long as the process
    await server.start()
    ready = folder / READY_FILE
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "port": port}))
    os.replace(tmp, ready)
    log.info("operators' reads served on %s:%d (pid %d)", spec.host, port, os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set() and os.getppid() == spec.parent_pid:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        with contextlib.suppress(OSError):  # a full disk: counted again at the next write
            tally.write(folder)
    await server.stop(2.0)
    await channel.close()
    readers.shutdown(wait=False, cancel_futures=True)
    store.close()
    with contextlib.suppress(OSError):
        tally.write(folder)
    trail.close()


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedra.coordinator.replica")
    parser.add_argument("spec", type=Path, help="the spec the daemon wrote (reads/spec.json)")
    args = parser.parse_args(None if argv is None else list(argv))
    spec = ReplicaSpec(**json.loads(args.spec.read_text()))
    die_with_parent(spec.parent_pid)  # elsewhere than Linux, the watchdog in _serve
    logformat.setup(spec.log_level, os.environ.get(logformat.ENV, "text"))
    try:
        asyncio.run(_serve(spec))
    except (OSError, RuntimeError, ValueError) as exc:  # a port in use, a database away
        log.error("the operators' read process could not serve: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
