"""Bounds at the edge: each caller's calls in flight, and request streams that stall.

Every call in flight costs the daemon memory and a share of its executor, so one caller
may have only a few at once: past its bound a call is refused (UNAVAILABLE, so that a site
retries it with backoff, as after a network blip) before it reads anything. A request
stream on which nothing arrives for ``stream_idle_s`` is ended, and so is an upload
whose site went silent (no chunk, no heartbeat, no other call) for the engine's
``site_timeout_s``: its task goes back to the round, which then fails it like any other
work of an offline site. One shared thread watches the streams, and ends a call by
cancelling its task on the server's event loop.

With mTLS a caller is its certificate (role and name), checked and looked up in the
deny list before anything else. Insecure mode (localhost development) has no
identities: a caller is its connection (the peer address), bounded as an admin is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import grpc

from fedra.config import ConfigError
from fedra.coordinator.auth import Guard
from fedra.coordinator.errors import Unavailable

log = logging.getLogger("fedra.coordinator")
# A site's agent has a poll, a heartbeat and a transfer (or a secure-aggregation stage)
# in flight, and a call it gave up on may linger a second: 8 leaves room for that.
DEFAULT_SITE_CALLS = 8
DEFAULT_ADMIN_CALLS = 32  # watches of several operators sharing a certificate
# At 1 MiB chunks a link must move about 140 kbit/s not to be cut: raise it for slower ones.
DEFAULT_STREAM_IDLE_S = 60.0
_MAX_TICK_S = 1.0  # the watchdog looks at least this often
_MIN_TICK_S = 0.05

Refuse = Callable[[Any, Exception], None]  # sets the call's status (edge.decline)


@dataclass(frozen=True)
class EdgeLimits:
    """How many calls one caller may have in flight, and how long a stream may be idle."""

    calls_per_site: int = DEFAULT_SITE_CALLS
    calls_per_admin: int = DEFAULT_ADMIN_CALLS
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-calls-per-site", self.calls_per_site),
            ("--max-calls-per-admin", self.calls_per_admin),
        ):
            if not 1 <= value <= 4096:
                raise ConfigError(f"{flag}: must be from 1 to 4096, got {value}")
        if not (math.isfinite(self.stream_idle_s) and self.stream_idle_s > 0):
            raise ConfigError(
                f"--stream-idle-s: must be a finite number > 0, got {self.stream_idle_s}"
            )


@dataclass(frozen=True)
class _Caller:
    key: tuple[str, str]
    who: str  # for messages: "site 'a'", "connection ipv4:127.0.0.1:5000"
    limit: int
    flag: str  # the flag that sets ``limit``


class _Call:
    """A call in flight, and whether (since when) it waits for its caller's next message."""

    def __init__(self, caller: _Caller, context: Any, method: str) -> None:
        self.caller, self.context, self.method = caller, context, method
        self._loop = asyncio.get_running_loop()
        self.waiting_since: float | None = None
        self._waiting: asyncio.Task[Any] | None = None  # the task waiting for a message
        self.site_id = ""  # set: an upload in progress, ended if its site goes silent
        self.cut = ""  # why the watchdog ended it
        self.ended = False

    async def requests(self, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The request stream, timing each wait for the caller (not the handler's work);
        ended (grpc.RpcError, answered CANCELLED) the moment the watchdog cuts it.

        A wait is the receive itself, in the handler's own task, which a cut cancels: no
        task and no ``asyncio.wait`` per message (an upload's messages are most of the
        calls a round's thousands of sites make)."""
        stream = aiter(messages)
        end = object()
        try:
            while not self.cut:
                self.waiting_since = time.monotonic()
                self._waiting = task = asyncio.current_task()
                try:
                    message = await anext(stream, end)
                except asyncio.CancelledError:
                    if not self._was_cut():  # not the watchdog's: the call is cancelled
                        raise
                    _uncancel(task)
                    break
                finally:
                    self._waiting, self.waiting_since = None, None
                if message is end:
                    return
                yield message
                del message  # not held while the next one is received
            raise grpc.RpcError(self.cut)
        finally:
            self._waiting, self.waiting_since = None, None

    def _was_cut(self) -> bool:  # read again after a wait (the watchdog's thread sets it)
        return bool(self.cut)

    def end(self) -> None:
        """Cut the stream now (from any thread, once ``cut`` says why): a wait for a
        message under way ends at once, and no other begins."""
        with suppress(RuntimeError):  # the loop closed: the call is over anyway
            self._loop.call_soon_threadsafe(self._cut_wait)

    def _cut_wait(self) -> None:  # on the call's loop
        if self._waiting is not None:
            self._waiting.cancel()


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    """Take back a cancellation this module asked for and handled (Python 3.11+ counts
    them: a task left marked would look cancelled to ``asyncio.timeout`` and task groups)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


class CallLimiter(grpc.aio.ServerInterceptor):
    """Checks the caller, bounds its calls in flight, and ends stalled request streams."""

    def __init__(
        self,
        guard: Guard,
        limits: EdgeLimits,
        refuse: Refuse,
        site_timeout_s: float = math.inf,
        site_heard: Callable[[str], bool] = lambda site_id: True,
    ) -> None:
        """``site_heard`` says whether a site was heard from within ``site_timeout_s``
        (the engine's liveness): an upload of a site gone silent is ended. A port that
        takes no uploads (the admin port) needs neither."""
        self.guard, self.limits, self.refuse = guard, limits, refuse
        self.site_timeout_s, self.site_heard = site_timeout_s, site_heard
        self._lock = threading.Lock()
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._streams: dict[Any, _Call] = {}
        self._watchdog: threading.Thread | None = None
        bound = min(limits.stream_idle_s, site_timeout_s) / 4
        self._tick_s = max(_MIN_TICK_S, min(_MAX_TICK_S, bound))

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _bounded(self, handler, handler_call_details.method)

    def enter(
        self, context: Any, method: str, streaming: bool, response_streaming: bool = True
    ) -> _Call | None:
        """Admit a call before it reads anything, or refuse it: None, its status set (the
        handler then returns at once, and gRPC ends the call with that status). The caller
        frees its slot (``leave``) when the handler ends; a response stream's slot is also
        freed when the call ends, as gRPC may drop the stream's generator without closing
        it."""
        try:
            caller = self._caller(context)
        except Exception as exc:  # revoked, no certificate, deny list unreadable
            self.refuse(context, exc)
            return None
        call = _Call(caller, context, method)
        with self._lock:
            full = self._in_flight[caller.key] >= caller.limit
            if not full:
                self._in_flight[caller.key] += 1
                if streaming:
                    self._streams[context] = call
                    self._start_watchdog()
        if full:
            self.refuse(
                context,
                Unavailable(
                    f"{caller.who} already has {caller.limit} calls in progress, the most "
                    f"this coordinator allows ({caller.flag}): retry once one has ended"
                ),
            )
            return None
        if response_streaming:
            # Not for every call: grpc.aio keeps a done callback in a reference cycle
            # with the call's state (and, through ``call``, so does this one), which
            # only the collector frees. At thousands of sites those cycles were most of
            # the daemon's young garbage, and its collections half its CPU.
            context.add_done_callback(lambda _: self.leave(call))
        return call

    def leave(self, call: _Call) -> None:
        """The call ended: its slot is free (once, however often this is called)."""
        with self._lock:
            if call.ended:
                return
            call.ended = True
            self._in_flight[call.caller.key] -= 1
            if not self._in_flight[call.caller.key]:
                del self._in_flight[call.caller.key]
            self._streams.pop(call.context, None)

    def upload_started(self, context: Any, site_id: str) -> None:
        """The call is an upload of ``site_id``'s: ended if that site goes silent."""
        with self._lock:
            call = self._streams.get(context)
            if call is not None:
                call.site_id = site_id

    def in_flight(self) -> int:
        """Calls admitted and not yet ended."""
        with self._lock:
            return sum(self._in_flight.values())

    def _caller(self, context: Any) -> _Caller:
        who = self.guard.identity(context)
        if who is None:  # insecure: no identities; the connection stands for the caller
            peer = context.peer()
            return _Caller(
                ("peer", peer), f"connection {peer}", self.limits.calls_per_admin,
                "--max-calls-per-admin",
            )  # fmt: skip
        if who.role == "admin":
            limit, flag = self.limits.calls_per_admin, "--max-calls-per-admin"
        else:
            limit, flag = self.limits.calls_per_site, "--max-calls-per-site"
        return _Caller((who.role, who.name), f"{who.role} {who.name!r}", limit, flag)

    def _start_watchdog(self) -> None:
        """Start the watchdog if none runs (lock held); it ends when no stream is left."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="stream-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self._tick_s)
            with self._lock:
                streams = list(self._streams.values())
                if not streams:
                    self._watchdog = None
                    return
            now = time.monotonic()
            for call in streams:
                reason = self._overdue(call, now)
                if reason:
                    self._cut(call, reason)

    def _overdue(self, call: _Call, now: float) -> str:
        """Why ``call`` must end now, or ''."""
        since = call.waiting_since
        if since is None or call.cut:
            return ""
        quiet = now - since
        idle = self.limits.stream_idle_s
        if quiet > idle:
            return f"its request stream was idle for {quiet:.1f} s (--stream-idle-s {idle:g})"
        timeout = self.site_timeout_s
        if call.site_id and quiet > timeout and not self.site_heard(call.site_id):
            return (
                f"site {call.site_id!r} went silent mid-upload: no chunk and no heartbeat for "
                f"more than {timeout:g} s (--site-timeout-s); its task goes back to the round"
            )
        return ""

    def _cut(self, call: _Call, reason: str) -> None:
        with self._lock:
            if call.ended or call.cut:
                return
            call.cut = reason
        log.warning(
            "ended %s of %s (%s): %s", call.method, call.caller.who, call.context.peer(), reason
        )
        call.end()


def _bounded(
    limiter: CallLimiter, handler: grpc.RpcMethodHandler[Any, Any], method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with each call admitted by ``limiter`` first and its slot freed after."""
    streaming = handler.request_streaming
    behavior: Any = (
        handler.stream_stream or handler.stream_unary
        if streaming
        else handler.unary_stream or handler.unary_unary
    )

    async def unary_out(request: Any, context: Any) -> Any:
        call = limiter.enter(context, method, streaming, response_streaming=False)
        if call is None:
            return None  # refused: its status is set
        try:
            return await behavior(call.requests(request) if streaming else request, context)
        finally:
            limiter.leave(call)

    async def stream_out(request: Any, context: Any) -> AsyncIterator[Any]:
        call = limiter.enter(context, method, streaming)
        if call is None:
            return  # refused: its status is set
        try:
            async for item in behavior(call.requests(request) if streaming else request, context):
                yield item
        finally:
            limiter.leave(call)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(streaming, handler.response_streaming)]
    return make(
        stream_out if handler.response_streaming else unary_out,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
