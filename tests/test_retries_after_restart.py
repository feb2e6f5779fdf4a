"""Retries and failed attempts across a coordinator restart (the in-process daemon is
stopped and a new one started on the same state directory and database).

A retry of an update that counted must be answered as accepted whatever happened in
between, and a failed attempt must be recorded once.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from sqlalchemy import text

from fedra.coordinator.engine import EngineSettings, uploads
from fedra.coordinator.state import ATTEMPT_FAILED
from fedra.protos.codec import encode
from fedra.protos.v1 import admin_pb2, site_pb2
from fedra.storage import Store, blobs
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    delta_payload,
    messages,
    model_state,
    register,
    round_status,
    start_round_one,
    submit,
    tasks_of_round,
    upload,
    wait_round,
)

SETTINGS = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
# Sites that stop polling are offline within seconds: attempts fail quickly.
QUICK = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=1.0, site_timeout_s=2.0)


def test_a_retry_after_a_restart_is_answered_as_accepted(tmp_path: Path) -> None:
    """The coordinator stopped after the durable accept, before the site saw the reply."""
    first = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, tasks = start_round_one(first, sites_per_round=3, min_sites=3)
        site, task = sorted(tasks.items())[0]
        nonce, payload = os.urandom(16), delta_payload()
        upload(first, messages(task, site, payload, nonce=nonce))
    finally:
        first.close()
    again = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        reply = upload(again, messages(task, site, payload, nonce=nonce))
        assert reply.bytes_received == len(payload)
        assert round_status(again, run_id, 1).updates == 1  # counted once
    finally:
        again.close()


def test_a_retry_while_its_round_closes_is_answered_as_accepted(tmp_path: Path) -> None:
    """The driver has begun closing the round (uploads are late from here) when the
    site's retry of an update it already sent arrives."""
    c = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
        site, task = sorted(tasks.items())[0]
        nonce, payload = os.urandom(16), delta_payload()
        upload(c, messages(task, site, payload, nonce=nonce))
        run = c.engine.runs[run_id]
        with c.engine._lock:
            run.closing = True  # what the driver sets before it commits
        try:
            reply = upload(c, messages(task, site, payload, nonce=nonce))
        finally:
            with c.engine._lock:
                run.closing = False
        assert reply.bytes_received == len(payload)
        status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
        assert next(r for r in status.rounds if r.number == 1).updates == 1
    finally:
        c.close()


def _attempt_failures(c: InProcessCoordinator, run_id: str) -> list[tuple[int | None, str]]:
    events = c.engine._store.list_events(run_id)
    return [(e.round_number, e.message) for e in events if e.kind == "attempt_failed"]


