"""How a round combines updates, checked number by number over real gRPC: the staleness
weights of async rounds, DP-FedAvg's clipping and noise, and retries after a commit."""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from fedra.client.connection import Connection
from fedra.coordinator.engine import EngineSettings
from fedra.coordinator.engine.folding import fold
from fedra.protos.codec import decode, encode, transfer_chunk_bytes
from fedra.protos.v1 import admin_pb2, common_pb2, site_pb2, site_pb2_grpc
from fedra.storage.blobs import BLOCK_BYTES
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    SITES,
    TASK,
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


def exported(c: InProcessCoordinator, run_id: str, number: int) -> dict[str, torch.Tensor]:
    chunks = c.admin.ExportModel(admin_pb2.ExportModelRequest(run_id=run_id, round=number))
    return decode(b"".join(m.data for m in chunks))


def download(c: InProcessCoordinator, site: str, task: site_pb2.Task) -> None:
    request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
    assert b"".join(m.data for m in c.site.DownloadModel(request))


def full(value: float) -> bytes:
    return encode({k: torch.full_like(v, value) for k, v in model_state().items()})


def test_async_stale_update_counts_less_and_a_retry_after_commit_is_done(
    coordinator: InProcessCoordinator,
) -> None:
    c = coordinator
    run_id, tasks = start_round_one(
        c,
        sites_per_round=3,
        min_sites=0,
        asynchronous=common_pb2.Async(buffer=2, max_staleness=1, staleness="sqrt"),
    )
    (a, ta), (b, tb), (s3, t3) = sorted(tasks.items())
    for site, task in tasks.items():
        download(c, site, task)
    first = messages(ta, a, full(0.1), num_samples=10)
    first_list = list(first)
    upload(c, iter(first_list))
    upload(c, messages(tb, b, full(0.3), num_samples=30))  # the buffer is full: round 1 commits
    wait_round(c, run_id, 1, "committed")
    # A retry of a's update (its reply lost), after the commit: answered as done.
    assert upload(c, iter(first_list)).bytes_received > 0
    # s3 is still training on round 1's model: its task carries into round 2.
    tasks2 = tasks_of_round(c, run_id, 2)
    assert sorted(tasks2) == [a, b]  # only the free sites get new tasks
    for site, task in tasks2.items():
        download(c, site, task)
    upload(c, messages(t3, s3, full(1.0), num_samples=20))  # one model behind: weight 1/sqrt 2
    upload(c, messages(tasks2[a], a, full(0.5), num_samples=20))
    wait_round(c, run_id, 2, "committed")
    m0, m1, m2 = (exported(c, run_id, n) for n in (0, 1, 2))
    for name in m0:
        assert torch.allclose(m1[name], m0[name] + (10 * 0.1 + 30 * 0.3) / 40)
        stale = 20 / math.sqrt(2) * 1.0 + 20 * 0.5
        assert torch.allclose(m2[name], m1[name] + stale / 40, atol=1e-6)
    r2 = round_status(c, run_id, 2)
    staleness = {
        p.site_id: p.metrics["staleness"] for p in r2.participations if p.status == "accepted"
    }
    assert staleness == {s3: 1.0, a: 0.0}


