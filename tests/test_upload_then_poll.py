"""A small update held as the site's next poll (``UploadSmallUpdate``'s then_poll_s): one
call a round where there were two, over real gRPC with the real engine.

Once the update is accepted, the call waits for the site's next task as PollTask would
and answers with both; it ends without a task as soon as the run opens an attempt
without the site, or ends. The acknowledgement is the same either way, a retry of a call
cut while held is answered as accepted, and a bad then_poll_s is refused before anything
changes.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from fedra.client.agent import SiteAgent
from fedra.client.config import SiteConfig
from fedra.client.connection import Connection, _assignment
from fedra.client.executor import LocalExecutor
from fedra.coordinator.engine import EngineSettings
from fedra.examples.synthetic import task as synthetic_task
from fedra.protos.codec import decode
from fedra.protos.v1 import admin_pb2, site_pb2
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    TASK,
    delta_payload,
    messages,
    round_status,
    start_round_one,
    submit,
    upload,
    wait_round,
)

# A poll timeout far above any wait below: an answer that comes well before it was woken.
SETTINGS = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=30.0, site_timeout_s=60.0)
WOKEN_S = 10.0


@pytest.fixture
def patient(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        yield c
    finally:
        c.close()


def held_request(
    task: site_pb2.Task, site: str, payload: bytes, then_poll_s: float, nonce: bytes | None = None
) -> site_pb2.UploadSmallUpdateRequest:
    first = next(messages(task, site, payload, nonce=nonce))
    return site_pb2.UploadSmallUpdateRequest(
        header=first.header, payload=payload, then_poll_s=then_poll_s
    )


def synthetic_agent(c: InProcessCoordinator, site: str) -> SiteAgent:
    """A real site agent of ``site`` for ``c`` (plaintext), serving the synthetic task."""
    config = SiteConfig(site, c.address, (TASK,), insecure=True)
    data = {TASK: synthetic_task.load_data({"samples": 64, "seed": 1})}
    return SiteAgent(config, executor=LocalExecutor(), tasks={TASK: synthetic_task}, data=data)


def wait_held(c: InProcessCoordinator, site: str) -> None:
    """Until the site's upload is accepted and its call waits as a poll."""
    deadline = time.monotonic() + WOKEN_S
    while c.engine._polling.get(site, 0) == 0:
        assert time.monotonic() < deadline, "the upload was never held as a poll"
        time.sleep(0.01)


def test_an_update_held_as_the_next_poll_comes_back_with_the_next_task(
    patient: InProcessCoordinator,
) -> None:
    c = patient
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
    (s1, t1), (s2, t2), (s3, t3) = sorted(tasks.items())
    payload = delta_payload(0.1)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(c.site.UploadSmallUpdate, held_request(t1, s1, payload, 60.0), 60)
        wait_held(c, s1)
        assert not call.done()
        r1 = round_status(c, run_id, 1)  # counted already, while the call is held
        assert r1.status == "open" and r1.updates == 1
        assert c.engine.site_online(s1)
        opened = time.monotonic()
        for site, task in ((s2, t2), (s3, t3)):
            upload(c, messages(task, site, delta_payload()))
        reply = call.result(timeout=WOKEN_S)
        assert time.monotonic() - opened < WOKEN_S  # woken by round 2, not its timeout
    assert reply.bytes_received == len(payload)
    assert reply.next.task.round == 2 and reply.next.task.run_id == run_id
    assert 0 < reply.held_s < WOKEN_S + 1
    # The very task a poll gives the site now, with its model (small models come along).
    polled = c.site.PollTask(site_pb2.PollTaskRequest(site_id=s1), timeout=10)
    assert polled.task.task_id == reply.next.task.task_id
    assert reply.next.model == polled.model
    assert c.engine._polling.get(s1, 0) == 0  # the hold is over
    assert round_status(c, run_id, 1).updates == 3


@pytest.mark.parametrize("how", ["completed", "cancelled"])
def test_a_held_update_answers_without_a_task_once_the_run_ends(
    patient: InProcessCoordinator, how: str
) -> None:
    """The last round's held uploads answer when the run ends, not at their timeout."""
    c = patient
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3, rounds=1)
    (s1, t1), *others = sorted(tasks.items())
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(
            c.site.UploadSmallUpdate, held_request(t1, s1, delta_payload(), 60.0), 60
        )
        wait_held(c, s1)
        ended = time.monotonic()
        if how == "completed":
            for site, task in others:
                upload(c, messages(task, site, delta_payload()))
        else:
            c.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id))
        reply = call.result(timeout=WOKEN_S)
        assert time.monotonic() - ended < WOKEN_S
    assert reply.bytes_received > 0 and not reply.next.HasField("task")
    status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
    assert status.state == how


def test_a_held_update_answers_without_a_task_when_the_next_attempt_leaves_the_site_out(
    patient: InProcessCoordinator,
) -> None:
    """The other two sites fail, so round 1's attempt ends and a retry opens; the held
    site now serves another task only (it registered again), so the retry cannot sample
    it. Its held upload is answered as the retry opens (the run's ``opened`` wake), with
    no task: not at the poll timeout, and not at the attempt's close before."""
    c = patient
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=2, max_round_attempts=3)
    (s1, t1), (s2, t2), (s3, t3) = sorted(tasks.items())
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(
            c.site.UploadSmallUpdate, held_request(t1, s1, delta_payload(), 60.0), 60
        )
        wait_held(c, s1)
        c.site.Register(
            site_pb2.RegisterRequest(site_id=s1, tasks=["elsewhere.tasks:other"], version="t"),
            timeout=10,
        )
        failed = time.monotonic()
        for site, task in ((s2, t2), (s3, t3)):
            c.site.ReportFailure(
                site_pb2.ReportFailureRequest(site_id=site, task_id=task.task_id, reason="oom"),
                timeout=10,
            )
        reply = call.result(timeout=WOKEN_S)
        assert time.monotonic() - failed < WOKEN_S
    assert reply.bytes_received > 0 and not reply.next.HasField("task")
    retry = wait_round(c, run_id, 1)
    assert retry.attempt == 2 and sorted(retry.sampled_sites) == [s2, s3]


