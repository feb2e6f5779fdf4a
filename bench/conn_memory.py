"""Coordinator memory per connected site, against a bare grpc.aio server on the same machine.

A waiting site costs the coordinator memory, not a thread: its connection, and the call
it waits in (a long poll). This measures that cost alone. The same client processes open
N channels (one TCP connection each, as sites in processes of their own have) to

- a bare ``grpc.aio`` server, the channels only (``bare_connection``);
- the same server, each channel with one call waiting in it (``bare_waiting_call``): a
  unary call whose handler awaits an event that never comes, which is what gRPC itself
  needs for a site in a long poll (queued as the coordinator's calls are: gRPC's own
  default refuses calls past about 3,000 waiting for the server);
- the real daemon (``fedra coordinator``, default flags, SQLite): each channel a
  registered site in a long poll (``PollTask``, polled again as each one times out).

Each server's resident memory (VmRSS) before the channels and once it has settled with
them all, divided by N. The ratio of the daemon's to the bare waiting call's is what
fedra's own state adds to gRPC's; the scale benchmark's "RSS growth per connected site"
(aim: under 50 kB) is the same figure with its sites heartbeating and training.

    OMP_NUM_THREADS=1 .venv/bin/python bench/conn_memory.py --sites 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from fedra.coordinator.server import PENDING_CALLS
from fedra.local import LocalCluster
from fedra.protos import wire
from fedra.protos.v1 import site_pb2, site_pb2_grpc

_HOLD = "/bench.Bare/Hold"
SETTLE_S = 60.0  # at most, for a server's memory to stop growing once all are in
READY_S = 120.0  # at most, for the clients to have every channel in place

_BARE_SERVER = """
import asyncio, sys
import grpc

async def main():
    pending = int(sys.argv[1])  # calls gRPC queues for the server: as the coordinator's
    server = grpc.aio.server(options=[
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
    ])
    never, held = asyncio.Event(), 0
    async def hold(request, context):
        nonlocal held
        held += 1
        await never.wait()
        return b""
    methods = {"Hold": grpc.unary_unary_rpc_method_handler(hold)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    while await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline):
        print(held, flush=True)  # each line asks how many calls wait in it
    await server.stop(0)

asyncio.run(main())
"""


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"process {pid} has no VmRSS")


async def _client(address: str, kind: str, first: int, count: int) -> None:
    """``count`` channels, each as ``kind`` asks; says ``ready`` once all are in place
    and waits until its stdin closes."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    waiting: list[asyncio.Future[object]] = []
    if kind == "bare_connection":
        await asyncio.gather(*(ch.channel_ready() for ch in channels))
    elif kind == "bare_waiting_call":
        await asyncio.gather(*(ch.channel_ready() for ch in channels))
        hold = [ch.unary_unary(_HOLD) for ch in channels]
        waiting = [asyncio.ensure_future(h(b"", timeout=3600.0)) for h in hold]
    else:
        stubs = [site_pb2_grpc.SiteServiceStub(ch) for ch in channels]
        ids = [f"site-{first + i:05d}" for i in range(count)]
        meta = wire.declared_timeout(30.0)
        polls = await asyncio.gather(*(
            stub.Register(site_pb2.RegisterRequest(site_id=site, tasks=["bench:task"]),
                          timeout=30.0, metadata=meta)
            for stub, site in zip(stubs, ids, strict=True)
        ))  # fmt: skip
        poll_s = max(r.poll_timeout_s for r in polls) + 10.0

        async def poll_forever(stub: site_pb2_grpc.SiteServiceStub, site: str) -> None:
            request = site_pb2.PollTaskRequest(site_id=site)
            while True:
                await stub.PollTask(request, timeout=poll_s, metadata=wire.declared_timeout(poll_s))

        waiting = [
            asyncio.ensure_future(poll_forever(s, i)) for s, i in zip(stubs, ids, strict=True)
        ]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for w in waiting:
        w.cancel()
    for ch in channels:
        await ch.close(None)


class Server:
    """The server a kind is measured against: its address, its pid, and how many calls
    wait in it now."""

    def __init__(self, address: str, pid: int, waiting: Callable[[], int]) -> None:
        self.address, self.pid, self.waiting = address, pid, waiting


