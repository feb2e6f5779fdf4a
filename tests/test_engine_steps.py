"""The engine's step thread: short steps that found the engine's lock taken run in turns
of it, and their outcomes reach their callers' loop (``coordinator.steps``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from fedra.coordinator.steps import MAX_TURN, LockedSteps
from fedra.coordinator.wakeups import LoopInbox


class _Lock:
    """A lock like the engine's (``Engine.locked``), counting the turns taken of it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.turns = 0

    def locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            self.turns += 1
            return fn(*args)


class _Blocker:
    """A step that holds the runner's thread until released: what is put meanwhile
    queues, and runs in the next turn, together."""

    def __init__(self) -> None:
        self.began, self.release = threading.Event(), threading.Event()

    def __call__(self) -> str:
        self.began.set()
        self.release.wait(10)
        return "done"


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_steps_queued_behind_the_lock_run_in_one_turn_in_order() -> None:
    lock, ran = _Lock(), []
    steps = LockedSteps(lock.locked)

    def step(i: int) -> int:
        assert lock.lock._is_owned()  # type: ignore[attr-defined]  # run holding the lock
        ran.append(i)
        return i * i

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        futures = [loop.create_future() for _ in range(10)]
        with lock.lock:  # taken: every step queues behind it
            for i, future in enumerate(futures):
                steps.put(step, (i,), future, inbox)
            await asyncio.to_thread(_wait_until, lambda: steps.pending == 10, "not queued")
            assert not ran
        return list(await asyncio.gather(*futures))

    try:
        assert asyncio.run(main()) == [i * i for i in range(10)]
        assert ran == list(range(10))
        _wait_until(lambda: steps.pending == 0, "the runner never counted its turns")
        # The first step may have been taken alone before the rest were queued.
        assert steps.steps == 10 and steps.turns <= 2
    finally:
        steps.close()


def test_a_failing_step_fails_its_own_caller_only() -> None:
    lock = _Lock()
    steps = LockedSteps(lock.locked)
    blocker = _Blocker()

    def fails() -> None:
        raise ValueError("this step's own refusal")

    async def main() -> tuple[BaseException | None, str]:
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        first, bad, good = loop.create_future(), loop.create_future(), loop.create_future()
        steps.put(blocker, (), first, inbox)
        await asyncio.to_thread(blocker.began.wait, 10)
        steps.put(fails, (), bad, inbox)
        steps.put(lambda: "after it", (), good, inbox)
        blocker.release.set()  # the two run in one turn now
        await first
        try:
            await bad
            refused = None
        except ValueError as exc:
            refused = exc
        return refused, await good

    try:
        refused, after = asyncio.run(main())
        assert isinstance(refused, ValueError) and "own refusal" in str(refused)
        assert after == "after it"
        _wait_until(lambda: steps.pending == 0, "the runner never counted its turns")
        assert steps.turns == 2 and steps.steps == 3  # the failure did not end its turn
    finally:
        steps.close()


def test_turns_are_bounded() -> None:
    lock = _Lock()
    steps = LockedSteps(lock.locked)
    n = MAX_TURN * 2 + 5

    async def main() -> None:
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        futures = [loop.create_future() for _ in range(n)]
        with lock.lock:
            for future in futures:
                steps.put(lambda: None, (), future, inbox)
        await asyncio.gather(*futures)

    try:
        asyncio.run(main())
        _wait_until(lambda: steps.pending == 0, "the runner never counted its turns")
        assert steps.steps == n and steps.turns >= 3  # none longer than MAX_TURN
    finally:
        steps.close()


def test_closing_cancels_what_is_queued_and_refuses_more() -> None:
    lock = _Lock()
    steps = LockedSteps(lock.locked)
    busy = _Blocker()

    async def main() -> tuple[str, bool]:
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        first, queued = loop.create_future(), loop.create_future()
        steps.put(busy, (), first, inbox)
        await asyncio.to_thread(busy.began.wait, 10)  # under way: it runs to its end
        steps.put(lambda: "never begun", (), queued, inbox)
        steps.close()
        busy.release.set()
        with pytest.raises(RuntimeError):
            steps.put(lambda: None, ())
        try:
            await asyncio.wait_for(queued, 5)
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        return await asyncio.wait_for(first, 5), cancelled

    assert asyncio.run(main()) == ("done", True)
    _wait_until(lambda: steps.pending == 0, "the runner never counted the step under way")


def test_a_step_nobody_waits_for_is_logged_when_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock = _Lock()
    steps = LockedSteps(lock.locked)
    done = threading.Event()

    def fails() -> None:
        raise ValueError("a clean-up that failed")

    try:
        with caplog.at_level(logging.ERROR, logger="fedra.coordinator"):
            steps.put(fails, ())
            steps.put(done.set, ())
            assert done.wait(10)
            _wait_until(lambda: steps.pending == 0, "the steps never ran")
        failed = [r for r in caplog.records if "engine step failed" in r.getMessage()]
        assert failed and "fails" in failed[0].getMessage()
    finally:
        steps.close()


def test_quick_runs_a_step_the_loop_finds_locked_on_the_step_thread(
    coordinator: Any,
) -> None:
    """The front door's ``quick`` with the engine's real lock taken: the step waits on
    the step thread, not on the loop, and its outcome comes back."""
    api, engine = coordinator.server.api, coordinator.engine
    threads: list[str] = []

    def step(x: int) -> int:
        threads.append(threading.current_thread().name)
        return x + 1

    taken, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread's turn of the lock (the lock is reentrant)
        with engine._lock:
            taken.set()
            release.wait(10)

    async def main() -> int:
        await asyncio.to_thread(taken.wait, 10)
        call = asyncio.ensure_future(api.quick(step, 41))
        await asyncio.sleep(0.05)  # the loop goes on meanwhile
        assert not call.done() and not threads
        release.set()
        return await asyncio.wait_for(call, 10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert asyncio.run(main()) == 42
    finally:
        release.set()
        holder.join()
    assert threads == ["engine-steps"]


def test_an_outcome_a_future_refuses_leaves_no_other_caller_waiting() -> None:
    lock = _Lock()
    steps = LockedSteps(lock.locked)
    blocker = _Blocker()

    def stops() -> None:
        raise StopIteration  # an asyncio future refuses to take it

    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        first, odd, good = loop.create_future(), loop.create_future(), loop.create_future()
        steps.put(blocker, (), first, inbox)
        await asyncio.to_thread(blocker.began.wait, 10)
        steps.put(stops, (), odd, inbox)
        steps.put(lambda: "settled", (), good, inbox)  # in the same turn, after it
        blocker.release.set()
        try:
            await asyncio.wait_for(odd, 5)
            said = ""
        except RuntimeError as exc:
            said = str(exc)
        return said, await asyncio.wait_for(good, 5)

    try:
        said, after = asyncio.run(main())
        assert "outcome was refused" in said and after == "settled"
    finally:
        steps.close()
