"""The site service over real gRPC: the round flow and every way an upload is refused.

Each refusal must carry the right status code and a message naming what was wrong,
and must change nothing: the task stays open and a correct upload is still accepted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.message import Message

from fedra.client.agent import SiteAgent
from fedra.client.connection import Assignment, Connection, _assignment
from fedra.coordinator.engine import EngineSettings
from fedra.examples import synthetic
from fedra.protos import wire
from fedra.protos.codec import CodecError, decode, encode
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, common_pb2, site_pb2, site_pb2_grpc
from fedra.runspec import CodecSpec, TrainSpec
from tests.conftest import InProcessCoordinator
from tests.pagecache import drops_pages, resident_pages

TASK = "fedra.examples.synthetic:task"
SITES = ("site-a", "site-b", "site-c")


def register(c: InProcessCoordinator, *sites: str) -> None:
    for s in sites:
        c.site.Register(site_pb2.RegisterRequest(site_id=s, tasks=[TASK], version="test"))


def submit(c: InProcessCoordinator, **overrides: object) -> str:
    spec = admin_pb2.RunSpec(
        name="t",
        task=TASK,
        rounds=3,
        sites_per_round=2,
        min_sites=2,
        round_deadline_s=60,
        max_round_attempts=1,
        join_timeout_s=5,
        strategy="fedavg",
        train=common_pb2.TrainSettings(local_steps=1, batch_size=8, learning_rate=0.1),
    )
    for k, v in overrides.items():
        if isinstance(v, Message):
            getattr(spec, k).CopyFrom(v)
        else:
            setattr(spec, k, v)
    return c.admin.SubmitRun(admin_pb2.SubmitRunRequest(spec=spec)).run_id


def wait_round(
    c: InProcessCoordinator, run_id: str, number: int, state: str = "open"
) -> admin_pb2.RoundStatus:
    """Follow WatchRun until round ``number`` reaches ``state`` (bounded by the stream timeout)."""
    for status in c.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=30):
        for r in status.rounds:
            if r.number == number and r.status == state:
                return r
    raise AssertionError(f"run {run_id} ended before round {number} was {state}")


def serve_one_run(c: InProcessCoordinator, agent: SiteAgent, rounds: int) -> str:
    """Serve a run of ``rounds`` with ``agent``, its one site, running in a thread; the
    run (its id returned) must complete, and the agent is stopped after it, however it
    went."""
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        run_id = submit(c, sites_per_round=1, min_sites=1, rounds=rounds)
        for status in c.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=60):
            if status.state in ("completed", "failed", "cancelled"):
                break
        assert status.state == "completed", status.reason
    finally:
        agent.shutdown()
        thread.join(30)
    assert not thread.is_alive()
    return run_id


def tasks_of_round(c: InProcessCoordinator, run_id: str, number: int) -> dict[str, site_pb2.Task]:
    """The tasks of round ``number``, collected by polling each sampled site."""
    rnd = wait_round(c, run_id, number)
    tasks = {}
    for site in rnd.sampled_sites:
        r = c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=10)
        assert r.HasField("task") and r.task.round == number, (site, r)
        tasks[site] = r.task
    return tasks


def model_state() -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for k, v in synthetic.task.create_model(0, {}).state_dict().items()
    }


def messages(
    task: site_pb2.Task,
    site: str,
    payload: bytes,
    *,
    nonce: bytes | None = None,
    sha256: str | None = None,
    payload_bytes: int | None = None,
    num_samples: int = 10,
    codec: str = "none",
    round_number: int | None = None,
    chunk: int = 7,
) -> Iterator[site_pb2.UpdateChunk]:
    header = site_pb2.UpdateHeader(
        site_id=site,
        run_id=task.run_id,
        round=task.round if round_number is None else round_number,
        task_id=task.task_id,
        num_samples=num_samples,
        metrics={"train_loss": 1.0},
        codec=codec,
        sha256=sha256 if sha256 is not None else hashlib.sha256(payload).hexdigest(),
        nonce=nonce if nonce is not None else os.urandom(16),
        payload_bytes=len(payload) if payload_bytes is None else payload_bytes,
    )
    yield site_pb2.UpdateChunk(header=header)
    for i in range(0, len(payload), chunk):
        yield site_pb2.UpdateChunk(data=payload[i : i + chunk])


def upload(
    c: InProcessCoordinator, msgs: Iterator[site_pb2.UpdateChunk], via: str = "stream"
) -> site_pb2.UploadUpdateResponse | site_pb2.UploadSmallUpdateResponse:
    """The coordinator's reply. ``via``: "stream" (UploadUpdate, the messages as they are)
    or "unary" (UploadSmallUpdate: the header and the chunks joined)."""
    if via == "stream":
        return c.site.UploadUpdate(msgs, timeout=30)
    first, *rest = msgs
    request = site_pb2.UploadSmallUpdateRequest(
        header=first.header, payload=b"".join(m.data for m in rest)
    )
    return c.site.UploadSmallUpdate(request, timeout=30)


def refused(
    c: InProcessCoordinator,
    msgs: Iterator[site_pb2.UpdateChunk],
    code: grpc.StatusCode,
    text: str,
    via: str = "stream",
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        upload(c, msgs, via)
    err = info.value
    assert err.code() == code, err.details()
    assert text in err.details(), err.details()


def round_status(c: InProcessCoordinator, run_id: str, number: int) -> admin_pb2.RoundStatus:
    status = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
    return next(r for r in status.rounds if r.number == number)


def start_round_one(
    c: InProcessCoordinator, **spec: object
) -> tuple[str, dict[str, site_pb2.Task]]:
    register(c, *SITES)
    run_id = submit(c, **spec)
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    assert init_task.kind == site_pb2.TASK_KIND_INIT
    upload(c, messages(init_task, init_site, encode(model_state())))
    return run_id, tasks_of_round(c, run_id, 1)


def delta_payload(scale: float = 0.01) -> bytes:
    return encode({k: torch.full_like(v, scale) for k, v in model_state().items()})


def test_full_round_flow_downloads_the_initial_model_and_averages(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(coordinator)
    assert len(tasks) == 2
    initial = model_state()
    for i, (site, task) in enumerate(sorted(tasks.items())):
        chunks = coordinator.site.DownloadModel(
            site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
        )
        payload = b"".join(m.data for m in chunks)
        assert hashlib.sha256(payload).hexdigest() == task.model_sha256
        upload(
            coordinator,
            messages(task, site, delta_payload(0.1 * (i + 1)), num_samples=10 * (i + 1)),
        )
    wait_round(coordinator, run_id, 1, "committed")

    export = coordinator.admin.ExportModel(admin_pb2.ExportModelRequest(run_id=run_id, round=1))
    model = decode(b"".join(m.data for m in export))
    # FedAvg weighted by samples: (10 * 0.1 + 20 * 0.2) / 30
    expected = {k: v + (10 * 0.1 + 20 * 0.2) / 30 for k, v in initial.items()}
    for k, v in expected.items():
        torch.testing.assert_close(model[k], v)
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "committed" and r1.updates == 2
    assert r1.bytes_down > 0 and r1.bytes_up > 0
    # The round's ledger: every stage timed, the whole round at least as long as its parts.
    stages = dict(r1.stages)
    assert set(stages) == {
        "distribute_s", "compute_s", "transfer_s", "aggregate_s", "checkpoint_s", "round_s",
        "fold_tail_s",
    }  # fmt: skip
    assert all(v >= 0 for v in stages.values())
    assert stages["aggregate_s"] > 0 and stages["checkpoint_s"] > 0 and stages["distribute_s"] > 0
    assert stages["round_s"] >= stages["checkpoint_s"]


def test_a_site_checks_a_large_model_it_downloads_against_its_task_s_digest(
    coordinator: InProcessCoordinator,
) -> None:
    """Hashed beside its receipt (past its first MiB), a downloaded model is still whole
    and checked before it is used: bytes that do not hash to the task's digest are
    refused."""
    register(coordinator, *SITES)
    run_id = submit(coordinator)
    ((site, init),) = tasks_of_round(coordinator, run_id, 0).items()
    big = {"w": torch.randn(600_000), "b": torch.arange(10, dtype=torch.int64)}  # 2.4 MB
    upload(coordinator, messages(init, site, encode(big), chunk=1 << 20))
    tasks = tasks_of_round(coordinator, run_id, 1)
    conn = Connection(coordinator.address, site)
    try:
        task = _assignment(tasks[site], b"")
        model = conn.download(task, timeout_s=30.0)
        assert model.keys() == big.keys()
        for k, v in big.items():
            torch.testing.assert_close(model[k], v, rtol=0, atol=0)
        wrong = replace(task, model_sha256=hashlib.sha256(b"another model").hexdigest())
        with pytest.raises(CodecError, match="model SHA-256"):
            conn.download(wrong, timeout_s=30.0)
    finally:
        conn.close()


def test_a_checkpoint_the_next_one_replaced_leaves_the_page_cache(
    coordinator: InProcessCoordinator,
) -> None:
    """Every round writes a checkpoint that stays on disk; once the next round's replaces
    it, its pages leave the OS's page cache (which would otherwise pile up a model a
    round), while the latest, which the sites download, stays."""
    models = coordinator.engine.models
    if not drops_pages(models.root):
        pytest.skip(f"{models.root}'s file system keeps a file's pages whatever it is asked")
    run_id, tasks = start_round_one(coordinator)
    for site, task in sorted(tasks.items()):
        upload(coordinator, messages(task, site, delta_payload(0.1)))
    wait_round(coordinator, run_id, 1, "committed")
    store = coordinator.engine._store
    initial, first = (store.get_checkpoint(run_id, n) for n in (0, 1))
    assert initial is not None and first is not None
    assert initial.model_sha256 != first.model_sha256
    replaced, latest = models.path(initial.model_sha256), models.path(first.model_sha256)
    deadline = time.monotonic() + 10.0  # dropped as round 2 opens, beside the sites' work
    while resident_pages(replaced) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident_pages(replaced) == 0
    assert resident_pages(latest) > 0
    next_task = tasks_of_round(coordinator, run_id, 2)[site]
    request = site_pb2.DownloadModelRequest(site_id=site, task_id=next_task.task_id)
    chunks = coordinator.site.DownloadModel(request)
    assert hashlib.sha256(b"".join(m.data for m in chunks)).hexdigest() == first.model_sha256
    whole = b"".join(models.read_chunks(initial.model_sha256))  # still on disk, as it was
    assert hashlib.sha256(whole).hexdigest() == initial.model_sha256


@pytest.mark.parametrize(
    ("case", "code", "text"),
    [
        ("wrong_round", grpc.StatusCode.INVALID_ARGUMENT, "header names run"),
        ("bad_codec", grpc.StatusCode.INVALID_ARGUMENT, "codec 'zstd'"),
        ("short_nonce", grpc.StatusCode.INVALID_ARGUMENT, "nonce must be 16 bytes"),
        ("bad_sha_format", grpc.StatusCode.INVALID_ARGUMENT, "sha256 must be 64"),
        ("zero_samples", grpc.StatusCode.INVALID_ARGUMENT, "num_samples must be in"),
        ("huge_weight", grpc.StatusCode.INVALID_ARGUMENT, "num_samples must be in"),
        ("checksum", grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        ("wrong_shape", grpc.StatusCode.INVALID_ARGUMENT, "linear.weight"),
        ("wrong_dtype", grpc.StatusCode.INVALID_ARGUMENT, "linear.bias"),
        ("missing_tensor", grpc.StatusCode.INVALID_ARGUMENT, "linear.bias"),
        ("extra_tensor", grpc.StatusCode.INVALID_ARGUMENT, "sneaky"),
        ("nan", grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
        ("inf", grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
        ("longer_than_declared", grpc.StatusCode.INVALID_ARGUMENT, "longer than the declared"),
        ("shorter_than_declared", grpc.StatusCode.INVALID_ARGUMENT, "payload ended after"),
        ("garbage", grpc.StatusCode.INVALID_ARGUMENT, "payload"),
        ("too_big", grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds"),
        ("unknown_task", grpc.StatusCode.NOT_FOUND, "no task"),
        ("other_sites_task", grpc.StatusCode.PERMISSION_DENIED, "was not given to site"),
        ("unregistered_site", grpc.StatusCode.NOT_FOUND, "not registered"),
    ],
)
@pytest.mark.parametrize("via", ["stream", "unary"])
def test_bad_upload_is_refused_and_changes_nothing(
    coordinator: InProcessCoordinator, case: str, code: grpc.StatusCode, text: str, via: str
) -> None:
    run_id, tasks = start_round_one(coordinator)
    (site, task), (other_site, other_task) = sorted(tasks.items())
    good = delta_payload()
    state = model_state()
    msgs = {
        "wrong_round": lambda: messages(task, site, good, round_number=task.round + 1),
        "bad_codec": lambda: messages(task, site, good, codec="zstd"),
        "short_nonce": lambda: messages(task, site, good, nonce=b"123"),
        "bad_sha_format": lambda: messages(task, site, good, sha256="xyz"),
        "zero_samples": lambda: messages(task, site, good, num_samples=0),
        "huge_weight": lambda: messages(task, site, good, num_samples=2**62),
        "checksum": lambda: messages(task, site, good, sha256=hashlib.sha256(b"other").hexdigest()),
        "wrong_shape": lambda: messages(
            task, site, encode({**state, "linear.weight": torch.zeros(2, 8)})
        ),
        "wrong_dtype": lambda: messages(
            task, site, encode({**state, "linear.bias": torch.zeros(1, dtype=torch.float64)})
        ),
        "missing_tensor": lambda: messages(
            task, site, encode({"linear.weight": state["linear.weight"]})
        ),
        "extra_tensor": lambda: messages(task, site, encode({**state, "sneaky": torch.zeros(1)})),
        "nan": lambda: messages(
            task, site, encode({**state, "linear.weight": torch.full((1, 8), float("nan"))})
        ),
        "inf": lambda: messages(
            task, site, encode({**state, "linear.bias": torch.tensor([float("inf")])})
        ),
        "longer_than_declared": lambda: messages(task, site, good, payload_bytes=len(good) - 8),
        "shorter_than_declared": lambda: messages(task, site, good, payload_bytes=len(good) + 8),
        "garbage": lambda: messages(task, site, b"\xff" * 64),
        "too_big": lambda: messages(task, site, good, payload_bytes=2**40),
        "unknown_task": lambda: messages(
            site_pb2.Task(task_id="f" * 32, run_id=run_id, round=1), site, good
        ),
        "other_sites_task": lambda: messages(other_task, site, good),
        "unregistered_site": lambda: messages(task, "site-z", good),
    }[case]()
    refused(coordinator, msgs, code, text, via)

    # Nothing changed: both tasks still open, nothing accepted, nothing spooled.
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "open" and r1.updates == 0
    assert {p.status for p in r1.participations} <= {"assigned", "downloaded"}
    spool = coordinator.engine.updates.root
    assert not [p for p in spool.rglob("*") if p.is_file()], "a refused upload left a file behind"
    # ... and the same sites can still deliver correct updates.
    upload(coordinator, messages(task, site, good))
    upload(coordinator, messages(other_task, other_site, good))
    assert wait_round(coordinator, run_id, 1, "committed").updates == 2


def test_one_update_per_site_per_round_and_no_nonce_reuse(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(coordinator, sites_per_round=3, min_sites=3)
    (s1, t1), (s2, t2), _ = sorted(tasks.items())
    nonce = os.urandom(16)
    upload(coordinator, messages(t1, s1, delta_payload(), nonce=nonce))
    refused(
        coordinator,
        messages(t1, s1, delta_payload()),
        grpc.StatusCode.ALREADY_EXISTS,
        "already accepted",
    )
    refused(
        coordinator,
        messages(t2, s2, delta_payload(), nonce=nonce),
        grpc.StatusCode.ALREADY_EXISTS,
        "nonce",
    )
    r1 = round_status(coordinator, run_id, 1)
    assert r1.updates == 1
    assert {p.site_id: p.status for p in r1.participations}[s2] in ("assigned", "downloaded")
    upload(coordinator, messages(t2, s2, delta_payload()))
    assert round_status(coordinator, run_id, 1).updates == 2


def test_late_update_is_refused_and_the_site_gets_the_next_task(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(
        coordinator, sites_per_round=3, min_sites=2, round_deadline_s=2.0
    )
    (s1, t1), (s2, t2), (late_site, late_task) = sorted(tasks.items())
    upload(coordinator, messages(t1, s1, delta_payload()))
    upload(coordinator, messages(t2, s2, delta_payload()))
    wait_round(coordinator, run_id, 1, "committed")  # at its deadline, with 2 of 3
    refused(
        coordinator,
        messages(late_task, late_site, delta_payload()),
        grpc.StatusCode.FAILED_PRECONDITION,
        "has closed",
    )
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "committed" and r1.updates == 2
    late = {p.site_id: p for p in r1.participations}[late_site]
    assert late.status == "expired" and "round closed" in late.error
    # The straggler simply gets the next round's task.
    r = coordinator.site.PollTask(site_pb2.PollTaskRequest(site_id=late_site), timeout=10)
    assert r.HasField("task") and r.task.round == 2


def test_a_small_update_in_one_call_counts_as_a_streamed_one(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(coordinator)
    (s1, t1), (s2, t2) = sorted(tasks.items())
    payload = delta_payload(0.1)
    reply = upload(coordinator, messages(t1, s1, payload), via="unary")
    assert reply.bytes_received == len(payload)
    again = messages(t1, s1, payload)
    refused(coordinator, again, grpc.StatusCode.ALREADY_EXISTS, "already accepted", via="unary")
    upload(coordinator, messages(t2, s2, delta_payload(0.3)))  # the other, streamed
    assert wait_round(coordinator, run_id, 1, "committed").updates == 2
    export = coordinator.admin.ExportModel(admin_pb2.ExportModelRequest(run_id=run_id, round=1))
    model = decode(b"".join(m.data for m in export))
    for name, value in model_state().items():  # equal samples: the plain mean of the steps
        torch.testing.assert_close(model[name], value + 0.2)


def test_a_one_call_upload_without_a_header_or_too_large_is_refused(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(coordinator)
    (site, task), _ = sorted(tasks.items())
    no_header = site_pb2.UploadSmallUpdateRequest(payload=delta_payload())
    large = encode({"linear.weight": torch.zeros(1, 20_000), "linear.bias": torch.zeros(1)})
    (first, *_) = messages(task, site, large)
    too_large = site_pb2.UploadSmallUpdateRequest(header=first.header, payload=large)
    for request, text in ((no_header, "header"), (too_large, "send it with UploadUpdate")):
        with pytest.raises(grpc.RpcError) as info:
            coordinator.site.UploadSmallUpdate(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert text in info.value.details(), info.value.details()
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "open" and r1.updates == 0
    assert upload(coordinator, messages(task, site, delta_payload()), via="unary").bytes_received


def test_upload_must_start_with_a_header(coordinator: InProcessCoordinator) -> None:
    register(coordinator, "site-a")
    for stream in ([site_pb2.UpdateChunk(data=b"x")], []):  # an empty one: once its end
        # is confirmed as the caller's own (wire.RequestStream.closed)
        refused(coordinator, iter(stream), grpc.StatusCode.INVALID_ARGUMENT, "header")


def test_register_refuses_bad_site_ids_and_empty_task_lists(
    coordinator: InProcessCoordinator,
) -> None:
    for site_id, tasks, text in [
        ("", [TASK], "site_id"),
        ("a b", [TASK], "site_id"),
        ("ok", [], "tasks"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            coordinator.site.Register(site_pb2.RegisterRequest(site_id=site_id, tasks=tasks))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert text in info.value.details()
    assert coordinator.admin.ListSites(admin_pb2.ListSitesRequest()).sites == []


def test_bad_run_spec_is_refused_with_the_key_and_creates_nothing(
    coordinator: InProcessCoordinator,
) -> None:
    cases = {
        "rounds": 0,
        "min_sites": 5,
        "strategy": "sgd",
        "task": "nocolon",
        "round_deadline_s": -1.0,
    }
    for key, value in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            submit(coordinator, **{key: value})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert key.split("_s")[0] in info.value.details() or "strategy" in info.value.details()
    assert coordinator.admin.ListRuns(admin_pb2.ListRunsRequest()).runs == []


def test_unknown_run_is_not_found(coordinator: InProcessCoordinator) -> None:
    for call, request in [
        (coordinator.admin.GetRun, admin_pb2.GetRunRequest(run_id="nope")),
        (coordinator.admin.CancelRun, admin_pb2.CancelRunRequest(run_id="nope")),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()


def test_round_without_quorum_is_retried_then_the_run_fails_with_the_reason(
    coordinator: InProcessCoordinator,
) -> None:
    register(coordinator, *SITES)
    run_id = submit(coordinator, round_deadline_s=0.5, max_round_attempts=2)
    for status in coordinator.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=30):
        if status.state == "failed":
            break
    else:
        raise AssertionError("the run did not fail")
    assert "round 0 attempt 2: 0 of the 1 required updates" in status.reason
    assert "gave up after 2 attempts" in status.reason
    (r0,) = status.rounds
    assert r0.status == "failed" and r0.attempt == 2 and r0.closed_unix_s > 0  # ended with it
    assert [p.attempt for p in r0.participations] == [1, 2]
    assert {p.status for p in r0.participations} == {"expired"}
    # Nothing is left for the sites to do.
    for site in SITES:
        r = coordinator.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=10)
        assert not r.HasField("task")


def test_cancel_withdraws_the_task(coordinator: InProcessCoordinator) -> None:
    run_id, tasks = start_round_one(coordinator)
    site, task = sorted(tasks.items())[0]
    beat = site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id)
    assert coordinator.site.Heartbeat(beat).task_current
    state = coordinator.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id)).state
    assert state == "cancelled"
    for status in coordinator.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=30):
        if status.state == "cancelled":
            break
    assert not coordinator.site.Heartbeat(beat).task_current
    refused(
        coordinator,
        messages(task, site, delta_payload()),
        grpc.StatusCode.FAILED_PRECONDITION,
        "closed",
    )
    with pytest.raises(grpc.RpcError) as info:
        coordinator.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already cancelled" in info.value.details()


def test_health_service_reports_serving(coordinator: InProcessCoordinator) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(coordinator.channel)
    for service in ("", "fedra.v1.SiteService", "fedra.v1.AdminService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_status_says_when_the_coordinator_is_insecure(coordinator: InProcessCoordinator) -> None:
    register(coordinator, *SITES)
    run_id = submit(coordinator)
    status = coordinator.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
    assert status.coordinator_insecure
    from fedra.cli import format_status

    assert "WITHOUT TLS" in format_status(status)


def test_a_retry_of_an_accepted_update_is_answered_as_done(
    coordinator: InProcessCoordinator,
) -> None:
    """The reply to an accepted upload was lost; the site retries with the same nonce."""
    run_id, tasks = start_round_one(coordinator, sites_per_round=3, min_sites=3)
    site, task = sorted(tasks.items())[0]
    nonce, payload = os.urandom(16), delta_payload()
    first = upload(coordinator, messages(task, site, payload, nonce=nonce))
    again = upload(coordinator, messages(task, site, payload, nonce=nonce))
    assert again.bytes_received == first.bytes_received == len(payload)
    assert round_status(coordinator, run_id, 1).updates == 1  # counted once


def test_watch_resends_a_round_only_when_it_changed(coordinator: InProcessCoordinator) -> None:
    """WatchRun with changed_rounds_only: the first message is whole, later ones carry only
    the rounds that changed, and together they add up to the status GetRun reports. Without
    the flag every message holds every round (what a client from before it expects)."""
    from fedra.admin import AdminClient
    from fedra.coordinator.status import RunWatch

    run_id, tasks = start_round_one(coordinator)
    changes = coordinator.admin.WatchRun(
        admin_pb2.WatchRunRequest(run_id=run_id, changed_rounds_only=True), timeout=30
    )
    whole = coordinator.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=30)
    first = next(changes)
    assert [(r.number, r.status) for r in first.rounds] == [(0, "committed"), (1, "open")]
    assert first.spec.task == TASK and first.state == "running"
    assert [r.number for r in next(whole).rounds] == [0, 1]
    for site, task in sorted(tasks.items()):
        upload(coordinator, messages(task, site, delta_payload()))
    kept = {r.number: r for r in first.rounds}
    later = []
    for status in changes:  # until round 2 has opened (bounded by the stream's deadline)
        later.append([r.number for r in status.rounds])
        kept.update((r.number, r) for r in status.rounds)
        if 2 in kept:
            break
    changes.cancel()
    assert all(0 not in numbers for numbers in later), later  # round 0 never changed
    assert [1] in later or [1, 2] in later, later  # round 1's updates and commit
    assert kept[1].status == "committed" and kept[2].status == "open"
    status = coordinator.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id))
    assert [kept[n] for n in sorted(kept)] == list(status.rounds)
    for status in whole:  # every message whole
        assert [r.number for r in status.rounds][:2] == [0, 1]
        if len(status.rounds) == 3:
            break
    whole.cancel()
    # The typed client merges the changes: each status it yields holds every round.
    with AdminClient(coordinator.address) as admin:
        merged = next(iter(admin.watch(run_id, timeout_s=30)))
    assert list(merged.rounds) == list(status.rounds)
    # A watch reads only the rounds that can still change: 0 and 1 are final now.
    watch = RunWatch(coordinator.engine, run_id, insecure=True, changed_rounds_only=True)
    [message] = watch.look()
    assert [r.number for r in message.rounds] == [0, 1, 2]
    assert watch.floor == 0  # rounds 0 and 1 are final, but only sent once so far
    assert watch.look() == []  # nothing changed since
    assert (watch.floor, sorted(watch.sent)) == (2, [2])  # not read again from here on
    # However long the run, no message is much larger than message_bytes: here a round each,
    # all but the last saying that more of the same look follows.
    small = RunWatch(coordinator.engine, run_id, True, True, message_bytes=1)
    batches = small.look()
    assert [[r.number for r in m.rounds] for m in batches] == [[0], [1], [2]]
    assert [m.more_rounds_follow for m in batches] == [True, True, False]
    assert all(m.state == "running" and m.spec.task == TASK for m in batches)


def test_a_watch_shows_a_download_and_keeps_reading_its_round_until_it_is_written(
    coordinator: InProcessCoordinator,
) -> None:
    """A download is counted in the database a moment after it ends: the watch is told
    when it is, and a closed round with a download still under way is not taken for final
    (its bytes would be missed for good)."""
    from fedra.coordinator.status import RunWatch

    run_id, tasks = start_round_one(
        coordinator, sites_per_round=3, min_sites=2, round_deadline_s=6.0
    )
    (s1, t1), (s2, t2), (slow, slow_task) = sorted(tasks.items())
    # The stream ends before the round's deadline and long before the watch's own look
    # every 10 s: only the ledger's notice can bring the download's row in time.
    changes = coordinator.admin.WatchRun(
        admin_pb2.WatchRunRequest(run_id=run_id, changed_rounds_only=True), timeout=4
    )
    next(changes)
    store = coordinator.engine._store
    original, release = store.mark_downloaded_many, threading.Event()

    def _late(
        rows: list[tuple[str, int, float, int | None]], cuts: list[tuple[str, int]]
    ) -> list[str]:
        release.wait(10)  # written after the watch's look at the download's own notice
        return original(rows, cuts)

    store.mark_downloaded_many = _late  # type: ignore[method-assign]
    threading.Timer(0.5, release.set).start()
    payload = b"".join(
        m.data
        for m in coordinator.site.DownloadModel(
            site_pb2.DownloadModelRequest(site_id=s1, task_id=t1.task_id), timeout=10
        )
    )
    for status in changes:  # the download's row, sent without any other change
        [r1] = [r for r in status.rounds if r.number == 1] or [None]
        if r1 is not None and r1.bytes_down == len(payload):
            break
    changes.cancel()
    store.mark_downloaded_many = original  # type: ignore[method-assign]
    # The slow site's download is under way (its call open) while the round closes.
    engine = coordinator.engine
    engine.open_download(slow, slow_task.task_id)
    upload(coordinator, messages(t1, s1, delta_payload()))
    upload(coordinator, messages(t2, s2, delta_payload()))
    wait_round(coordinator, run_id, 1, "committed")  # at its deadline, with 2 of 3
    watch = RunWatch(engine, run_id, insecure=True, changed_rounds_only=True)
    for _ in range(3):
        watch.look()
    assert watch.floor == 1  # round 0 passed over; round 1 still read
    before = {p.site_id: p.bytes_down for p in round_status(coordinator, run_id, 1).participations}
    assert before[slow] == 0
    engine.record_download(slow_task.task_id, 1234, 0.5, 1)
    assert engine.downloads.flush(10)
    [message] = watch.look()
    [r1] = [r for r in message.rounds if r.number == 1]
    assert {p.site_id: p.bytes_down for p in r1.participations}[slow] == 1234
    watch.look()
    assert watch.floor == 2  # now it can change no more


def test_an_upload_cut_off_mid_stream_is_given_back_quietly(
    coordinator: InProcessCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """A site that dies or cancels mid-upload (or a daemon stopping under it) is an
    ordinary event: the task is the site's again at once, and the log says so in one
    line rather than as an internal error with a traceback."""
    import threading
    import time

    caplog.set_level(logging.INFO, logger="fedra.coordinator")
    _, tasks = start_round_one(coordinator)
    site, task = sorted(tasks.items())[0]
    payload = delta_payload()
    sent_some = threading.Event()

    def _cut_short() -> Iterator[site_pb2.UpdateChunk]:
        msgs = messages(task, site, payload, chunk=64)
        yield next(msgs)
        yield next(msgs)
        sent_some.set()
        threading.Event().wait(30)  # never sends the rest: the call is cancelled

    call = coordinator.site.UploadUpdate.future(_cut_short(), timeout=30)
    assert sent_some.wait(10)
    # Cut off once the coordinator is receiving it: a call cancelled before its handler
    # ran is never the coordinator's to log (a race this test would otherwise lose).
    began = time.monotonic() + 10
    while not coordinator.engine._moving[site]:
        assert time.monotonic() < began and not call.done(), "the upload never began"
        threading.Event().wait(0.01)
    call.cancel()
    # The handler's last act is one line. Which one is gRPC's race: its request stream
    # either fails as cancelled, or (the cancellation not yet seen) just ends, short.
    ends = ("ended before its request stream", "payload ended after 64 of the declared")
    deadline = time.monotonic() + 10
    while not any(end in caplog.text for end in ends):
        assert time.monotonic() < deadline, caplog.text
        threading.Event().wait(0.02)
    assert "unexpected error" not in caplog.text, caplog.text  # not an internal error
    assert "Traceback" not in caplog.text, caplog.text
    assert upload(coordinator, messages(task, site, payload)).bytes_received == len(payload)


@pytest.mark.parametrize("sent", ["whole", "short"])
def test_an_upload_whose_call_ends_after_its_stream_is_cut_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sent: str
) -> None:
    """The end of an upload's stream is confirmed (wire.RequestStream.defer_end_check)
    beside the payload's last checks and its spool file's sync, before the file is put in
    place. A call that ends just after its stream did (the transport refusing a message
    over the size limit ends a stream alike; here the caller cancels) counts for nothing,
    leaves nothing in the spool, and is logged as cut, not refused as short or headless
    (the site was told why it ended); the site's retry counts."""
    monkeypatch.setattr(wire, "STREAM_END_CHECK_S", 3.0)  # the check, made long
    caplog.set_level(logging.INFO, logger="fedra.coordinator")
    settings = EngineSettings(
        heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0,
        inline_model_bytes=0, small_update_bytes=0,  # every update a spool file
    )  # fmt: skip
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        run_id, tasks = start_round_one(c)
        site, task = sorted(tasks.items())[0]
        payload = delta_payload()
        digest = hashlib.sha256(payload).hexdigest()
        spool = c.engine.updates.blobs
        closed = threading.Event()
        whole = list(messages(task, site, payload, chunk=64))
        stream = whole if sent == "whole" else whole[:2]

        def then_closed() -> Iterator[site_pb2.UpdateChunk]:
            yield from stream
            closed.set()  # gRPC asks past the last message: the stream is closed now

        call = c.site.UploadUpdate.future(then_closed(), timeout=30)
        assert closed.wait(10)
        threading.Event().wait(1.0)  # the coordinator reads the end, then checks it
        call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
        deadline = time.monotonic() + 10
        while "ended before its request stream" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            threading.Event().wait(0.02)
        while c.engine._moving.get(site, 0):
            assert time.monotonic() < deadline
            threading.Event().wait(0.02)
        assert "INVALID_ARGUMENT" not in caplog.text, caplog.text
        assert round_status(c, run_id, 1).updates == 0
        assert not spool.path(digest).exists() and list(spool._tmp.iterdir()) == []
        monkeypatch.setattr(wire, "STREAM_END_CHECK_S", 0.005)
        assert upload(c, messages(task, site, payload)).bytes_received == len(payload)
        assert spool.path(digest).exists() and list(spool._tmp.iterdir()) == []
        assert round_status(c, run_id, 1).updates == 1
    finally:
        c.close()