def test_central_dp_clips_each_update_and_adds_the_noise(coordinator: InProcessCoordinator) -> None:
    """Two sites send updates far larger than the clip: the new model moves by the mean of
    the clipped updates (one vote each, over sites_per_round) plus Gaussian noise of std
    noise_multiplier * clip / sites_per_round per coordinate."""
    c = coordinator
    clip, z = 0.5, 1.0
    privacy = common_pb2.Privacy(clip=clip, noise_multiplier=z, epsilon=100.0, delta=1e-5)
    run_id, tasks = start_round_one(c, sites_per_round=2, min_sites=2, privacy=privacy)
    initial = model_state()
    numel = sum(v.numel() for v in initial.values())
    (a, ta), (b, tb) = sorted(tasks.items())
    for site, task in tasks.items():
        download(c, site, task)
    upload(c, messages(ta, a, full(10.0), num_samples=1))  # norm 10 * sqrt(numel)
    upload(c, messages(tb, b, full(-3.0), num_samples=1000))  # weight ignored: one vote each
    wait_round(c, run_id, 1, "committed")
    model = exported(c, run_id, 1)
    per_coord = clip / math.sqrt(numel)  # each clipped update is +-clip/sqrt(numel) everywhere
    noiseless = (per_coord - per_coord) / 2  # the two clipped updates cancel exactly
    noise = torch.cat([(model[k] - initial[k] - noiseless).flatten() for k in initial])
    std = z * clip / 2
    assert noise.abs().max() < 6 * std  # nothing beyond the clipped updates and the noise
    assert noise.abs().max() > 0.02 * std  # and the noise is really there
    r1 = round_status(c, run_id, 1)
    assert r1.metrics["privacy_epsilon"] > 0


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda data: data[: len(data) // 2], "stream ended inside"),  # a torn write
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "its SHA-256 is"),  # a flipped bit
    ],
)
def test_a_damaged_checkpoint_ends_its_run_at_restart_with_the_reason(
    tmp_path: Path, damage: Callable[[bytes], bytes], says: str
) -> None:
    """The coordinator keeps no copy of the model: it reads the blob through at restart, so
    a damaged one fails the run before any site trains on it (and the daemon serves on)."""
    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
    state = tmp_path / "state"
    c = InProcessCoordinator(state, settings)
    try:
        run_id, _ = start_round_one(c)
        model_sha = round_status(c, run_id, 0).model_sha256
    finally:
        c.close()
    blob = state / "blobs" / model_sha[:2] / model_sha
    blob.write_bytes(damage(blob.read_bytes()))
    c = InProcessCoordinator(state, settings)
    try:
        status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
        assert status.state == "failed"
        assert "the checkpoint of round 0 is damaged" in status.reason
        assert says in status.reason
        round1 = [p for r in status.rounds if r.number == 1 for p in r.participations]
        assert round1 and all(p.status == "expired" for p in round1)  # its tasks end too
        assert c.admin.ListSites(admin_pb2.ListSitesRequest()).sites  # still serving
    finally:
        c.close()


def test_a_site_takes_download_chunks_larger_than_its_own(tmp_path: Path) -> None:
    """Register settles the upload chunk size only; downloads come in the coordinator's
    (4 MiB in earlier versions), and the site's 1 MiB default must not refuse them."""
    settings = EngineSettings(
        heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0, chunk_bytes=4 << 20
    )
    c = InProcessCoordinator(tmp_path / "state", settings)
    conn = None
    try:
        register(c, *SITES)
        run_id = submit(c)
        ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
        # 64 MiB and a header: large enough that its download chunks are the full 4 MiB
        big = {"w": torch.arange(16 << 20, dtype=torch.float32)}
        payload = encode(big)
        upload(c, messages(init_task, init_site, payload, chunk=1 << 20))
        (site, task), (other, _) = sorted(tasks_of_round(c, run_id, 1).items())
        limits = [("grpc.max_receive_message_length", 8 << 20)]
        with grpc.insecure_channel(c.address, options=limits) as channel:
            request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
            stub = site_pb2_grpc.SiteServiceStub(channel)  # the generated stubs agree
            sizes = [len(m.data) for m in stub.DownloadModel(request)]
        assert sizes[0] == 4 << 20 and sum(sizes) == len(payload)
        conn = Connection(c.address, other)
        assert conn.chunk_bytes == 1 << 20
        assignment = conn.poll(5.0)
        assert assignment is not None and assignment.round == 1
        model = conn.download(assignment, timeout_s=30.0)
        assert torch.equal(model["w"], big["w"])
        sent = [p.bytes_down for p in round_status(c, run_id, 1).participations]
        assert sent == [len(payload)] * 2  # each whole download recorded at the model's size
    finally:
        if conn is not None:
            conn.close()
        c.close()


