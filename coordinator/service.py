"""gRPC servicers (grpc.aio): validate, call the front door (``api``), map domain errors
to status codes. Protobuf messages live here and in ``status``; the inside takes and
returns plain values and dataclasses."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from fedra import logsafe, pki
from fedra.coordinator import uploads
from fedra.coordinator.api import CoordinatorAPI
from fedra.coordinator.auth import Guard
from fedra.coordinator.engine import SITES_PAGE, TaskView
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
from fedra.coordinator.observers import Observers
from fedra.coordinator.status import (
    PAGE_BYTES,
    FinalRounds,
    RunWatch,
    SharedPages,
    run_header,
    run_page,
    run_status,
)
from fedra.protos import wire
from fedra.protos.codec import Buffer
from fedra.protos.serde import (
    codec_to_proto,
    privacy_to_proto,
    provenance_from_proto,
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


def _status(exc: BaseException, peer: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised ``exc`` ends with, logged as an operator needs."""
    if isinstance(exc, grpc.RpcError):  # the call ended under us: the site's to retry
        log.info(
            "a call from %s ended before its request stream did (cancelled by the caller, "
            "past its deadline, or this daemon stopping)",
            peer,
        )
        return grpc.StatusCode.CANCELLED, "the call ended before its request stream"
    if isinstance(exc, ClaimLostError):  # stopping: the database is another coordinator's
        log.info("refused a call from %s: %s", peer, logsafe.safe(exc))
        return grpc.StatusCode.UNAVAILABLE, (
            "this coordinator no longer holds its database (another coordinator took it) "
            "and is stopping: try again"
        )
    if isinstance(exc, FedraError):
        code = _STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT)
        level = logging.WARNING if code in _LOUD else logging.INFO
        # The message often quotes what the caller sent (an id, a name): escaped and cut.
        text = logsafe.safe(exc, logsafe.MESSAGE_CHARS)
        log.log(level, "refused a call from %s: %s: %s", peer, code.name, text)
        return code, logsafe.safe(exc, logsafe.STATUS_CHARS)
    storage = transient_fault(exc)
    if storage:  # the site's to retry, as after a restart; the driver rides it out
        log.warning("a call from %s met a storage fault: %s", peer, storage)
        return grpc.StatusCode.UNAVAILABLE, f"the coordinator's storage: {storage}"
    if isinstance(exc, BlobCorruptError):  # the driver ends the run with the reason
        log.error("a call from %s read damaged stored data: %s", peer, exc)
        return grpc.StatusCode.DATA_LOSS, "the coordinator's stored data is damaged"
    # Internals stay in the coordinator's log, never in the caller's status.
    log.error("unexpected error in %s: %s", type(exc).__name__, logsafe.exception_text(exc))
    return grpc.StatusCode.INTERNAL, "internal coordinator error (see the coordinator log)"


async def refuse(
    context: grpc.aio.ServicerContext[Any, Any], exc: Exception, told: Observers | None = None
) -> None:
    """End the call with the status ``exc`` maps to (it raises, as context.abort does);
    also for checks made before a handler runs (fedra.coordinator.limits). ``told``
    hear of the refusal (metrics count them by status)."""
    code, message = _status(exc, context.peer())
    if told is not None:
        told.refused(code.name)
    await context.abort(code, message)


def mapped(method: F) -> F:
    """Turn domain errors raised by a unary handler into gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            if _aborted(exc):
                raise
            await refuse(context, exc, self.api.engine.observers)

    return wrapper  # type: ignore[return-value]


def mapped_stream(method: F) -> F:
    """The same for handlers that return a response stream (async generators)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in method(self, request, context):
                yield item
        except Exception as exc:
            if _aborted(exc):
                raise
            await refuse(context, exc, self.api.engine.observers)

    return wrapper  # type: ignore[return-value]