def test_a_round_s_calls_leave_nothing_in_reference_cycles(tmp_path: Path) -> None:
    """Polls, uploads (one call and streamed) and status reads end without leaving the
    call, its upload's ticket or the futures of its accept in a reference cycle: such
    garbage waits for the collector, whose work at thousands of sites grew with it
    (scale.md). gRPC's own per-call leftovers (its method lookup's closure) are not
    counted."""
    import gc

    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
    c = InProcessCoordinator(tmp_path / "state", settings)  # models come with their tasks

    def opened(run_id: str, number: int) -> admin_pb2.RoundStatus:
        deadline = time.monotonic() + 10
        while True:  # the round opens a moment after the one before commits
            rounds = c.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id)).rounds
            found = [r for r in rounds if r.number == number]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"round {number} did not open"
            threading.Event().wait(0.02)

    def play(run_id: str, number: int, via: str) -> None:
        sampled = opened(run_id, number).sampled_sites
        for site in sorted(sampled):
            task = c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=10).task
            assert task.round == number
            upload(c, messages(task, site, delta_payload(), chunk=64), via=via)
        deadline = time.monotonic() + 10
        while round_status(c, run_id, number).status != "committed":
            assert time.monotonic() < deadline, f"round {number} did not commit"
            threading.Event().wait(0.02)

    try:
        run_id, _ = start_round_one(c, rounds=6)
        play(run_id, 1, "unary")  # warm
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for number, via in ((2, "unary"), (3, "stream"), (4, "unary"), (5, "stream")):
                play(run_id, number, via)
            gc.collect()
            left = Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        # Before, each of the 8 uploads left its ticket and two futures, and each of the
        # calls its call state; a few may be another test's, become garbage meanwhile.
        kinds = ("UploadTicket", "Future", "_Call", "_Caller", "RPCState", "_ServicerContext")
        cycles = {k: left[k] for k in kinds if left[k]}
        assert max(cycles.values(), default=0) < 4, f"left in reference cycles: {cycles} ({left})"
    finally:
        c.close()


