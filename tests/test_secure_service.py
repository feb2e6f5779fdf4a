"""A secure-aggregation round over real gRPC, driven stage by stage from the test, and
every way a site can get a stage wrong: each refusal names the problem, changes
nothing, and the round still completes with the exact (quantised) mean.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from fedra.protos.codec import decode, encode
from fedra.protos.compression import MASKED, flatten_update, to_wire_u32
from fedra.protos.v1 import admin_pb2, common_pb2, site_pb2
from fedra.secagg import SiteSecAgg
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    SITES,
    messages,
    model_state,
    round_status,
    start_round_one,
    upload,
    wait_round,
)

SECAGG = common_pb2.SecAgg(threshold=0.5, clip=8.0, setup_timeout_s=30, unmask_timeout_s=30)


def refused(call, code: grpc.StatusCode, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details(), info.value.details()


def keys_request(site: str, task: site_pb2.Task, keys: bytes, wait_s: float = 0.0):  # type: ignore[no-untyped-def]
    return site_pb2.SecAggKeysRequest(
        site_id=site, task_id=task.task_id, public_keys=keys, wait_s=wait_s
    )


def test_secure_round_over_grpc_and_its_refusals(coordinator: InProcessCoordinator) -> None:
    c = coordinator
    run_id, tasks = start_round_one(c, sites_per_round=3, min_sites=2, secagg=SECAGG)
    assert sorted(tasks) == sorted(SITES)
    for task in tasks.values():
        assert task.HasField("secagg") and task.codec == "secagg"
        assert task.secagg.threshold == 1 and task.secagg.bits == 30
        assert task.secagg.context.endswith(f"|{run_id}|1|1".encode())
    a, b, s3 = sorted(tasks)
    maskers = {s: SiteSecAgg(s, t.secagg.threshold, t.secagg.context) for s, t in tasks.items()}
    delta = {k: torch.full_like(v, 0.25) for k, v in model_state().items()}
    wire = encode({MASKED: torch.zeros(flatten_update(delta).numel(), dtype=torch.int32)})

    # Stage 1. Uploading before the key exchange, bad keys, another site's task: refused.
    refused(
        lambda: upload(c, messages(tasks[a], a, wire, codec="secagg")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "must complete the key exchange first",
    )
    refused(
        lambda: c.site.SecAggKeys(keys_request(a, tasks[a], b"short")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "public_keys",
    )
    refused(
        lambda: c.site.SecAggKeys(keys_request(a, tasks[a], b"")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "send public_keys first",
    )
    refused(
        lambda: c.site.SecAggKeys(keys_request(a, tasks[b], maskers[a].public_keys())),
        grpc.StatusCode.PERMISSION_DENIED,
        "was not given to site",
    )
    shares_early = site_pb2.SecAggSharesRequest(
        site_id=a, task_id=tasks[a].task_id, ciphertexts={b: b"x"}
    )
    refused(
        lambda: c.site.SecAggShares(shares_early),
        grpc.StatusCode.FAILED_PRECONDITION,
        "share exchange of run",
    )
    reveal_early = site_pb2.SecAggRevealRequest(site_id=a, task_id=tasks[a].task_id)
    refused(
        lambda: c.site.SecAggReveal(reveal_early),
        grpc.StatusCode.FAILED_PRECONDITION,
        "only once uploads close",
    )
    # Nothing above changed anything: the key stage waits for all three, then closes.
    first = c.site.SecAggKeys(keys_request(a, tasks[a], maskers[a].public_keys()))
    assert not first.ready
    c.site.SecAggKeys(keys_request(b, tasks[b], maskers[b].public_keys()))
    # Site a waits in a long poll while the last site sends its keys: the stage's close
    # must wake it, not leave it to sit out its wait_s.
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(c.site.SecAggKeys, keys_request(a, tasks[a], b"", wait_s=10))
        time.sleep(0.2)  # let the long poll start; correctness does not depend on it
        c.site.SecAggKeys(keys_request(s3, tasks[s3], maskers[s3].public_keys()))
        assert waiting.result(timeout=15).ready
        assert time.monotonic() - started < 5.0
    neighbour_keys = {}
    for s, t in tasks.items():
        r = c.site.SecAggKeys(keys_request(s, t, b"", wait_s=10))
        assert r.ready and sorted(r.neighbour_keys) == sorted(set(SITES) - {s})
        neighbour_keys[s] = dict(r.neighbour_keys)

    # Stage 2: shares, routed to their recipients.
    for s, t in tasks.items():
        cts = maskers[s].share_keys(neighbour_keys[s])
        request = site_pb2.SecAggSharesRequest(site_id=s, task_id=t.task_id, ciphertexts=cts)
        c.site.SecAggShares(request)
    for s, t in tasks.items():
        request = site_pb2.SecAggSharesRequest(site_id=s, task_id=t.task_id, wait_s=10)
        r = c.site.SecAggShares(request)
        assert r.ready and sorted(r.inbox) == sorted(set(SITES) - {s})
        maskers[s].receive_shares(dict(r.inbox))

    # Stage 3: a plain-codec update is refused; masked ones are accepted.
    refused(
        lambda: upload(c, messages(tasks[a], a, encode(delta), codec="none")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "does not match the run's codec 'secagg'",
    )
    scales = {a: 0.5, b: -0.25, s3: 1.0}
    for s, t in tasks.items():
        vector = flatten_update({k: v * scales[s] for k, v in delta.items()})
        masked = maskers[s].mask(vector, clip=t.secagg.clip, bits=t.secagg.bits)
        payload = encode({MASKED: to_wire_u32(masked)})
        upload(c, messages(t, s, payload, codec="secagg"))

    # Stage 4: the survivors reveal; the round commits with the exact mean.
    asked = {}
    for s, t in tasks.items():
        request = site_pb2.SecAggUnmaskRequest(site_id=s, task_id=t.task_id, wait_s=10)
        r = c.site.SecAggUnmask(request)
        assert r.ready and sorted(r.survivors) == sorted(set(SITES) - {s}) and not r.dropped
        asked[s] = r
    # Threshold 1: two sites' shares rebuild every self-mask; the third is not needed.
    for s, t in list(tasks.items())[:2]:
        r = asked[s]
        shares = maskers[s].reveal(list(r.survivors), list(r.dropped))
        bad = site_pb2.SecAggRevealRequest(site_id=s, task_id=t.task_id, shares={"nobody": b"1"})
        refused(
            lambda bad=bad: c.site.SecAggReveal(bad), grpc.StatusCode.INVALID_ARGUMENT, "shares"
        )
        c.site.SecAggReveal(
            site_pb2.SecAggRevealRequest(site_id=s, task_id=t.task_id, shares=shares)
        )
    wait_round(c, run_id, 1, "committed")
    export = c.admin.ExportModel(admin_pb2.ExportModelRequest(run_id=run_id, round=1))
    model = decode(b"".join(m.data for m in export))
    initial = model_state()
    mean = sum(scales.values()) / 3  # secure aggregation: one vote per site
    for name, tensor in initial.items():
        torch.testing.assert_close(model[name], tensor + 0.25 * mean, rtol=0, atol=1e-6)
    r1 = round_status(c, run_id, 1)
    assert r1.updates == 3 and r1.attempt == 1


def test_a_secure_task_is_refused_by_a_plain_run(coordinator: InProcessCoordinator) -> None:
    run_id, tasks = start_round_one(coordinator)
    site, task = next(iter(tasks.items()))
    assert not task.HasField("secagg")
    refused(
        lambda: coordinator.site.SecAggKeys(keys_request(site, task, b"k" * 64)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "does not use secure aggregation",
    )
    assert round_status(coordinator, run_id, 1).status == "open"


def test_a_stage_call_waits_without_a_thread_and_wakes_when_its_stage_closes(
    tmp_path: Path,
) -> None:
    """Sites waiting for a stage to close hold no worker thread (the daemon here has 4,
    fewer than the calls waiting) and are answered the moment the stage closes."""
    from fedra.coordinator.engine import EngineSettings

    settings = EngineSettings(poll_timeout_s=30.0, site_timeout_s=60.0)
    c = InProcessCoordinator(tmp_path / "state", settings, workers=4)
    try:
        _, tasks = start_round_one(c, sites_per_round=3, min_sites=2, secagg=SECAGG)
        a, b, s3 = sorted(tasks)
        maskers = {s: SiteSecAgg(s, t.secagg.threshold, t.secagg.context) for s, t in tasks.items()}
        for s in (a, b):  # their keys are in; s3's are missing, so the stage stays open
            assert not c.site.SecAggKeys(keys_request(s, tasks[s], maskers[s].public_keys())).ready
        deadline = time.monotonic() + 10
        with ThreadPoolExecutor(6) as pool:
            waiting = [
                pool.submit(c.site.SecAggKeys, keys_request(s, tasks[s], b"", wait_s=20))
                for s in (a, a, a, b, b, b)
            ]
            while c.engine.waiting_calls() < 6:  # more than the daemon's 4 threads
                assert time.monotonic() < deadline, c.engine.waiting_calls()
                time.sleep(0.01)
            assert not any(w.done() for w in waiting)
            started = time.monotonic()
            last = c.site.SecAggKeys(keys_request(s3, tasks[s3], maskers[s3].public_keys(), 20))
            assert last.ready
            assert all(w.result(timeout=15).ready for w in waiting)  # the stage closed
            assert time.monotonic() - started < 5
    finally:
        c.close()
