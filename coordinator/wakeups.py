"""Waiting without a thread: calls that wait park an asyncio future under a key.

A long poll waits under its site's key, a secure-aggregation stage call or a run watch
under its run's key. The engine (any thread) wakes a key when what its waiters wait
for may have changed: a round opened with the site in it, a stage closed, the run
changed. Nobody else is woken, and nothing wakes periodically: a waiting call costs a
future and the coroutine that awaits it, not a thread.

A waiter takes its ``Ticket`` *before* it looks at the state it waits on, so a wake
between the look and the wait is never lost: the ticket is already set when awaited.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from contextlib import suppress

log = logging.getLogger("fedra.coordinator")


def site_key(site_id: str) -> tuple[str, str]:
    return ("site", site_id)


def run_key(run_id: str) -> tuple[str, str]:
    """Any change of the run (a watch waits on it)."""
    return ("run", run_id)


def stage_key(run_id: str) -> tuple[str, str]:
    """A change of the run's open attempt or its secure-aggregation stage."""
    return ("stage", run_id)


def opened_key(run_id: str) -> tuple[str, str]:
    """An attempt of the run opened, or the run ended (an upload held as its site's next
    poll waits on it: not on the round's close before)."""
    return ("opened", run_id)


class Ticket:
    """One waiter's claim on a key: set by a wake from any thread, awaited on its loop."""

    __slots__ = ("_board", "_future", "_keys")

    def __init__(self, board: Wakeups, keys: tuple[Hashable, ...]) -> None:
        # True once woken; False once its wait timed out (whichever comes first).
        self._future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._keys, self._board = keys, board

    async def wait(self, timeout_s: float) -> bool:
        """Wait until woken (True) or ``timeout_s`` passes (False); the ticket is spent.

        One timer and the future itself, not ``asyncio.wait_for`` around a shield (two
        more futures, a task's worth of callbacks and, on a timeout, another pass of the
        loop): thousands of polls wait like this at once."""
        future = self._future
        try:
            if timeout_s <= 0 or future.done():
                return future.done() and future.result()
            timer = future.get_loop().call_later(timeout_s, _time_up, future)
            try:
                return await future
            finally:
                timer.cancel()
        finally:
            self._board.discard(self)

    def discard(self) -> None:
        """Not waited for after all."""
        self._board.discard(self)

    def _set(self) -> None:  # on the ticket's loop
        if not self._future.done():
            self._future.set_result(True)

    def wake(self) -> None:  # from any thread
        loop = self._future.get_loop()
        if loop.is_closed():
            return
        with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(self._set)


def _time_up(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


WAKE_SLICE = 64  # tickets set in one pass of their loop


def _set_slices(loop: asyncio.AbstractEventLoop, tickets: list[Ticket], start: int) -> None:
    """On ``loop``: set ``tickets[start:]``, a slice a pass."""
    for ticket in tickets[start : start + WAKE_SLICE]:
        ticket._set()
    if start + WAKE_SLICE < len(tickets):
        loop.call_soon(_set_slices, loop, tickets, start + WAKE_SLICE)


class Wakeups:
    """The waiting calls, by key. Safe to wake from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, set[Ticket]] = {}
        self._closed = False

    def ticket(self, *keys: Hashable) -> Ticket:
        """A ticket woken by a wake of any of ``keys`` (call on the waiter's loop)."""
        ticket = Ticket(self, keys)
        with self._lock:
            closed = self._closed
            if not closed:
                for key in keys:
                    self._waiting.setdefault(key, set()).add(ticket)
        if closed:  # stopping: nothing waits
            ticket._set()
        return ticket

    def discard(self, ticket: Ticket) -> None:
        with self._lock:
            for key in ticket._keys:
                waiters = self._waiting.get(key)
                if waiters is not None:
                    waiters.discard(ticket)
                    if not waiters:
                        del self._waiting[key]

    def wake(self, keys: Iterable[Hashable]) -> int:
        """Wake every ticket of ``keys``; returns how many were woken.

        The tickets of one loop are set by one callback on it, ``WAKE_SLICE`` at a time,
        each slice a pass of the loop after the last: a round opening for thousands of
        sites wakes their polls with one hand-over to the loop instead of thousands, and
        the calls that arrive meanwhile (an operator's status) are served between the
        slices instead of after every one of those polls."""
        with self._lock:
            woken = {t for key in keys for t in self._waiting.pop(key, ())}
        by_loop: dict[asyncio.AbstractEventLoop, list[Ticket]] = {}
        for ticket in woken:
            by_loop.setdefault(ticket._future.get_loop(), []).append(ticket)
        for loop, tickets in by_loop.items():
            if loop.is_closed():
                continue
            with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                loop.call_soon_threadsafe(_set_slices, loop, tickets, 0)
        return len(woken)

    def close(self) -> None:
        """Wake everyone, now and from now on (the daemon is stopping)."""
        with self._lock:
            self._closed = True
            woken = {t for waiters in self._waiting.values() for t in waiters}
            self._waiting.clear()
        for ticket in woken:
            ticket.wake()

    def waiting(self) -> int:
        """Tickets parked now (a ticket under several keys counts once)."""
        with self._lock:
            return len({t for waiters in self._waiting.values() for t in waiters})


INBOX_SLICE = 32  # steps a LoopInbox runs in one pass of its loop


class LoopInbox:
    """Short steps handed to one event loop from any thread: one hand-over for as many as
    are queued, and at most ``INBOX_SLICE`` of them a pass of the loop.

    A group commit of hundreds of accepted updates completes them all at once. Handed
    over one by one (``call_soon_threadsafe`` each) they cost a write to the loop's
    self-pipe each, and the next pass of the loop ran all of them and then all their
    calls' replies: passes of a quarter to half a second at 1,000 sites, which every
    call waiting on the loop (an operator's status) waited out several times. Here the
    calls that arrive meanwhile are served between the slices.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._steps: deque[Callable[[], object]] = deque()
        self._scheduled = False

    def put(self, step: Callable[[], object]) -> None:
        """Run ``step()`` on the loop soon (in the order put). RuntimeError if the loop
        is closed: the step will not run."""
        with self._lock:
            if self.loop.is_closed():  # also when a drain was due: it will never run
                raise RuntimeError("the event loop is closed")
            self._steps.append(step)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile: this step will not run (nor will any)
            with self._lock:
                self._scheduled = False
                with suppress(ValueError):
                    self._steps.remove(step)
            raise

    def _drain(self) -> None:  # on the loop
        for _ in range(INBOX_SLICE):
            with self._lock:
                if not self._steps:
                    self._scheduled = False
                    return
                step = self._steps.popleft()
            try:
                step()
            except Exception:  # a step's own failure: the steps after it still run
                log.exception("a step handed to the event loop failed")
            except BaseException:  # the loop is being interrupted: the rest run after
                self.loop.call_soon(self._drain)
                raise
        self.loop.call_soon(self._drain)
