"""Small payloads. A small model goes out with its task in the poll's reply: one call a
site and round fewer. It is the model the download would stream, counted as that
download; a larger one is downloaded as before; a site trains on it without a download
call. A small update is kept in its participation row, durable with its accept, instead
of as a file (storage.spool)."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from sqlalchemy import text

from fedra.client import heartbeat as heartbeat_mod
from fedra.client.agent import SiteAgent
from fedra.client.config import SiteConfig
from fedra.client.connection import Assignment, Connection
from fedra.client.executor import LocalExecutor
from fedra.client.heartbeat import FIRST_BEAT, Heartbeat, first_beat_s
from fedra.coordinator.engine import EngineSettings
from fedra.examples.synthetic import task as synthetic_task
from fedra.protos.codec import CodecError, decode, encode
from fedra.protos.v1 import admin_pb2, site_pb2
from fedra.runspec import CodecSpec, TrainSpec
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    TASK,
    delta_payload,
    messages,
    model_state,
    round_status,
    serve_one_run,
    submit,
    tasks_of_round,
    upload,
    wait_round,
)
from tests.test_site_service import (
    start_round_one as _start_round_one,
)

SETTINGS = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)


def _coordinator(tmp_path: Path, **settings: int) -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(tmp_path / "state", replace(SETTINGS, **settings))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def inlining(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    yield from _coordinator(tmp_path)  # the default: models up to 64 KiB come along


def test_a_small_model_comes_with_its_task_and_counts_as_its_download(
    inlining: InProcessCoordinator,
) -> None:
    c = inlining
    run_id, tasks = _start_round_one(c)
    # Round 1's model is the initial one, which sites rebuild from the seed: not sent.
    for site, task in sorted(tasks.items()):
        again = c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=10)
        assert again.task.task_id == task.task_id and again.model == b""
        upload(c, messages(task, site, delta_payload()))
    wait_round(c, run_id, 1, "committed")
    tasks = tasks_of_round(c, run_id, 2)
    (s1, t1), (s2, t2) = sorted(tasks.items())
    # The reply that gave the task had the model: poll again (the same task) to look at it.
    again = c.site.PollTask(site_pb2.PollTaskRequest(site_id=s1), timeout=10)
    assert again.task.task_id == t1.task_id
    model = again.model
    assert len(model) == t1.model_bytes > 0
    assert hashlib.sha256(model).hexdigest() == t1.model_sha256
    streamed = b"".join(
        m.data
        for m in c.site.DownloadModel(
            site_pb2.DownloadModelRequest(site_id=s2, task_id=t2.task_id), timeout=10
        )
    )
    assert streamed == model  # the very bytes a download streams
    assert c.engine.downloads.flush(10)
    by_site = {p.site_id: p for p in round_status(c, run_id, 2).participations}
    assert by_site[s1].status == "downloaded"
    # Each reply that carried the model counts, as each download does: s1 got it twice,
    # s2 once with its task and once by its own download.
    assert by_site[s1].bytes_down == by_site[s2].bytes_down == 2 * len(model)
    for site, task in ((s1, t1), (s2, t2)):
        upload(c, messages(task, site, delta_payload()))
    assert wait_round(c, run_id, 2, "committed").updates == 2


def test_the_initial_model_task_has_nothing_to_send(inlining: InProcessCoordinator) -> None:
    c = inlining
    for s in ("site-a", "site-b"):
        c.site.Register(site_pb2.RegisterRequest(site_id=s, tasks=[TASK], version="test"))
    run_id = submit(c)
    wait_round(c, run_id, 0)
    replies = [
        c.site.PollTask(site_pb2.PollTaskRequest(site_id=s), timeout=10)
        for s in ("site-a", "site-b")
    ]
    [init] = [r for r in replies if r.HasField("task")]
    assert init.task.kind == site_pb2.TASK_KIND_INIT and init.model == b""


@pytest.mark.parametrize("limit", [0, 64])  # off; or below this model's bytes
def test_a_model_above_the_limit_is_downloaded(tmp_path: Path, limit: int) -> None:
    for c in _coordinator(tmp_path, inline_model_bytes=limit):
        run_id, tasks = _start_round_one(c)
        site, task = sorted(tasks.items())[0]
        assert task.model_bytes > 64
        again = c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=10)
        assert again.task.task_id == task.task_id and again.model == b""
        assert c.engine.downloads.flush(10)
        by_site = {p.site_id: p for p in round_status(c, run_id, 1).participations}
        assert by_site[site].status == "assigned" and by_site[site].bytes_down == 0


def test_a_site_trains_on_the_model_that_came_with_its_task(
    inlining: InProcessCoordinator,
) -> None:
    """A real agent serves three rounds and never calls DownloadModel."""
    c = inlining
    config = SiteConfig("site-a", c.address, (TASK,), insecure=True)
    data = {TASK: synthetic_task.load_data({"samples": 64, "seed": 1})}
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={TASK: synthetic_task}, data=data)
    downloads = 0
    real_download = agent.conn.download

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal downloads
        downloads += 1
        return real_download(*args, **kwargs)  # type: ignore[arg-type]

    agent.conn.download = counted  # type: ignore[method-assign, assignment]
    run_id = serve_one_run(c, agent, rounds=3)
    assert agent.rounds_done == 4  # the initial model, then three rounds
    assert downloads == 0
    rounds = [r for r in c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id)).rounds]
    # Round 1: the initial model, rebuilt from the seed; then each came with its task.
    assert [r.participations[0].bytes_down > 0 for r in rounds[1:]] == [False, True, True]


class _Answer:
    """A heartbeat's answer to come, as ``Connection.heartbeat_future`` gives it: after
    ``after_s`` (None: not until cancelled)."""

    def __init__(self, current: bool = True, after_s: float | None = 0.0) -> None:
        self.current = current
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[_Answer], None]] = []
        self._done = self.was_cancelled = False
        if after_s is not None:
            timer = threading.Timer(after_s, self._finish)
            timer.daemon = True
            timer.start()

    def _finish(self, cancelled: bool = False) -> None:
        with self._lock:
            if self._done:
                return
            self._done, self.was_cancelled = True, cancelled
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        self._finish(cancelled=True)
        return True

    def cancelled(self) -> bool:
        return self.was_cancelled

    def result(self) -> site_pb2.HeartbeatResponse:
        if self.was_cancelled:
            raise grpc.FutureCancelledError()
        return site_pb2.HeartbeatResponse(task_current=self.current)

    def add_done_callback(self, callback: Callable[[_Answer], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)


class _Beating:
    """A Connection's transfer state and heartbeats, without a coordinator: each beat's
    time, timeout and hold are kept; ``answer`` says how each is answered (by number)."""

    def __init__(self, answer: Callable[[int], _Answer] = lambda n: _Answer()) -> None:
        self.conn = Connection("127.0.0.1:9", "s1")
        self.times: list[float] = []
        self.timeouts: list[float] = []
        self.holds: list[float] = []
        self.answers: list[_Answer] = []

        def heartbeat_future(task_id: str, timeout_s: float = 10.0, hold_s: float = 0.0) -> _Answer:
            self.times.append(time.monotonic())
            self.timeouts.append(timeout_s)
            self.holds.append(hold_s)
            self.answers.append(answer(len(self.times)))
            return self.answers[-1]

        self.conn.heartbeat_future = heartbeat_future  # type: ignore[assignment]

    @property
    def beats(self) -> int:
        return len(self.times)

    def until(self, beats: int) -> None:
        deadline = time.monotonic() + 10
        while self.beats < beats and time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_heartbeat_is_skipped_while_a_transfer_moves_bytes() -> None:
    b = _Beating()
    try:
        assert not b.conn.moved_within(10.0)
        with b.conn._transfer():
            assert b.conn.moved_within(10.0)
            with Heartbeat(b.conn, "t", 0.05):
                end = time.monotonic() + 0.4
                while time.monotonic() < end:  # a chunk every 10 ms
                    b.conn._moved_at = time.monotonic()
                    time.sleep(0.01)
            assert b.beats == 0
            # Its next chunk long in coming (a slow link): heartbeats again.
            with Heartbeat(b.conn, "t", 0.05):
                deadline = time.monotonic() + 10
                while b.beats == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert b.beats > 0
        assert not b.conn.moved_within(10.0)  # no transfer under way
    finally:
        b.conn.close()


def test_a_round_s_first_heartbeats_are_spread_over_the_second_half_of_the_interval() -> None:
    """Sites that got their tasks at one instant do not all beat at one instant: each
    first beat is drawn in [interval / 2, interval], never later than the interval."""
    rng = random.Random(7)
    firsts = [first_beat_s(4.0, rng) for _ in range(5000)]
    assert FIRST_BEAT == (0.5, 1.0)
    assert 2.0 <= min(firsts) < 2.01 and 3.99 < max(firsts) <= 4.0
    # Spread evenly: each tenth of that half holds about a tenth of them (binomial: 500
    # each, sd 21; a constant or a narrow draw puts thousands in one).
    tenths = [0] * 10
    for first in firsts:
        tenths[min(9, int((first - 2.0) / 0.2))] += 1
    assert all(400 < n < 600 for n in tenths), tenths


def test_a_heartbeat_beats_first_when_drawn_then_an_interval_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.05)
    b = _Beating()
    try:
        started = time.monotonic()
        with Heartbeat(b.conn, "t", 0.5):
            b.until(3)
        times = b.times
        assert len(times) >= 3
        assert 0.05 <= times[0] - started < 0.45  # the drawn point, well before the interval
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert all(g >= 0.45 for g in gaps), gaps  # then an interval apart
        assert set(b.holds) == {0.0}  # none asked to be held
    finally:
        b.conn.close()


def test_a_slow_heartbeat_answer_does_not_hold_back_the_beats_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each beat is due an interval after the one before was due: a beat answered late
    (a busy coordinator) is followed by the next as soon as it is answered, not an
    interval after; one is in flight at a time; each waits two intervals for its answer."""

    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.05)
    interval_s = 0.3
    b = _Beating(lambda n: _Answer(after_s=2.5 * interval_s if n == 2 else 0.0))
    try:
        with Heartbeat(b.conn, "t", interval_s):
            b.until(5)
        times = b.times
        assert len(times) >= 5
        slow_answered = times[1] + 2.5 * interval_s  # none sent while it was open
        assert slow_answered <= times[2] < slow_answered + 0.5 * interval_s
        gaps = [later - earlier for earlier, later in itertools.pairwise(times[2:])]
        assert all(g >= 0.9 * interval_s for g in gaps), gaps  # then the cadence, no burst
        assert set(b.timeouts) == {heartbeat_mod.beat_timeout_s(interval_s)}
        assert heartbeat_mod.beat_timeout_s(interval_s) == heartbeat_mod.BEAT_TIMEOUT_MIN_S
        assert heartbeat_mod.beat_timeout_s(5.0) == 10.0  # two intervals
    finally:
        b.conn.close()


