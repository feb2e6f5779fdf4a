"""gRPC servicers: validate, call the engine, map domain errors to status codes."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from fedra import logsafe, pki
from fedra.coordinator import secure, uploads
from fedra.coordinator.auth import Guard
from fedra.coordinator.engine import HANG_UP_CHECK_S, Engine, TaskView
from fedra.coordinator.errors import (
    AlreadyExists,
    FailedPrecondition,
    FedraError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from fedra.coordinator.status import RunWatch, run_header, run_page, run_status
from fedra.faults import crash_point
from fedra.protos import wire
from fedra.protos.codec import transfer_chunk_bytes
from fedra.protos.serde import (
    codec_to_proto,
    runspec_from_proto,
    secagg_round_to_proto,
    train_to_proto,
)
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, site_pb2, site_pb2_grpc
from fedra.storage.blobs import BlobCorruptError
from fedra.storage.store import ClaimLostError, transient_fault

if TYPE_CHECKING:
    from fedra.coordinator.limits import CallLimiter

log = logging.getLogger("fedra.coordinator")
F = TypeVar("F", bound=Callable[..., Any])

_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


# Refusals an operator should see in the coordinator's own log, not only the caller.
_LOUD = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.RpcError):  # the call ended under us: the site's to retry
        log.info(
            "a call from %s ended before its request stream did (cancelled by the caller, "
            "past its deadline, or this daemon stopping)",
            context.peer(),
        )
        context.abort(grpc.StatusCode.CANCELLED, "the call ended before its request stream")
    if isinstance(exc, ClaimLostError):  # stopping: the database is another coordinator's
        log.info("refused a call from %s: %s", context.peer(), logsafe.safe(exc))
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "this coordinator no longer holds its database (another coordinator took it) "
            "and is stopping: try again",
        )
    if isinstance(exc, FedraError):
        code = _STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT)
        level = logging.WARNING if code in _LOUD else logging.INFO
        # The message often quotes what the caller sent (an id, a name): escaped and cut.
        text = logsafe.safe(exc, logsafe.MESSAGE_CHARS)
        log.log(level, "refused a call from %s: %s: %s", context.peer(), code.name, text)
        context.abort(code, logsafe.safe(exc, logsafe.STATUS_CHARS))
    storage = transient_fault(exc)
    if storage:  # the site's to retry, as after a restart; the driver rides it out
        log.warning("a call from %s met a storage fault: %s", context.peer(), storage)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"the coordinator's storage: {storage}")
    if isinstance(exc, BlobCorruptError):  # the driver ends the run with the reason
        log.error("a call from %s read damaged stored data: %s", context.peer(), exc)
        context.abort(grpc.StatusCode.DATA_LOSS, "the coordinator's stored data is damaged")
    # Internals stay in the coordinator's log, never in the caller's status.
    log.error("unexpected error in %s: %s", type(exc).__name__, logsafe.exception_text(exc))
    context.abort(grpc.StatusCode.INTERNAL, "internal coordinator error (see the coordinator log)")


def refuse(context: grpc.ServicerContext, exc: Exception) -> None:
    """End the call with the status ``exc`` maps to, as handlers do (for checks made
    before a handler runs: fedra.coordinator.limits)."""
    _abort(context, exc)


def mapped(method: F) -> F:
    """Turn domain errors raised by a unary handler into gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, exc)

    return wrapper  # type: ignore[return-value]


def mapped_stream(method: F) -> F:
    """The same for handlers that return a response stream (generators)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except Exception as exc:
            _abort(context, exc)

    return wrapper  # type: ignore[return-value]


def _task_to_proto(t: TaskView) -> site_pb2.Task:
    return site_pb2.Task(
        task_id=t.task_id,
        run_id=t.run_id,
        round=t.round,
        kind=site_pb2.TASK_KIND_INIT if t.kind == "init" else site_pb2.TASK_KIND_TRAIN,
        entry_point=t.entry_point,
        settings=train_to_proto(t.train),
        seed=t.seed,
        model_sha256=t.model_sha256,
        model_bytes=t.model_bytes,
        deadline_in_s=t.deadline_in_s,
        codec=t.codec.name,
        compression=codec_to_proto(t.codec),
        secagg=secagg_round_to_proto(t.secagg) if t.secagg is not None else None,
        base_sha256=t.base_sha256,
        delta_sha256=t.delta_sha256,
        delta_bytes=t.delta_bytes,
    )


def _long_poll_s(requested: float, context: Any) -> float:
    """How long a long poll may wait: what was asked, within the caller's own deadline."""
    remaining = context.time_remaining()
    wait = requested if requested > 0 else 0.0
    if remaining is not None:
        wait = min(wait, max(0.0, remaining - 1.0))
    return wait


