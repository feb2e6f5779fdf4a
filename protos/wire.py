"""Model chunks on the wire without protobuf's copies.

``ModelChunk`` (``bytes data = 1``) and the data arm of ``UpdateChunk`` (``bytes data = 2``)
carry nearly every byte fedra moves. Through the generated classes each chunk is copied
into a message, serialized into a second buffer, and parsed back out into a third; here
the sender writes the field's tag and length in front of the chunk as it builds it
(``encode_chunks(frame=...)``, one copy), and the receiver takes a view of the payload
inside the bytes gRPC hands it (no copy). The bytes on the wire are exactly the protobuf
encoding, so either side may be the generated code; anything but a lone data field (an
empty chunk, unknown fields, a header) goes through the generated parser as before.

A request that does not parse (``add_service``) is refused with INVALID_ARGUMENT before
its handler runs; left to gRPC, it would be INTERNAL with a traceback in the log.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from fedra import logsafe
from fedra.protos.v1 import common_pb2, site_pb2

log = logging.getLogger("fedra.coordinator")  # add_service builds the coordinator's services

_LEN = 2  # protobuf wire type of bytes fields
MODEL_CHUNK_TAG = (1 << 3) | _LEN  # ModelChunk.data
UPDATE_CHUNK_DATA_TAG = (2 << 3) | _LEN  # UpdateChunk.data (the header is field 1)
_MAX_VARINT_BYTES = 10

SITE_SERVICE = "fedra.v1.SiteService"
ADMIN_SERVICE = "fedra.v1.AdminService"
DOWNLOAD_MODEL = f"/{SITE_SERVICE}/DownloadModel"
UPLOAD_UPDATE = f"/{SITE_SERVICE}/UploadUpdate"
EXPORT_MODEL = f"/{ADMIN_SERVICE}/ExportModel"
# The largest payload UploadSmallUpdate takes: bigger updates go up in a stream of chunks.
# A site's calls say the deadline they were given (metadata, in milliseconds): the
# coordinator's gRPC server counts a call's deadline from its arrival, so what is left of
# it when the handler starts tells how long the call waited in the server's queue first.
TIMEOUT_KEY = "fedra-timeout-ms"
_MAX_DECLARED_S = 3600.0  # a longer declared deadline is not believed


def declared_timeout(timeout_s: float) -> tuple[tuple[str, str]]:
    """The metadata a call given ``timeout_s`` carries to say so (``queued_s``)."""
    return ((TIMEOUT_KEY, str(round(timeout_s * 1000))),)


# A call cancelled this close to its deadline ran out of time (past_deadline).
DEADLINE_SLACK_S = 1.0


def past_deadline(context: Any) -> bool:
    """Whether the call is at its deadline, or within ``DEADLINE_SLACK_S`` of it: a call
    cancelled then ran out of time (its caller's deadline, counted on its side, passes
    about when the server's does) rather than being hung up by its caller."""
    remaining = context.time_remaining()
    return remaining is not None and remaining < DEADLINE_SLACK_S


def queued_s(context: Any) -> float | None:
    """How long a call waited between its arrival and its handler, from the deadline its
    caller declared (``declared_timeout``) and what is left of it; None when it declared
    none, or one not to be believed. A caller that lies can only say it waited longer
    (its deadline is counted from arrival), and never more than it declared."""
    declared = None
    for key, value in context.invocation_metadata() or ():
        if key == TIMEOUT_KEY:
            declared = value
            break
    remaining: float | None = context.time_remaining()
    if declared is None or remaining is None:
        return None
    try:
        declared_s = int(declared) / 1000
    except (TypeError, ValueError):
        return None
    if not 0.0 < declared_s <= _MAX_DECLARED_S:
        return None
    return min(declared_s, max(0.0, declared_s - remaining))


SMALL_UPLOAD_MAX_BYTES = 64 * 1024
# The largest message the coordinator sends, and the admin client accepts: an unpaged
# GetRun answers with a whole run, about 220 bytes per participation, so 64 MiB holds
# some 300,000 (paged GetRun and WatchRun messages stay near 1 MiB however long the run).
MAX_STATUS_BYTES = 64 * 2**20
# How long the end of a request stream waits for news that the call ended instead (about
# a millisecond after it, when it does). An upload takes the wait beside its last checks
# and its spool's sync (RequestStream.defer_end_check), so its reply comes that much later
# only where those take less.
STREAM_END_CHECK_S = 0.005
# The least a deferred check waits, however long the work beside it took.
STREAM_END_MIN_WAIT_S = 0.001


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def model_chunk_frame(size: int) -> bytes:
    """What goes in front of ``size`` payload bytes to make them a ``ModelChunk``."""
    return bytes([MODEL_CHUNK_TAG]) + _varint(size)


def update_chunk_frame(size: int) -> bytes:
    """The same for the data arm of an ``UpdateChunk``."""
    return bytes([UPDATE_CHUNK_DATA_TAG]) + _varint(size)


def lone_field(raw: bytes, tag: int) -> memoryview | None:
    """The payload of ``raw`` when ``raw`` is exactly one length-delimited field ``tag``
    (a view, no copy); None for anything else, which the generated parser must read."""
    if len(raw) < 2 or raw[0] != tag:
        return None
    length, shift, pos = 0, 0, 1
    while True:
        if pos >= len(raw) or pos > _MAX_VARINT_BYTES:
            return None
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            break
        shift += 7
    if pos + length != len(raw):
        return None  # more fields follow (or it is truncated): not the fast path's to judge
    return memoryview(raw)[pos:]


def parse_model_chunk(raw: bytes) -> memoryview:
    """A ``ModelChunk``'s data, as a view into ``raw`` when it is a lone data field."""
    view = lone_field(raw, MODEL_CHUNK_TAG)
    if view is not None:
        return view
    return memoryview(common_pb2.ModelChunk.FromString(raw).data)


def parse_update_chunk(raw: bytes) -> site_pb2.UpdateChunk | memoryview:
    """An ``UpdateChunk``: a view of its data when it is a lone data field, else the message
    (a header, or data framed some other valid way)."""
    view = lone_field(raw, UPDATE_CHUNK_DATA_TAG)
    if view is not None:
        return view
    return site_pb2.UpdateChunk.FromString(raw)


def update_chunk_data(message: site_pb2.UpdateChunk | memoryview) -> memoryview | None:
    """The data of an upload message, or None when it is not a data message."""
    if isinstance(message, memoryview):
        return message
    if message.WhichOneof("part") != "data":
        return None
    return memoryview(message.data)


def serialize(message: bytes | Message) -> bytes:
    """Pre-framed bytes pass through as they are; messages serialize as usual."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


class Malformed:
    """What a request deserializer gives for bytes that do not parse: the call is refused."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedMessage(BaseException):
    """Raised by a request stream at a message that does not parse. A BaseException, as
    a cancellation is: the handler's own error mapping (``except Exception``) passes it
    by, its cleanup (``finally``, ``except BaseException: ...; raise``) still runs, and
    the call ends with INVALID_ARGUMENT (``_stream_request``)."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(what, reason)
        self.what, self.reason = what, reason


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` returning ``Malformed`` where it would raise (gRPC would answer
    INTERNAL and log a traceback)."""

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # anything the parser raises on remote bytes
            return Malformed(f"{type(exc).__name__}: {logsafe.safe(exc)}")

    return parse


def _refuse(context: grpc.ServicerContext, what: str, reason: str) -> None:
    message = f"{what} is not a valid message of this RPC ({reason})"
    log.info("refused a call from %s: INVALID_ARGUMENT: %s", context.peer(), message)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _unary_request(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            _refuse(context, "the request", request.reason)  # before any other work
        return behavior(request, context)

    return checked


def _check_stream_closed(context: grpc.ServicerContext) -> None:
    """Raise grpc.RpcError (as a cancelled call's stream does) unless the caller closed
    its stream. gRPC ends a request stream the same way when the caller closes it and when
    the transport refuses a message (one over the size limit): the call is then ended, but
    that news arrives a moment later. Without this wait, a whole payload followed by an
    oversized message was accepted while the caller was told RESOURCE_EXHAUSTED."""
    ended = threading.Event()
    if not context.add_callback(ended.set) or ended.wait(STREAM_END_CHECK_S):
        raise grpc.RpcError("the call ended before its request stream was closed")


def _messages(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for number, request in enumerate(requests, 1):
        if isinstance(request, Malformed):
            raise MalformedMessage(f"message {number} of the request stream", request.reason)
        yield request
    _check_stream_closed(context)


def _stream_request(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            return behavior(_messages(requests, context), context)
        except MalformedMessage as exc:
            _refuse(context, exc.what, exc.reason)

    return checked


def _stream_both(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(_messages(requests, context), context)
        except MalformedMessage as exc:
            _refuse(context, exc.what, exc.reason)

    return checked


async def _refuse_async(context: Any, what: str, reason: str) -> None:
    message = f"{what} is not a valid message of this RPC ({reason})"
    log.info("refused a call from %s: INVALID_ARGUMENT: %s", context.peer(), message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


class RequestStream:
    """A request stream as an event-driven (grpc.aio) handler reads it: a message that
    does not parse raises ``MalformedMessage``, and its end is checked as
    ``_check_stream_closed`` does, by waiting up to ``STREAM_END_CHECK_S`` for news that
    the call ended instead.

    A handler with work to do before it acts on the whole stream (an upload's last chunk,
    its checks, its spool's sync) takes that wait later, overlapped with the work:
    ``defer_end_check`` before reading, then ``closed`` before anything the caller is
    told about (nothing of the stream may count until ``closed`` has returned)."""

    __slots__ = ("_context", "_deferred", "_ended_at", "_number", "_requests")

    def __init__(self, requests: AsyncIterator[Any], context: Any) -> None:
        self._requests, self._context = requests.__aiter__(), context
        self._number = 0
        self._deferred = False
        self._ended_at: float | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        try:
            request = await self._requests.__anext__()
        except StopAsyncIteration:
            if self._ended_at is None:
                self._ended_at = time.monotonic()
                if not self._deferred:
                    await self.closed()
            raise
        self._number += 1
        if isinstance(request, Malformed):
            raise MalformedMessage(f"message {self._number} of the request stream", request.reason)
        return request

    def defer_end_check(self) -> Callable[[], Awaitable[None]]:
        """The end's check is the reader's to make (``closed``, returned), not made when
        the stream ends. A stream the transport cut looks short to the reader: before
        refusing it as such, the reader asks ``closed``, whose error says it was cut."""
        self._deferred = True
        return self.closed

    async def closed(self) -> None:
        """Raise grpc.RpcError (as a cancelled call's stream does) unless the caller
        closed its stream: ``STREAM_END_CHECK_S`` after its end, waiting only what is left
        of that since the stream ended (``STREAM_END_MIN_WAIT_S`` at least)."""
        if self._ended_at is None:
            raise RuntimeError("the request stream was not read to its end")
        left = self._ended_at + STREAM_END_CHECK_S - time.monotonic()
        # At least a short wait even when the work took longer: the loop then polls for
        # news once more, which may have queued behind the work's own result.
        await asyncio.sleep(max(left, STREAM_END_MIN_WAIT_S))
        if self._context.cancelled() or self._context.done():
            raise grpc.RpcError("the call ended before its request stream was closed")


def _unary_request_async(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def checked(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed):
            await _refuse_async(context, "the request", request.reason)  # before other work
        return await behavior(request, context)

    return checked


def _unary_request_stream_async(
    behavior: Callable[[Any, Any], Any],
) -> Callable[[Any, Any], Any]:
    async def checked(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await _refuse_async(context, "the request", request.reason)  # before other work
        async for item in behavior(request, context):
            yield item

    return checked


def _stream_request_async(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def checked(requests: AsyncIterator[Any], context: Any) -> Any:
        try:
            return await behavior(RequestStream(requests, context), context)
        except MalformedMessage as exc:
            await _refuse_async(context, exc.what, exc.reason)

    return checked


def _stream_both_async(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        try:
            async for item in behavior(RequestStream(requests, context), context):
                yield item
        except MalformedMessage as exc:
            await _refuse_async(context, exc.what, exc.reason)

    return checked


def _with_wire(handler: Any, request: Any = None, response: Any = None) -> Any:
    """``handler`` (an RpcMethodHandler namedtuple) with its (de)serializers replaced."""
    changes = {}
    if request is not None:
        changes["request_deserializer"] = request
    if response is not None:
        changes["response_serializer"] = response
    return handler._replace(**changes)


def _tolerant_handler(handler: Any) -> Any:
    """``handler`` refusing a request that does not parse with INVALID_ARGUMENT."""
    changes: dict[str, Any] = {"request_deserializer": tolerant(handler.request_deserializer)}
    wrappers = {
        "unary_unary": _unary_request,
        "unary_stream": _unary_request,
        "stream_unary": _stream_request,
        "stream_stream": _stream_both,
    }
    async_wrappers = {
        "unary_unary": _unary_request_async,
        "unary_stream": _unary_request_stream_async,
        "stream_unary": _stream_request_async,
        "stream_stream": _stream_both_async,
    }
    for kind, wrap in wrappers.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            event_driven = inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(
                behavior
            )  # a grpc.aio server's handler
            changes[kind] = (async_wrappers[kind] if event_driven else wrap)(behavior)
    return handler._replace(**changes)


class _Capture:
    """Stands in for a server to collect a generated ``add_*_to_server``'s handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers = dict(handlers)


def add_service(
    server: grpc.Server | grpc.aio.Server,
    add_generated: Any,
    servicer: Any,
    service: str,
    overrides: dict[str, dict[str, Any]],
    registered: Collection[str] | None = None,
) -> None:
    """Register ``servicer`` as the generated ``add_generated`` would, with some methods'
    (de)serializers replaced (``overrides[method] = {"request": f, "response": g}``), and
    every method refusing a request that does not parse with INVALID_ARGUMENT.

    ``registered``: the methods gRPC's core takes calls of with a request of their own
    (every one if None, as the generated code does); the rest are found by name. gRPC's
    asyncio server keeps one request outstanding in its core per registered method, and
    one for all the others, and waits on all of them (``asyncio.wait``) for every call it
    takes in: at twenty-odd methods that cost 5-8% of a small call's server CPU
    (``bench/call_cost.py``). A method of its own keeps its calls from queueing behind the
    others' while the server's loop is busy (``bench/accept_rate.py``): the calls every
    site makes every round want one, the rare ones do not."""
    capture = _Capture()
    add_generated(servicer, capture)
    if not capture.handlers:
        raise RuntimeError(f"{service}: the generated code registered no handlers")
    handlers = capture.handlers
    unknown = set(registered or ()) - set(handlers)
    if unknown:
        raise ValueError(f"{service} has no method {', '.join(sorted(unknown))}")
    for method, change in overrides.items():
        handlers[method] = _with_wire(handlers[method], **change)
    handlers = {method: _tolerant_handler(h) for method, h in handlers.items()}
    if registered is None or registered:
        own = handlers if registered is None else {m: handlers[m] for m in registered}
        server.add_registered_method_handlers(service, own)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