def test_a_held_heartbeat_is_asked_for_and_cancelled_when_the_task_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a hold, each beat asks the coordinator to keep it open that long (its timeout
    covers the hold); the next goes as soon as a held one is answered, and one still held
    when the task ends is cancelled at once: ending the task does not wait for it."""

    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.02)
    # The first is held past its interval, the second on until the task ends.
    b = _Beating(lambda n: _Answer(after_s=1.3 if n == 1 else None))
    try:
        with Heartbeat(b.conn, "t", 1.0, hold_s=30.0):
            b.until(2)
            started = time.monotonic()
        assert time.monotonic() - started < 5.0  # the held beat did not hold the task's end
        assert b.beats == 2
        assert 1.3 <= b.times[1] - b.times[0] < 1.8  # right after the first was answered
        assert set(b.holds) == {30.0}
        assert set(b.timeouts) == {30.0 + heartbeat_mod.beat_timeout_s(1.0)}
        assert b.answers[1].cancelled()
    finally:
        b.conn.close()


def test_a_heartbeat_still_tells_a_site_its_task_was_withdrawn() -> None:
    b = _Beating(lambda n: _Answer(current=False))
    try:
        with Heartbeat(b.conn, "t", 0.02) as beat:
            assert beat.withdrawn.wait(10)
    finally:
        b.conn.close()


@pytest.mark.parametrize("when", ["before its work", "after its model came"])
def test_a_task_withdrawn_before_its_training_is_neither_trained_nor_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A site that hears from its heartbeat that its task was withdrawn (its attempt
    failed, or here its run was cancelled) stops at the next step of its work: it does
    not fetch the model for it, nor, once the model is in, train on it. Before, it
    trained to the end and then did not upload: time a site then spent late for the
    task given next (the retry of a round, at thousands of sites)."""
    from fedra.client.connection import Session

    monkeypatch.setattr(heartbeat_mod, "first_beat_s", lambda interval_s: 0.02)
    made = _coordinator(tmp_path)
    c = next(made)
    agent: SiteAgent | None = None
    try:
        run_id, tasks = _start_round_one(c)
        site = sorted(tasks)[0]
        config = SiteConfig(site, c.address, (TASK,), insecure=True)
        data = {TASK: synthetic_task.load_data({"samples": 64, "seed": 1})}
        agent = SiteAgent(config, executor=LocalExecutor(), tasks={TASK: synthetic_task}, data=data)
        task = agent.conn.poll(2.0)
        assert task is not None and task.round == 1
        fetched, trained = [], []
        real_model, real_train = agent._global_model, agent.executor.train
        beat = Heartbeat(agent.conn, task.task_id, 1.0, hold_s=2.0)

        def withdraw() -> None:
            c.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id), timeout=10)
            assert beat.withdrawn.wait(10), "the heartbeat never said so"

        def model(*args: object) -> object:
            fetched.append(True)
            got = real_model(*args)  # type: ignore[arg-type]
            if when == "after its model came":
                withdraw()
            return got

        def train(*args: object) -> object:
            trained.append(True)
            return real_train(*args)  # type: ignore[arg-type]

        agent._global_model = model  # type: ignore[method-assign, assignment]
        agent.executor.train = train  # type: ignore[method-assign, assignment]
        with beat:
            if when == "before its work":
                withdraw()
            accepted = agent._audit_soon("task.accept", task)
            agent._train_and_upload(task, Session(1.0, 2.0, 1 << 20), "test", beat, accepted)
        assert fetched == ([] if when == "before its work" else [True])
        assert trained == [] and agent.rounds_done == 0
        (p,) = [p for p in round_status(c, run_id, 1).participations if p.site_id == site]
        assert p.bytes_up == 0 and p.status != "accepted"
    finally:
        if agent is not None:
            agent.conn.close()
        next(made, None)


