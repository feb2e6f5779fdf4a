"""When the coordinator was not listening, so that its own stalls are not blamed on sites.

A site is taken as gone when nothing of it was heard for ``site_timeout_s``. But a
coordinator can stop listening for a while: its event loop starved of CPU by a burst
of thousands of calls, a long collection pause, the process stopped (a debugger, a
suspended VM). Calls that arrived meanwhile wait in gRPC's queue, and their sites would
be declared silent for the coordinator's own delay. ``Attention`` measures those
stretches on the server's event loop (a tick every ``TICK_S`` that comes late means the
loop was not running) and ``stalled(since, now)`` says how much of a stretch of time
they cover; liveness counts only the rest (``Engine.is_online``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("fedra.coordinator")

TICK_S = 0.1  # how often the loop is looked at
SLACK_S = 0.05  # lateness below this is ordinary scheduling, not a stall
LOG_S = 1.0  # stalls this long are logged
KEEP = 4096  # stall intervals kept (the oldest go first; a liveness timeout needs few)


class Attention:
    """Stretches of wall time (``clock``'s) when the coordinator's loop did not run.

    ``tick`` is called from the loop (``watch``); ``stalled`` from any thread."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._stalls: deque[tuple[float, float]] = deque(maxlen=KEEP)  # (from, to), in order
        self._ticked_at: float | None = None  # wall time of the last tick, while watched
        self.stalled_s = 0.0  # in all, since the watch began

    def tick(self, late_s: float) -> None:
        """The loop ran a tick ``late_s`` seconds after it was due."""
        now = self.clock()
        lost = late_s - SLACK_S
        with self._lock:
            if lost > 0:
                self._stalls.append((now - lost, now))
                self.stalled_s += lost
            self._ticked_at = now
        if late_s >= LOG_S:
            log.warning(
                "the coordinator's event loop ran %.1f s late (overloaded, paused, or short "
                "of CPU): that time does not count against the sites' liveness",
                late_s,
            )

    def stop(self) -> None:
        with self._lock:
            self._ticked_at = None

    def stalled(self, since: float, now: float) -> float:
        """Seconds of [since, now] the loop was not running, the stall under way included."""

        def overlap(start: float, end: float) -> float:
            return max(0.0, min(end, now) - max(start, since))

        with self._lock:
            total = 0.0
            if self._ticked_at is not None:  # the next tick was due then: late since
                total += overlap(self._ticked_at + TICK_S + SLACK_S, now)
            for start, end in reversed(self._stalls):
                if end <= since:
                    break  # in order: the rest ended earlier still
                total += overlap(start, end)
            return total

    async def watch(self) -> None:
        """Tick on the running loop until cancelled."""
        try:
            while True:
                due = time.monotonic() + TICK_S
                await asyncio.sleep(TICK_S)
                self.tick(max(0.0, time.monotonic() - due))
        finally:
            self.stop()