def _cut_bytes(c: InProcessCoordinator, run_id: str, number: int) -> dict[str, int]:
    assert c.engine.downloads.flush(10)  # the ledger writes them in the background
    return {p.site_id: p.bytes_cut for p in round_status(c, run_id, number).participations}


def test_a_refused_upload_s_payload_is_counted_as_cut_and_nothing_else_changes(
    coordinator: InProcessCoordinator,
) -> None:
    run_id, tasks = start_round_one(coordinator)
    (site, task), (other_site, other_task) = sorted(tasks.items())
    good = delta_payload()
    refused(
        coordinator,
        messages(task, site, good, sha256=hashlib.sha256(b"other").hexdigest()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "checksum mismatch",
    )
    # Refused from its header: no payload was read, none counted.
    refused(
        coordinator,
        messages(other_task, other_site, good, codec="zstd"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "codec",
    )
    assert _cut_bytes(coordinator, run_id, 1) == {site: len(good), other_site: 0}
    r1 = round_status(coordinator, run_id, 1)
    assert (r1.cut_bytes, r1.lost_bytes) == (len(good), len(good))
    assert r1.status == "open" and r1.updates == 0
    assert {p.status for p in r1.participations} <= {"assigned", "downloaded"}
    upload(coordinator, messages(task, site, good))  # the retry counts in full
    upload(coordinator, messages(other_task, other_site, good))
    r1 = wait_round(coordinator, run_id, 1, "committed")
    by_site = {p.site_id: p for p in r1.participations}
    assert (by_site[site].bytes_up, by_site[site].bytes_cut) == (len(good), len(good))
    assert r1.lost_bytes == len(good)  # the refused try only


def test_an_update_that_arrives_after_its_round_closed_is_cut_whole(
    coordinator: InProcessCoordinator,
) -> None:
    """Its upload began in time; the round closed (at its deadline) while it streamed."""
    run_id, tasks = start_round_one(
        coordinator, sites_per_round=3, min_sites=2, round_deadline_s=2.0
    )
    (s1, t1), (s2, t2), (late_site, late_task) = sorted(tasks.items())
    payload = delta_payload()
    release = threading.Event()

    def _slow() -> Iterator[site_pb2.UpdateChunk]:
        msgs = messages(late_task, late_site, payload, chunk=64)
        yield next(msgs)  # the header: the upload is under way
        yield next(msgs)
        release.wait(30)
        yield from msgs

    call = coordinator.site.UploadUpdate.future(_slow(), timeout=30)
    upload(coordinator, messages(t1, s1, payload))
    upload(coordinator, messages(t2, s2, payload))
    wait_round(coordinator, run_id, 1, "committed")  # at its deadline, with 2 of 3
    # Still streaming into a committed round: pending, so no watch takes the round for
    # final before the bytes it moves for nothing are counted.
    assert late_task.task_id in coordinator.engine.downloads.pending()
    release.set()
    with pytest.raises(grpc.RpcError) as info:
        call.result()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert "closed before your update arrived" in (info.value.details() or "")
    assert _cut_bytes(coordinator, run_id, 1)[late_site] == len(payload)
    assert late_task.task_id not in coordinator.engine.downloads.pending()
    r1 = round_status(coordinator, run_id, 1)
    assert r1.lost_bytes == len(payload) and r1.cut_bytes == len(payload)


def test_a_download_cut_off_midway_counts_what_was_sent(
    coordinator: InProcessCoordinator,
) -> None:
    register(coordinator, *SITES)
    run_id = submit(coordinator)
    ((init_site, init_task),) = tasks_of_round(coordinator, run_id, 0).items()
    big = encode({**model_state(), "extra": torch.zeros(1_000_000)})  # 4 MB: 16 chunks
    upload(coordinator, messages(init_task, init_site, big, chunk=1 << 20))
    tasks = tasks_of_round(coordinator, run_id, 1)
    site, task = sorted(tasks.items())[0]
    # A small fixed receive window: the coordinator cannot have sent it all before the
    # cancellation, however fast this machine is.
    small = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 16)]
    with grpc.insecure_channel(coordinator.address, options=small) as channel:
        stream = site_pb2_grpc.SiteServiceStub(channel).DownloadModel(
            site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id), timeout=30
        )
        first = next(stream)
        assert 0 < len(first.data) < len(big) // 8
        stream.cancel()
    deadline = threading.Event()
    for _ in range(200):  # the handler sees the cancellation at its next yield
        if _cut_bytes(coordinator, run_id, 1)[site] > 0:
            break
        deadline.wait(0.05)
    cut = _cut_bytes(coordinator, run_id, 1)[site]
    assert len(first.data) <= cut < len(big)  # what had gone out, not the whole model
    r1 = round_status(coordinator, run_id, 1)
    mine = {p.site_id: p for p in r1.participations}[site]
    assert mine.bytes_down == 0 and mine.status == "assigned"  # no download was finished