def test_a_model_that_does_not_match_its_digest_is_refused_by_the_site() -> None:
    state = synthetic_task.create_model(0, {}).state_dict()
    model = encode({k: v.detach() for k, v in state.items()})
    good = Assignment(
        task_id="t", run_id="r", round=1, init=False, entry_point=TASK,
        train=TrainSpec(local_steps=1, batch_size=8, learning_rate=0.1), seed=0,
        model_sha256=hashlib.sha256(model).hexdigest(), model_bytes=len(model),
        deadline_in_s=10.0, codec=CodecSpec("none"), model=model,
    )  # fmt: skip
    conn = Connection("127.0.0.1:9", "s1")
    try:
        got = conn.sent_model(good)
        assert got is not None and set(got) == set(state)
        with pytest.raises(CodecError, match="SHA-256"):
            conn.sent_model(replace(good, model=model[:-1] + bytes([model[-1] ^ 1])))
        assert conn.sent_model(replace(good, model=b"")) is None
    finally:
        conn.close()


def _spool_files(c: InProcessCoordinator) -> list[Path]:
    return [p for p in c.engine.updates.root.rglob("*") if p.is_file()]


def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_small_update_needs_no_file_and_its_row_lets_go_once_the_round_ends(
    inlining: InProcessCoordinator,
) -> None:
    c = inlining
    run_id, tasks = _start_round_one(c)
    (s1, t1), (s2, t2) = sorted(tasks.items())
    upload(c, messages(t1, s1, delta_payload(0.1)))
    assert _spool_files(c) == []  # durable in its row, with its accept
    assert c.engine._store.holding_update_data() == [t1.task_id]
    upload(c, messages(t2, s2, delta_payload(0.3)))
    wait_round(c, run_id, 1, "committed")
    assert _until(lambda: c.engine._store.holding_update_data() == [])
    assert _spool_files(c) == []