def _aborted(exc: BaseException) -> bool:
    """Whether ``exc`` is gRPC's own: the call was already ended with its status."""
    return isinstance(exc, grpc.aio.AbortError | grpc.aio.UsageError)


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
        sites_in_round=t.sites_in_round,
        privacy=privacy_to_proto(t.privacy) if t.privacy is not None else None,
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


class SiteService(site_pb2_grpc.SiteServiceServicer):
    def __init__(
        self, api: CoordinatorAPI, guard: Guard, limiter: CallLimiter | None = None
    ) -> None:
        self.api, self.guard = api, guard
        self.limiter = limiter  # set: it ends an upload whose site goes silent

    @mapped
    async def Register(
        self, request: site_pb2.RegisterRequest, context: Any
    ) -> site_pb2.RegisterResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        if len(request.provenance) > len(request.tasks):
            raise InvalidArgument("provenance: at most one per task")
        try:
            told = [provenance_from_proto(p) for p in request.provenance]
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        await self.api.register(request.site_id, list(request.tasks), request.version, told)
        s = self.api.settings
        return site_pb2.RegisterResponse(
            heartbeat_interval_s=s.heartbeat_interval_s,
            poll_timeout_s=s.poll_timeout_s,
            chunk_bytes=s.chunk_bytes,
        )

    @mapped
    async def Heartbeat(
        self, request: site_pb2.HeartbeatRequest, context: Any
    ) -> site_pb2.HeartbeatResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        current = await self.api.heartbeat(request.site_id, request.task_id)
        return site_pb2.HeartbeatResponse(task_current=current)

    @mapped
    async def PollTask(
        self, request: site_pb2.PollTaskRequest, context: Any
    ) -> site_pb2.PollTaskResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        # Leave a margin inside the caller's own deadline so the reply gets back in time.
        timeout = _long_poll_s(self.api.settings.poll_timeout_s, context)
        task = await self.api.poll(request.site_id, timeout)
        if task is None:
            return site_pb2.PollTaskResponse()
        # Checked again: a certificate revoked while its poll waited gets no task (nor
        # the model that goes with it).
        self.guard.site(context, request.site_id)
        return site_pb2.PollTaskResponse(task=_task_to_proto(task), model=task.model)

    @mapped_stream
    async def DownloadModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: site_pb2.DownloadModelRequest, context: Any
    ) -> AsyncIterator[bytes]:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        chunks = self.api.download(
            request.site_id, request.task_id, request.delta, wire.model_chunk_frame
        )
        async for chunk in chunks:
            yield chunk
            del chunk

    @mapped
    async def UploadUpdate(
        self, request_iterator: AsyncIterator[site_pb2.UpdateChunk | memoryview], context: Any
    ) -> site_pb2.UploadUpdateResponse:
        # Who is calling, before a byte is read: a revoked caller is refused at once.
        self.guard.any_site(context)
        # Data messages arrive as views of their payload (wire.parse_update_chunk).
        first = await anext(aiter(request_iterator), None)
        if not isinstance(first, site_pb2.UpdateChunk) or first.WhichOneof("part") != "header":
            raise InvalidArgument("an upload must start with exactly one header message")
        h = first.header
        self.guard.site(context, h.site_id)
        self.api.touch(h.site_id)
        message = pki.upload_message(
            h.run_id, h.round, h.site_id, h.task_id, h.nonce, h.sha256,
            num_samples=h.num_samples, codec=h.codec, payload_bytes=h.payload_bytes,
        )  # fmt: skip
        limiter = self.limiter

        def started() -> None:  # it holds the round now: not past the site's silence
            if limiter is not None:
                limiter.upload_started(context, h.site_id)

        try:
            size = await self.api.upload(
                _header_from_proto(h),
                _payload(request_iterator),
                started,
                check=lambda: self.guard.upload(context, message, h.signature),
            )
        except asyncio.CancelledError:  # an ordinary event: one line, the task given back
            _status(grpc.RpcError(), context.peer())
            raise
        return site_pb2.UploadUpdateResponse(bytes_received=size)

    @mapped
    async def ReportFailure(
        self, request: site_pb2.ReportFailureRequest, context: Any
    ) -> site_pb2.ReportFailureResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        await self.api.report_failure(
            request.site_id, request.task_id, request.reason, request.declined
        )
        return site_pb2.ReportFailureResponse()

    @mapped
    async def SecAggKeys(
        self, request: site_pb2.SecAggKeysRequest, context: Any
    ) -> site_pb2.SecAggKeysResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        ready, peers = await self.api.secagg_keys(
            request.site_id,
            request.task_id,
            request.public_keys,
            request.signature,
            lambda message, signature: self.guard.signed(context, message, signature, "key"),
            _long_poll_s(request.wait_s, context),
        )
        return site_pb2.SecAggKeysResponse(
            ready=ready,
            neighbour_keys={peer: keys for peer, (keys, _, _) in peers.items()},
            signatures={peer: sig for peer, (_, sig, _) in peers.items()},
            certificates={peer: cert for peer, (_, _, cert) in peers.items()},
        )

    @mapped
    async def SecAggShares(
        self, request: site_pb2.SecAggSharesRequest, context: Any
    ) -> site_pb2.SecAggSharesResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        ready, inbox = await self.api.secagg_shares(
            request.site_id,
            request.task_id,
            dict(request.ciphertexts),
            _long_poll_s(request.wait_s, context),
        )
        return site_pb2.SecAggSharesResponse(ready=ready, inbox=inbox)

    @mapped
    async def SecAggUnmask(
        self, request: site_pb2.SecAggUnmaskRequest, context: Any
    ) -> site_pb2.SecAggUnmaskResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        ready, (survivors, dropped) = await self.api.secagg_unmask(
            request.site_id, request.task_id, _long_poll_s(request.wait_s, context)
        )
        return site_pb2.SecAggUnmaskResponse(ready=ready, survivors=survivors, dropped=dropped)

    @mapped
    async def SecAggReveal(
        self, request: site_pb2.SecAggRevealRequest, context: Any
    ) -> site_pb2.SecAggRevealResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id)
        await self.api.secagg_reveal(request.site_id, request.task_id, dict(request.shares))
        return site_pb2.SecAggRevealResponse()


