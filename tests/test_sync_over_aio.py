"""The scale bench's site transport (``bench/sync_over_aio.py``): gRPC's synchronous
channel API over ``grpc.aio`` channels sharing one event loop. A site's ``Connection``
must see what the synchronous channel gives it: answers, status codes and details,
deadlines, a cancelled future, streams both ways; checked against a real ``grpc.aio``
server in a process of its own, and a real ``Connection`` on top."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from fedra.client.connection import Connection

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench"
SERVER = r"""
import asyncio, sys, grpc

async def echo(request, context):
    if request == b"fail":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fail asked for")
    if request == b"hold":
        await asyncio.sleep(30)
    return b"echo:" + request

async def count(request, context):
    for i in range(int(request)):
        yield str(i).encode()

async def join(requests, context):
    parts = [r async for r in requests]
    if b"fail" in parts:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a part said fail")
    return b"+".join(parts)

async def refuse_early(requests, context):
    async for r in requests:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no more, thanks")

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Join": grpc.stream_unary_rpc_method_handler(join),
        "RefuseEarly": grpc.stream_unary_rpc_method_handler(refuse_early),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)

asyncio.run(main())
"""


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_over_aio", BENCH / "sync_over_aio.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()  # the server prints its port once it serves
        assert port.isdigit(), port
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def test_calls_answer_fail_and_time_out_as_the_synchronous_channel_does(server: str) -> None:
    soa = _module()
    loop = soa.Loop()
    channel = soa.Channel(loop, server, [("grpc.use_local_subchannel_pool", 1)])
    echo = channel.unary_unary("/t.T/Echo", _registered_method=True)
    assert echo(b"hi", timeout=10, metadata=(("k", "v"),)) == b"echo:hi"
    with pytest.raises(grpc.RpcError) as refused:
        echo(b"fail", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "fail asked for"
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        echo(b"hold", timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5

    # A future: its callback gets the future, a cancelled one says so.
    answered = threading.Event()
    seen: list[object] = []
    future = echo.future(b"later", timeout=10)
    future.add_done_callback(lambda f: (seen.append(f), answered.set()))
    assert answered.wait(10) and seen == [future]
    assert future.done() and future.result() == b"echo:later" and future.exception() is None
    held = echo.future(b"hold", timeout=30)
    told: list[bool] = []  # what its callback sees: cancelled by its caller, no error
    held.add_done_callback(lambda f: told.append(f.cancelled()))
    time.sleep(0.2)  # under way at the server
    assert held.cancel() and held.cancelled()
    assert told == [True]
    with pytest.raises(grpc.FutureCancelledError):
        held.result()

    # Streams both ways, and their failures.
    assert list(channel.unary_stream("/t.T/Count")(b"3", timeout=10)) == [b"0", b"1", b"2"]
    join = channel.stream_unary("/t.T/Join")
    assert join(iter([b"a", b"b", b"c"]), timeout=10) == b"a+b+c"
    with pytest.raises(grpc.RpcError) as failed:
        join(iter([b"a", b"fail"]), timeout=10)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    def endless() -> Iterator[bytes]:  # the server refuses after the first: writes fail
        while True:
            yield b"x" * 1000
            time.sleep(0.01)

    with pytest.raises(grpc.RpcError) as early:
        channel.stream_unary("/t.T/RefuseEarly")(endless(), timeout=10)
    assert early.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    counting = channel.unary_stream("/t.T/Count")(b"1000000", timeout=10)
    assert next(counting) == b"0"
    counting.close()  # a reader that stops early: the call is cancelled, nothing hangs
    assert echo(b"after", timeout=10) == b"echo:after"

    # The channel closing under a call, and a call on a closed channel.
    cut = echo.future(b"hold", timeout=30)
    blocked: list[BaseException] = []

    def blocking() -> None:
        try:
            echo(b"hold", timeout=30)
        except BaseException as exc:
            blocked.append(exc)

    waiter = threading.Thread(target=blocking)
    waiter.start()
    time.sleep(0.3)  # both under way at the server
    channel.close()
    waiter.join(10)
    assert [type(e) for e in blocked] and isinstance(blocked[0], grpc.RpcError), blocked
    assert blocked[0].code() == grpc.StatusCode.CANCELLED
    assert not cut.cancelled()  # not its caller's doing: an error, as a synchronous one's
    assert isinstance(cut.exception(), grpc.RpcError)
    with pytest.raises(grpc.RpcError):
        cut.result()
    with pytest.raises(ValueError, match="closed channel"):
        echo(b"late", timeout=10)

    # A callback run on the loop's own thread that makes a blocking call is refused.
    other = soa.Channel(loop, server, [("grpc.use_local_subchannel_pool", 1)])
    again = other.unary_unary("/t.T/Echo")
    refused_here: list[BaseException] = []

    def blocking_callback(_: object) -> None:
        try:
            again(b"x", timeout=5)
        except RuntimeError as exc:
            refused_here.append(exc)
        answered.set()

    answered.clear()
    again.future(b"y", timeout=10).add_done_callback(blocking_callback)
    assert answered.wait(10) and len(refused_here) == 1
    other.close()
    loop.close()


def test_a_connection_over_it_gets_the_coordinators_answers(tmp_path: Path) -> None:
    """A real Connection to a real coordinator, over the transport: a registration, a
    poll that finds no task, a refused heartbeat's status, as the synchronous channel."""
    from fedra.coordinator.engine import EngineSettings
    from tests.conftest import InProcessCoordinator

    soa = _module()
    loop = soa.Loop()
    plain = grpc.insecure_channel
    c = InProcessCoordinator(tmp_path / "state", EngineSettings())
    try:
        grpc.insecure_channel = lambda target, options=None, compression=None: soa.Channel(
            loop, target, options
        )
        conn = Connection(c.address, "site-a")
        grpc.insecure_channel = plain
        session = conn.register(["fedra.examples.synthetic:task"])
        assert session.poll_timeout_s > 0
        assert conn.poll(0.2) is None
        beat = conn.heartbeat_future("no-such-task", timeout_s=10).result()
        assert not beat.task_current
        with pytest.raises(grpc.RpcError) as refused:
            conn.report_failure("no-such-task", "x")
        assert refused.value.code() in (
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        conn.close()
    finally:
        grpc.insecure_channel = plain
        c.close()
        loop.close()
