"""Coordinator CPU per site call, against a bare grpc.aio server on the same machine.

A coordinator's cost at thousands of sites is mostly its cost per call: every site
heartbeats and polls, whatever the model. This measures it alone, without the round
machinery: the real daemon (`fedra coordinator`, default flags, SQLite) answers
`Heartbeat` from registered sites, and a bare `grpc.aio`
server on one event loop answers a unary call that does nothing; both are called by
the same client threads, and each server's CPU (user + system, from /proc) is divided
by the calls it answered. The ratio is what fedra's edge, engine and bookkeeping add.
The bare server also answers a client-streaming call of one message (the shape of a
small update's upload): against the unary call, what the streaming shape costs in gRPC
alone. And the bare unary call again with its server's methods registered with gRPC's
core (all of them, as generated code does, or the six of a round, as the coordinator
does): each registered method is one more request the server waits on for every call.

    OMP_NUM_THREADS=1 .venv/bin/python bench/call_cost.py --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from fedra.client.connection import Connection
from fedra.local import LocalCluster
from fedra.protos.v1 import site_pb2

_TICK = os.sysconf("SC_CLK_TCK")
_BARE = "/bench.Bare/Call"
_BARE_STREAM = "/bench.Bare/Stream"


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def hammer(calls: list[Callable[[], object]], threads: int, seconds: float) -> int:
    """Run the ``calls`` (callables) round-robin from ``threads`` threads for ``seconds``;
    returns how many completed."""
    done = [0] * threads
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        mine = calls[i::threads]
        n = 0
        while time.monotonic() < stop:
            mine[n % len(mine)]()
            n += 1
        done[i] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done)


def measure_fedra(sites: int, threads: int, seconds: float) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), secure=False) as cluster:
        address = cluster.start_coordinator()
        assert cluster.coordinator is not None
        pid = cluster.coordinator.popen.pid
        conns = [Connection(address, f"site-{i:04d}") for i in range(sites)]
        try:
            for c in conns:
                c.register(["bench"])
            calls = [functools.partial(c.heartbeat, "no-such-task") for c in conns]
            hammer(calls, threads, 1.0)  # warm up
            before = cpu_s(pid)
            n = hammer(calls, threads, seconds)
            out["Heartbeat"] = (cpu_s(pid) - before) / n * 1e6
            out["Heartbeat_per_s"] = n / seconds
        finally:
            for c in conns:
                c.close()
    return out


# A bare server with as many methods as the coordinator's site port serves (the site
# and admin services: 22), found by name (generic), all registered with gRPC's core as
# generated code does (``all``), or the six a site calls every round (``round``,
# ``coordinator.server.ROUND_METHODS``).
_BARE_SERVER = """
import asyncio, sys
import grpc

async def main():
    server = grpc.aio.server()
    async def call(request, context):
        return b""
    async def stream(requests, context):
        async for _ in requests:
            pass
        return b""
    methods = {
        "Call": grpc.unary_unary_rpc_method_handler(call),
        "Stream": grpc.stream_unary_rpc_method_handler(stream),
        **{f"Other{i}": grpc.unary_unary_rpc_method_handler(call) for i in range(20)},
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", methods),))
    mode = sys.argv[1]
    if mode == "all":
        server.add_registered_method_handlers("bench.Bare", methods)
    elif mode == "round":
        hot = ["Call", "Stream", "Other0", "Other1", "Other2", "Other3"]
        server.add_registered_method_handlers("bench.Bare", {m: methods[m] for m in hot})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)

asyncio.run(main())
"""


def _one_message_stream(
    method: grpc.StreamUnaryMultiCallable, request: bytes
) -> Callable[[], object]:
    return lambda: method(iter((request,)), timeout=10.0)


def measure_bare(
    sites: int, threads: int, seconds: float, mode: str = "generic", stream: bool = True
) -> dict[str, float]:
    """The bare server's CPU per call; ``mode``: how its methods are registered (above)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _BARE_SERVER, mode], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(sites)]
        request = site_pb2.HeartbeatRequest(site_id="site-0000", task_id="x").SerializeToString()
        unary = [functools.partial(ch.unary_unary(_BARE), request, timeout=10.0) for ch in channels]
        streams = [_one_message_stream(ch.stream_unary(_BARE_STREAM), request) for ch in channels]
        figures: dict[str, float] = {}
        kinds = [("Bare", unary), ("BareStream", streams)] if stream else [("Bare", unary)]
        for name, calls in kinds:
            hammer(calls, threads, 1.0)  # warm up
            before = cpu_s(proc.pid)
            n = hammer(calls, threads, seconds)
            figures[name] = (cpu_s(proc.pid) - before) / n * 1e6
            figures[f"{name}_per_s"] = n / seconds
        for ch in channels:
            ch.close()
        return figures
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=50, help="registered sites (channels)")
    parser.add_argument("--threads", type=int, default=8, help="calling threads")
    parser.add_argument("--seconds", type=float, default=8.0, help="per measured call kind")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    figures = measure_bare(args.sites, args.threads, args.seconds)
    for mode in ("all", "round"):
        once = measure_bare(args.sites, args.threads, args.seconds, mode, stream=False)
        figures[f"Bare_registered_{mode}"] = once["Bare"]
        figures[f"Bare_registered_{mode}_per_s"] = once["Bare_per_s"]
    figures.update(measure_fedra(args.sites, args.threads, args.seconds))
    bare = figures["Bare"]
    print(f"bare grpc.aio unary call: {bare:.0f} us of server CPU per call "
          f"({figures['Bare_per_s']:.0f} calls/s), its 22 methods found by name")  # fmt: skip
    for mode, what in (("all", "all 22"), ("round", "the 6 of a round")):
        cost = figures[f"Bare_registered_{mode}"]
        print(f"  the same, {what} registered with gRPC's core: {cost:.0f} us "
              f"({figures[f'Bare_registered_{mode}_per_s']:.0f} calls/s), "
              f"{cost / bare:.2f}x")  # fmt: skip
    stream = figures["BareStream"]
    print(
        f"bare grpc.aio client stream of one message: {stream:.0f} us of server CPU per call "
        f"({figures['BareStream_per_s']:.0f} calls/s), {stream / bare:.2f}x the unary call"
    )
    beat = figures["Heartbeat"]
    print(
        f"fedra Heartbeat: {beat:.0f} us of coordinator CPU per call "
        f"({figures['Heartbeat_per_s']:.0f} calls/s), {beat / bare:.2f}x the bare call"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