def _header_from_proto(m: site_pb2.UpdateHeader) -> uploads.UpdateHeader:
    return uploads.UpdateHeader(
        site_id=m.site_id,
        run_id=m.run_id,
        round=m.round,
        task_id=m.task_id,
        num_samples=m.num_samples,
        metrics=dict(m.metrics),
        codec=m.codec,
        sha256=m.sha256,
        nonce=m.nonce,
        payload_bytes=m.payload_bytes,
    )


def _model_chunks(engine: Engine, digest: str, size: int) -> Iterator[bytes]:
    """A stored model as framed ModelChunks (by hand, fedra.protos.wire), in chunks sized
    to the model (codec.transfer_chunk_bytes) so that a stream holds a fraction of it."""
    chunk = transfer_chunk_bytes(size, engine.settings.chunk_bytes)
    return engine.models.read_chunks(digest, chunk, frame=wire.model_chunk_frame)


class SiteService(site_pb2_grpc.SiteServiceServicer):
    def __init__(self, engine: Engine, guard: Guard, limiter: CallLimiter | None = None) -> None:
        self.engine, self.guard = engine, guard
        self.limiter = limiter  # set: it ends an upload whose site goes silent

    @mapped
    def Register(
        self, request: site_pb2.RegisterRequest, context: Any
    ) -> site_pb2.RegisterResponse:
        self.guard.site(context, request.site_id)
        self.engine.register(request.site_id, list(request.tasks), request.version)
        s = self.engine.settings
        return site_pb2.RegisterResponse(
            heartbeat_interval_s=s.heartbeat_interval_s,
            poll_timeout_s=s.poll_timeout_s,
            chunk_bytes=s.chunk_bytes,
        )

    @mapped
    def Heartbeat(
        self, request: site_pb2.HeartbeatRequest, context: Any
    ) -> site_pb2.HeartbeatResponse:
        self.guard.site(context, request.site_id)
        current = self.engine.heartbeat(request.site_id, request.task_id)
        return site_pb2.HeartbeatResponse(task_current=current)

    @mapped
    def PollTask(
        self, request: site_pb2.PollTaskRequest, context: Any
    ) -> site_pb2.PollTaskResponse:
        self.guard.site(context, request.site_id)
        # Leave a margin inside the caller's own deadline so the reply gets back in time.
        remaining = context.time_remaining()
        timeout = self.engine.settings.poll_timeout_s
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - 1.0))
        task = self.engine.poll(request.site_id, timeout, active=context.is_active)
        if task is None:
            return site_pb2.PollTaskResponse()
        return site_pb2.PollTaskResponse(task=_task_to_proto(task))

    @mapped_stream
    def DownloadModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: site_pb2.DownloadModelRequest, context: Any
    ) -> Iterator[bytes]:
        self.guard.site(context, request.site_id)
        digest, size, base = self.engine.open_download(
            request.site_id, request.task_id, request.delta
        )
        started = time.monotonic()
        sent = 0  # handed to gRPC, frames included
        try:
            for chunk in _model_chunks(self.engine, digest, size):
                if sent:  # the first chunk has gone out
                    crash_point("mid_download", base)
                sent += len(chunk)
                yield chunk
                del chunk  # not held while the next one is read
        except BaseException:  # cancelled, failed, or closed by gRPC: what went out is cut
            self.engine.downloads.abandoned(request.task_id, min(sent, size))
            raise
        self.engine.record_download(request.task_id, size, time.monotonic() - started, base)

    @mapped
    def UploadUpdate(
        self, request_iterator: Iterator[site_pb2.UpdateChunk | memoryview], context: Any
    ) -> site_pb2.UploadUpdateResponse:
        # Who is calling, before a byte is read: a revoked caller holds no thread waiting.
        self.guard.any_site(context)
        # Data messages arrive as views of their payload (wire.parse_update_chunk).
        first = next(request_iterator, None)
        if not isinstance(first, site_pb2.UpdateChunk) or first.WhichOneof("part") != "header":
            raise InvalidArgument("an upload must start with exactly one header message")
        h = first.header
        self.guard.site(context, h.site_id)
        message = pki.upload_message(
            h.run_id, h.round, h.site_id, h.task_id, h.nonce, h.sha256,
            num_samples=h.num_samples, codec=h.codec, payload_bytes=h.payload_bytes,
        )  # fmt: skip
        self.guard.upload(context, message, h.signature)
        try:
            ticket = uploads.begin_upload(self.engine, _header_from_proto(h))
        except uploads.AlreadyAccepted as done:
            return site_pb2.UploadUpdateResponse(bytes_received=done.nbytes)
        task_id, size = ticket.header.task_id, ticket.header.payload_bytes
        if self.limiter is not None:  # it holds the round now: not past the site's silence
            self.limiter.upload_started(context, h.site_id)
        ledger = self.engine.downloads  # the upload is pending there until it ends
        received = _Received(request_iterator)
        try:
            digest = uploads.receive(self.engine, ticket, received)
        except BaseException:  # cut off or refused: what arrived crossed the wire for nothing
            ledger.ended(task_id, received.nbytes)
            uploads.abort_upload(self.engine, ticket)
            raise
        try:
            uploads.accept(self.engine, ticket, digest, size)
        except BaseException:  # refused whole (too late, say): all of it for nothing
            ledger.ended(task_id, size)
            raise
        ledger.ended(task_id)
        return site_pb2.UploadUpdateResponse(bytes_received=size)

    @mapped
    def ReportFailure(
        self, request: site_pb2.ReportFailureRequest, context: Any
    ) -> site_pb2.ReportFailureResponse:
        self.guard.site(context, request.site_id)
        self.engine.report_failure(request.site_id, request.task_id, request.reason)
        return site_pb2.ReportFailureResponse()

    @mapped
    def SecAggKeys(
        self, request: site_pb2.SecAggKeysRequest, context: Any
    ) -> site_pb2.SecAggKeysResponse:
        self.guard.site(context, request.site_id)
        ready, peers = secure.keys(
            self.engine,
            request.site_id,
            request.task_id,
            request.public_keys,
            request.signature,
            _long_poll_s(request.wait_s, context),
            lambda message, signature: self.guard.signed(context, message, signature, "key"),
        )
        return site_pb2.SecAggKeysResponse(
            ready=ready,
            neighbour_keys={peer: keys for peer, (keys, _, _) in peers.items()},
            signatures={peer: sig for peer, (_, sig, _) in peers.items()},
            certificates={peer: cert for peer, (_, _, cert) in peers.items()},
        )

    @mapped
    def SecAggShares(
        self, request: site_pb2.SecAggSharesRequest, context: Any
    ) -> site_pb2.SecAggSharesResponse:
        self.guard.site(context, request.site_id)
        ready, inbox = secure.shares(
            self.engine,
            request.site_id,
            request.task_id,
            dict(request.ciphertexts),
            _long_poll_s(request.wait_s, context),
        )
        return site_pb2.SecAggSharesResponse(ready=ready, inbox=inbox)

    @mapped
    def SecAggUnmask(
        self, request: site_pb2.SecAggUnmaskRequest, context: Any
    ) -> site_pb2.SecAggUnmaskResponse:
        self.guard.site(context, request.site_id)
        ready, survivors, dropped = secure.unmask(
            self.engine, request.site_id, request.task_id, _long_poll_s(request.wait_s, context)
        )
        return site_pb2.SecAggUnmaskResponse(ready=ready, survivors=survivors, dropped=dropped)

    @mapped
    def SecAggReveal(
        self, request: site_pb2.SecAggRevealRequest, context: Any
    ) -> site_pb2.SecAggRevealResponse:
        self.guard.site(context, request.site_id)
        secure.reveal(self.engine, request.site_id, request.task_id, dict(request.shares))
        return site_pb2.SecAggRevealResponse()