def test_a_small_model_travels_in_chunks_sized_to_it(coordinator: InProcessCoordinator) -> None:
    """A 4 MB model goes down in 16 chunks of 1/16th, not in four of 1 MiB: each stream then
    holds a fraction of the model however many sites download at once."""
    c = coordinator
    register(c, *SITES)
    run_id = submit(c)
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    model = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB and a header
    payload = encode(model)
    upload(c, messages(init_task, init_site, payload, chunk=1 << 20))
    site, task = sorted(tasks_of_round(c, run_id, 1).items())[0]
    request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
    sizes = [len(m.data) for m in c.site.DownloadModel(request)]
    assert sum(sizes) == len(payload)
    chunk = transfer_chunk_bytes(len(payload))
    assert chunk == len(payload) // 16 < 1 << 20
    assert sizes[:-1] == [chunk] * (len(sizes) - 1) and len(sizes) == -(-len(payload) // chunk)
    export = admin_pb2.ExportModelRequest(run_id=run_id, round=0)
    exported = [m.data for m in c.admin.ExportModel(export)]
    assert [len(d) for d in exported] == sizes and b"".join(exported) == payload


def test_folding_an_update_holds_one_block_of_it(coordinator: InProcessCoordinator) -> None:
    """The coordinator folds a spooled update in blocks of BLOCK_BYTES (256 KiB), never
    holding two at once, whatever the wire's chunk size: a 4 MB update folds in a fraction
    of its size, and the sum it makes is the update's."""
    c = coordinator
    register(c, *SITES)
    run_id = submit(c)
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    model = {"w": torch.zeros(1 << 20, dtype=torch.float32)}  # 4 MiB
    upload(c, messages(init_task, init_site, encode(model), chunk=1 << 20))
    tasks_of_round(c, run_id, 1)  # round 1 is open: its sum is allocated
    update = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    digest = c.engine.updates.put(encode(update))
    run = c.engine.runs[run_id]
    assert run.accumulator is not None
    with run.fold_lock:
        tracemalloc.start()
        try:
            fold(c.engine, run, digest, 3, SITES[0])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # torch's own allocations are not traced: this bounds the blocks read from the spool.
    assert peak < 1.5 * BLOCK_BYTES < 4 * (1 << 20) // 8
    assert torch.equal(run.accumulator.sums["w"], 3 * update["w"])


def test_a_coordinator_that_lost_its_database_refuses_writes_as_unavailable(
    coordinator: InProcessCoordinator,
) -> None:
    """Once another coordinator holds the database, a call that would write gets
    UNAVAILABLE (the site retries, reaching the one that holds it), and reads still work."""
    c = coordinator
    register(c, SITES[0])
    c.engine._store._fenced = True  # as check_claim leaves it when another took the database
    with pytest.raises(grpc.RpcError) as refused:
        register(c, SITES[1])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no longer holds its database" in (refused.value.details() or "")
    listed = c.admin.ListSites(admin_pb2.ListSitesRequest())
    assert [s.site_id for s in listed.sites] == [SITES[0]]


def test_a_round_whose_sites_all_fail_ends_at_once_saying_why(
    coordinator: InProcessCoordinator,
) -> None:
    """Every sampled site reports a failure before the round driver looks: the attempt
    ends then, not at its deadline, its reason names the sites' errors (not a deadline
    that never passed), and the round the run ended in shows as failed, closed."""
    import time

    run_id, tasks = start_round_one(coordinator, round_deadline_s=300)
    started = time.monotonic()
    with coordinator.engine._lock:  # both failures land before the driver's next look
        for site, task in sorted(tasks.items()):
            coordinator.engine.report_failure(
                site, task.task_id, f"ValueError: bad params at {site}"
            )
    for status in coordinator.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=60):
        if status.state == "failed":
            break
    assert status.state == "failed" and time.monotonic() - started < 60
    a, b = sorted(tasks)
    assert (
        "round 1 attempt 1: 0 of the 2 required updates arrived, and the other sampled sites "
        f"failed; failed: {a}: site reported: ValueError: bad params at {a}; {b}: site reported: "
        f"ValueError: bad params at {b}"
    ) in status.reason, status.reason
    assert "deadline" not in status.reason
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "failed" and r1.closed_unix_s > 0
    assert round_status(coordinator, run_id, 0).status == "committed"


