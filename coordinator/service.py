"""gRPC servicers (grpc.aio): validate, call the front door (``api``), map domain errors
to status codes. Protobuf messages live here and in ``status``; the inside takes and
returns plain values and dataclasses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from fedra import pki
from fedra.coordinator.admin_reads import WATCH_GAP_S, AdminReads
from fedra.coordinator.api import CoordinatorAPI
from fedra.coordinator.auth import Guard
from fedra.coordinator.edge import _status, mapped, mapped_stream
from fedra.coordinator.engine import TaskView, uploads
from fedra.coordinator.errors import FedraError, InvalidArgument
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
from fedra.protos.v1 import admin_pb2, site_pb2, site_pb2_grpc

if TYPE_CHECKING:
    from fedra.coordinator.limits import CallLimiter

log = logging.getLogger("fedra.coordinator")


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
        controls_sha256=t.controls_sha256,
        controls_bytes=t.controls_bytes,
        rounds=t.rounds,
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
        self.api.touch(request.site_id, wire.queued_s(context))
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
        self.api.touch(request.site_id, wire.queued_s(context))
        if not request.hold_s >= 0.0:  # negative, or not a number
            raise InvalidArgument(f"hold_s must be a number of seconds >= 0, not {request.hold_s}")
        # Leave a margin inside the caller's own deadline so the answer gets back in time.
        hold_s = _long_poll_s(request.hold_s, context) if request.hold_s > 0 else 0.0
        current = await self.api.heartbeat(
            request.site_id, request.task_id, hold_s, lambda: not wire.past_deadline(context)
        )
        return site_pb2.HeartbeatResponse(task_current=current)

    @mapped
    async def PollTask(
        self, request: site_pb2.PollTaskRequest, context: Any
    ) -> site_pb2.PollTaskResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id, wire.queued_s(context))
        return await self._poll(request.site_id, self.api.settings.poll_timeout_s, context)

    async def _poll(
        self, site_id: str, wait_s: float, context: Any, after: tuple[str, str] | None = None
    ) -> site_pb2.PollTaskResponse:
        """The caller's next task, waiting up to ``wait_s`` (and the poll timeout) for one;
        ``after``: see ``CoordinatorAPI.poll``."""
        # Leave a margin inside the caller's own deadline so the reply gets back in time.
        timeout = _long_poll_s(min(wait_s, self.api.settings.poll_timeout_s), context)
        task = await self.api.poll(site_id, timeout, lambda: not wire.past_deadline(context), after)
        if task is None:
            return site_pb2.PollTaskResponse()
        # Checked again: a certificate revoked while its poll waited gets no task (nor
        # the model that goes with it).
        self.guard.site(context, site_id)
        return site_pb2.PollTaskResponse(task=_task_to_proto(task), model=task.model)

    @mapped_stream
    async def DownloadModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: site_pb2.DownloadModelRequest, context: Any
    ) -> AsyncIterator[bytes]:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id, wire.queued_s(context))
        chunks = self.api.download(
            request.site_id, request.task_id, request.delta, wire.model_chunk_frame,
            controls=request.controls,
        )  # fmt: skip
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
        # The stream's end is checked beside the payload's last checks and sync, before
        # the update counts (wire.RequestStream).
        closed = None
        if isinstance(request_iterator, wire.RequestStream):
            closed = request_iterator.defer_end_check()
        first = await anext(aiter(request_iterator), None)
        if first is None and closed is not None:
            await closed()  # a stream the transport cut at its first message was cut
        if not isinstance(first, site_pb2.UpdateChunk) or first.WhichOneof("part") != "header":
            raise InvalidArgument("an upload must start with exactly one header message")
        size = await self._upload(first.header, _payload(request_iterator), context, closed)
        return site_pb2.UploadUpdateResponse(bytes_received=size)

    @mapped
    async def UploadSmallUpdate(
        self, request: site_pb2.UploadSmallUpdateRequest, context: Any
    ) -> site_pb2.UploadSmallUpdateResponse:
        self.guard.any_site(context)
        if not request.HasField("header"):
            raise InvalidArgument("an upload must carry its header")
        then_poll_s = request.then_poll_s
        if not then_poll_s >= 0.0:  # negative, or not a number
            raise InvalidArgument(
                f"then_poll_s must be a number of seconds >= 0, not {then_poll_s}"
            )
        payload = request.payload
        if len(payload) > wire.SMALL_UPLOAD_MAX_BYTES:
            raise InvalidArgument(
                f"payload: {len(payload)} bytes, more than UploadSmallUpdate takes "
                f"({wire.SMALL_UPLOAD_MAX_BYTES}); send it with UploadUpdate"
            )

        async def chunks() -> AsyncIterator[bytes]:
            if payload:
                yield payload

        size = await self._upload(request.header, chunks(), context)
        reply = site_pb2.UploadSmallUpdateResponse(bytes_received=size)
        if then_poll_s > 0:
            accepted, h = time.monotonic(), request.header
            try:
                polled = await self._poll(h.site_id, then_poll_s, context, (h.run_id, h.task_id))
                reply.next.CopyFrom(polled)
            except FedraError as exc:  # the update is in whatever the poll meets: say so,
                # and leave the poll's refusal to the PollTask the site makes next
                log.info(
                    "site %s: the poll after its accepted update is left to PollTask: %s",
                    h.site_id, exc, extra={"site": h.site_id},
                )  # fmt: skip
            except Exception:  # the same for what nothing expected (a cancel is not caught)
                log.exception(
                    "site %s: the poll after its accepted update failed; the site polls anew",
                    h.site_id, extra={"site": h.site_id},
                )  # fmt: skip
            reply.held_s = time.monotonic() - accepted
        return reply

    async def _upload(
        self,
        h: site_pb2.UpdateHeader,
        chunks: AsyncIterator[Buffer],
        context: Any,
        closed: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """An update whose header is ``h`` and payload ``chunks``, from the caller;
        ``closed`` checks the end of its request stream (``CoordinatorAPI.upload``)."""
        self.guard.site(context, h.site_id)
        self.api.touch(h.site_id, wire.queued_s(context))
        message = pki.upload_message(
            h.run_id, h.round, h.site_id, h.task_id, h.nonce, h.sha256,
            num_samples=h.num_samples, codec=h.codec, payload_bytes=h.payload_bytes,
        )  # fmt: skip
        limiter = self.limiter

        def started() -> None:  # it holds the round now: not past the site's silence
            if limiter is not None:
                limiter.upload_started(context, h.site_id)

        try:
            return await self.api.upload(
                _header_from_proto(h),
                chunks,
                started,
                check=lambda: self.guard.upload(context, message, h.signature),
                closed=closed,
            )
        except asyncio.CancelledError:  # an ordinary event: one line, the task given back
            _status(grpc.RpcError(), context.peer())
            raise

    @mapped
    async def ReportFailure(
        self, request: site_pb2.ReportFailureRequest, context: Any
    ) -> site_pb2.ReportFailureResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id, wire.queued_s(context))
        await self.api.report_failure(
            request.site_id, request.task_id, request.reason, request.declined
        )
        return site_pb2.ReportFailureResponse()

    @mapped
    async def SecAggKeys(
        self, request: site_pb2.SecAggKeysRequest, context: Any
    ) -> site_pb2.SecAggKeysResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id, wire.queued_s(context))
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
        self.api.touch(request.site_id, wire.queued_s(context))
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
        self.api.touch(request.site_id, wire.queued_s(context))
        ready, (survivors, dropped) = await self.api.secagg_unmask(
            request.site_id, request.task_id, _long_poll_s(request.wait_s, context)
        )
        return site_pb2.SecAggUnmaskResponse(ready=ready, survivors=survivors, dropped=dropped)

    @mapped
    async def SecAggReveal(
        self, request: site_pb2.SecAggRevealRequest, context: Any
    ) -> site_pb2.SecAggRevealResponse:
        self.guard.site(context, request.site_id)
        self.api.touch(request.site_id, wire.queued_s(context))
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
class EngineReads:
    """The daemon's own ``ReadSide``: the engine's memory (read without its lock) and the
    database, on the front door's reader threads."""

    def __init__(self, api: CoordinatorAPI) -> None:
        self.api = api
        self.source = api.status_source
        self.readers = api.readers
        self.read = api.read
        self.changes = api.changes
        self.site_counts = api.site_counts
        self.list_sites = api.list_sites

    def listing_key(self) -> None:
        return None  # the engine's memory changes with every call: built each time


class AdminService(AdminReads):
    """Every admin call: the reads (``AdminReads``) and the writes, through the front door."""

    def __init__(
        self,
        api: CoordinatorAPI,
        guard: Guard,
        watch_interval_s: float = 10.0,
        watch_gap_s: float = WATCH_GAP_S,
    ) -> None:
        super().__init__(EngineReads(api), guard, api.observers, watch_interval_s, watch_gap_s)
        self.api = api

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
    async def CancelRun(
        self, request: admin_pb2.CancelRunRequest, context: Any
    ) -> admin_pb2.CancelRunResponse:
        who = self.guard.admin(context)
        return admin_pb2.CancelRunResponse(state=await self.api.cancel(request.run_id, who))

    @mapped_stream
    async def ExportModel(  # type: ignore[override]  # framed ModelChunks: see server.py
        self, request: admin_pb2.ExportModelRequest, context: Any
    ) -> AsyncIterator[bytes]:
        who = self.guard.admin(context)
        round_number = None if request.latest else request.round
        ckpt = await self.api.export_checkpoint(request.run_id, round_number, who)
        chunks = self.api.read_model(ckpt.model_sha256, ckpt.model_bytes, wire.model_chunk_frame)
        async for chunk in chunks:
            yield chunk
            del chunk
