"""A task's heartbeats, sent by one clock thread for every task of the process.

While a site works on a task it beats: it tells the coordinator it is alive and hears
whether the task still counts. A thread of its own per task would sleep between beats
and wait for each answer; with many sites in one process (an engineer's test bed, the
scale bench's workers of hundreds of sites) that is hundreds of threads started, woken
and joined a round, each hand-over of the interpreter lock a context switch. Here one
daemon thread (``BeatClock``) keeps every beat due in a heap, sends each when it is due
(a call whose answer comes as a future), and the answer's callback schedules the next:
nothing waits on a thread meanwhile.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import random
import threading
import time
from concurrent.futures import CancelledError
from typing import Protocol

import grpc

log = logging.getLogger("fedra.site")

FIRST_BEAT = (0.5, 1.0)  # where in its interval a task's first heartbeat falls, drawn
# Its own generator: a task that seeds ``random`` for its training keeps what it drew.
_BEATS = random.Random()
BEAT_TIMEOUT_MIN_S = 2.0  # a heartbeat call waits at least this long for its answer


def first_beat_s(interval_s: float, rng: random.Random | None = None) -> float:
    """When a task's first heartbeat is due: at a point drawn in the second half of the
    interval, the next ones an interval apart. A round's sites get their tasks at one
    instant; beating at the interval's end, they would all beat at one instant every
    interval (thousands of calls at once at the coordinator, every 5 s). Never later than
    the interval, so the coordinator hears a site as often as before; a task shorter than
    half an interval still sends none."""
    low, high = FIRST_BEAT
    return interval_s * (rng or _BEATS).uniform(low, high)


def beat_timeout_s(interval_s: float) -> float:
    """How long a heartbeat call waits for its answer beyond its hold: two intervals. A
    beat that waits in a busy coordinator's queue still counts when its handler starts,
    so it is not given up after one interval (a coordinator whose queue held every call
    longer would hear no beat at all) (``Heartbeat``)."""
    return max(2 * interval_s, BEAT_TIMEOUT_MIN_S)


class Beating(Protocol):
    """What a heartbeat needs of its site's connection (``client.connection.Connection``)."""

    def moved_within(self, seconds: float) -> bool: ...

    def heartbeat_future(
        self, task_id: str, timeout_s: float = ..., hold_s: float = ...
    ) -> grpc.Future: ...  # type: ignore[type-arg]