def test_an_attempt_that_can_no_longer_reach_its_quorum_ends_at_once(
    coordinator: InProcessCoordinator,
) -> None:
    """Two of two sites required and one fails: the other's update could not make the
    attempt commit, so the attempt ends at once (not at its 300 s deadline, nor when the
    other site answers), saying why; the other site hears its task withdrawn at its next
    heartbeat, and the retry samples afresh."""
    import time

    run_id, tasks = start_round_one(coordinator, round_deadline_s=300, max_round_attempts=2)
    a, b = sorted(tasks)
    started = time.monotonic()
    coordinator.site.ReportFailure(
        site_pb2.ReportFailureRequest(site_id=a, task_id=tasks[a].task_id, reason="out of memory"),
        timeout=10,
    )
    retry = wait_round(coordinator, run_id, 1)  # open again: attempt 2
    while retry.attempt < 2 and time.monotonic() - started < 30:
        retry = wait_round(coordinator, run_id, 1)
    assert retry.attempt == 2 and time.monotonic() - started < 30
    beat = coordinator.site.Heartbeat(
        site_pb2.HeartbeatRequest(site_id=b, task_id=tasks[b].task_id), timeout=10
    )
    assert not beat.task_current  # withdrawn: b need not train for an attempt that failed
    parts = coordinator.engine._store.list_participations(run_id, 1, 1)
    assert {p.site_id: p.state for p in parts} == {a: "failed", b: "expired"}
    expired = next(p for p in parts if p.site_id == b)
    assert (
        "round 1 attempt 1: 1 of the 2 sampled sites failed, so at most 1 of the 2 required "
        f"updates could arrive: ended early; failed: {a}: site reported: out of memory"
    ) in expired.error, expired.error


def test_a_decline_still_reads_as_one_after_a_restart(tmp_path: Path) -> None:
    """A site declines its task and the coordinator restarts: the resumed attempt knows
    the failure for a decline, so it waits for the other site (an attempt lost only to
    declines does not count) instead of ending early as a failed one; and the site stays
    out of the run's sampling for the rest of its hold, as without the restart."""
    from fedra.coordinator.engine.rounds import short_of_quorum

    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=60.0)
    state = tmp_path / "state"
    c = InProcessCoordinator(state, settings)
    try:
        run_id, tasks = start_round_one(c, round_deadline_s=300)
        a, b = sorted(tasks)
        c.site.ReportFailure(
            site_pb2.ReportFailureRequest(
                site_id=a, task_id=tasks[a].task_id, reason="not approved", declined=True
            ),
            timeout=10,
        )
    finally:
        c.close()
    c = InProcessCoordinator(state, settings)
    try:
        run = c.engine.runs[run_id]
        with c.engine._lock:
            assert run.assignments[a].declined and not run.assignments[b].declined
            assert short_of_quorum(run) is None
            now = c.engine.clock()
            assert set(run.declined) == {a} and now - 30 < run.declined[a] <= now
            eligible = c.engine.eligible_sites(run, now)
            assert a not in eligible and b in eligible
        assert round_status(c, run_id, 1).status == "open"
        beat = c.site.Heartbeat(
            site_pb2.HeartbeatRequest(site_id=b, task_id=tasks[b].task_id), timeout=10
        )
        assert beat.task_current  # b's task still counts: the attempt waits for it
    finally:
        c.close()


