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
    time_collections()


def time_collections() -> None:
    """Time every collection from now on (once a process): ``collections`` has the
    totals, and one long enough to stall the process is logged."""
    if not any(isinstance(getattr(cb, "__self__", None), _GcTimer) for cb in gc.callbacks):
        gc.callbacks.append(_GcTimer().callback)


def collections() -> dict[int, tuple[int, float]]:
    """By generation, the collections timed so far and their CPU seconds in all (the
    daemon's metrics ``fedra_gc_collections_total``, ``fedra_gc_seconds_total``)."""
    return {g: (n, s) for g, (n, s) in enumerate(_TOTALS)}


class _GcTimer:
    """Logs a collection long enough to stall the daemon (it holds the interpreter lock:
    nothing else runs meanwhile, and the event loop's watch reports it late too)."""

    def __init__(self) -> None:
        self.started = self.cpu_started = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started, self.cpu_started = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - self.started
        generation = info.get("generation", -1)
        if 0 <= generation < len(_TOTALS):  # the collector holds the interpreter's lock
            # CPU seconds: it runs on the thread that set it off, and a busy machine may
            # take that thread off its core meanwhile (wall time, logged below).
            count, seconds = _TOTALS[generation]
            _TOTALS[generation] = count + 1, seconds + time.thread_time() - self.cpu_started
        if took >= _GC_LOG_S:
            log.warning(
                "a garbage collection (generation %d) took %.2f s and freed %d objects",
                info.get("generation", -1), took, info.get("collected", 0),
            )  # fmt: skip


_GC_LOG_S = 0.5
# Collections timed and their seconds, by generation (0, 1, 2).
_TOTALS: list[tuple[int, float]] = [(0, 0.0), (0, 0.0), (0, 0.0)]
