"""Per-message cost of a client-streaming upload: gRPC's threaded server against grpc.aio.

The coordinator's memory at small models and many sites is mostly uploads in flight, which
smaller chunks would cut; but each message costs the threaded Python server a hand-off
between its polling thread and the handler's. This measures that cost, nothing of fedra:
N client processes each upload a P-byte payload R times at once, in chunks of C bytes, to
one server process that hashes every chunk (as the coordinator does), once with
``grpc.server`` (a thread pool) and once with ``grpc.aio.server`` (an event loop). It
prints the wall time and the server's CPU time, median of the repeats, and their ratios.

    OMP_NUM_THREADS=1 .venv/bin/python bench/server_modes.py [--chunks 250000 62500]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.synchronize import Event

import grpc

SERVICE, METHOD = "bench.Upload", "Up"
# Fresh interpreters: forking a process that already runs gRPC threads is unsafe.
MP = mp.get_context("spawn")
OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def _same(data: bytes) -> bytes:
    return data


def _handler(behaviour: object) -> grpc.GenericRpcHandler:
    method = grpc.stream_unary_rpc_method_handler(behaviour, _same, _same)  # type: ignore[arg-type]
    return grpc.method_handlers_generic_handler(SERVICE, {METHOD: method})


def _serve_threads(ready: mp.Queue, stop: Event) -> None:
    def up(chunks: Iterator[bytes], _: grpc.ServicerContext) -> bytes:
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        return digest.digest()

    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=OPTIONS)
    server.add_generic_rpc_handlers([_handler(up)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(port)
    stop.wait()
    server.stop(0)


def _serve_asyncio(ready: mp.Queue, stop: Event) -> None:
    async def up(chunks: AsyncIterator[bytes], _: grpc.aio.ServicerContext) -> bytes:
        digest = hashlib.sha256()
        async for chunk in chunks:
            digest.update(chunk)
        return digest.digest()

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers([_handler(up)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    asyncio.run(main())


def _client(port: int, payload: int, chunk: int, rounds: int, go: Event, done: mp.Queue) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    up = channel.stream_unary(f"/{SERVICE}/{METHOD}", _same, _same)
    data = os.urandom(payload)
    pieces = [data[i : i + chunk] for i in range(0, payload, chunk)]
    up(iter(pieces[:1]))  # connected before the clock starts
    done.put("ready")
    go.wait()
    expected = hashlib.sha256(data).digest()
    for _ in range(rounds):
        if up(iter(pieces)) != expected:
            done.put("the server hashed other bytes than were sent")
            return
    done.put("done")
    channel.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(asyncio_server: bool, sites: int, payload: int, chunk: int, rounds: int) -> tuple:
    """(wall seconds, server CPU seconds) for ``rounds`` rounds of ``sites`` uploads."""
    ready: mp.Queue = MP.Queue()
    done: mp.Queue = MP.Queue()
    stop, go = MP.Event(), MP.Event()
    target = _serve_asyncio if asyncio_server else _serve_threads
    server = MP.Process(target=target, args=(ready, stop))
    server.start()
    clients: list[mp.process.BaseProcess] = []
    try:
        port = ready.get(timeout=60)
        clients = [
            MP.Process(target=_client, args=(port, payload, chunk, rounds, go, done))
            for _ in range(sites)
        ]
        for c in clients:
            c.start()
        for _ in clients:
            if done.get(timeout=60) != "ready":
                raise RuntimeError("a client did not connect")
        assert server.pid is not None
        cpu0, started = _cpu_s(server.pid), time.perf_counter()
        go.set()
        for _ in clients:
            result = done.get(timeout=300)
            if result != "done":
                raise RuntimeError(result)
        return time.perf_counter() - started, _cpu_s(server.pid) - cpu0
    finally:
        stop.set()
        for p in [*clients, server]:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=8)
    parser.add_argument("--payload", type=int, default=4_000_000, help="bytes per upload")
    parser.add_argument("--chunks", type=int, nargs="+", default=[250_000, 62_500])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mb = args.sites * args.payload * args.rounds / 1e6
    print(f"{args.sites} clients x {args.rounds} uploads of {args.payload / 1e6:g} MB ({mb:g} MB)")
    print("chunk KB  server   wall ms  server CPU ms")
    results: dict[tuple[int, bool], tuple[float, float]] = {}
    for chunk in args.chunks:
        for asyncio_server in (False, True):
            runs = [
                measure(asyncio_server, args.sites, args.payload, chunk, args.rounds)
                for _ in range(args.repeats)
            ]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            results[chunk, asyncio_server] = wall, cpu
            name = "asyncio" if asyncio_server else "threads"
            print(f"{chunk / 1e3:8.1f}  {name:7}  {wall * 1e3:7.1f}  {cpu * 1e3:13.1f}")
    print("\nratios, asyncio over threads (below 1: asyncio cheaper):")
    for chunk in args.chunks:
        (tw, tc), (aw, ac) = results[chunk, False], results[chunk, True]
        print(f"  {chunk / 1e3:g} KB chunks: wall {aw / tw:.2f}, server CPU {ac / tc:.2f}")
    big, small = max(args.chunks), min(args.chunks)
    for asyncio_server, name in ((False, "threads"), (True, "asyncio")):
        ratio = results[small, asyncio_server][1] / results[big, asyncio_server][1]
        print(
            f"  {name}: server CPU at {small / 1e3:g} KB over {big / 1e3:g} KB chunks {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
