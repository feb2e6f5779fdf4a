"""gRPC's synchronous channel API over its asyncio channel, for many sites in one process.

The scale bench runs thousands of real site agents (``SiteAgent`` over ``Connection``) as
threads of a few processes. gRPC's synchronous Python client waits for a blocking call,
and for a channel's futures, in a loop that wakes every 200 ms to take the interpreter
lock and look for signals (``_INTERRUPT_CHECK_PERIOD_MS`` in its Cython completion queue;
not a setting). A site process has a few such waits; a worker of 312 sites has one per
site in a long poll and one per channel with a heartbeat under way, some 1,600 wake-ups
a second, each a context switch and an interpreter-lock hand-over (docs/scale.md).

``Channel`` here is the part of ``grpc.Channel`` that ``Connection`` uses (the four
multi-callables, ``close``), made of a ``grpc.aio`` channel on one event loop that the
worker's sites share (``Loop``). A caller's thread waits for its call on a
``concurrent.futures.Future``, which sleeps until the answer comes. Each site keeps a
channel (and a TCP connection) of its own, its calls, deadlines, metadata, status codes
and cancellation are gRPC's own, and the coordinator sees the same calls as from the
synchronous client. What a ``Connection`` raises is what it would raise: ``AioRpcError``
is a ``grpc.RpcError`` with the same ``code()`` and ``details()``; a call its channel's
closing cut ends CANCELLED, one made on a closed channel raises ValueError, and a future
its caller cancelled raises ``grpc.FutureCancelledError``, as the synchronous channel's.
``Channel.subscribe`` (the watch of the channel's state behind
``Connection.wait_reconnected``) is not offered: the bench replaces that wait
(``plain_backoff``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from grpc._cython.cygrpc import UsageError

T = TypeVar("T")


class Loop:
    """An event loop on a thread of its own, for the channels of one process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="sites-aio", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _check_thread(self) -> None:
        # Waiting for the loop on its own thread would wait forever (a done callback, a
        # stream's generator finalised there): say so instead.
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking call on the event loop's own thread")

    def submit(self, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run the awaitable ``make()`` builds on the loop (built there: an aio call binds
        to the loop it is made on)."""
        self._check_thread()

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, make: Callable[[], T]) -> T:
        """``make()`` on the loop's thread, waited for."""
        self._check_thread()

        async def run() -> T:
            return make()

        return _result(asyncio.run_coroutine_threadsafe(run(), self.loop))

    def soon(self, fn: Callable[[], object]) -> None:
        """``fn()`` on the loop's thread, not waited for (from any thread, its own too)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Stop the loop and its thread (the channels on it closed first)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


def _converted(exc: BaseException) -> BaseException:
    """What the synchronous channel raises where the asyncio one raised ``exc``: a call
    cancelled other than by its caller (its channel closed under it) ends CANCELLED, and
    a call made on a closed channel is a ValueError."""
    if isinstance(exc, concurrent.futures.CancelledError | asyncio.CancelledError):
        return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, details="Channel closed!")
    if isinstance(exc, UsageError):
        return ValueError("Cannot invoke RPC on closed channel!")
    return exc


def _result(future: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``future``'s result, raising what the synchronous channel would."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise grpc.FutureTimeoutError() from None
    except BaseException as exc:  # each converted, or raised as it came
        converted = _converted(exc)
        if converted is exc:
            raise
        raise converted from None


class _Future:
    """The part of ``grpc.Future`` a heartbeat uses, over a concurrent future. Its done
    callbacks run on the loop's thread: they must not block (fedra's set an event)."""

    def __init__(self, inner: concurrent.futures.Future[Any]) -> None:
        self._inner = inner
        self._cancelled = False  # by its caller (not by its channel closing)

    def done(self) -> bool:
        return self._inner.done()

    def cancelled(self) -> bool:
        return self._cancelled and self._inner.cancelled()

    def running(self) -> bool:
        return not self._inner.done()

    def cancel(self) -> bool:
        # Said before: the done callbacks run inside the inner cancel, and must see it.
        self._cancelled = True
        self._cancelled = self._inner.cancel()  # cancels the task on the loop, and the call
        return self._cancelled

    def result(self, timeout: float | None = None) -> Any:
        if self.cancelled():
            raise grpc.FutureCancelledError()
        return _result(self._inner, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self.cancelled():
            raise grpc.FutureCancelledError()
        try:
            _result(self._inner, timeout)
        except grpc.FutureTimeoutError:
            raise
        except Exception as exc:  # the call's own error is the answer
            return exc
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._inner.add_done_callback(lambda _: fn(self))


def _call_options(timeout: float | None, metadata: Any) -> dict[str, Any]:
    return {"timeout": timeout, "metadata": tuple(metadata) if metadata else None}


class _MultiCallable:
    """One method of a channel: its ``grpc.aio`` multi-callable, called on ``loop``."""

    def __init__(self, loop: Loop, method: Any) -> None:
        self._loop, self._method = loop, method


class _UnaryUnary(_MultiCallable):
    def future(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any
    ) -> _Future:
        options = _call_options(timeout, metadata)
        return _Future(self._loop.submit(lambda: self._method(request, **options)))

    def __call__(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any
    ) -> Any:
        options = _call_options(timeout, metadata)
        return _result(self._loop.submit(lambda: self._method(request, **options)))


class _UnaryStream(_MultiCallable):
    def __call__(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any
    ) -> Iterator[Any]:
        options = _call_options(timeout, metadata)
        call = self._loop.call(lambda: self._method(request, **options))
        try:
            while True:
                message = _result(self._loop.submit(call.read))
                if message is grpc.aio.EOF:
                    return
                yield message
        finally:  # the reader stopped early (or the call failed): nothing more is wanted
            self._loop.soon(call.cancel)  # not waited for: this may run on the loop's thread


class _StreamUnary(_MultiCallable):
    def __call__(
        self,
        request_iterator: Iterable[Any],
        timeout: float | None = None,
        metadata: Any = None,
        **_: Any,
    ) -> Any:
        """Each message is taken from ``request_iterator`` on the caller's thread (as the
        synchronous client takes them on its own), then written on the loop."""
        options = _call_options(timeout, metadata)
        call = self._loop.call(lambda: self._method(**options))
        try:
            for message in request_iterator:
                _result(self._loop.submit(lambda m=message: call.write(m)))
            _result(self._loop.submit(call.done_writing))
        except grpc.RpcError:
            raise
        except Exception:  # a write after the call ended: its own status says why
            if not self._loop.call(call.done):
                self._loop.soon(call.cancel)
                raise
        except BaseException:
            self._loop.soon(call.cancel)
            raise
        return _result(self._loop.submit(lambda: call))


class Channel:
    """A site's channel: a ``grpc.aio`` channel of its own on the shared ``loop``, offered
    through the synchronous API's multi-callables."""

    def __init__(self, loop: Loop, target: str, options: Any = None) -> None:
        self._loop = loop
        self._aio = loop.call(lambda: grpc.aio.insecure_channel(target, options=options))

    def unary_unary(self, method: str, request_serializer: Any = None,
                    response_deserializer: Any = None, **_: Any) -> _UnaryUnary:  # fmt: skip
        return _UnaryUnary(self._loop, self._aio.unary_unary(
            method, request_serializer, response_deserializer))  # fmt: skip

    def unary_stream(self, method: str, request_serializer: Any = None,
                     response_deserializer: Any = None, **_: Any) -> _UnaryStream:  # fmt: skip
        return _UnaryStream(self._loop, self._aio.unary_stream(
            method, request_serializer, response_deserializer))  # fmt: skip

    def stream_unary(self, method: str, request_serializer: Any = None,
                     response_deserializer: Any = None, **_: Any) -> _StreamUnary:  # fmt: skip
        return _StreamUnary(self._loop, self._aio.stream_unary(
            method, request_serializer, response_deserializer))  # fmt: skip

    def close(self) -> None:
        """Close the channel: calls under way end CANCELLED, as a synchronous channel's do."""
        if not self._loop.loop.is_closed():
            _result(self._loop.submit(self._aio.close))
