"""The daemon: build the engine and gRPC server, announce readiness, stop gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedra import pki
from fedra.audit import AUDIT_FILE, AuditLog
from fedra.config import READY_FILE, ConfigError
from fedra.coordinator.api import CoordinatorAPI
from fedra.coordinator.audit import AuditTrail
from fedra.coordinator.auth import Guard
from fedra.coordinator.edge import decline
from fedra.coordinator.engine import Engine, EngineSettings
from fedra.coordinator.gctune import quieter_gc
from fedra.coordinator.limits import CallLimiter, EdgeLimits
from fedra.coordinator.replica import (
    READS_DIR,
    REFUSALS_FILE,
    SNAPSHOT_FILE,
    ForwardedGuard,
    LiveSnapshot,
    ReadsProcess,
    RefusalsRead,
    ReplicaSpec,
    engine_socket_path,
    release_socket,
)
from fedra.coordinator.service import AdminService, SiteService
from fedra.coordinator.telemetry import HttpEndpoint, Telemetry, check_http_address
from fedra.coordinator.tracking import check_track, parse_track
from fedra.coordinator.web import StatusPages
from fedra.files import LockHeld, ProcessLock
from fedra.httpserve import tls_context
from fedra.protos import wire
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, site_pb2, site_pb2_grpc
from fedra.region import Region, RegionConfig
from fedra.storage import BlobStore, Store
from fedra.storage.store import InUseError

log = logging.getLogger("fedra.coordinator")
# The site calls of every site and round: each has a request of its own outstanding in
# gRPC's core, so that none queues behind the others' while the loop is busy. The rest
# (secure aggregation's stages, failure reports, every operator's call) share one: each
# method registered costs every call taken in a look (``wire.add_service``).
ROUND_METHODS = (
    "Register", "Heartbeat", "PollTask", "DownloadModel", "UploadUpdate", "UploadSmallUpdate",
)  # fmt: skip
DENY_LIST = "revoked.json"  # `fedra revoke` writes it; read on every call
STATE_LOCK_FILE = "coordinator.lock"  # held by the daemon serving the state directory
CLAIM_CHECK_S = 10.0  # how often the daemon checks it still holds its database
SIGNAL_CHECK_S = 0.25  # the longest its main thread waits before it runs a signal's handler
# 8 MiB: a site 50 ms away uploads at up to 168 MB/s (1.3 Gbit/s).
DEFAULT_STREAM_WINDOW_MB = 8.0
MAX_STREAM_WINDOW_MB = 1024.0  # HTTP/2 windows stop at 2 GiB - 1
# Threads for the blocking steps of calls (the database, hashing, folding): a call that
# waits (a long poll, a stage, a watch) holds none, so this is not sized to the sites.
DEFAULT_WORKERS, MIN_WORKERS, MAX_WORKERS = 32, 4, 1024
SERVICE_NAMES = (
    site_pb2.DESCRIPTOR.services_by_name["SiteService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
)


@dataclass(frozen=True)
class CoordinatorConfig:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 50051
    db_url: str = ""  # empty: SQLite file in the state directory
    max_workers: int = DEFAULT_WORKERS  # threads for blocking steps (not per waiting call)
    # Each upload's HTTP/2 receive window, MiB; 0: sized by gRPC's BDP probing (server_options).
    stream_window_mb: float = DEFAULT_STREAM_WINDOW_MB
    grace_s: float = 5.0
    engine: EngineSettings = field(default_factory=EngineSettings)
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # calls per caller, idle streams
    tls_dir: Path | None = None  # the coordinator's folder from `fedra provision`
    insecure: bool = False  # plaintext, no identities: localhost development only
    # HOST:PORT of /metrics and the status page (telemetry.HttpEndpoint); empty: none.
    # Off loopback: TLS with the coordinator's certificate, admin client certificates only.
    http: str = ""
    track: tuple[str, ...] = ()  # --track: tensorboard[=DIR], mlflow[=URI] (tracking.py)
    # The admin port, served by the operators' read process (replica.py); None: admin
    # calls only on the site port, in this process.
    admin_port: int | None = None
    # --upstream: this coordinator is a region, one site of the coordinator above it.
    region: RegionConfig | None = None

    def __post_init__(self) -> None:
        if (self.tls_dir is None) == (not self.insecure):
            raise ConfigError(
                "--tls-dir: give the coordinator's folder from `fedra provision`, "
                "or --insecure for localhost development (not both)"
            )
        if not MIN_WORKERS <= self.max_workers <= MAX_WORKERS:
            raise ConfigError(
                f"--workers: must be from {MIN_WORKERS} to {MAX_WORKERS}, got {self.max_workers}"
            )
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ConfigError(
                f"--admin-port: must be a port from 0 to 65535, got {self.admin_port}"
            )
        if self.admin_port is not None and self.admin_port == self.port != 0:
            raise ConfigError(f"--admin-port: {self.admin_port} is the site port (--port) too")
        if self.http:
            check_http_address(self.http, tls=self.tls_dir is not None)
        check_track(self.track)
        window = self.stream_window_mb
        if not (math.isfinite(window) and 0 <= window <= MAX_STREAM_WINDOW_MB):
            raise ConfigError(
                f"--stream-window-mb: must be 0 (adaptive) or a size in MiB up to "
                f"{MAX_STREAM_WINDOW_MB:g}, got {window}"
            )

    @property
    def deny_list_path(self) -> Path:
        return self.state_dir / DENY_LIST

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{self.state_dir / 'fedra.db'}"


def build_engine(config: CoordinatorConfig, claim: bool = False) -> Engine:
    """The engine over the config's database and state directory; with ``claim``, the
    database is claimed for this process (Store.claim) before its schema is touched."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.database_url, migrate=not claim)
    if claim:
        try:
            store.claim()
            store.upgrade()
        except BaseException:
            store.close()
            raise
    return Engine(
        store,
        models=BlobStore(config.state_dir / "blobs"),
        updates=BlobStore(config.state_dir / "updates"),
        settings=config.engine,
        audit=AuditTrail(AuditLog(config.state_dir / AUDIT_FILE)),
    )