Task = tuple[str, site_pb2.Task]


def _first_update_in(c: InProcessCoordinator) -> tuple[str, Task, Task]:
    """Round 1 open with two sites, the first one's small update accepted."""
    run_id, tasks = _start_round_one(c)
    (s1, t1), (s2, t2) = sorted(tasks.items())
    upload(c, messages(t1, s1, delta_payload(0.1)))
    return run_id, (s1, t1), (s2, t2)


def test_a_small_update_accepted_before_a_restart_counts_after_it(tmp_path: Path) -> None:
    first = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, (s1, _), (s2, t2) = _first_update_in(first)
    finally:
        first.close()
    again = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        assert again.engine.runs[run_id].assignments[s1].state == "accepted"
        upload(again, messages(t2, s2, delta_payload(0.3)))
        wait_round(again, run_id, 1, "committed")
        export = admin_pb2.ExportModelRequest(run_id=run_id, round=1)
        model = decode(b"".join(m.data for m in again.admin.ExportModel(export, timeout=30)))
        for name, value in model_state().items():  # both sent 10 samples: the plain mean
            torch.testing.assert_close(model[name], value + (0.1 + 0.3) / 2)
        assert _until(lambda: again.engine._store.holding_update_data() == [])
    finally:
        again.close()


def test_rows_left_holding_bytes_by_a_crash_are_let_go_at_start(tmp_path: Path) -> None:
    first = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, (_, t1), (s2, t2) = _first_update_in(first)
        upload(first, messages(t2, s2, delta_payload(0.3)))
        wait_round(first, run_id, 1, "committed")
        assert _until(lambda: first.engine._store.holding_update_data() == [])
        # As a crash between the round's commit and its clean-up would leave them:
        data = delta_payload(0.1)
        with first.engine._store.engine.begin() as conn:
            conn.execute(
                text("UPDATE participations SET update_data = :d WHERE task_id = :t"),
                {"d": data, "t": t1.task_id},
            )
        assert first.engine._store.holding_update_data() == [t1.task_id]
    finally:
        first.close()
    again = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        assert again.engine._store.holding_update_data() == []
    finally:
        again.close()
