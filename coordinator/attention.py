"""When the coordinator was not listening, so that its own stalls are not blamed on sites.

A site is taken as gone when nothing of it was heard for ``site_timeout_s``. But a
coordinator can stop listening for a while: its event loop starved of CPU by a burst
of thousands of calls, a long collection pause, the process stopped (a debugger, a
suspended VM). Calls that arrived meanwhile wait in gRPC's queue, and their sites would
be declared silent for the coordinator's own delay. ``Attention`` measures those
stretches on the server's event loop (a tick every ``TICK_S`` that comes late means the
loop was not running) and ``stalled(since, now)`` says how much of a stretch of time
they cover; liveness counts only the rest (``Engine.is_online``).

A loop that runs can still be late to hear: gRPC's asyncio server takes a new call of a
method only every few passes of its loop, so under a burst the calls wait in gRPC's
queue, unseen, while the loop is busy with those it took. Each call of a site's says
the deadline it was given, and what is left of it when its handler starts tells how
long it waited there (``fedra.protos.wire.queued_s``). ``lag`` is the median of those
waits over the latest ``LAG_RECENT`` distinct sites heard (within ``LAG_WINDOW_S``): the
time by which the coordinator currently hears late, which liveness also allows. A
median over distinct sites is moved by no minority of them (a site can only claim to
have waited longer, never to be fresher), and the allowance is at most one liveness
timeout.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger("fedra.coordinator")

TICK_S = 0.1  # how often the loop is looked at
SLACK_S = 0.05  # lateness below this is ordinary scheduling, not a stall
LOG_S = 1.0  # stalls this long are logged, at most one warning per LOG_EVERY_S
LOG_EVERY_S = 10.0
KEEP = 4096  # stalls kept (the older half goes when full: a liveness timeout needs few)
LAG_WINDOW_S = 10.0  # the queue waits of the calls heard in this last stretch count
LAG_RECENT = 31  # of them, the latest distinct sites' (gRPC's queue is first in, first out)
LAG_MIN_SITES = 3  # fewer distinct sites than this in the window: no lag is taken
LAG_KEEP = 512  # distinct sites' latest waits kept (the oldest go first)
LAG_CACHE_S = 0.25  # the median is worked out at most this often


class Attention:
    """Stretches of wall time (``clock``'s) when the coordinator's loop did not run.

    ``tick`` is called from the loop (``watch``); ``stalled`` from any thread, for every
    site a listing or a round looks at: it costs O(log stalls kept)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        # The stalls kept, in order: where each began and ended, and the seconds of all
        # stalls up to its end (those let go included, from ``_base`` on).
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._upto: list[float] = []
        self._base = 0.0
        self._ticked_at: float | None = None  # wall time of the last tick, while watched
        self.stalled_s = 0.0  # in all, since the watch began
        self._logged_at = -math.inf  # monotonic: the last warning
        self._unlogged = 0.0, 0  # stalls of LOG_S or more since: longest, how many
        # Each site's latest call that said its deadline: when it reached its handler
        # (clock), and how long it had waited in gRPC's queue.
        self._waits: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lag = 0.0, -math.inf  # the lag worked out, and when (clock)
        self.lag_cap_s = math.inf  # the most lag allowed: the engine's liveness timeout
        self.lag_longest_s = 0.0  # the largest lag worked out since the watch began
        self._lag_logged_at = -math.inf  # monotonic

    def tick(self, late_s: float) -> None:
        """The loop ran a tick ``late_s`` seconds after it was due."""
        now = self.clock()
        lost = late_s - SLACK_S
        with self._lock:
            if lost > 0 and (not self._ends or now > self._ends[-1]):
                if len(self._ends) >= KEEP:  # let the older half go
                    half = KEEP // 2
                    self._base = self._upto[half - 1]
                    del self._starts[:half], self._ends[:half], self._upto[:half]
                # Not before the last tick, when the loop did run (nor the last stall's end).
                start = now - lost
                if self._ticked_at is not None:
                    start = max(start, self._ticked_at)
                self._starts.append(max(start, self._ends[-1]) if self._ends else start)
                self._ends.append(now)
                self._upto.append((self._upto[-1] if self._upto else self._base) + lost)
                self.stalled_s += lost
            self._ticked_at = now
        if late_s >= LOG_S:
            self._log(late_s)

    def _log(self, late_s: float) -> None:
        longest, count = self._unlogged
        longest, count = max(longest, late_s), count + 1
        if time.monotonic() - self._logged_at < LOG_EVERY_S:
            self._unlogged = longest, count
            return
        self._logged_at, self._unlogged = time.monotonic(), (0.0, 0)
        log.warning(
            "the coordinator's event loop ran %.1f s late%s (overloaded, paused, or short "
            "of CPU): that time does not count against the sites' liveness",
            longest, f" ({count} times since the last such warning)" if count > 1 else "",
        )  # fmt: skip

    def queued(self, site_id: str, waited_s: float) -> None:
        """A call of ``site_id``'s reached its handler after ``waited_s`` in gRPC's queue."""
        now = self.clock()
        with self._lock:
            self._waits[site_id] = now, waited_s
            self._waits.move_to_end(site_id)
            if len(self._waits) > LAG_KEEP:
                self._waits.popitem(last=False)

    def lag(self) -> float:
        """How late the coordinator hears its sites now: the median wait in gRPC's queue
        of the calls of the latest ``LAG_RECENT`` distinct sites heard within
        ``LAG_WINDOW_S`` (0 with fewer than ``LAG_MIN_SITES`` of them), at most
        ``lag_cap_s``."""
        now = self.clock()
        with self._lock:
            lag, at = self._lag
            if 0.0 <= now - at < LAG_CACHE_S:
                return lag
            while self._waits:  # the oldest first: those out of the window go
                _, (heard, _) = next(iter(self._waits.items()))
                if now - heard <= LAG_WINDOW_S:
                    break
                self._waits.popitem(last=False)
            # The latest: calls leave gRPC's queue in the order they came, so those just
            # taken say how long a call waits now (a queue that grows under a burst makes
            # the older ones say too little).
            latest = list(itertools.islice(reversed(self._waits.values()), LAG_RECENT))
            waits = sorted(w for _, w in latest)
            lag = 0.0
            if len(waits) >= LAG_MIN_SITES:
                lag = statistics.median(waits)
            lag = min(lag, self.lag_cap_s)
            self._lag = lag, now
            self.lag_longest_s = max(self.lag_longest_s, lag)
        if lag >= LOG_S and time.monotonic() - self._lag_logged_at >= LOG_EVERY_S:
            self._lag_logged_at = time.monotonic()
            log.warning(
                "the coordinator hears its sites %.1f s late (their calls wait that long in "
                "gRPC's queue before it takes them): that time does not count against "
                "their liveness", lag,
            )  # fmt: skip
        return lag

    def stop(self) -> None:
        with self._lock:
            self._ticked_at = None

    def stalled(self, since: float, now: float) -> float:
        """Seconds of [since, now] the loop was not running, the stall under way included."""
        with self._lock:
            total = self._until(now) - self._until(since)
            if self._ticked_at is not None:  # the next tick was due then: late since
                late_from = max(self._ticked_at + TICK_S + SLACK_S, since)
                total += max(0.0, now - late_from)
            return max(0.0, total)

    def _until(self, t: float) -> float:
        """Seconds of the stalls kept up to ``t`` (those let go count as before it)."""
        i = bisect.bisect_right(self._ends, t)
        total = self._upto[i - 1] if i else self._base
        if i < len(self._ends) and self._starts[i] < t:  # within stall i
            total += t - self._starts[i]
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