def _long_run(coordinator: InProcessCoordinator, run_id: str = "long-run") -> str:
    """Six rounds of ten sites with a long error each: about 1 MB of status per round."""
    from fedra.runspec import RunSpec

    store = coordinator.engine._store
    spec = RunSpec(name="long", task=TASK, rounds=6, sites_per_round=10, min_sites=1)
    store.create_run(run_id, "long", TASK, spec.validate().to_json(), 1.0)
    sites = [f"site-{i}" for i in range(10)]
    for number in range(6):
        store.open_round(run_id, number, 1, {s: f"{number}-{s}" for s in sites}, 1.0, 2.0)
        for s in sites:
            store.fail_participation(f"{number}-{s}", f"{number}{s} " + "x" * 100_000, 2.0)
    return run_id


def test_get_run_pages_a_run_too_long_for_one_reply(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paged, GetRun sends whole rounds about 1 MiB at a time, each once, in order, and
    says whether more follow; unpaged, a status over the reply limit is refused saying
    to page, and the admin client (which pages) still reads it whole."""
    from fedra.admin import AdminClient
    from fedra.coordinator.status import PAGE_BYTES
    from fedra.protos import wire

    run_id = _long_run(coordinator)
    request = admin_pb2.GetRunRequest(run_id=run_id, page=True)
    numbers, sizes, follows = [], [], []
    while True:
        page = coordinator.admin.GetRun(request, timeout=10)
        numbers += [r.number for r in page.rounds]
        sizes.append(page.ByteSize())
        follows.append(page.more_rounds_follow)
        assert page.state == "pending" and page.spec.name == "long"  # each page has the run
        if not page.more_rounds_follow:
            break
        request.first_round = page.rounds[-1].number + 1
    assert numbers == list(range(6))
    assert len(sizes) >= 3 and follows[-1] is False and all(follows[:-1])
    assert max(sizes) < 2 * PAGE_BYTES
    past = coordinator.admin.GetRun(
        admin_pb2.GetRunRequest(run_id=run_id, first_round=6, page=True), timeout=10
    )
    assert (list(past.rounds), past.more_rounds_follow) == ([], False)
    tail = coordinator.admin.GetRun(
        admin_pb2.GetRunRequest(run_id=run_id, first_round=4), timeout=10
    )  # unpaged, from a round on
    assert [r.number for r in tail.rounds] == [4, 5] and not tail.more_rounds_follow

    monkeypatch.setattr(wire, "MAX_STATUS_BYTES", 3 * 2**20)
    with pytest.raises(grpc.RpcError) as info:
        coordinator.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"status of run {run_id} is" in str(info.value.details())
    assert "GetRunRequest.page" in str(info.value.details())
    with AdminClient(coordinator.address) as admin:
        whole = admin.status(run_id)
        assert [r.number for r in whole.rounds] == list(range(6))
        assert whole.ByteSize() > 6_000_000 and not whole.more_rounds_follow
        assert [r.number for r in admin.status(run_id, first_round=3).rounds] == [3, 4, 5]
    with pytest.raises(grpc.RpcError) as missing:
        coordinator.admin.GetRun(admin_pb2.GetRunRequest(run_id="nope", page=True), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_page_reads_rounds_in_batches_until_it_is_full(
    coordinator: InProcessCoordinator,
) -> None:
    """Rounds come in whole and in order across the reads of a page (the first of 8
    rounds, the next sized by what that held), a round larger than the page goes alone,
    and a page reads little more than it holds."""
    from fedra.coordinator.status import run_page, run_status
    from fedra.runspec import RunSpec

    store, run_id = coordinator.engine._store, "many-rounds"
    spec = RunSpec(name="many", task=TASK, rounds=40, sites_per_round=2, min_sites=1)
    store.create_run(run_id, "many", TASK, spec.validate().to_json(), 1.0)
    for number in range(40):
        store.open_round(run_id, number, 1, {s: f"{number}-{s}" for s in "ab"}, 1.0, 2.0)
        store.fail_participation(f"{number}-a", "gone", 2.0)
        store.fail_participation(f"{number}-b", "gone", 2.0)
    whole = run_page(coordinator.engine, run_id, False, 0)
    assert [r.number for r in whole.rounds] == list(range(40)) and not whole.more_rounds_follow
    assert [len(r.participations) for r in whole.rounds] == [2] * 40
    assert list(whole.rounds) == list(run_status(coordinator.engine, run_id).rounds)
    one = run_page(coordinator.engine, run_id, False, 17, page_bytes=1)
    assert [r.number for r in one.rounds] == [17] and one.more_rounds_follow
    reads: list[int | None] = []
    original = store.read_run

    def _counted(run: str, *, since: int = 0, limit: int | None = None):  # type: ignore[no-untyped-def]
        reads.append(limit)
        return original(run, since=since, limit=limit)

    store.read_run = _counted  # type: ignore[method-assign]
    twelve = sum(r.ByteSize() for r in whole.rounds[20:32])
    page = run_page(coordinator.engine, run_id, False, 20, page_bytes=twelve)
    assert [r.number for r in page.rounds] == list(range(20, 32)) and page.more_rounds_follow
    assert reads == [8, 5]  # 8 rounds, then the 4 more that fit and one to spare
    reads.clear()
    assert list(run_page(coordinator.engine, run_id, False, 0).rounds) == list(whole.rounds)
    assert reads == [8, 1024]
    store.read_run = original  # type: ignore[method-assign]
    three = sum(r.ByteSize() for r in whole.rounds[30:33])
    some = run_page(coordinator.engine, run_id, False, 30, page_bytes=three)
    assert [r.number for r in some.rounds] == [30, 31, 32] and some.more_rounds_follow


def test_a_long_runs_status_reaches_the_admin_client_and_its_watch_stays_small(
    coordinator: InProcessCoordinator,
) -> None:
    """Six rounds of ten sites with a long error each: about 6 MB of status. GetRun
    reaches AdminClient whole; a watch spreads it over messages near 1 MiB; run list
    sends no rounds at all."""
    from fedra.admin import AdminClient
    from fedra.coordinator.status import WATCH_MESSAGE_BYTES

    run_id = _long_run(coordinator)
    with AdminClient(coordinator.address) as admin:
        status = admin.status(run_id)
        assert status.ByteSize() > 6_000_000
        assert [r.number for r in status.rounds] == list(range(6))
        whole = next(iter(admin.watch(run_id, timeout_s=10)))  # merged from several messages
        assert list(whole.rounds) == list(status.rounds)
        [listed] = [r for r in admin.runs() if r.run_id == run_id]
    assert (listed.state, listed.spec.name, len(listed.rounds)) == ("pending", "long", 0)
    watch = coordinator.admin.WatchRun(
        admin_pb2.WatchRunRequest(run_id=run_id, changed_rounds_only=True), timeout=10
    )
    sizes, seen = [], []
    for message in watch:  # the initial state, in batches; then it waits for a change
        sizes.append(message.ByteSize())
        seen += [r.number for r in message.rounds]
        if len(seen) == 6:
            break
    watch.cancel()
    assert seen == list(range(6)) and len(sizes) >= 5
    assert max(sizes) < 2 * WATCH_MESSAGE_BYTES


def test_a_round_commits_only_once_its_downloads_are_counted(
    coordinator: InProcessCoordinator,
) -> None:
    """Downloads are written in the background; the round's commit waits for them, so a
    committed round's ledger (bytes, the distribute stage) is whole."""
    run_id, tasks = start_round_one(coordinator)
    store = coordinator.engine._store
    original, release = store.mark_downloaded_many, threading.Event()

    def _held(
        rows: list[tuple[str, int, float, int | None]], cuts: list[tuple[str, int]]
    ) -> list[str]:
        release.wait(10)
        return original(rows, cuts)

    store.mark_downloaded_many = _held  # type: ignore[method-assign]
    try:
        for site, task in sorted(tasks.items()):
            request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
            assert b"".join(m.data for m in coordinator.site.DownloadModel(request, timeout=10))
            upload(coordinator, messages(task, site, delta_payload()))
        r1 = round_status(coordinator, run_id, 1)
        assert (r1.status, r1.updates) == ("open", 2)  # every update in; the rows are not
        release.set()
        r1 = wait_round(coordinator, run_id, 1, "committed")
    finally:
        release.set()
        store.mark_downloaded_many = original  # type: ignore[method-assign]
    assert r1.stages["distribute_s"] > 0
    assert all(p.bytes_down > 0 and p.download_s > 0 for p in r1.participations)


def test_a_run_no_known_site_can_serve_is_accepted_with_a_warning(
    coordinator: InProcessCoordinator,
) -> None:
    """Accepted (sites may come later), but the submitter is told why it cannot start."""

    def warnings(sites_per_round: int = 1, min_sites: int = 0, task: str = TASK) -> list[str]:
        from fedra.protos.serde import runspec_to_proto
        from fedra.runspec import RunSpec

        spec = RunSpec(task=task, rounds=1, sites_per_round=sites_per_round, min_sites=min_sites)
        request = admin_pb2.SubmitRunRequest(spec=runspec_to_proto(spec))
        reply = coordinator.admin.SubmitRun(request, timeout=10)
        assert reply.run_id
        return list(reply.warnings)

    assert warnings() == [
        f"no site known to this coordinator allows task {TASK}: the run waits until sites "
        "that do are online (no site has registered yet)"
    ]
    register(coordinator, SITES[0])
    # A misspelt task: the one meant shows beside it.
    assert warnings(task=TASK + "x") == [
        f"no site known to this coordinator allows task {TASK}x: the run waits until sites "
        f"that do are online (the tasks known sites allow: {TASK})"
    ]
    assert warnings(sites_per_round=2) == [
        f"only 1 known site(s) allow task {TASK}, fewer than the 2 a round needs (min_sites): "
        "the run waits until more that do are online"
    ]
    assert warnings(sites_per_round=2, min_sites=1) == []
    register(coordinator, *SITES[1:])
    assert warnings(sites_per_round=3) == []


class _DaemonBeforePaging(admin_pb2_grpc.AdminServiceServicer):
    """GetRun and WatchRun as a daemon that predates paging, ``first_round`` and
    ``changed_rounds_only`` answer (it ignores fields it does not know): every round, in
    one message, every time."""

    def __init__(self, rounds: int) -> None:
        self.requests: list[admin_pb2.GetRunRequest] = []
        self.rounds = rounds

    def _status(self, rounds: int, state: str) -> admin_pb2.RunStatus:
        status = admin_pb2.RunStatus(run_id="old", state=state)
        status.rounds.extend(admin_pb2.RoundStatus(number=n) for n in range(rounds))
        return status

    def GetRun(  # noqa: N802 (the generated servicer's name)
        self, request: admin_pb2.GetRunRequest, context: object
    ) -> admin_pb2.RunStatus:
        self.requests.append(request)
        return self._status(self.rounds, "completed")

    def WatchRun(  # noqa: N802
        self, request: admin_pb2.WatchRunRequest, context: object
    ) -> Iterator[admin_pb2.RunStatus]:
        yield self._status(self.rounds - 1, "running")
        yield self._status(self.rounds, "completed")


def test_the_admin_client_reads_a_daemon_that_predates_paging() -> None:
    """A daemon that predates paging sends every round at once: the client keeps the ones
    asked for, does not ask again, and a watch holds every round as it does with paging."""
    from concurrent.futures import ThreadPoolExecutor

    from fedra.admin import AdminClient

    old = _DaemonBeforePaging(rounds=5)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    admin_pb2_grpc.add_AdminServiceServicer_to_server(old, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with AdminClient(f"127.0.0.1:{port}", timeout_s=10) as admin:
            status = admin.status("old", first_round=3)
            assert [r.number for r in status.rounds] == [3, 4]
            assert not status.more_rounds_follow
            assert len(old.requests) == 1 and old.requests[0].page  # asked once, for pages
            assert [r.number for r in admin.status("old").rounds] == [0, 1, 2, 3, 4]
            seen = [
                (s.state, [r.number for r in s.rounds]) for s in admin.watch("old", timeout_s=10)
            ]
            assert seen == [("running", [0, 1, 2, 3]), ("completed", [0, 1, 2, 3, 4])]
    finally:
        server.stop(grace=None)


def test_get_run_shares_a_large_page_for_a_moment_and_shows_a_cancel_at_once(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large page (here: any page; its moment made long) is built once for the calls
    within a moment of each other, a site's change showing a moment late; a cancel and
    the run's end are seen at once (a page is never kept across either)."""
    from fedra.coordinator import status as status_mod

    assert coordinator.server.admin is not None
    pages = coordinator.server.admin.pages
    assert isinstance(pages, status_mod.SharedPages)
    monkeypatch.setattr(pages, "min_participations", 1)
    monkeypatch.setattr(pages, "max_age_s", 60.0)
    monkeypatch.setattr(pages, "max_stale_s", 60.0)
    monkeypatch.setattr(pages, "share", 1e-6)
    run_id, tasks = start_round_one(coordinator, min_sites=1)  # one failure ends nothing
    store = coordinator.engine._store
    reads: list[int] = []
    original = store.read_run

    def _counted(run: str, *, since: int = 0, limit: int | None = None):  # type: ignore[no-untyped-def]
        reads.append(since)
        return original(run, since=since, limit=limit)

    monkeypatch.setattr(store, "read_run", _counted)
    request = admin_pb2.GetRunRequest(run_id=run_id, page=True)
    first = coordinator.admin.GetRun(request, timeout=10)
    assert first.state == "running" and len(reads) >= 1
    read_once = len(reads)
    site, task = sorted(tasks.items())[0]
    failed = site_pb2.ReportFailureRequest(site_id=site, task_id=task.task_id, reason="boom")
    coordinator.site.ReportFailure(failed, timeout=10)  # a site's change
    assert coordinator.admin.GetRun(request, timeout=10) == first and len(reads) == read_once
    coordinator.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id), timeout=10)
    cancelling = coordinator.admin.GetRun(request, timeout=10)  # the driver may not be done
    assert len(reads) > read_once and cancelling.state in ("running", "cancelled")
    assert any("boom" in p.error for r in cancelling.rounds for p in r.participations)
    deadline = time.monotonic() + 30
    while run_id in coordinator.engine.runs:  # the driver ends the run, then lets it go
        assert time.monotonic() < deadline, "the cancelled run was never let go"
        time.sleep(0.01)
    assert coordinator.admin.GetRun(request, timeout=10).state == "cancelled"  # it ended


def test_get_run_keeps_the_status_of_final_rounds_and_reads_only_the_rest(
    coordinator: InProcessCoordinator,
) -> None:
    """Committed rounds whose participations are all finished can change no more: a page
    holds them from the cache (the same bytes as read fresh) and reads only the rounds
    after them; a round still open is read every time, and kept once it is final."""
    from fedra.coordinator.status import FinalRounds, run_page
    from fedra.runspec import RunSpec
    from fedra.storage.records import CheckpointRecord

    store, run_id = coordinator.engine._store, "kept-rounds"
    spec = RunSpec(name="kept", task=TASK, rounds=6, sites_per_round=2, min_sites=1)
    store.create_run(run_id, "kept", TASK, spec.validate().to_json(), 1.0)

    def commit(number: int) -> None:
        ckpt = CheckpointRecord(run_id, number, "0" * 64, 1, None, 3.0)
        store.commit_round(run_id, number, ckpt, {"loss": float(number)}, 3.0)

    for number in range(5):
        store.open_round(run_id, number, 1, {s: f"{number}-{s}" for s in "ab"}, 1.0, 2.0)
        store.fail_participation(f"{number}-a", "gone", 2.0)
        store.fail_participation(f"{number}-b", "gone", 2.0)
        if number < 4:
            commit(number)
    kept = FinalRounds()
    first = run_page(coordinator.engine, run_id, False, 0, kept=kept)
    fresh = run_page(coordinator.engine, run_id, False, 0)
    assert list(first.rounds) == list(fresh.rounds) and len(first.rounds) == 5
    assert [admin_pb2.RoundStatus.FromString(b).number for b in kept.from_(run_id, 0)] == [
        0,
        1,
        2,
        3,
    ]  # 4 is still open
    reads: list[int] = []
    original = store.read_run

    def _counted(run: str, *, since: int = 0, limit: int | None = None):  # type: ignore[no-untyped-def]
        reads.append(since)
        return original(run, since=since, limit=limit)

    store.read_run = _counted  # type: ignore[method-assign]
    try:
        again = run_page(coordinator.engine, run_id, False, 0, kept=kept)
        assert list(again.rounds) == list(fresh.rounds)
        assert reads == [4]  # only the open round was read
        commit(4)
        later = run_page(coordinator.engine, run_id, False, 2, kept=kept)
        assert [r.number for r in later.rounds] == [2, 3, 4] and later.rounds[-1].status == (
            "committed"
        )
        assert [admin_pb2.RoundStatus.FromString(b).number for b in kept.from_(run_id, 0)] == [
            0,
            1,
            2,
            3,
            4,
        ]
        small = run_page(coordinator.engine, run_id, False, 0, page_bytes=1, kept=kept)
        assert [r.number for r in small.rounds] == [0] and small.more_rounds_follow
    finally:
        store.read_run = original  # type: ignore[method-assign]


def test_a_site_streams_its_small_update_to_a_coordinator_without_the_one_call_upload() -> None:
    """A coordinator of a version before UploadSmallUpdate answers it UNIMPLEMENTED: the
    site streams that update and every later one, as such a coordinator takes them."""
    streamed: list[int] = []
    tried_small: list[bool] = []

    def upload_small(request: bytes, context: grpc.ServicerContext) -> bytes:
        tried_small.append(True)  # as gRPC answers a method it does not know
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        raise AssertionError("abort returns no more")

    def upload_update(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        chunks = [site_pb2.UpdateChunk.FromString(r) for r in requests]
        assert chunks[0].WhichOneof("part") == "header"
        streamed.append(sum(len(c.data) for c in chunks[1:]))
        return site_pb2.UploadUpdateResponse(bytes_received=streamed[-1]).SerializeToString()

    older = grpc.server(ThreadPoolExecutor(2))
    older.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "fedra.v1.SiteService",
                {
                    "UploadUpdate": grpc.stream_unary_rpc_method_handler(upload_update),
                    "UploadSmallUpdate": grpc.unary_unary_rpc_method_handler(upload_small),
                },
            ),
        )
    )
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    conn = Connection(f"127.0.0.1:{port}", "site-a")
    try:
        task = Assignment(
            task_id="t" * 32, run_id="r" * 12, round=1, init=False, entry_point=TASK,
            train=TrainSpec(), seed=0, model_sha256="", model_bytes=0, deadline_in_s=60.0,
            codec=CodecSpec(),
        )  # fmt: skip
        update = {k: torch.full_like(v, 0.01) for k, v in model_state().items()}
        sizes = [
            conn.upload(task, update, 10, {}, os.urandom(16), timeout_s=30).bytes_received
            for _ in range(2)
        ]
    finally:
        conn.close()
        older.stop(None)
    assert streamed == sizes == [len(encode(update))] * 2
    assert tried_small == [True]  # asked once, then remembered


