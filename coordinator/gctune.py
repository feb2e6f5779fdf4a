"""The collector tuned for a long-lived server process (the daemon, its read process):
what was built at start is frozen out of its way, and young objects are collected less
often; a collection long enough to stall the process is logged."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("fedra.coordinator")

# Young objects the collector lets pile up before it looks (Python's default is 700).
# Every call allocates hundreds of short-lived objects; at thousands of sites the default
# ran a collection every few calls, a tenth of the daemon's CPU (profiled at 1,000 sites).
_GC_YOUNG = 50_000


def quieter_gc() -> None:
    """Before the daemon serves: what it has built so far (torch, gRPC, the engine and the
    server) lives as long as the process, so no collection need walk it again
    (``gc.freeze``; the runs resumed after it are not frozen, so a run's state can still
    be collected when it ends), and collections come less often. Cycles are still found."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(_GC_YOUNG, older, oldest)
    gc.callbacks.append(_GcTimer().callback)


class _GcTimer:
    """Logs a collection long enough to stall the daemon (it holds the interpreter lock:
    nothing else runs meanwhile, and the event loop's watch reports it late too)."""

    def __init__(self) -> None:
        self.started = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        if took >= _GC_LOG_S:
            log.warning(
                "a garbage collection (generation %d) took %.2f s and freed %d objects",
                info.get("generation", -1), took, info.get("collected", 0),
            )  # fmt: skip


_GC_LOG_S = 0.5