class Heartbeat:
    """Beats while a task runs; notices when the coordinator withdraws the task.

    Each beat asks the coordinator to hold it open up to ``hold_s`` while the task counts
    (the site is online while it is held, so one call stands for many beats), and it
    answers at once when the task stops counting. A coordinator that does not hold calls
    answers each at once, and the beats go an interval apart. Either way each is due an
    interval after the one before was due, not after its answer came (a beat whose time
    passed while the one before was open goes as soon as that one is answered), and one
    is in flight at a time: a coordinator behind on its calls is not sent more of them.
    Each waits two intervals beyond its hold for its answer (``beat_timeout_s``). No beat
    is sent while a transfer of the site's moves bytes (``moved_within``): the coordinator
    hears the site through it.

    ``withdrawn`` is set when an answer says the task no longer counts; ``ended`` once
    no beat of this task will be sent any more (its task ended, or its site closed its
    channel). A beat still open when the task ends is cancelled: ending a task never
    waits for one."""

    def __init__(
        self,
        conn: Beating,
        task_id: str,
        interval_s: float,
        hold_s: float = 0.0,
        clock: BeatClock | None = None,
    ) -> None:
        self.conn, self.task_id, self.interval_s = conn, task_id, interval_s
        self.hold_s = max(0.0, hold_s)
        self.timeout_s = self.hold_s + beat_timeout_s(interval_s)
        self.withdrawn = threading.Event()
        self.ended = threading.Event()
        self._clock = clock
        self._lock = threading.Lock()
        self._done = False
        self._open: grpc.Future | None = None  # type: ignore[type-arg]
        self.due = 0.0  # when the next beat is due (the clock's heap orders by it)

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.due = time.monotonic() + first_beat_s(self.interval_s)
        (self._clock or shared_clock()).schedule(self)

    def stop(self) -> None:
        """The task ended: no beat is sent after this, and one open is cancelled."""
        with self._lock:
            self._done, beat = True, self._open
        if beat is not None:
            beat.cancel()
        self.ended.set()

    def beat(self, clock: BeatClock, now: float) -> None:
        """Due now (on the clock's thread): send a beat, or, while a transfer moves the
        site's bytes, skip it and come back an interval later."""
        with self._lock:
            if self._done:
                return
            if self.conn.moved_within(self.interval_s):  # heard through it
                self.due = max(self.due + self.interval_s, now)
                clock.schedule(self)
                return
            try:
                beat = self.conn.heartbeat_future(self.task_id, self.timeout_s, self.hold_s)
            except ValueError:  # the site is stopping: it closed its channel under us
                self._done = True
                self.ended.set()
                return
            self._open = beat
        beat.add_done_callback(lambda done: self._answered(clock, done))

    def _answered(self, clock: BeatClock, beat: grpc.Future) -> None:  # type: ignore[type-arg]
        """A beat's answer came (gRPC's thread, or the one that cancelled it): note what
        it says, and schedule the next, due an interval after this one was due or now if
        that has passed (the beats missed meanwhile are not sent in a burst)."""
        try:
            if not beat.result().task_current:
                self.withdrawn.set()
        except grpc.RpcError:
            pass  # the coordinator may be restarting; the upload path retries
        except (grpc.FutureCancelledError, CancelledError, ValueError):  # the task ended,
            pass  # or the site stopped
        except Exception:  # never the end of this task's beats
            log.exception("a heartbeat of task %s: its answer could not be read", self.task_id)
        with self._lock:
            self._open = None
            if self._done:
                return
            self.due = max(self.due + self.interval_s, time.monotonic())
        clock.schedule(self)


class BeatClock:
    """One thread that sends every due beat of the process's tasks (``Heartbeat``)."""

    def __init__(self, name: str = "heartbeats") -> None:
        self._due: list[tuple[float, int, Heartbeat]] = []
        self._order = itertools.count()  # ties in ``due`` go first come, first served
        self._changed = threading.Condition()
        self._name = name
        self._thread: threading.Thread | None = None

    def after_fork(self) -> None:
        """In a child process (forked): none of the parent's beats, nor its thread."""
        self._due, self._thread = [], None
        self._changed = threading.Condition()

    def schedule(self, heart: Heartbeat) -> None:
        """Send ``heart``'s beat at ``heart.due`` (any thread)."""
        with self._changed:
            heapq.heappush(self._due, (heart.due, next(self._order), heart))
            if self._thread is None:
                self._start()
            if self._due[0][2] is heart:  # earlier than what the thread sleeps for
                self._changed.notify()

    def _start(self) -> None:  # under ``_changed``
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # it serves as long as the process; ended anyway, its beats go on
            with self._changed:
                self._thread = None
                if self._due:
                    with contextlib.suppress(RuntimeError):  # the interpreter is ending
                        self._start()

    def _serve(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                while not self._due or self._due[0][0] > now:
                    self._changed.wait(self._due[0][0] - now if self._due else None)
                    now = time.monotonic()
                ready = []
                while self._due and self._due[0][0] <= now:
                    ready.append(heapq.heappop(self._due)[2])
            for heart in ready:  # not under the heap's lock: a beat may schedule again
                try:
                    heart.beat(self, now)
                except Exception:  # one task's failure stops its beats, not the others'
                    log.exception("a heartbeat of task %s could not be sent", heart.task_id)
                    with contextlib.suppress(Exception):
                        heart.stop()


_SHARED = BeatClock()  # its thread starts with the first beat scheduled
os.register_at_fork(after_in_child=_SHARED.after_fork)


def shared_clock() -> BeatClock:
    """The process's clock."""
    return _SHARED