async def _payload(
    messages: AsyncIterator[site_pb2.UpdateChunk | memoryview],
) -> AsyncIterator[Buffer]:
    """An upload's payload chunks, after its header."""
    async for message in messages:
        data = wire.update_chunk_data(message)
        if data is None:
            raise InvalidArgument("only the first message of an upload may be a header")
        yield data
        del message, data  # not held while the next message is received


# The least time between two looks of one watch (each reads the database).
WATCH_GAP_S = 0.2


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        api: CoordinatorAPI,
        guard: Guard,
        watch_interval_s: float = 10.0,
        watch_gap_s: float = WATCH_GAP_S,
    ) -> None:
        self.api, self.engine, self.guard = api, api.engine, guard
        self.watch_interval_s = watch_interval_s  # a watch looks at least this often
        self.watch_gap_s = watch_gap_s  # and at most this often
        self.kept = FinalRounds()  # GetRun pages build only the rounds still moving
        self.pages = SharedPages()  # a large page is built once for the calls at once

    @mapped
    async def SubmitRun(
        self, request: admin_pb2.SubmitRunRequest, context: Any
    ) -> admin_pb2.SubmitRunResponse:
        who = self.guard.admin(context)
        if not request.HasField("spec"):
            raise InvalidArgument("spec: required")
        try:
            spec = runspec_from_proto(request.spec)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        run_id, warnings = await self.api.submit(spec, who)
        return admin_pb2.SubmitRunResponse(run_id=run_id, warnings=warnings)

    @mapped
    async def GetRun(self, request: admin_pb2.GetRunRequest, context: Any) -> admin_pb2.RunStatus:
        self.guard.admin(context)
        insecure, first = self.guard.insecure, request.first_round
        if request.page:
            # Shared for a moment within a phase (driven, cancelled, ended), never across one.
            key = (request.run_id, first, insecure, self.engine.run_phase(request.run_id))
            build = functools.partial(
                run_page, self.engine, request.run_id, insecure, first, PAGE_BYTES, self.kept
            )
            if (page := self.pages.answer(key, build, self.api.readers)) is not None:
                return page
            return await self.api.read(self.pages.get, key, build)
        return await self.api.read(run_status, self.engine, request.run_id, insecure, first)

    @mapped
    async def ListRuns(
        self, request: admin_pb2.ListRunsRequest, context: Any
    ) -> admin_pb2.ListRunsResponse:
        self.guard.admin(context)

        def read() -> list[admin_pb2.RunStatus]:
            records = self.engine.store.list_runs()
            return [run_header(self.engine, r, self.guard.insecure) for r in records]

        return admin_pb2.ListRunsResponse(runs=await self.api.read(read))

    @mapped_stream
    async def WatchRun(
        self, request: admin_pb2.WatchRunRequest, context: Any
    ) -> AsyncIterator[admin_pb2.RunStatus]:
        self.guard.admin(context)
        insecure, only_changed = self.guard.insecure, request.changed_rounds_only
        watch = RunWatch(self.engine, request.run_id, insecure, only_changed)
        # Woken by a change of the run (a burst of them is one look), or every interval;
        # it waits holding no thread, and a client that hangs up ends it at once.
        async for _ in self.api.changes(request.run_id, self.watch_interval_s, self.watch_gap_s):
            for message in await self.api.read(watch.look):
                yield message
            if watch.finished:
                return

    @mapped
    async def CancelRun(
        self, request: admin_pb2.CancelRunRequest, context: Any
    ) -> admin_pb2.CancelRunResponse:
        who = self.guard.admin(context)
        return admin_pb2.CancelRunResponse(state=await self.api.cancel(request.run_id, who))

    @mapped
    async def ListSites(
        self, request: admin_pb2.ListSitesRequest, context: Any
    ) -> admin_pb2.ListSitesResponse:
        self.guard.admin(context)
        if len(request.page_token) > uploads.MAX_ID_CHARS:
            raise InvalidArgument(f"page_token: at most {uploads.MAX_ID_CHARS} characters")
        if request.summary_only:

            def counts() -> tuple[int, int]:  # O(sites), and reads the deny list: not here
                return self.engine.site_counts(self.guard.revoked_sites())

            total, online = await self.api.read(counts)
            return admin_pb2.ListSitesResponse(total=total, online=online)

        def page() -> admin_pb2.ListSitesResponse:  # built on a reader thread, not the loop
            # Counted in the same step: each hand-off to a thread and back costs the call
            # a pass of the event loop, which is long while a round's calls arrive.
            revoked = self.guard.revoked_sites()  # at once: offline, whatever it did last
            total, online = self.engine.site_counts(revoked)
            found, next_token = self.engine.list_sites(
                request.page_token, request.page_size or SITES_PAGE
            )
            sites = [
                admin_pb2.Site(
                    site_id=s.id,
                    tasks=list(s.tasks),
                    online=is_online and s.id not in revoked,
                    registered_unix_s=s.registered_at,
                    last_seen_unix_s=last_seen,
                    version=s.version,
                    revoked=s.id in revoked,
                )
                for s, is_online, last_seen in found
            ]
            return admin_pb2.ListSitesResponse(
                sites=sites, next_page_token=next_token, total=total, online=online
            )

        return await self.api.read(page)

    @mapped_stream
    async def ExportModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: admin_pb2.ExportModelRequest, context: Any
    ) -> AsyncIterator[bytes]:
        who = self.guard.admin(context)
        round_number = None if request.latest else request.round
        ckpt = await self.api.call(self.engine.export_checkpoint, request.run_id, round_number, who)
        chunks = self.api.read_model(ckpt.model_sha256, ckpt.model_bytes, wire.model_chunk_frame)
        async for chunk in chunks:
            yield chunk
            del chunk