def test_a_failed_attempt_reads_its_own_tasks_once_whatever_its_number(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each failed attempt's close reads that attempt's participations once (its failures,
    whether only declines lost it, its bytes): not again for each attempt before it, nor
    the whole round, which at thousands of sites made the gap before a retry tens of
    seconds. Three attempts fail in a row, and the run fails with the third."""
    import time

    c = coordinator
    store = c.engine._store
    reads: list[tuple[int | None, int | None]] = []
    original = store.list_participations

    def counted(run_id: str, number: int | None = None, attempt: int | None = None):  # type: ignore[no-untyped-def]
        reads.append((number, attempt))
        return original(run_id, number, attempt)

    run_id, tasks = start_round_one(c, round_deadline_s=300, max_round_attempts=3)
    monkeypatch.setattr(store, "list_participations", counted)
    for attempt in (1, 2, 3):
        deadline = time.monotonic() + 30
        while (r := round_status(c, run_id, 1)).attempt < attempt:
            assert time.monotonic() < deadline, r
            time.sleep(0.02)
        if attempt > 1:
            tasks = tasks_of_round(c, run_id, 1)
        site = sorted(tasks)[0]
        c.site.ReportFailure(
            site_pb2.ReportFailureRequest(
                site_id=site, task_id=tasks[site].task_id, reason=f"fails in attempt {attempt}"
            ),
            timeout=10,
        )
    deadline = time.monotonic() + 30
    while c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id)).state != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The run's spool is dropped just after it shows failed (nothing refers to it then).
    while (1, None) not in reads:
        assert time.monotonic() < deadline, reads
        time.sleep(0.02)
    # Each attempt once, in turn; the whole round only as the run ends (its spool dropped).
    assert [r for r in reads if r[0] == 1] == [(1, 1), (1, 2), (1, 3), (1, None)], reads


def test_short_of_quorum_only_when_the_failures_leave_too_few_to_come() -> None:
    """The rule alone: 2 of 3 sites required. One failure leaves enough to come; two do
    not, unless nothing is left to wait for, or every failure is a policy's decline (such
    an attempt waits and does not count). An asynchronous run's tasks carry on instead,
    and a Poisson-sampled private run commits whatever arrives."""
    from fedra.coordinator.aggregation import ServerOptimizer
    from fedra.coordinator.engine.rounds import short_of_quorum
    from fedra.coordinator.state import ActiveRun, TaskState
    from fedra.runspec import AsyncSpec, PrivacySpec, RunSpec

    def opened(**spec: object) -> ActiveRun:
        rs = RunSpec("m:t", 3, sites_per_round=3, **spec).validate()  # type: ignore[arg-type]
        run = ActiveRun(run_id="r", spec=rs, optimizer=ServerOptimizer(rs))
        run.set_open(1, 1, {s: f"t-{s}" for s in "abc"}, 0.0, 300.0)
        return run

    run = opened(min_sites=2)
    assert short_of_quorum(run) is None
    run.assignments["a"].move(TaskState.FAILED)
    assert short_of_quorum(run) is None  # b and c can still make 2
    run.assignments["b"].move(TaskState.UPLOADING)
    run.assignments["b"].move(TaskState.FAILED)
    assert short_of_quorum(run) == (
        "2 of the 3 sampled sites failed, so at most 1 of the 2 required updates could "
        "arrive: ended early"
    )
    run.assignments["a"].declined = run.assignments["b"].declined = True
    assert short_of_quorum(run) is None  # declines only: the attempt waits, spared
    run.assignments["b"].declined = False
    assert short_of_quorum(run) is not None
    run.assignments["c"].move(TaskState.UPLOADING)
    run.assignments["c"].move(TaskState.ACCEPTED)
    assert short_of_quorum(run) is None  # nothing left to wait for: it ends anyway
    for spec in (
        {"asynchronous": AsyncSpec(buffer=3)},
        {"privacy": PrivacySpec(epsilon=50.0, sampling="poisson", population=3)},
    ):
        other = opened(**spec)
        for site in "ab":
            other.assignments[site].move(TaskState.FAILED)
        assert short_of_quorum(other) is None, spec


def test_waiting_calls_hold_no_thread_and_others_are_served_meanwhile(tmp_path: Path) -> None:
    """Two dozen long polls and a watch wait on a daemon with 4 worker threads: they hold none,
    the daemon's threads do not grow with them, and a register, a status and a site list
    are answered at once meanwhile."""
    import threading
    import time

    from fedra.runspec import RunSpec

    settings = EngineSettings(poll_timeout_s=30.0, site_timeout_s=60.0)
    c = InProcessCoordinator(tmp_path / "state", settings, workers=4)
    sites = [f"site-{i:02d}" for i in range(24)]  # insecure: one connection, 32 calls at most
    waiting: list[threading.Thread] = []
    try:
        register(c, *sites)
        spec = RunSpec(name="watched", task=TASK, rounds=1).validate()
        c.engine._store.create_run("watched", "watched", TASK, spec.to_json(), 1.0)
        watch = c.admin.WatchRun(admin_pb2.WatchRunRequest(run_id="watched"), timeout=60)
        assert next(watch).state == "pending"
        threads_before = threading.active_count()

        def _wait(site: str) -> None:
            with contextlib.suppress(grpc.RpcError):  # the daemon stopping under it, at the end
                c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=60)

        for site in sites:
            t = threading.Thread(target=_wait, args=(site,))
            t.start()
            waiting.append(t)
        deadline = time.monotonic() + 15
        while c.engine.waiting_calls() < len(sites) + 1:  # every poll and the watch wait
            assert time.monotonic() < deadline, c.engine.waiting_calls()
            time.sleep(0.01)
        started = time.monotonic()
        register(c, "late-site")
        c.admin.GetRun(admin_pb2.GetRunRequest(run_id="watched"), timeout=10)
        listed = c.admin.ListSites(admin_pb2.ListSitesRequest(), timeout=10)
        assert len(listed.sites) == len(sites) + 1
        assert time.monotonic() - started < 5  # not behind the polls' 30 s
        # The daemon's own threads: its executor (4) at most, beside the test's callers.
        daemon_threads = threading.active_count() - threads_before - len(waiting)
        assert daemon_threads <= 4, daemon_threads
        assert all(t.is_alive() for t in waiting)  # every poll still waits
        watch.cancel()
        hung_up = time.monotonic()
        while c.engine.waiting_calls() > len(sites):  # the watch's waiter went with it
            assert time.monotonic() < hung_up + 5
            time.sleep(0.01)
    finally:
        c.close()  # the daemon stopping ends the waiting polls
        for t in waiting:
            t.join(30)
    assert not any(t.is_alive() for t in waiting)


def test_a_round_wakes_only_the_polls_of_the_sites_it_samples(tmp_path: Path) -> None:
    """A poll returns the moment a round opens with its site in it, not at a periodic
    wake-up or its timeout; the poll of a site the round did not sample sleeps on."""
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from fedra.runspec import RunSpec

    settings = EngineSettings(poll_timeout_s=8.0, site_timeout_s=60.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        register(c, *SITES[:2])
        with ThreadPoolExecutor(2) as pool:
            polls = {
                site: pool.submit(
                    c.site.PollTask, site_pb2.PollTaskRequest(site_id=site), timeout=30
                )
                for site in SITES[:2]
            }
            deadline = time.monotonic() + 10
            while c.engine.waiting_calls() < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            submitted = time.monotonic()
            spec = RunSpec(name="one", task=TASK, rounds=1, sites_per_round=1, min_sites=1)
            c.engine.submit(spec.validate())
            done = next(as_completed(polls.values()))
            took = time.monotonic() - submitted
            assert done.result().HasField("task") and took < 2, took
            [other] = [f for f in polls.values() if f is not done]
            assert not other.done()  # not woken: its site is not in the round
            assert not other.result(timeout=20).HasField("task")  # its own timeout ended it
            assert time.monotonic() - submitted > 4
    finally:
        c.close()


def test_the_daemon_s_workers_are_bounded_and_not_sized_to_its_sites(tmp_path: Path) -> None:
    from fedra.config import ConfigError
    from fedra.coordinator.server import DEFAULT_WORKERS, CoordinatorConfig

    assert CoordinatorConfig(state_dir=tmp_path / "s", insecure=True).max_workers == DEFAULT_WORKERS
    with pytest.raises(ConfigError, match="--workers: must be from 4 to 1024, got 2"):
        CoordinatorConfig(state_dir=tmp_path / "s", insecure=True, max_workers=2)


def test_a_site_that_hangs_up_on_its_poll_is_offline_at_once(tmp_path: Path) -> None:
    """A stopped site cancels its poll: the coordinator neither counts it online until the
    poll would have timed out nor samples it, and it is back the moment it polls again."""
    import time

    settings = EngineSettings(poll_timeout_s=30.0, site_timeout_s=60.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        register(c, SITES[0])

        def online() -> bool:
            [site] = c.admin.ListSites(admin_pb2.ListSitesRequest(), timeout=10).sites
            return site.online

        call = c.site.PollTask.future(site_pb2.PollTaskRequest(site_id=SITES[0]), timeout=60)
        deadline = time.monotonic() + 10
        while not c.engine._polling[SITES[0]]:  # waiting in the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert online()
        call.cancel()
        deadline = time.monotonic() + 10  # the engine looks every second: well within this
        while online():
            assert time.monotonic() < deadline, "still online after hanging up"
            time.sleep(0.05)
        assert c.engine.hung_up(SITES[0])
        reply = c.site.PollTask(site_pb2.PollTaskRequest(site_id=SITES[0]), timeout=2)
        assert not reply.HasField("task")  # it waited the 1 s its own deadline leaves
        assert online() and not c.engine.hung_up(SITES[0])  # heard from again
    finally:
        c.close()


def test_a_hang_up_of_an_old_connection_leaves_a_site_with_a_newer_one_online(
    tmp_path: Path,
) -> None:
    """A site that reconnects polls again before the coordinator notices its old poll is
    gone: that old poll must not mark it offline, nor must a hang-up outlive the site's
    next normal poll or its registering again. And a site already online polling again
    wakes nobody."""
    import time

    settings = EngineSettings(poll_timeout_s=30.0, site_timeout_s=60.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    site = SITES[0]
    try:
        register(c, site)
        engine = c.engine

        def online() -> bool:
            return engine.is_online(site, engine.clock())

        def wait_polling(n: int) -> None:
            deadline = time.monotonic() + 10
            while engine._polling[site] != n:
                assert time.monotonic() < deadline, engine._polling[site]
                time.sleep(0.01)

        version = engine.version
        old = c.site.PollTask.future(site_pb2.PollTaskRequest(site_id=site), timeout=60)
        wait_polling(1)
        assert engine.version == version  # online since it registered: no one to wake
        new = c.site.PollTask.future(site_pb2.PollTaskRequest(site_id=site), timeout=3)
        wait_polling(2)
        old.cancel()
        wait_polling(1)  # the old poll is noticed gone (within a second)
        assert online() and not engine.hung_up(site)
        assert not new.result(timeout=10).HasField("task")  # the new poll ends normally
        assert online() and not engine.hung_up(site)

        lone = c.site.PollTask.future(site_pb2.PollTaskRequest(site_id=site), timeout=60)
        wait_polling(1)
        lone.cancel()
        wait_polling(0)
        assert not online() and engine.hung_up(site)
        register(c, site)  # it comes back
        assert online() and not engine.hung_up(site)
    finally:
        c.close()


def _spooled(c: InProcessCoordinator, digests: set[str]) -> set[str]:
    return {d for d in digests if c.engine.updates.exists(d)}


def test_the_next_round_opens_while_the_last_one_s_spool_is_dropped(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping a committed round's spooled updates (a read of its tasks, the unlinks, a
    commit: half a second at 5,000 sites) is not between two rounds: round 2 opens and
    its sites poll while that drop is held up, and once it goes on round 1's files go."""
    c = coordinator
    c.engine.updates.small_bytes = 0  # spooled as files, however small
    store = c.engine._store
    run_id, tasks = start_round_one(c, rounds=3)
    round_one = {t.task_id for t in tasks.values()}
    held, release = threading.Event(), threading.Event()
    original = store.clear_update_data

    def held_up(task_ids: list[str]) -> None:
        if round_one & set(task_ids):
            held.set()
            assert release.wait(30)
        original(task_ids)

    monkeypatch.setattr(store, "clear_update_data", held_up)
    try:
        payloads = {site: delta_payload(0.01 * (i + 1)) for i, site in enumerate(sorted(tasks))}
        for site, task in sorted(tasks.items()):
            upload(c, messages(task, site, payloads[site]))
        digests = {hashlib.sha256(p).hexdigest() for p in payloads.values()}
        assert held.wait(30), "round 1's spooled updates were never dropped"
        deadline = time.monotonic() + 15
        while not [r for r in c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id)).rounds
                   if r.number == 2 and r.status == "open"]:  # fmt: skip
            assert time.monotonic() < deadline, "round 2 waited for round 1's clean-up"
            time.sleep(0.02)
        assert set(tasks_of_round(c, run_id, 2)) == set(tasks)  # its sites have their tasks
    finally:
        release.set()
    deadline = time.monotonic() + 15
    while _spooled(c, digests):  # unlinked before the commit that was held up
        assert time.monotonic() < deadline, _spooled(c, digests)
        time.sleep(0.02)
    while store.holding_update_data():
        assert time.monotonic() < deadline, store.holding_update_data()
        time.sleep(0.02)