def _wait_until(c: InProcessCoordinator, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    version = c.engine.version
    while not done():
        assert time.monotonic() < deadline, "timed out"
        version = c.engine.wait_for_change(version, 0.5)


def test_an_attempt_that_failed_before_a_restart_is_not_failed_again(tmp_path: Path) -> None:
    """Stopped while waiting to open the next attempt: the restarted daemon opens it, and
    the ledger says once, with the right count, why the first one failed."""
    first = InProcessCoordinator(tmp_path / "state", QUICK)
    try:
        run_id, tasks = start_round_one(
            first, sites_per_round=3, min_sites=3, max_round_attempts=2, round_deadline_s=30
        )
        site, task = sorted(tasks.items())[0]
        upload(first, messages(task, site, delta_payload()))
        # The other two go silent: attempt 1 fails, and with no site online the driver
        # waits to open attempt 2.
        run = first.engine.runs[run_id]
        _wait_until(first, lambda: "waiting for online sites" in run.waiting_reason, 20)
        assert re.search(r"want 3 \(quorum 3\), for \d+ s so far$", run.waiting_reason)
        assert len(_attempt_failures(first, run_id)) == 1
    finally:
        first.close()
    again = InProcessCoordinator(tmp_path / "state", QUICK)
    try:
        # Attempt 2 opens with the sites given one liveness timeout to return; they do not.
        _wait_until(again, lambda: run_id not in again.engine.runs, 30)
        failures = _attempt_failures(again, run_id)
        assert [n for n, _ in failures] == [1, 1], failures
        assert "attempt 1: 1 of the 3 required updates" in failures[0][1], failures
        assert "attempt 2: 0 of the 3 required updates" in failures[1][1], failures
        assert again.engine._store.get_run(run_id).state == "failed"  # type: ignore[union-attr]
    finally:
        again.close()


def _header_only(msgs: Iterator[site_pb2.UpdateChunk]) -> Iterator[site_pb2.UpdateChunk]:
    yield next(msgs)  # how a site asks whether an update it sent before counted


def test_a_site_learns_whether_its_update_counted_from_the_header_alone(
    tmp_path: Path,
) -> None:
    """Accepted in an attempt that then failed: it did not count, and the site is told so;
    accepted in a round that committed: it counted (a top-k site moves its residual on
    only then)."""
    c = InProcessCoordinator(tmp_path / "state", QUICK)
    try:
        run_id, tasks = start_round_one(
            c, sites_per_round=3, min_sites=3, max_round_attempts=3, round_deadline_s=30
        )
        site, task = sorted(tasks.items())[0]
        nonce, payload = os.urandom(16), delta_payload()
        upload(c, messages(task, site, payload, nonce=nonce))
        _wait_until(c, lambda: len(_attempt_failures(c, run_id)) == 1, 20)  # others silent
        with pytest.raises(grpc.RpcError) as refused:
            upload(c, _header_only(messages(task, site, payload, nonce=nonce)))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "did not count: attempt 1 of round 1" in (refused.value.details() or "")
        # Attempt 2 (the silent sites are back): every site delivers, the round commits,
        # and the header is enough.
        run = c.engine.runs[run_id]
        second: dict[str, site_pb2.Task] = {}
        deadline = time.monotonic() + 30
        while len(second) < len(tasks):  # each poll (1 s at most) says the site is there
            assert time.monotonic() < deadline, "attempt 2 did not open"
            for s in sorted(set(tasks) - set(second)):
                r = c.site.PollTask(site_pb2.PollTaskRequest(site_id=s), timeout=10)
                if r.HasField("task"):
                    second[s] = r.task
        assert run.attempt == 2
        sent = {s: (os.urandom(16), delta_payload()) for s in second}
        for s, t in second.items():
            upload(c, messages(t, s, sent[s][1], nonce=sent[s][0]))
        wait_round(c, run_id, 1, "committed")
        t = second[site]
        reply = upload(c, _header_only(messages(t, site, sent[site][1], nonce=sent[site][0])))
        assert reply.bytes_received == len(sent[site][1])
    finally:
        c.close()


class _Killed(BaseException):
    """Stands for SIGKILL at a fault point: the driver thread ends there, nothing after."""


def test_a_last_attempt_that_failed_before_a_restart_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between recording its last attempt's failure and ending the run: the
    restarted daemon ends it, and opens no attempt past max_round_attempts."""

    def crash_point(name: str, round_number: int) -> None:
        if name == "after_attempt_failed":
            raise _Killed

    monkeypatch.setattr("fedra.coordinator.engine.rounds.crash_point", crash_point)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the driver's "death"
    first = InProcessCoordinator(tmp_path / "state", QUICK)
    try:
        run_id, _ = start_round_one(
            first, sites_per_round=3, min_sites=3, max_round_attempts=1, round_deadline_s=30
        )
        _wait_until(first, lambda: len(_attempt_failures(first, run_id)) == 1, 20)
    finally:
        first.close()
    assert first.engine._store.get_run(run_id).state == "running"  # type: ignore[union-attr]
    monkeypatch.undo()
    again = InProcessCoordinator(tmp_path / "state", QUICK)
    try:
        record = again.engine._store.get_run(run_id)
        assert record is not None and record.state == "failed", record
        assert "gave up after 1 attempts" in record.reason
        assert len(_attempt_failures(again, run_id)) == 1
        assert run_id not in again.engine.runs
    finally:
        again.close()


@pytest.mark.parametrize("where", ["file", "row"])  # a spool file; a small one's own row
def test_a_spooled_update_damaged_across_a_restart_fails_its_task_alone(
    tmp_path: Path, where: str
) -> None:
    """The daemon starts, the damaged update's task fails with the reason, the others'
    updates stay in, and the round goes on."""
    small = 0 if where == "file" else SETTINGS.small_update_bytes
    settings = replace(SETTINGS, small_update_bytes=small)
    first = InProcessCoordinator(tmp_path / "state", settings)
    try:
        run_id, tasks = start_round_one(first, sites_per_round=3, min_sites=2)
        (a, ta), (b, tb) = sorted(tasks.items())[:2]
        upload(first, messages(ta, a, delta_payload(0.1)))
        upload(first, messages(tb, b, delta_payload(0.2)))
        damaged = first.engine._store.get_participation(ta.task_id)
        assert damaged is not None and damaged.update_sha256
        path = first.engine.updates.blobs.path(damaged.update_sha256)
        assert path.exists() == (where == "file")
    finally:
        first.close()
    if where == "file":
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:
        store = Store(f"sqlite:///{tmp_path / 'state' / 'fedra.db'}")
        try:
            data = store.update_data(damaged.update_sha256)
            assert data is not None
            with store.engine.begin() as conn:
                conn.execute(
                    text("UPDATE participations SET update_data = :d WHERE task_id = :t"),
                    {"d": data[:-1] + bytes([data[-1] ^ 0xFF]), "t": ta.task_id},
                )
        finally:
            store.close()
    again = InProcessCoordinator(tmp_path / "state", settings)
    try:
        run = again.engine.runs[run_id]
        assert run.assignments[a].state == "failed" and run.assignments[b].state == "accepted"
        part = again.engine._store.get_participation(ta.task_id)
        assert part is not None and "damaged in the spool" in part.error
        assert not path.exists()
    finally:
        again.close()


# -- spool files nobody refers to ------------------------------------------------------

FILES = replace(SETTINGS, small_update_bytes=0)  # every update a spool file


def _spool_path(c: InProcessCoordinator, payload: bytes) -> Path:
    return c.engine.updates.blobs.path(hashlib.sha256(payload).hexdigest())


def test_a_start_deletes_spool_files_no_round_refers_to_and_keeps_accepted_ones(
    tmp_path: Path,
) -> None:
    """A crash between an update's file and its durable accept leaves a file that no row
    names: the next start deletes it, keeps every accepted update's, and the round goes
    on with those."""
    first = InProcessCoordinator(tmp_path / "state", FILES)
    try:
        run_id, tasks = start_round_one(first, sites_per_round=3, min_sites=3)
        (a, ta), (b, tb), (c, tc) = sorted(tasks.items())
        upload(first, messages(ta, a, delta_payload(0.1)))
        upload(first, messages(tb, b, delta_payload(0.2)))
        accepted = [_spool_path(first, delta_payload(x)) for x in (0.1, 0.2)]
        first.engine.updates.put(delta_payload(0.3))  # put in place, never accepted
        orphan = _spool_path(first, delta_payload(0.3))
        leftover = orphan.parent / "notes.txt"  # not a spooled update: not the spool's
        leftover.write_text("an operator's file")
    finally:
        first.close()
    assert orphan.exists() and all(p.exists() for p in accepted)
    again = InProcessCoordinator(tmp_path / "state", FILES)
    try:
        assert not orphan.exists() and leftover.exists()
        assert all(p.exists() for p in accepted)
        run = again.engine.runs[run_id]
        assert [run.assignments[s].state for s in (a, b)] == ["accepted", "accepted"]
        upload(again, messages(tc, c, delta_payload(0.3)))
        wait_round(again, run_id, 1, "committed")
        r1 = round_status(again, run_id, 1)
        assert r1.attempt == 1 and r1.updates == 3  # none lost to the sweep
        # The round lets go of them once the next one is open (its clean-up's turn).
        _wait_until(again, lambda: not any(p.exists() for p in accepted), 15)
    finally:
        again.close()


def _fed(
    c: InProcessCoordinator, site: str, task: site_pb2.Task, payload: bytes
) -> tuple[uploads.UploadTicket, uploads.Receiver]:
    """An upload whose payload has all arrived, before its last step."""
    h = next(messages(task, site, payload)).header
    ticket = uploads.begin_upload(
        c.engine,
        uploads.UpdateHeader(
            site_id=h.site_id, run_id=h.run_id, round=h.round, task_id=h.task_id,
            num_samples=h.num_samples, metrics=dict(h.metrics), codec=h.codec,
            sha256=h.sha256, nonce=h.nonce, payload_bytes=h.payload_bytes,
        ),
    )  # fmt: skip
    receiver = uploads.Receiver(c.engine, ticket)
    receiver.feed(payload)
    return ticket, receiver


def _spooled(
    c: InProcessCoordinator, site: str, task: site_pb2.Task, payload: bytes
) -> uploads.UploadTicket:
    """An upload whose last step ran (its file in place) and whose accept has not begun."""
    ticket, receiver = _fed(c, site, task, payload)
    receiver.finish()
    return ticket


def test_an_upload_given_up_with_its_file_in_place_leaves_it_only_to_another_holder(
    tmp_path: Path,
) -> None:
    """A call cancelled after its last step put the file in place is given back: the file
    goes, unless another upload of the same bytes holds it until its own accept."""
    c = InProcessCoordinator(tmp_path / "state", FILES)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
        payload = delta_payload(0.1)
        path = _spool_path(c, payload)

        def spooled(site: str, task: site_pb2.Task) -> uploads.UploadTicket:
            ticket = _spooled(c, site, task, payload)
            assert ticket.spooled == path.name and path.exists()
            return ticket

        (a, ta), (b, tb), (s3, t3) = sorted(tasks.items())
        first, second = spooled(a, ta), spooled(b, tb)  # identical updates: one file
        run = c.engine.runs[run_id]
        assert run.assignments[a].state == run.assignments[b].state == "uploading"
        uploads.give_up(c.engine, second)
        assert path.exists(), "deleted while another upload of the same bytes held it"
        uploads.give_up(c.engine, first)
        assert not path.exists(), "a given-up upload's file stayed in the spool"
        assert run.assignments[a].state != "uploading" != run.assignments[b].state
        for site, task in ((a, ta), (b, tb), (s3, t3)):  # the tasks are the sites' again
            upload(c, messages(task, site, payload))
        wait_round(c, run_id, 1, "committed")
        assert round_status(c, run_id, 1).updates == 3
    finally:
        c.close()


def test_an_accept_that_fails_or_a_file_put_in_place_unsynced_holds_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever makes an upload fail after its file is in place (an accept that raises
    something other than a refusal; the directory's sync failing after the rename), the
    file goes with it and no hold is left to keep later clean-ups from deleting it."""
    c = InProcessCoordinator(tmp_path / "state", FILES)
    try:
        run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=3)
        (a, ta), (b, tb), _ = sorted(tasks.items())
        spool, run = c.engine.updates, c.engine.runs[run_id]

        payload = delta_payload(0.1)
        ticket = _spooled(c, a, ta, payload)

        def broken(*args: object) -> bool:
            raise RuntimeError("the database went away")

        monkeypatch.setattr(run, "accepting", broken)
        with pytest.raises(RuntimeError, match="went away"):
            uploads.accept_begin(c.engine, ticket, str(ticket.spooled), len(payload))
        monkeypatch.undo()
        assert not _spool_path(c, payload).exists() and not spool._holds
        assert run.assignments[a].state != "uploading"  # the site may send it again

        other = delta_payload(0.2)

        def no_sync(path: Path) -> None:
            raise OSError("the directory's sync failed")

        ticket, receiver = _fed(c, b, tb, other)
        monkeypatch.setattr(blobs, "fsync_dir", no_sync)
        with pytest.raises(OSError, match="sync failed"):
            receiver.finish()
        monkeypatch.undo()
        assert _spool_path(c, other).exists()  # renamed, not known to be durable
        assert run.assignments[b].state == "uploading"
        uploads.give_up(c.engine, ticket)  # as the failed call's clean-up does
        assert not _spool_path(c, other).exists() and not spool._holds
    finally:
        c.close()


