"""How fast a grpc.aio server takes new calls while its event loop has other work.

A grpc.aio server keeps one request for a new call open in gRPC's core per method (and
one for methods it has not registered): each answer comes through the event loop, and
the server asks for the next once its serving task has run again, a few passes of the
loop later. While a pass also runs other ready callbacks (the handlers of thousands of
calls in flight, their timers), each new call of a method waits several whole passes in
the core's queue, and the calls a second it can take fall as the passes lengthen,
however idle its CPU is otherwise. Calls waiting there are not seen by their handler:
the coordinator reads how long they waited from the deadlines its sites' calls declare
(``fedra.protos.wire.queued_s``) and does not count that against their liveness.

This starts ``--servers`` bare ``grpc.aio`` servers of one method on one loop, sharing
one port (SO_REUSEPORT: the kernel gives each new connection to one of them), keeps
``--busy`` callbacks of about ``--work-us`` each ready on that loop (each reschedules
itself: every pass runs all of them), and calls the servers from a client process of its
own (this script again, with ``--client``) over ``--connections`` connections,
``--window`` calls in flight, as fast as it can for ``--seconds``. It prints the calls a
second taken for each ``--busy`` (a comma-separated list), the loop's pass time measured,
and their product (calls per pass).

    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rate.py --busy 0,10,50,200
    OMP_NUM_THREADS=1 .venv/bin/python bench/accept_rate.py --busy 50 --servers 4 \
        --connections 32 --window 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

_METHOD = "/bench.Accept/Ping"


def _spin(work_us: float) -> None:
    end = time.perf_counter() + work_us / 1e6
    while time.perf_counter() < end:
        pass


def client_main(port: int, seconds: float, window: int, connections: int) -> None:
    """Calls in flight ``window`` at a time, spread over ``connections`` connections,
    until ``seconds`` have passed; prints the calls answered and those that failed (each
    call waits at most 10 s)."""
    answered, failed = 0, 0
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(connections)
    ]
    with contextlib.ExitStack() as stack:
        for channel in channels:
            stack.enter_context(channel)
        methods: list[grpc.UnaryUnaryMultiCallable[bytes, bytes]] = [
            channel.unary_unary(_METHOD) for channel in channels
        ]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            calls = [methods[i % connections].future(b"", timeout=10) for i in range(window)]
            for c in calls:
                try:
                    c.result()
                    answered += 1
                except grpc.RpcError:  # DEADLINE_EXCEEDED: it waited 10 s untaken
                    failed += 1
    print(json.dumps({"answered": answered, "failed": failed}), flush=True)


async def _bare_servers(count: int) -> tuple[list[grpc.aio.Server], int]:
    """``count`` servers of one method on one port, sharing it (SO_REUSEPORT): the kernel
    gives each new connection to one of them."""

    async def ping(request: bytes, context: Any) -> bytes:
        return b""

    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(ping)
    servers: list[grpc.aio.Server] = []
    port = 0
    for _ in range(count):
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Accept", {"Ping": handler}),)
        )
        server.add_registered_method_handlers("bench.Accept", {"Ping": handler})
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        servers.append(server)
    for server in servers:
        await server.start()
    return servers, port


async def measure(
    busy: int,
    work_us: float,
    seconds: float,
    servers: int = 1,
    connections: int = 1,
    window: int = 16,
) -> dict[str, Any]:
    bare, port = await _bare_servers(servers)
    loop = asyncio.get_running_loop()
    stopping = False
    passes = [0]

    def busy_callback() -> None:
        _spin(work_us)
        if not stopping:
            loop.call_soon(busy_callback)

    def count_pass() -> None:  # one in the ready queue: it runs once a pass
        passes[0] += 1
        if not stopping:
            loop.call_soon(count_pass)

    for _ in range(busy):
        loop.call_soon(busy_callback)
    loop.call_soon(count_pass)
    began = time.monotonic()
    command = [sys.executable, __file__, "--client", str(port), "--seconds", str(seconds)]
    command += ["--connections", str(connections), "--window", str(window)]
    client = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(client.communicate(), seconds + 60)
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
        stopping = True
        took = time.monotonic() - began
        for server in bare:
            await server.stop(0)
    if client.returncode != 0:
        raise RuntimeError(f"the client process failed (exit {client.returncode})")
    counted = json.loads(out)
    # The client's own start (imports, connecting) is in its run: timed by its calls alone.
    calls_per_s = counted["answered"] / seconds
    pass_ms = 1000 * took / max(1, passes[0])  # the loop's mean pass over the whole run
    return {
        "busy": busy,
        "calls_per_s": calls_per_s,
        "failed": counted["failed"],
        "pass_ms": pass_ms,
        "calls_per_pass": calls_per_s * pass_ms / 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", default="0,10,50,200", help="ready callbacks, comma-separated")
    parser.add_argument("--work-us", type=float, default=20.0, help="each callback's work")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--servers", type=int, default=1, help="servers sharing the port")
    parser.add_argument("--window", type=int, default=16, help="calls in flight")
    parser.add_argument("--connections", type=int, default=1, help="the client's connections")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # the calling process
    args = parser.parse_args(argv)
    if args.client is not None:
        client_main(args.client, args.seconds, args.window, args.connections)
        return 0
    try:
        counts = [int(b) for b in args.busy.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--busy: not a list of counts: {args.busy!r}")
    if not counts or min(counts) < 0 or args.seconds <= 0:
        parser.error("--busy counts must be >= 0, --seconds positive")
    if min(args.servers, args.connections, args.window) < 1:
        parser.error("--servers, --connections and --window must be at least 1")
    results = []
    for busy in counts:
        r = asyncio.run(
            measure(busy, args.work_us, args.seconds, args.servers, args.connections, args.window)
        )
        results.append(r)
        print(
            f"{busy:5d} callbacks of {args.work_us:g} us ready a pass: loop pass "
            f"{r['pass_ms']:.2f} ms, {r['calls_per_s']:,.0f} calls a second taken "
            f"({r['calls_per_pass']:.2f} a pass; {r['failed']} calls failed)"
        )
    if args.out:
        args.out.write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
