"""WAN emulation: a TCP proxy that gives a link a bandwidth and a latency.

Put it between a site and the coordinator so that a localhost run behaves like a site
on another continent:

    fedra wan --target 127.0.0.1:50051 --bandwidth-mbit 100 --latency-ms 50

Each direction is modelled as a link: a chunk leaves once the link has serialised the
bytes before it (``bandwidth``) and arrives ``latency`` later. The queue in between is
bounded, so a fast sender is slowed by TCP's own flow control, as on a real link.
Packet loss is not emulated here: a byte-stream proxy cannot lose packets; use
``tc netem`` in a network namespace for that.
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


@dataclass(frozen=True)
class Link:
    bandwidth_mbit: float  # per direction
    latency_ms: float = 0.0  # one way

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbit) and self.bandwidth_mbit > 0):
            raise ValueError(
                f"bandwidth_mbit: must be a finite number > 0, got {self.bandwidth_mbit}"
            )
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency_ms: must be a finite number >= 0, got {self.latency_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8


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
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> WanProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