def test_a_failed_attempt_s_clean_up_at_a_start_spares_bytes_a_later_run_accepted(
    tmp_path: Path,
) -> None:
    """Two runs' open rounds each accepted the same bytes; the first run's attempt had
    failed before the restart. Restoring it must not delete the file the second run,
    restored after it, still counts on."""
    first = InProcessCoordinator(tmp_path / "state", FILES)
    sites = ("site-a", "site-b", "site-c", "site-d")
    payload = delta_payload(0.1)
    try:
        register(first, *sites)
        runs = []
        for _ in range(2):  # two sites each: one delivers, the other keeps the round open
            run_id = submit(first, sites_per_round=2, min_sites=2, max_round_attempts=3)
            ((init_site, init_task),) = tasks_of_round(first, run_id, 0).items()
            upload(first, messages(init_task, init_site, encode(model_state())))
            site, task = sorted(tasks_of_round(first, run_id, 1).items())[0]
            upload(first, messages(task, site, payload))
            runs.append((run_id, site))
        path = _spool_path(first, payload)
        assert path.exists()
        (failed, _), (kept, kept_site) = runs
        now = first.engine.clock()
    finally:
        first.close()
    store = Store(f"sqlite:///{tmp_path / 'state' / 'fedra.db'}")
    try:  # as if its driver had recorded the attempt's failure, then the process died
        store.expire_attempt(failed, 1, 1, "test: failed", now, event=ATTEMPT_FAILED)
    finally:
        store.close()
    again = InProcessCoordinator(tmp_path / "state", FILES)
    try:
        assert again.engine.runs[kept].assignments[kept_site].state == "accepted"
        assert again.engine.runs[failed].attempt == 2
        assert path.exists()
    finally:
        again.close()