def test_a_storage_fault_in_the_spool_s_clean_up_leaves_it_to_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The clean-up's commit finds the database gone: the run carries on (its next rounds
    commit), the closed round's updates stay spooled, and the next start sweeps them."""
    from sqlalchemy.exc import OperationalError

    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        store = c.engine._store  # small updates: held in their rows until the clean-up
        run_id, tasks = start_round_one(c, rounds=2)
        round_one = {t.task_id for t in tasks.values()}
        original = store.clear_update_data

        def gone(task_ids: list[str]) -> None:
            if round_one & set(task_ids):
                raise OperationalError("UPDATE participations", {}, Exception("connection lost"))
            original(task_ids)

        monkeypatch.setattr(store, "clear_update_data", gone)
        payloads = [delta_payload(0.01 * (i + 1)) for i in range(len(tasks))]
        for (site, task), payload in zip(sorted(tasks.items()), payloads, strict=True):
            upload(c, messages(task, site, payload))
        for site, task in sorted(tasks_of_round(c, run_id, 2).items()):
            upload(c, messages(task, site, delta_payload(0.5)))
        status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
        deadline = time.monotonic() + 30
        while status.state != "completed":
            assert time.monotonic() < deadline, status
            time.sleep(0.02)
            status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
        assert "spooled updates stay until the daemon's next start" in caplog.text
        assert round_one <= set(store.holding_update_data())
    finally:
        c.close()
    monkeypatch.undo()
    again = InProcessCoordinator(tmp_path / "state", settings)
    try:
        assert not set(again.engine._store.holding_update_data()) & round_one
    finally:
        again.close()