# Calls that gRPC's core has received and the server has not yet taken up. A grpc.aio
# server takes them one at a time, through its event loop; past 1,000 waiting, the core
# cancels new ones at random (the caller reads CANCELLED, and no handler ever sees the
# call), and every one past 3,000. A round of thousands of sites opens at one instant:
# their polls, heartbeats and registrations were cancelled so, and came back later as
# retries. Waiting costs a call about 2.4 kB here; its own deadline, and the core's 30 s
# limit on a call left waiting, still bound how long it waits.
PENDING_CALLS = 32_768


def server_options(chunk_bytes: int, stream_window_mb: float) -> list[tuple[str, int]]:
    """gRPC server options: message limits for ``chunk_bytes`` chunks, and the receive window.

    ``stream_window_mb > 0`` fixes each stream's HTTP/2 receive window: an upload then
    buffers at most that much in the coordinator however fast it arrives, and a site at
    round-trip time r uploads at most window / r. 0 lets gRPC size windows by probing the
    bandwidth-delay product: never a limit on a long link, but on a fast one each upload
    may buffer tens of MB while the coordinator catches up.
    """
    limit = chunk_bytes + 1024 * 1024  # a chunk plus its envelope
    options = [
        # gRPC shares a port in use by default (SO_REUSEPORT): a second daemon on it would
        # answer calls in turn with the first. Binding a port in use fails instead.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limit),
        # What it sends it builds itself: chunks, and a whole run's status (GetRun).
        ("grpc.max_send_message_length", max(limit, wire.MAX_STATUS_BYTES)),
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
    ]
    if stream_window_mb > 0:
        options += [
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", int(stream_window_mb * 2**20)),
        ]
    return options


T = TypeVar("T")