def test_a_held_update_cut_by_its_site_is_counted_once_when_sent_again(
    patient: InProcessCoordinator,
) -> None:
    c = patient
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
    (s1, t1), (s2, t2), (s3, t3) = sorted(tasks.items())
    nonce, payload = os.urandom(16), delta_payload()
    request = held_request(t1, s1, payload, 60.0, nonce=nonce)
    call = c.site.UploadSmallUpdate.future(request, timeout=60)
    wait_held(c, s1)
    call.cancel()  # the site's link dropped while it waited for round 2
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    again = c.site.UploadSmallUpdate(held_request(t1, s1, payload, 0.0, nonce=nonce), timeout=30)
    assert again.bytes_received == len(payload) and not again.HasField("next")
    assert round_status(c, run_id, 1).updates == 1  # counted once
    for site, task in ((s2, t2), (s3, t3)):
        upload(c, messages(task, site, delta_payload()))
    assert wait_round(c, run_id, 1, "committed").updates == 3


def test_a_site_is_heard_through_its_held_upload(patient: InProcessCoordinator) -> None:
    """``Connection.upload`` with then_poll_s: no heartbeat is needed while the call is
    held (``moved_within``), and the next task comes back with the answer."""
    c = patient
    _, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
    (s1, t1), (s2, t2), (s3, t3) = sorted(tasks.items())
    conn = Connection(c.address, s1)
    try:
        task = _assignment(t1)
        update = decode(delta_payload())
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(conn.upload, task, update, 10, {}, os.urandom(16), 30.0, False, 60.0)
            wait_held(c, s1)
            assert conn.holding() and conn.moved_within(0.0)
            for site, other in ((s2, t2), (s3, t3)):
                upload(c, messages(other, site, delta_payload()))
            sent = call.result(timeout=WOKEN_S)
        assert not conn.holding() and not conn.moved_within(0.0)
        assert sent.next_task is not None and sent.next_task.round == 2
        assert sent.next_task.model  # a small model comes with its task
        assert sent.held_s > 0 and sent.bytes_received == sent.payload_bytes
    finally:
        conn.close()


@pytest.mark.parametrize("then_poll_s", [-1.0, math.nan, -math.inf])
def test_a_bad_then_poll_s_is_refused_and_changes_nothing(
    patient: InProcessCoordinator, then_poll_s: float
) -> None:
    c = patient
    run_id, tasks = start_round_one(c)
    (site, task), _ = sorted(tasks.items())
    with pytest.raises(grpc.RpcError) as info:
        c.site.UploadSmallUpdate(held_request(task, site, delta_payload(), then_poll_s), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "then_poll_s" in (info.value.details() or "")
    r1 = round_status(c, run_id, 1)
    assert r1.status == "open" and r1.updates == 0
    ok = c.site.UploadSmallUpdate(held_request(task, site, delta_payload(), 0.0), timeout=10)
    assert ok.bytes_received > 0


def test_a_site_agent_serves_a_run_with_one_call_a_round(
    patient: InProcessCoordinator,
) -> None:
    """A real agent: its updates are held as its next polls, so after its first poll every
    task comes with the answer to the update before it."""
    c = patient
    agent = synthetic_agent(c, "site-a")
    polls = 0
    real_poll = agent.conn.poll

    def poll(timeout_s: float) -> object:
        nonlocal polls
        polls += 1
        return real_poll(timeout_s)

    agent.conn.poll = poll  # type: ignore[method-assign, assignment]
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        register_deadline = time.monotonic() + WOKEN_S
        while not agent.registered:
            assert time.monotonic() < register_deadline, "the agent never registered"
            time.sleep(0.01)
        run_id = submit(c, sites_per_round=1, min_sites=1, rounds=3)
        for status in c.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=60):
            if status.state in ("completed", "failed", "cancelled"):
                break
        assert status.state == "completed", status.reason
        # The last update's answer comes when the run ends, not at the poll timeout.
        done_deadline = time.monotonic() + WOKEN_S
        while agent.rounds_done < 4:  # the initial model, then three rounds
            assert time.monotonic() < done_deadline, agent.rounds_done
            time.sleep(0.01)
    finally:
        agent.shutdown()
        thread.join(30)
    assert not thread.is_alive()
    # The first poll waited for round 0's task, and one more began once the run had ended:
    # every other task came with the answer to the update before it (4 polls before).
    assert polls <= 2, polls


def test_a_site_stopping_reports_the_task_that_came_back_with_its_update(
    patient: InProcessCoordinator,
) -> None:
    """A task that came with an upload's answer and is not yet served is the one a stop
    reports, so the round need not wait for the site's silence."""
    c = patient
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
    site, task = sorted(tasks.items())[0]
    agent = synthetic_agent(c, site)
    agent._next = _assignment(task)  # as the answer to its last upload left it
    agent.shutdown("the site is stopping")
    mine = {p.site_id: p for p in round_status(c, run_id, 1).participations}[site]
    assert mine.status == "failed" and "the site is stopping" in mine.error
