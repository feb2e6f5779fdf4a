"""WAN emulation: a TCP proxy that gives a link a bandwidth, a latency and a loss rate.

Put it between a site and the coordinator so that a localhost run behaves like a site
on another continent:

    fedra wan --target 127.0.0.1:50051 --bandwidth-mbit 100 --latency-ms 50 --loss-pct 0.1

Each direction is modelled as a link: a chunk leaves once the link has serialised the
bytes before it (``bandwidth``) and arrives ``latency`` later. The queue in between is
bounded, so a fast sender is slowed by TCP's own flow control, as on a real link.

A byte-stream proxy cannot drop packets, so loss is modelled by what it does to a TCP
flow: random loss at rate p caps a flow at MSS / RTT * sqrt(3 / 2p) (Mathis, Semke,
Mahdavi and Ott, 1997), e.g. 0.1% loss at 100 ms RTT gives about 4.5 Mbit/s, whatever
the link's bandwidth. The proxy paces each direction at the lower of the two rates.
(``tc netem`` in a network namespace drops real packets, where the kernel has it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from dataclasses import dataclass

_READ_BYTES = 64 * 1024
_QUEUE_CHUNKS = 64  # at most 4 MiB in flight per direction
MSS_BYTES = 1448  # a TCP segment's payload on a 1500-byte Ethernet MTU with timestamps


@dataclass(frozen=True)
class Link:
    bandwidth_mbit: float  # per direction
    latency_ms: float = 0.0  # one way
    loss_pct: float = 0.0  # random packet loss, in percent

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbit) and self.bandwidth_mbit > 0):
            raise ValueError(
                f"bandwidth_mbit: must be a finite number > 0, got {self.bandwidth_mbit}"
            )
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency_ms: must be a finite number >= 0, got {self.latency_ms}")
        if not (math.isfinite(self.loss_pct) and 0 <= self.loss_pct < 100):
            raise ValueError(f"loss_pct: must be in [0, 100), got {self.loss_pct}")
        if self.loss_pct > 0 and self.latency_ms <= 0:
            raise ValueError("loss_pct: needs a latency > 0 (a loss costs round trips)")

    @property
    def bytes_per_s(self) -> float:
        """The rate each direction is paced at: the bandwidth, or what loss leaves of it."""
        bandwidth = self.bandwidth_mbit * 1e6 / 8
        if self.loss_pct <= 0:
            return bandwidth
        p, rtt_s = self.loss_pct / 100, 2 * self.latency_ms / 1000
        return min(bandwidth, MSS_BYTES / rtt_s * math.sqrt(3 / (2 * p)))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Copy one direction, releasing each chunk at the link's pace."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
    delay = link.latency_ms / 1000

    async def receive() -> None:
        free_at = 0.0  # when the link has finished serialising what it was given
        while data := await reader.read(_READ_BYTES):
            free_at = max(time.monotonic(), free_at) + len(data) / link.bytes_per_s
            await queue.put((free_at + delay, data))
        await queue.put((0.0, b""))

    async def deliver() -> None:
        while True:
            at, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    await asyncio.gather(receive(), deliver())


class WanProxy:
    """Listens on ``host:port`` (0: a free port) and forwards to ``target`` over ``link``."""

    def __init__(self, target: str, link: Link, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target_host, _, target_port = target.rpartition(":")
        self.target_port = int(target_port)
        self.link, self.host = link, host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan", daemon=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(
                _pump(reader, up_writer, self.link), _pump(up_reader, writer, self.link)
            )
        except (ConnectionError, OSError):
            pass  # one side went away: close both
        finally:
            for w in (writer, up_writer):
                w.close()

    def start(self) -> int:
        """Start serving in a background thread; returns the port."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, self.host, self.port), self._loop
        )
        self._server = future.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        """Close the listener and every proxied connection, then the event loop."""
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            with contextlib.suppress(Exception):
                done.result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # each connection's handler closes both of its sockets
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> WanProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