def test_a_held_heartbeat_is_held_while_its_task_counts_and_answers_when_it_stops(
    coordinator: InProcessCoordinator,
) -> None:
    """Held (hold_s): the call stays open while the task counts, at most the poll timeout
    (2 s here), the site online meanwhile; cancelling the run answers it at once, False."""
    run_id, tasks = start_round_one(coordinator)
    site, task = sorted(tasks.items())[0]
    held = site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id, hold_s=60.0)
    started = time.monotonic()
    assert coordinator.site.Heartbeat(held, timeout=30).task_current
    assert 1.5 <= time.monotonic() - started < 10  # held up to the poll timeout, not 60 s
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(coordinator.site.Heartbeat, held, timeout=30)
        deadline = time.monotonic() + 10
        while coordinator.engine._polling[site] == 0:  # its hold has begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert coordinator.engine.site_online(site)
        cancelled_at = time.monotonic()
        coordinator.admin.CancelRun(admin_pb2.CancelRunRequest(run_id=run_id))
        assert answer.result(timeout=30).task_current is False
        assert time.monotonic() - cancelled_at < 1.5  # woken, not held to its end
    assert coordinator.engine._polling[site] == 0
    # A task that does not count is answered at once, held or not.
    started = time.monotonic()
    assert not coordinator.site.Heartbeat(held, timeout=30).task_current
    assert time.monotonic() - started < 1.0