class Server:
    """The event-driven gRPC server (grpc.aio) on an event loop of its own thread, with
    blocking methods for the daemon's main thread and for tests: ``start``, ``stop``."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop")
        self._thread.daemon = True
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        # The admin calls the operators' read process forwards, on a Unix socket.
        self._forwarded: grpc.aio.Server | None = None
        self.guard: Guard | None = None
        self.api: CoordinatorAPI | None = None
        self.admin: AdminService | None = None  # its admin servicer (tests look into it)
        self._watch: asyncio.Task[None] | None = None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def start(self) -> None:
        assert self._server is not None
        self.run(self._server.start())
        if self._forwarded is not None:
            self.run(self._forwarded.start())
        if self.api is not None:  # how late the loop runs: liveness leaves that out
            self._watch = self.run(_spawn(self.api.engine.attention.watch()))

    def stop(self, grace_s: float | None) -> threading.Event:
        """Stop serving: calls in flight get ``grace_s`` to end, then are cancelled. The
        returned event is set (stopped) when this returns."""
        stopped = threading.Event()
        if self._thread.is_alive():
            self.run(self._stop(grace_s))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        stopped.set()
        return stopped

    async def _stop(self, grace_s: float | None) -> None:
        if self._forwarded is not None:
            await self._forwarded.stop(grace_s)
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.api is not None:
            self.api.close()  # steps not yet begun are dropped; those under way end
        if self._watch is not None:
            self._watch.cancel()
        # What is left are the calls the stop cut: gRPC ends each once its handler has, and
        # a handler in a blocking step under way ends when the step has (``api.call``).
        # Cancelling gRPC's own task for a call would make it log the cancellation as an
        # unhandled error, with a traceback; what outlives the drain is cancelled anyway.
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if rest:
            _, late = await asyncio.wait(rest, timeout=_DRAIN_S)
            for task in late:
                task.cancel()
            if late:  # their clean-up (a ticket let go, a poll ended) runs before the loop stops
                await asyncio.wait(late, timeout=_CANCELLED_S)


async def _spawn(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coroutine)


_DRAIN_S = 30.0  # how long stopping waits for the blocking steps under way to end
_CANCELLED_S = 1.0  # and then for those it cancelled to clean up


def create_server(
    engine: Engine,
    address: str,
    max_workers: int = DEFAULT_WORKERS,
    tls: pki.TlsFiles | None = None,
    deny_list: Path | None = None,
    stream_window_mb: float = DEFAULT_STREAM_WINDOW_MB,
    limits: EdgeLimits | None = None,
    engine_socket: Path | None = None,
) -> tuple[Server, int]:
    """The site, admin and health services on ``address``: mTLS with ``tls``, else plaintext;
    with ``engine_socket``, the admin service also on that Unix socket, for the calls the
    operators' read process forwards (``replica``).

    Every call is admitted by a CallLimiter first (its caller checked, its calls in
    flight bounded by ``limits``); its blocking steps run on ``max_workers`` threads
    (``api``); a port in use is refused (RuntimeError from gRPC).
    """
    if tls is not None and deny_list is None:
        raise ValueError("a server with TLS needs a deny list path")
    guard = Guard(
        pki.DenyList(deny_list) if deny_list else None,
        insecure=tls is None,
        on_refused=engine.audit.identity_refused,
    )
    engine.bar_sites_by(guard.revoked_sites)  # a revoked site is not sampled into a round
    handle = Server()
    handle.guard = guard
    try:
        port = handle.run(
            _build(handle, engine, guard, address, max_workers, tls, stream_window_mb, limits)
        )
        if engine_socket is not None:
            forwarded = ForwardedGuard(guard.deny_list, insecure=guard.insecure)
            handle.run(_build_forwarded(handle, forwarded, engine_socket, stream_window_mb))
    except BaseException:
        handle.stop(0)
        raise
    return handle, port


async def _build(
    handle: Server,
    engine: Engine,
    guard: Guard,
    address: str,
    max_workers: int,
    tls: pki.TlsFiles | None,
    stream_window_mb: float,
    limits: EdgeLimits | None,
) -> int:
    api = handle.api = CoordinatorAPI(engine, max_workers)
    handle.admin = AdminService(api, guard)
    told = functools.partial(decline, told=engine.observers)  # refusals are counted
    limiter = CallLimiter(
        guard, limits or EdgeLimits(), told, engine.settings.site_timeout_s, engine.site_heard
    )
    server = grpc.aio.server(
        interceptors=[limiter],
        options=server_options(engine.settings.chunk_bytes, stream_window_mb),
    )
    # Model chunks are framed and parsed by hand (fedra.protos.wire): no protobuf copies.
    wire.add_service(
        server,
        site_pb2_grpc.add_SiteServiceServicer_to_server,
        SiteService(api, guard, limiter),
        wire.SITE_SERVICE,
        {
            "DownloadModel": {"response": wire.serialize},
            "UploadUpdate": {"request": wire.parse_update_chunk},
        },
        registered=ROUND_METHODS,
    )
    wire.add_service(
        server,
        admin_pb2_grpc.add_AdminServiceServicer_to_server,
        handle.admin,
        wire.ADMIN_SERVICE,
        {"ExportModel": {"response": wire.serialize}},
        registered=(),
    )
    health_servicer = health.aio.HealthServicer()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, pki.server_credentials(tls))
    if port == 0:
        raise OSError(f"could not bind {address}")
    handle._server = server
    return port


async def _build_forwarded(
    handle: Server, guard: Guard, socket: Path, stream_window_mb: float
) -> None:
    assert handle.api is not None
    server = grpc.aio.server(
        options=server_options(handle.api.settings.chunk_bytes, stream_window_mb)
    )
    wire.add_service(
        server,
        admin_pb2_grpc.add_AdminServiceServicer_to_server,
        AdminService(handle.api, guard),
        wire.ADMIN_SERVICE,
        {"ExportModel": {"response": wire.serialize}},
        registered=(),
    )
    socket.unlink(missing_ok=True)  # a crashed daemon's
    if server.add_insecure_port(f"unix:{socket}") == 0:
        raise OSError(f"could not bind the Unix socket {socket}")
    os.chmod(socket, 0o600)
    handle._forwarded = server


def _write_ready_file(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def _fewer_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (by default up to 8 per core).

    Each gRPC worker thread receiving an upload otherwise gets an arena of its own that
    keeps freed chunk buffers; two arenas cut the coordinator's peak memory by about a
    third in the round benchmark, at no measured cost in speed.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, arenas)


_M_ARENA_MAX = -8  # from glibc's <malloc.h>


def serve(config: CoordinatorConfig) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    _fewer_malloc_arenas()
    tls = None
    if config.tls_dir is not None:
        try:
            tls = pki.load_folder(config.tls_dir, role="coordinator")
        except ValueError as exc:
            raise ConfigError(f"--tls-dir: {exc}") from None
    state_lock = claim_state_dir(config.state_dir)
    try:
        _serve(config, tls)
    finally:
        state_lock.release()


def _http_endpoint(
    config: CoordinatorConfig, telemetry: Telemetry, pages: StatusPages, audit: AuditTrail
) -> HttpEndpoint:
    """``--http``: plain on loopback; elsewhere TLS with the coordinator's own certificate,
    to callers with an admin certificate of the project CA that is not revoked."""
    _, _, loopback = check_http_address(config.http, tls=config.tls_dir is not None)
    if loopback or config.tls_dir is None:
        return HttpEndpoint(config.http, telemetry, pages)
    guard = Guard(pki.DenyList(config.deny_list_path), on_refused=audit.identity_refused)
    try:
        tls = tls_context(config.tls_dir)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--http: cannot serve TLS from --tls-dir {config.tls_dir}: {exc}"
        ) from None
    return HttpEndpoint(config.http, telemetry, pages, tls, guard.admin_certificate)


def claim_state_dir(state_dir: Path) -> ProcessLock:
    """Hold ``state_dir`` for this process: a second coordinator on it (which would drive
    the same runs, clear the first's temporary files and take its readiness file) fails
    at once, naming the first's pid."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        return ProcessLock(state_dir / STATE_LOCK_FILE)
    except LockHeld as exc:
        raise ConfigError(
            f"--state-dir {state_dir}: in use by another coordinator{exc.who}; stop it "
            "first, or give this one another directory"
        ) from None
    except OSError as exc:  # e.g. a state directory this user may not write
        raise ConfigError(f"--state-dir {state_dir}: cannot lock it: {exc}") from None


def _serve(config: CoordinatorConfig, tls: pki.TlsFiles | None) -> None:
    try:
        engine = build_engine(config, claim=True)
    except InUseError as exc:
        raise ConfigError(f"--db {_redact(config.database_url)}: {exc}") from None
    server: Server | None = None
    endpoint: HttpEndpoint | None = None
    reads: ReadsProcess | None = None
    snapshot: LiveSnapshot | None = None
    socket: Path | None = None
    region: Region | None = None
    try:
        if config.admin_port is not None:  # it starts up while this process does
            socket = engine_socket_path(config.state_dir)
            for last in (SNAPSHOT_FILE, REFUSALS_FILE):  # the previous daemon's
                (config.state_dir / READS_DIR / last).unlink(missing_ok=True)
            reads = ReadsProcess(_replica_spec(config, socket))
            reads.start()
        # Before the engine starts: resumed runs are told to the trackers as started again.
        tracker = parse_track(config.track, config.state_dir)
        if tracker is not None:
            engine.observers.add(tracker)
        if config.http:  # bound first too: a port in use fails the start
            telemetry = Telemetry(
                lambda: engine.gauges(engine.barred()),
                RefusalsRead(config.state_dir).new if reads is not None else None,
            )
            engine.observers.add(telemetry)
            pages = StatusPages(engine, config.insecure)
            endpoint = _http_endpoint(config, telemetry, pages, engine.audit)
        address = f"{config.host}:{config.port}"
        # Bound before the engine starts: a port in use fails the start before any run moves.
        server, port = create_server(
            engine, address, config.max_workers, tls, config.deny_list_path,
            config.stream_window_mb, config.limits, socket,
        )  # fmt: skip
        admin_port = None
        if reads is not None:  # serving too before any run moves: a port in use fails here
            try:
                admin_port = reads.wait_ready()
            except RuntimeError as exc:
                raise ConfigError(f"--admin-port {config.admin_port}: {exc}") from None
        quieter_gc()  # before the runs are resumed: what a run holds may be let go
        engine.start()
        server.start()
        if endpoint is not None:
            endpoint.start()
        if config.region is not None:  # once it serves its own sites: a region's rounds need them
            region = Region(config.region, engine)
            region.start()
        if reads is not None:
            assert server.guard is not None
            snapshot = LiveSnapshot(engine, server.guard, config.state_dir)
            snapshot.start()
    except BaseException:  # nothing may drive runs, or hold the database, after this
        if region is not None:
            region.stop()
        if reads is not None:
            reads.stop()
        if socket is not None:
            release_socket(socket, config.state_dir)
        if snapshot is not None:
            snapshot.stop()
        if endpoint is not None:
            endpoint.stop()
        if server is not None:
            server.stop(0)
        engine.stop()
        engine.close()  # a tracker's writer thread, its files; the database
        raise
    try:
        _run(config, engine, server, port, endpoint, admin_port, reads, region)
    finally:  # however it ends, no read process outlives this one's serving
        if reads is not None:
            reads.stop()
        if snapshot is not None:
            snapshot.stop()
        if socket is not None:
            release_socket(socket, config.state_dir)


def _run(
    config: CoordinatorConfig,
    engine: Engine,
    server: Server,
    port: int,
    endpoint: HttpEndpoint | None,
    admin_port: int | None,
    reads: ReadsProcess | None,
    region: Region | None = None,
) -> None:
    """Announce readiness, serve until a signal (or a lost database), stop gracefully."""
    ready = config.state_dir / READY_FILE
    host = config.host if config.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
    announced: dict[str, object] = {
        "address": f"{host}:{port}",
        "port": port,
        "pid": os.getpid(),
        "database": _redact(config.database_url),
        "started_unix_s": time.time(),
        "insecure": config.insecure,
    }
    if admin_port is not None:
        announced.update(admin_address=f"{host}:{admin_port}", admin_port=admin_port)
    if endpoint is not None:
        announced.update(
            http_address=endpoint.address, http_url=f"{endpoint.scheme}://{endpoint.address}/"
        )
    _write_ready_file(ready, announced)
    announcing = threading.Lock()
    stopping = False

    def admin_port_serving(up: bool) -> None:
        """While the read process restarts, admin commands given --state-dir go to the
        site port: coordinator.json names the admin port only while it serves."""
        with announcing:
            if stopping:
                return
            admin_keys = ("admin_address", "admin_port")
            shown = {k: v for k, v in announced.items() if up or k not in admin_keys}
            _write_ready_file(ready, shown)
        log.info("admin calls: %s", "the admin port again" if up else "the site port meanwhile")

    if reads is not None:
        reads.serving = admin_port_serving
    if endpoint is not None:
        url = f"{endpoint.scheme}://{endpoint.address}/"
        log.info("status page at %s, metrics at %smetrics", url, url)
    if config.insecure:
        log.warning("serving on %s:%d WITHOUT TLS: for localhost development only", host, port)
    else:
        log.info("serving on %s:%d with mutual TLS", host, port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lost = False
    claim_checked = time.monotonic()
    # In slices: a signal that another thread took runs its handler here only once this
    # thread runs again, and a wait of CLAIM_CHECK_S would hold a SIGTERM that long.
    while not stop.wait(SIGNAL_CHECK_S):
        if time.monotonic() - claim_checked < CLAIM_CHECK_S:
            continue
        claim_checked = time.monotonic()
        if not engine.holds_claim():  # another coordinator drives its runs now
            log.critical(
                "this coordinator lost its hold on the database (its connection dropped) "
                "and another coordinator took it: stopping, so that one drives its runs"
            )
            lost = True
            break
    # Lost: in-flight calls end now (their writes would be refused); sites retry theirs.
    grace_s = 0.0 if lost else config.grace_s
    log.info("stopping: finishing in-flight calls (grace %.0f s)", grace_s)
    with announcing:
        stopping = True
        ready.unlink(missing_ok=True)
    if region is not None:  # no longer a site upstream: its round stays for the next start
        region.stop()
    shutdown(server, engine, grace_s)
    if endpoint is not None:
        endpoint.stop()
    log.info("stopped")
    if lost:
        raise ConfigError(
            f"--db {_redact(config.database_url)}: another coordinator took the database "
            "while this one's connection was down; this one stopped"
        )


def _replica_spec(config: CoordinatorConfig, socket: Path) -> ReplicaSpec:
    assert config.admin_port is not None
    return ReplicaSpec(
        state_dir=str(config.state_dir),
        db_url=config.database_url,
        host=config.host,
        port=config.admin_port,
        engine_socket=str(socket),
        parent_pid=os.getpid(),
        tls_dir=str(config.tls_dir) if config.tls_dir is not None else None,
        deny_list=str(config.deny_list_path) if config.tls_dir is not None else None,
        max_message_bytes=config.engine.chunk_bytes + 2**20,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        calls_per_admin=config.limits.calls_per_admin,
        stream_idle_s=config.limits.stream_idle_s,
    )


def shutdown(server: Server, engine: Engine, grace_s: float) -> None:
    """Stop in the order that loses nothing: long polls first, then calls, then drivers."""
    engine.begin_stop()  # waiting calls return at once
    server.stop(grace_s).wait()
    engine.stop()
    engine.close()


def _redact(url: str) -> str:
    """The database URL without its password, for the readiness file."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