class _Received:
    """An upload's payload chunks, counting the bytes that arrived."""

    def __init__(self, messages: Iterator[site_pb2.UpdateChunk | memoryview]) -> None:
        self.messages, self.nbytes = messages, 0

    def __iter__(self) -> Iterator[memoryview]:
        for message in self.messages:
            data = wire.update_chunk_data(message)
            if data is None:
                raise InvalidArgument("only the first message of an upload may be a header")
            self.nbytes += len(data)
            yield data
            del message, data  # not held while the next message is received


# The least time between two looks of one watch (each reads the database).
WATCH_GAP_S = 0.2


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        engine: Engine,
        guard: Guard,
        watch_interval_s: float = 10.0,
        watch_gap_s: float = WATCH_GAP_S,
    ) -> None:
        self.engine, self.guard = engine, guard
        self.watch_interval_s = watch_interval_s  # a watch looks at least this often
        self.watch_gap_s = watch_gap_s  # and at most this often

    @mapped
    def SubmitRun(
        self, request: admin_pb2.SubmitRunRequest, context: Any
    ) -> admin_pb2.SubmitRunResponse:
        self.guard.admin(context)
        if not request.HasField("spec"):
            raise InvalidArgument("spec: required")
        try:
            spec = runspec_from_proto(request.spec)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        run_id, warnings = self.engine.submit(spec)
        return admin_pb2.SubmitRunResponse(run_id=run_id, warnings=warnings)

    @mapped
    def GetRun(self, request: admin_pb2.GetRunRequest, context: Any) -> admin_pb2.RunStatus:
        self.guard.admin(context)
        if request.page:
            return run_page(self.engine, request.run_id, self.guard.insecure, request.first_round)
        return run_status(self.engine, request.run_id, self.guard.insecure, request.first_round)

    @mapped
    def ListRuns(
        self, request: admin_pb2.ListRunsRequest, context: Any
    ) -> admin_pb2.ListRunsResponse:
        self.guard.admin(context)
        records = self.engine.store.list_runs()
        return admin_pb2.ListRunsResponse(
            runs=[run_header(self.engine, r, self.guard.insecure) for r in records]
        )

    @mapped_stream
    def WatchRun(
        self, request: admin_pb2.WatchRunRequest, context: Any
    ) -> Iterator[admin_pb2.RunStatus]:
        self.guard.admin(context)
        engine = self.engine
        version = engine.version
        watch = RunWatch(engine, request.run_id, self.guard.insecure, request.changed_rounds_only)
        with engine.waiting():  # it holds a worker thread for as long as it lasts
            while context.is_active():
                looked = time.monotonic()
                yield from watch.look()
                if watch.finished or engine.stopping:
                    return
                # Woken by a change, or after watch_interval_s; a client that hung up is
                # noticed within HANG_UP_CHECK_S, so its thread is not held for nothing.
                until = time.monotonic() + self.watch_interval_s
                while context.is_active() and not engine.stopping:
                    remaining = until - time.monotonic()
                    new = engine.wait_for_change(version, min(remaining, HANG_UP_CHECK_S))
                    if new != version or remaining <= HANG_UP_CHECK_S:
                        version = new
                        break
                # A round brings dozens of changes in bursts (every upload, fold, download):
                # one look after each burst, not one per change.
                engine.wait_for_stop(self.watch_gap_s - (time.monotonic() - looked))

    @mapped
    def CancelRun(
        self, request: admin_pb2.CancelRunRequest, context: Any
    ) -> admin_pb2.CancelRunResponse:
        self.guard.admin(context)
        return admin_pb2.CancelRunResponse(state=self.engine.cancel(request.run_id))

    @mapped
    def ListSites(
        self, request: admin_pb2.ListSitesRequest, context: Any
    ) -> admin_pb2.ListSitesResponse:
        self.guard.admin(context)
        sites = [
            admin_pb2.Site(
                site_id=s.id,
                tasks=list(s.tasks),
                online=online,
                registered_unix_s=s.registered_at,
                last_seen_unix_s=last_seen,
                version=s.version,
            )
            for s, online, last_seen in self.engine.list_sites()
        ]
        return admin_pb2.ListSitesResponse(sites=sites)

    @mapped_stream
    def ExportModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: admin_pb2.ExportModelRequest, context: Any
    ) -> Iterator[bytes]:
        self.guard.admin(context)
        round_number = None if request.latest else request.round
        ckpt = self.engine.export_checkpoint(request.run_id, round_number)
        yield from _model_chunks(self.engine, ckpt.model_sha256, ckpt.model_bytes)