def _held(c: InProcessCoordinator, hold_s: float, timeout_s: float) -> tuple[str, Any]:
    """Round one's first site's heartbeat, held (``hold_s``), once the hold has begun."""
    _, tasks = start_round_one(c)
    site, task = sorted(tasks.items())[0]
    held = site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id, hold_s=hold_s)
    call = c.site.Heartbeat.future(held, timeout=timeout_s)
    deadline = time.monotonic() + 10
    while c.engine._polling[site] == 0:
        assert time.monotonic() < deadline, "the hold never began"
        time.sleep(0.01)
    return site, call


def test_a_site_that_hangs_up_its_held_heartbeat_is_offline_at_once(
    coordinator: InProcessCoordinator,
) -> None:
    site, call = _held(coordinator, hold_s=60.0, timeout_s=30.0)
    deadline = time.monotonic() + 10
    call.cancel()  # the site stopped
    while coordinator.engine.site_online(site):  # not after its 30 s liveness timeout
        assert time.monotonic() < deadline, "still online after hanging up"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["shutdown", "server stop alone"])
def test_stopping_with_no_grace_under_held_calls_logs_no_traceback(
    coordinator: InProcessCoordinator, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A coordinator that stops at once (a lost database: grace 0) while held calls are
    open ends them cleanly: gRPC's own task for a call is not cancelled under it, which
    makes gRPC log an unhandled CancelledError with a traceback."""
    from fedra.coordinator.server import shutdown

    _, tasks = start_round_one(coordinator)
    held = [
        site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id, hold_s=60.0)
        for site, task in tasks.items()
    ]
    # 15 a site: within the 32 calls a connection may have in progress.
    calls = [coordinator.site.Heartbeat.future(h, timeout=30) for h in held * 15]
    deadline = time.monotonic() + 10
    while sum(coordinator.engine._polling.values()) < len(calls):  # every hold has begun
        assert time.monotonic() < deadline, "the holds never began"
        time.sleep(0.01)
    with caplog.at_level(logging.DEBUG, logger="grpc"):
        if how == "shutdown":
            shutdown(coordinator.server, coordinator.engine, grace_s=0)
        else:
            coordinator.server.stop(0)
    for call in calls:
        try:
            call.result(timeout=10)  # answered (woken by the stop) or cut: either way ended
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    unhandled = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not unhandled, [r.getMessage() for r in unhandled]


def test_a_stop_waits_for_what_is_left_on_its_loop_instead_of_cancelling_it(
    coordinator: InProcessCoordinator,
) -> None:
    """What is still on the server's loop once gRPC has stopped (gRPC's own task of each
    call it cut, whose handler ends once its step has) is waited for, not cancelled: a
    cancelled one of gRPC's is logged as an unhandled error, with a traceback. Here a
    task on the loop that ends only when told stands for such a call."""
    server = coordinator.server
    seen: dict[str, bool] = {}

    async def on_loop() -> tuple[asyncio.Event, asyncio.Task[None]]:
        gate = asyncio.Event()

        async def call_like() -> None:
            try:
                await gate.wait()
                seen["ended"] = True
            except asyncio.CancelledError:
                seen["cancelled"] = True
                raise

        return gate, asyncio.get_running_loop().create_task(call_like())

    gate, task = server.run(on_loop())
    loop = task.get_loop()
    stopping = threading.Thread(target=server.stop, args=(0,))
    stopping.start()
    deadline = time.monotonic() + 10
    while True:  # gRPC has stopped: its port no longer answers
        try:
            coordinator.admin.ListRuns(admin_pb2.ListRunsRequest(), timeout=1)
        except grpc.RpcError:
            break
        assert time.monotonic() < deadline, "the server never stopped serving"
    stopping.join(1.0)  # a second into the drain, it still waits
    assert stopping.is_alive() and not seen
    loop.call_soon_threadsafe(gate.set)
    stopping.join(10)
    assert not stopping.is_alive() and seen == {"ended": True}


def test_stopping_with_no_grace_while_calls_wait_for_the_engine_logs_no_traceback(
    coordinator: InProcessCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """Calls whose step waits for the engine's lock when a stop with no grace cuts them
    (a lost database: the group commit holds the engine) end once their step has, or is
    dropped unbegun: the stop waits for them instead of cancelling gRPC's own task for
    each call, which made gRPC log an unhandled CancelledError with a traceback."""
    _, tasks = start_round_one(coordinator)
    engine = coordinator.engine
    beats = [
        site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id)
        for site, task in tasks.items()
    ] * 5
    steps = coordinator.server.api._steps  # where a step that finds the lock taken waits for it
    with caplog.at_level(logging.DEBUG, logger="grpc"):
        with engine._lock:
            calls = [coordinator.site.Heartbeat.future(b, timeout=30) for b in beats]
            deadline = time.monotonic() + 10
            while steps.pending < len(beats):  # every heartbeat's step waits for the lock
                assert time.monotonic() < deadline, "a heartbeat never reached the engine"
                time.sleep(0.01)
            stopping = threading.Thread(target=coordinator.server.stop, args=(0,))
            stopping.start()
            for call in calls:  # cut by the stop while their steps wait for the lock
                with pytest.raises(grpc.RpcError) as cut:
                    call.result(timeout=10)
                assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        stopping.join(30)
        assert not stopping.is_alive()
    unhandled = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not unhandled, [r.getMessage() for r in unhandled]


@pytest.mark.parametrize("call", ["held heartbeat", "poll"])
def test_a_wait_that_outlives_its_deadline_is_not_a_site_hanging_up(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A coordinator behind on its loop may answer a held call after the caller's
    deadline passed (it holds each to a margin inside it): the call is then cancelled,
    but by the deadline, not by the site, which is still there and calls again. The site
    stays online; a site that hangs up (above) is offline at once."""
    from fedra.coordinator import service

    monkeypatch.setattr(service, "_long_poll_s", lambda requested, context: 5.0)  # too late
    c = coordinator
    _, tasks = start_round_one(c)
    site, task = sorted(tasks.items())[0]
    if call == "poll":  # a site without a task: its poll waits
        (site,) = set(SITES) - set(tasks)
    hangups = c.engine.hangups
    with pytest.raises(grpc.RpcError) as info:
        if call == "poll":
            c.site.PollTask(site_pb2.PollTaskRequest(site_id=site), timeout=1.5)
        else:
            held = site_pb2.HeartbeatRequest(site_id=site, task_id=task.task_id, hold_s=5.0)
            c.site.Heartbeat(held, timeout=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while c.engine._polling.get(site, 0):  # the coordinator's side of the call ended
        assert time.monotonic() < deadline, "the call never ended at the coordinator"
        time.sleep(0.02)
    assert c.engine.hangups == hangups and c.engine.site_online(site)


@pytest.mark.parametrize("hold_s", [-1.0, float("nan")])
def test_a_heartbeat_with_a_bad_hold_is_refused(
    coordinator: InProcessCoordinator, hold_s: float
) -> None:
    register(coordinator, "site-a")
    beat = site_pb2.HeartbeatRequest(site_id="site-a", hold_s=hold_s)
    with pytest.raises(grpc.RpcError) as info:
        coordinator.site.Heartbeat(beat, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hold_s" in info.value.details()


def test_a_held_heartbeat_does_not_drop_the_task_when_the_coordinator_stops(
    tmp_path: Path,
) -> None:
    """A coordinator stopping (to restart, say) ends the calls it holds; none of them
    tells its site that the task stopped counting: it may count when the coordinator is
    back, and the site keeps it for its upload to retry."""
    settings = EngineSettings(
        heartbeat_interval_s=1.0, poll_timeout_s=30.0, site_timeout_s=60.0, inline_model_bytes=0
    )
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        _, call = _held(c, hold_s=30.0, timeout_s=60.0)
    finally:
        c.close()
    try:
        assert call.result(timeout=30).task_current  # answered before the stop: it counts
    except grpc.RpcError as exc:  # or cut off by it: nothing said against the task
        assert exc.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def test_a_hold_cancelled_while_it_begins_does_not_leave_its_site_counted_as_polling(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site hangs up while its held heartbeat's first step runs in the executor (the
    engine's lock was busy): the step runs to its end, and the hold it began is ended, so
    the site does not count as polling, online for ever, a round waiting on it."""
    from contextlib import suppress

    _, tasks = start_round_one(coordinator)
    site, task = sorted(tasks.items())[0]
    engine, api = coordinator.engine, coordinator.server.api
    assert api is not None
    began = threading.Event()
    real_begin = engine.hold_begin

    def slow_begin(site_id: str, task_id: str) -> tuple[float, bool]:
        began.set()
        time.sleep(0.5)  # the caller is cancelled meanwhile
        return real_begin(site_id, task_id)

    monkeypatch.setattr(engine, "hold_begin", slow_begin)
    monkeypatch.setattr(engine, "if_free", lambda fn, *args: (False, None))  # the lock is busy

    async def hang_up() -> None:
        held = asyncio.ensure_future(api.heartbeat(site, task.task_id, 30.0))
        while not began.is_set():
            await asyncio.sleep(0.01)
        held.cancel()
        with suppress(asyncio.CancelledError):
            await held

    coordinator.server.run(hang_up())
    deadline = time.monotonic() + 10
    while engine._polling[site] != 0:
        assert time.monotonic() < deadline, f"still counted as polling: {engine._polling[site]}"
        time.sleep(0.02)