@contextmanager
def _server(kind: str, work: Path) -> Iterator[Server]:
    """The server ``kind`` is measured against, stopped after."""
    if kind.startswith("bare"):
        proc = subprocess.Popen(
            [sys.executable, "-c", _BARE_SERVER, str(PENDING_CALLS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        stdin, stdout = proc.stdin, proc.stdout

        def held() -> int:
            stdin.write("count\n")
            stdin.flush()
            return int(stdout.readline())

        try:
            yield Server(f"127.0.0.1:{int(stdout.readline())}", proc.pid, held)
        finally:
            _stop(proc)
        return
    with LocalCluster(work, secure=False) as cluster:
        address = cluster.start_coordinator(flags=["--http", "127.0.0.1:0"])
        assert cluster.coordinator is not None
        http = json.loads((work / "coordinator.json").read_text())["http_address"]

        def polling() -> int:
            with urllib.request.urlopen(f"http://{http}/metrics", timeout=30) as reply:
                found = _WAITING.search(reply.read().decode())
            return int(float(found.group(1))) if found else 0

        yield Server(address, cluster.coordinator.popen.pid, polling)


_WAITING = re.compile(r"^fedra_waiting_calls ([0-9.e+]+)$", re.M)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _settled(pid: int) -> int:
    """The server's RSS once two samples a second apart differ by under 0.5%."""
    deadline, last = time.monotonic() + SETTLE_S, rss_kb(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_kb(pid)
        if abs(now - last) <= 0.005 * last:
            return now
        last = now
    return last


def measure(kind: str, sites: int, procs: int, work: Path) -> dict[str, float]:
    """The server's RSS growth per channel, in kB, with ``sites`` channels as ``kind``."""
    with _server(kind, work / kind) as server:
        address, pid = server.address, server.pid
        idle = _settled(pid)  # its start's own allocations done
        shares = [len(range(p, sites, procs)) for p in range(procs)]
        firsts = [sum(shares[:p]) for p in range(procs)]
        clients = [
            subprocess.Popen(
                [sys.executable, __file__, "--client", address, kind, str(first), str(count)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for first, count in zip(firsts, shares, strict=True)
            if count
        ]
        try:
            deadline = time.monotonic() + READY_S
            for c in clients:
                assert c.stdout is not None
                line = c.stdout.readline()  # each says ready, or ends
                if line.strip() != "ready" or time.monotonic() > deadline:
                    raise RuntimeError(f"a client of {kind} did not get its channels in place")
            wanted = 0 if kind == "bare_connection" else sites
            while (waiting := server.waiting()) < wanted:  # every call is in
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind}: {waiting} of {sites} calls waiting in time")
                time.sleep(0.2)
            connected = _settled(pid)
        finally:
            for c in clients:
                _stop(c)
    return {"idle_kb": idle, "connected_kb": connected, "kb_per_site": (connected - idle) / sites}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=2000, help="channels (sites)")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        address, kind, first, count = args.client
        asyncio.run(_client(address, kind, int(first), int(count)))
        return
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("bare_connection", "bare_waiting_call", "fedra"):
            figures[kind] = measure(kind, args.sites, args.procs, Path(tmp))
    conn, call = figures["bare_connection"], figures["bare_waiting_call"]
    fedra = figures["fedra"]
    print(f"{args.sites} channels from {args.procs} processes; server RSS growth per channel:")
    print(f"  bare grpc.aio server, connected:          {conn['kb_per_site']:5.1f} kB")
    print(f"  bare grpc.aio server, a call waiting in each: {call['kb_per_site']:5.1f} kB "
          f"(the call: {call['kb_per_site'] - conn['kb_per_site']:.1f} kB)")  # fmt: skip
    print(f"  fedra coordinator, a registered site polling in each: {fedra['kb_per_site']:5.1f} kB,"
          f" {fedra['kb_per_site'] / call['kb_per_site']:.2f}x the bare waiting call "
          f"(fedra's own: {fedra['kb_per_site'] - call['kb_per_site']:.1f} kB)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"sites": args.sites, **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
