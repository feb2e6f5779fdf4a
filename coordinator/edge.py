"""Where domain errors become gRPC statuses: one mapping, one log line each, for every
servicer of the coordinator (its daemon's and its read process's)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from fedra import logsafe
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
from fedra.storage.blobs import BlobCorruptError
from fedra.storage.store import ClaimLostError, transient_fault

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


def decline(
    context: grpc.aio.ServicerContext[Any, Any], exc: Exception, told: Observers | None = None
) -> None:
    """Set the status ``exc`` maps to, for a handler that then returns: gRPC ends the call
    with it (and no message). ``told`` hear of the refusal (metrics count them by status).

    Not raising, as ``context.abort`` does, matters at scale: gRPC keeps an abort's
    exception with the call's state, a reference cycle that holds the handler's frames and
    all they hold until the collector finds it, and a failed attempt at thousands of sites
    refuses thousands of calls (as a caller flooding the coordinator has each of its calls
    past its bound refused: fedra.coordinator.limits)."""
    code, message = _status(exc, context.peer())
    if told is not None:
        told.refused(code.name)
    context.set_code(code)
    context.set_details(message)


def mapped(method: F) -> F:
    """Turn domain errors raised by a unary handler into gRPC statuses (told to the
    servicer's ``observers``, where it has them)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            if _aborted(exc):
                raise
            decline(context, exc, getattr(self, "observers", None))
            return None

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
            decline(context, exc, getattr(self, "observers", None))

    return wrapper  # type: ignore[return-value]


def _aborted(exc: BaseException) -> bool:
    """Whether ``exc`` is gRPC's own: the call was already ended with its status."""
    return isinstance(exc, grpc.aio.AbortError | grpc.aio.UsageError)
