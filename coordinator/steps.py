"""Short engine steps that found the engine's lock taken: run by one thread, a queue of
them in one turn of the lock.

The front door runs a short step (``CoordinatorAPI.quick``: a look, a poll's start or
end, an update's accept) on the event loop when the engine's lock is free that instant,
and hands it off when it is not: the loop never waits for the lock. Handed to the
executor one by one, at thousands of sites a round each hand-off cost a future, a
thread woken, a turn of the lock fought for among the executor's threads (the more of
them held it, the more steps found it taken), and a future's callbacks back: measured
at 5,000 sites, a quarter of the loop's steps went that way. Here they queue for one
thread that takes the lock once for all that are queued and hands their outcomes back
to each loop in one go (``LoopInbox``).

A step that raises fails its own caller only; the ones queued with it run all the same.
Each runs to its end once begun, as in the executor: a caller cancelled meanwhile is
told once it has (``CoordinatorAPI.call``'s promise). Steps queued when the runner is
closed are cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from fedra.coordinator.wakeups import LoopInbox

log = logging.getLogger("fedra.coordinator")
MAX_TURN = 64  # steps run in one turn of the engine's lock, at most


class _Step:
    __slots__ = ("args", "fn", "future", "inbox")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...],
        future: asyncio.Future[Any] | None, inbox: LoopInbox | None,
    ) -> None:  # fmt: skip
        self.fn, self.args, self.future, self.inbox = fn, args, future, inbox


class LockedSteps:
    """One thread running queued steps, ``MAX_TURN`` at a time, each turn inside
    ``locked`` (the engine's ``locked``: the steps run holding its lock, as on the loop)."""

    def __init__(self, locked: Callable[..., Any], name: str = "engine-steps") -> None:
        self._locked = locked
        self._cond = threading.Condition()
        self._queue: deque[_Step] = deque()
        self._closed = False
        self.turns = 0  # turns of the lock taken
        self.steps = 0  # steps run in them
        self.pending = 0  # steps put and not yet run and handed back (or cancelled)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def put(
        self, fn: Callable[..., Any], args: tuple[Any, ...],
        future: asyncio.Future[Any] | None = None, inbox: LoopInbox | None = None,
    ) -> None:  # fmt: skip
        """Run ``fn(*args)`` in the next turn; its outcome goes into ``future`` (on its
        loop, through ``inbox``), or with none is not waited for (a failure is logged).
        RuntimeError once closed: it will not run."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine's steps are closed")
            self._queue.append(_Step(fn, args, future, inbox))
            self.pending += 1
            if len(self._queue) == 1:
                self._cond.notify()

    def close(self) -> None:
        """Stop taking steps; the ones queued are cancelled (not run)."""
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self.pending -= len(left)
            self._cond.notify()
        for step in left:
            if step.inbox is not None and step.future is not None:
                with suppress(RuntimeError):  # its loop closed: nobody waits any more
                    step.inbox.put(functools.partial(_cancel, step.future))

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                turn = [self._queue.popleft() for _ in range(min(MAX_TURN, len(self._queue)))]
            try:
                outcomes = self._locked(_run_all, turn)
            except BaseException as exc:  # the lock's own failure: every step is told
                outcomes = [(False, exc)] * len(turn)
            _hand_back(turn, outcomes)
            with self._cond:
                self.turns += 1
                self.steps += len(turn)
                self.pending -= len(turn)


def _run_all(turn: list[_Step]) -> list[tuple[bool, Any]]:
    """Each step of ``turn`` (the engine's lock held): (True, result) or (False, error)."""
    outcomes: list[tuple[bool, Any]] = []
    for step in turn:
        try:
            outcomes.append((True, step.fn(*step.args)))
        except BaseException as exc:
            outcomes.append((False, exc))
    return outcomes


def _hand_back(turn: list[_Step], outcomes: list[tuple[bool, Any]]) -> None:
    """The outcomes, into their futures: one hand-over a loop for all of its steps."""
    by_inbox: dict[int, tuple[LoopInbox, list[tuple[asyncio.Future[Any], bool, Any]]]] = {}
    for step, (ok, value) in zip(turn, outcomes, strict=True):
        if step.inbox is None or step.future is None:  # nobody waits for it
            if not ok:
                log.error("an engine step failed: %s", getattr(step.fn, "__name__", step.fn),
                          exc_info=value)  # fmt: skip
            continue
        entry = by_inbox.setdefault(id(step.inbox), (step.inbox, []))
        entry[1].append((step.future, ok, value))
    for inbox, settled in by_inbox.values():
        with suppress(RuntimeError):  # the loop closed: nobody waits any more
            inbox.put(functools.partial(_settle_all, settled))


def _settle_all(settled: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    """On the futures' loop; each on its own: one that cannot take its outcome (an
    asyncio future refuses a StopIteration) leaves none of the others waiting."""
    for future, ok, value in settled:
        if future.done():
            continue
        try:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        except Exception as exc:
            future.set_exception(RuntimeError(f"an engine step's outcome was refused: {exc}"))


def _cancel(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.cancel()
