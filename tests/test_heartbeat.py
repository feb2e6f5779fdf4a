"""The beat clock: one thread sends the heartbeats of every task of a process, each on
its own cadence (``fedra.client.heartbeat``). The cadence rules of a single task (first
beat drawn, held beats, slow answers, transfers) are tested in test_small_models."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from fedra.client import heartbeat as heartbeat_mod
from fedra.client.heartbeat import BeatClock, Heartbeat
from fedra.protos.v1 import site_pb2


class _Site:
    """A connection whose heartbeats are timed and answered at once (or fail to send)."""

    def __init__(self, fail: bool = False) -> None:
        self.times: list[float] = []
        self.fail = fail
        self.sent = threading.Event()

    def moved_within(self, seconds: float) -> bool:
        return False

    def heartbeat_future(self, task_id: str, timeout_s: float = 10.0, hold_s: float = 0.0) -> Any:
        if self.fail:
            raise RuntimeError("the channel broke in an unforeseen way")
        self.times.append(time.monotonic())
        self.sent.set()
        answer: Future[Any] = Future()
        answer.set_result(site_pb2.HeartbeatResponse(task_current=True))
        return answer

    def until(self, beats: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.times) < beats and time.monotonic() < deadline:
            time.sleep(0.01)


def test_one_thread_beats_for_many_tasks_each_on_its_own_cadence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 tasks on one clock: one thread more in the process, not 200, and each task's
    beats an interval apart."""
    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.02)
    clock = BeatClock(name="test-beats")
    sites = [_Site() for _ in range(200)]
    hearts = [Heartbeat(s, f"t{i}", 0.2, clock=clock) for i, s in enumerate(sites)]
    before = threading.active_count()
    started = time.monotonic()
    try:
        for heart in hearts:
            heart.start()
        for site in sites:
            site.until(3)
        assert threading.active_count() <= before + 1
        assert [t.name for t in threading.enumerate()].count("test-beats") == 1
    finally:
        for heart in hearts:
            heart.stop()
    for site in sites:
        assert len(site.times) >= 3
        # Beat k is due 0.02 + 0.2 k s after its task began, sent then or (a busy
        # machine) later: never earlier, so never in a burst.
        assert all(t - started >= 0.02 + 0.2 * k - 0.005 for k, t in enumerate(site.times))


def test_a_task_that_ends_sends_no_more_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.01)
    clock = BeatClock()
    site, other = _Site(), _Site()
    with Heartbeat(other, "other", 0.05, clock=clock):
        with Heartbeat(site, "t", 0.05, clock=clock):
            site.until(2)
        sent = len(site.times)
        other.until(len(other.times) + 4)  # four intervals of the clock's beats later
    assert len(site.times) == sent


def test_a_task_that_ends_before_its_first_beat_sends_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = BeatClock()
    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: interval_s / 2)
    short, long = _Site(), _Site()
    ended = Heartbeat(short, "short", 0.4, clock=clock)
    ended.start()
    ended.stop()  # before its first beat (0.2 s)
    assert ended.ended.is_set()
    with Heartbeat(long, "long", 0.2, clock=clock):
        long.until(3)  # 0.1 s, 0.3 s, 0.5 s: past the ended task's first beat's time
    assert len(long.times) >= 3
    assert short.times == []


def test_a_beat_that_fails_to_send_ends_only_its_own_task_s_beats(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.02)
    clock = BeatClock()
    broken, fine = _Site(fail=True), _Site()
    bad = Heartbeat(broken, "broken", 0.05, clock=clock)
    with caplog.at_level(logging.ERROR, logger="fedra.site"), bad:
        assert bad.ended.wait(10)
        with Heartbeat(fine, "fine", 0.05, clock=clock):
            fine.until(3)
    assert len(fine.times) >= 3
    assert "a heartbeat of task broken could not be sent" in caplog.text


def test_a_withdrawn_task_is_told_and_its_beats_go_on_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer that says the task no longer counts sets ``withdrawn``; the agent
    decides what to do, and the beats go on meanwhile."""
    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.02)

    class _Withdrawn(_Site):
        def heartbeat_future(
            self, task_id: str, timeout_s: float = 10.0, hold_s: float = 0.0
        ) -> Any:
            super().heartbeat_future(task_id, timeout_s, hold_s)
            answer: Future[Any] = Future()
            answer.set_result(site_pb2.HeartbeatResponse(task_current=False))
            return answer

    site = _Withdrawn()
    with Heartbeat(site, "t", 0.05, clock=BeatClock()) as heart:
        assert heart.withdrawn.wait(10)
        site.until(2)
    assert len(site.times) >= 2
