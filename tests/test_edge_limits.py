"""The edge's bounds over real gRPC: a caller is checked before it reads, holds only a few
calls at once, cannot keep a silent stream or a stalled upload open, and a second daemon
cannot share a port in use."""

from __future__ import annotations

import collections
import gc
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fedra import pki
from fedra.config import ConfigError
from fedra.coordinator import server as server_module
from fedra.coordinator.engine import EngineSettings
from fedra.coordinator.limits import CallLimiter, EdgeLimits
from fedra.coordinator.server import CoordinatorConfig, build_engine, create_server, shutdown
from fedra.local import LocalCluster
from fedra.protos.codec import encode
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, site_pb2, site_pb2_grpc
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    TASK,
    delta_payload,
    messages,
    model_state,
    submit,
    tasks_of_round,
    upload,
)


class _Coordinator:
    """The real engine and server in this process (mTLS or plaintext) with given limits."""

    def __init__(self, root: Path, limits: EdgeLimits, tls: bool, workers: int = 16) -> None:
        self.pki = root / "pki"
        folder = None
        if tls:
            sites = ["site-a", "site-b"]
            pki.provision(self.pki, coordinator_hosts=["localhost"], sites=sites, admins=["ops"])
            folder = self.pki / "coordinator"
        config = CoordinatorConfig(
            state_dir=root / "state", tls_dir=folder, insecure=not tls, max_workers=workers
        )
        self.deny_list = config.deny_list_path
        self.engine = build_engine(config)
        self.engine.start()
        self.server, port = create_server(
            self.engine, "127.0.0.1:0", workers,
            pki.load_folder(folder) if folder else None, self.deny_list if tls else None,
            limits=limits,
        )  # fmt: skip
        self.server.start()
        self.address = f"localhost:{port}"
        self.channels: list[grpc.Channel] = []

    def _channel(self, folder: Path | None) -> grpc.Channel:
        if folder is None:
            ch = grpc.insecure_channel(self.address)
        else:
            creds = pki.channel_credentials(pki.load_folder(folder))
            ch = grpc.secure_channel(self.address, creds)
        self.channels.append(ch)
        return ch

    def site(self, name: str) -> site_pb2_grpc.SiteServiceStub:
        folder = self.pki / "sites" / name if self.pki.exists() else None
        return site_pb2_grpc.SiteServiceStub(self._channel(folder))

    def admin(self) -> admin_pb2_grpc.AdminServiceStub:
        folder = self.pki / "admins" / "ops" if self.pki.exists() else None
        return admin_pb2_grpc.AdminServiceStub(self._channel(folder))

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        shutdown(self.server, self.engine, grace_s=0)


@pytest.fixture
def limiters(monkeypatch: pytest.MonkeyPatch) -> list[CallLimiter]:
    """The CallLimiter of each server built in the test (to see the calls it admitted)."""
    made: list[CallLimiter] = []

    class Recorded(CallLimiter):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(server_module, "CallLimiter", Recorded)
    return made


def _silent(release: threading.Event) -> Iterator[site_pb2.UpdateChunk]:
    """A request stream that sends nothing until ``release`` (then ends)."""
    release.wait(60)
    return
    yield  # a generator


def _wait_for(probe: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        threading.Event().wait(0.02)  # polling a condition, with a deadline


def _register(stub: site_pb2_grpc.SiteServiceStub, site: str) -> None:
    stub.Register(site_pb2.RegisterRequest(site_id=site, tasks=[TASK], version="t"), timeout=5)


# -- fault: any certificate holder could starve the daemon ------------------------------------


def test_a_revoked_site_holding_idle_uploads_starves_no_one(tmp_path: Path) -> None:
    """Upload streams of a revoked site that never send a message are refused before
    anything is read: they hold no server thread, and admin calls and other sites'
    heartbeats made meanwhile are answered at once."""
    c = _Coordinator(tmp_path, EdgeLimits(), tls=True, workers=16)
    release = threading.Event()
    try:
        good, revoked = c.site("site-a"), c.site("site-b")
        _register(good, "site-a")
        _register(revoked, "site-b")
        pki.revoke(c.deny_list, c.pki / "sites" / "site-b")
        held = [revoked.UploadUpdate.future(_silent(release), timeout=30) for _ in range(40)]
        # Forty streams on sixteen workers: without the early check these would wait.
        listed = c.admin().ListSites(admin_pb2.ListSitesRequest(), timeout=5).sites
        assert [s.site_id for s in listed] == ["site-a", "site-b"]
        good.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
        for call in held:
            err = call.exception(timeout=5)
            assert isinstance(err, grpc.RpcError)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
            assert "revoked" in (err.details() or "")
    finally:
        release.set()
        c.close()


def test_a_site_holds_only_so_many_calls_and_silent_streams_end(
    tmp_path: Path, limiters: list[CallLimiter], caplog: pytest.LogCaptureFixture
) -> None:
    """A site may have calls_per_site calls in flight: one more is refused with
    UNAVAILABLE naming the bound and its flag, others are served meanwhile, and
    streams that send nothing are ended after stream_idle_s, freeing their slots."""
    idle_s = 1.5
    limits = EdgeLimits(calls_per_site=4, stream_idle_s=idle_s)
    c = _Coordinator(tmp_path, limits, tls=True, workers=16)
    (limiter,) = limiters
    release = threading.Event()
    try:
        greedy, other = c.site("site-a"), c.site("site-b")
        _register(greedy, "site-a")
        _register(other, "site-b")
        started = time.monotonic()
        held = [greedy.UploadUpdate.future(_silent(release), timeout=30) for _ in range(4)]
        _wait_for(lambda: limiter.in_flight() == 4, "the four streams admitted")
        with pytest.raises(grpc.RpcError) as info:
            greedy.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details() or ""
        assert "site 'site-a' already has 4 calls" in details and "--max-calls-per-site" in details
        other.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-b"), timeout=5)
        c.admin().ListSites(admin_pb2.ListSitesRequest(), timeout=5)
        with caplog.at_level(logging.WARNING, logger="fedra.coordinator"):
            for call in held:
                err = call.exception(timeout=10)
                assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.CANCELLED
        took = time.monotonic() - started
        assert idle_s <= took < idle_s + 5, took
        cut = [r.getMessage() for r in caplog.records if "--stream-idle-s" in r.getMessage()]
        assert len(cut) == 4 and all("site 'site-a'" in m for m in cut), cut
        _wait_for(lambda: limiter.in_flight() == 0, "the slots freed")
        greedy.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
    finally:
        release.set()
        c.close()


def test_an_ended_call_frees_its_slot_and_leaves_no_cycle_for_the_collector(
    tmp_path: Path, limiters: list[CallLimiter]
) -> None:
    """Every call frees its slot however it ends: answered, refused, or cancelled by its
    caller while it waits. And a call answered or cancelled leaves nothing of the
    limiter's, nor gRPC's call state, for the collector: at thousands of sites, calls
    held in reference cycles were most of the daemon's young garbage, and its
    collections half its CPU."""
    c = _Coordinator(tmp_path, EdgeLimits(calls_per_admin=8, stream_idle_s=30), tls=False)
    (limiter,) = limiters
    try:
        stub = c.site("site-a")
        _register(stub, "site-a")
        for _ in range(10):  # warm: whatever a first call builds once is not the calls'
            stub.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(50):
                stub.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
            waiting = stub.PollTask.future(site_pb2.PollTaskRequest(site_id="site-a"), timeout=30)
            _wait_for(lambda: limiter.in_flight() == 1, "the poll admitted")
            waiting.cancel()  # the handler is cancelled mid-wait
            _wait_for(lambda: limiter.in_flight() == 0, "the slots freed")
            for _ in range(5):  # the server's loop finishes the cancelled call meanwhile
                stub.Heartbeat(site_pb2.HeartbeatRequest(site_id="site-a"), timeout=5)
            for _ in range(50):  # refused by the servicer: its status set, nothing raised
                with pytest.raises(grpc.RpcError) as info:
                    bad = site_pb2.HeartbeatRequest(site_id="site-a", hold_s=-1)
                    stub.Heartbeat(bad, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "hold_s" in (info.value.details() or ""), info.value.details()
            del info
            _wait_for(lambda: limiter.in_flight() == 0, "the refused calls' slots freed")
            gc.collect()
            left = collections.Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        # Each of the 51 calls left one of each before, and each of the 50 refusals its
        # exception's traceback and frames too (an abort's exception, kept by gRPC with
        # the call's state); a few may be another test's, whose objects became garbage
        # meanwhile.
        kinds = ("_Call", "_Caller", "RPCState", "_ServicerContext", "traceback", "frame")
        cycles = {k: left[k] for k in kinds if left[k]}
        assert max(cycles.values(), default=0) < 10, f"calls left in cycles: {cycles} ({left})"
    finally:
        c.close()


def test_insecure_mode_bounds_each_connection(tmp_path: Path, limiters: list[CallLimiter]) -> None:
    """Without TLS there are no identities: a connection stands for its caller."""
    c = _Coordinator(tmp_path, EdgeLimits(calls_per_admin=3, stream_idle_s=30), tls=False)
    (limiter,) = limiters
    release = threading.Event()
    try:
        stub = c.site("site-a")
        held = [stub.UploadUpdate.future(_silent(release), timeout=30) for _ in range(3)]
        _wait_for(lambda: limiter.in_flight() == 3, "the three streams admitted")
        with pytest.raises(grpc.RpcError) as info:
            c.admin().ListRuns(admin_pb2.ListRunsRequest(), timeout=5)  # the same connection
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connection ipv" in (info.value.details() or "")
        del info
        # A caller past its bound is refused without an abort's exception: a flood of
        # refused calls leaves nothing in reference cycles for the collector.
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(30):
                with pytest.raises(grpc.RpcError) as info:
                    c.admin().ListRuns(admin_pb2.ListRunsRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            del info
            gc.collect()
            left = collections.Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        kinds = ("RPCState", "_ServicerContext", "AbortError", "traceback", "frame")
        cycles = {k: left[k] for k in kinds if left[k]}
        assert max(cycles.values(), default=0) < 10, f"refusals left in cycles: {cycles} ({left})"
        release.set()  # the streams end (empty: refused), and the connection may call again
        for call in held:
            assert call.exception(timeout=10) is not None
        _wait_for(lambda: limiter.in_flight() == 0, "the slots freed")
        c.admin().ListRuns(admin_pb2.ListRunsRequest(), timeout=5)
    finally:
        release.set()
        c.close()


# -- fault: a stalled upload held its round until the deadline -------------------------------


class _Heartbeats:
    """Heartbeats for the sites in ``alive``, every 0.25 s, from a thread of its own."""

    def __init__(self, c: InProcessCoordinator, *sites: str) -> None:
        self.alive, self.stop = set(sites), threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(c,), daemon=True)
        self.thread.start()

    def _beat(self, c: InProcessCoordinator) -> None:
        while not self.stop.wait(0.25):
            for site in sorted(self.alive):
                c.site.Heartbeat(site_pb2.HeartbeatRequest(site_id=site), timeout=5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _round_one(c: InProcessCoordinator) -> tuple[str, dict[str, site_pb2.Task], _Heartbeats]:
    """Round 1 of a one-round run of sites a and b (either's update is enough), both alive."""
    for site in ("site-a", "site-b"):
        _register(c.site, site)
    beats = _Heartbeats(c, "site-a", "site-b")
    spec = {"rounds": 1, "sites_per_round": 2, "min_sites": 1, "round_deadline_s": 60}
    run_id = submit(c, **spec)
    ((init_site, init_task),) = tasks_of_round(c, run_id, 0).items()
    upload(c, messages(init_task, init_site, encode(model_state())))
    return run_id, tasks_of_round(c, run_id, 1), beats


def _paced(
    msgs: Iterator[site_pb2.UpdateChunk],
    pause_after: set[int],
    pause: threading.Event,
    pause_s: float,
) -> Iterator[site_pb2.UpdateChunk]:
    """``msgs``, waiting ``pause_s`` (or until ``pause`` is set) after the listed ones."""
    for i, message in enumerate(msgs):
        yield message
        if i in pause_after:
            pause.wait(pause_s)


def _run_state(c: InProcessCoordinator, run_id: str) -> str:
    record = c.engine._store.get_run(run_id)
    assert record is not None
    return record.state


@pytest.fixture
def quick(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    settings = EngineSettings(heartbeat_interval_s=0.5, poll_timeout_s=2.0, site_timeout_s=2.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        yield c
    finally:
        c.close()


def test_a_site_silent_mid_upload_loses_its_task_after_the_site_timeout(
    quick: InProcessCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """Header and half the payload, then nothing (no chunk, no heartbeat): the upload is
    ended after about site_timeout_s, the task fails as the site's other work would, and
    the round commits the other site's update long before its 60 s deadline."""
    run_id, tasks, beats = _round_one(quick)
    release = threading.Event()
    try:
        upload(quick, messages(tasks["site-a"], "site-a", delta_payload()))
        payload = delta_payload(0.02)
        msgs = messages(tasks["site-b"], "site-b", payload, chunk=len(payload) // 4)
        stalled = quick.site.UploadUpdate.future(
            _paced(msgs, {2}, release, 60), timeout=60
        )  # header, two of four chunks, then silence
        beats.alive.discard("site-b")
        went_silent = time.monotonic()
        err = stalled.exception(timeout=15)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.CANCELLED
        cut_after = time.monotonic() - went_silent
        assert 1.5 < cut_after < 6, cut_after
        _wait_for(lambda: _run_state(quick, run_id) == "completed", "the run completed", 15)
        failed = quick.engine._store.get_participation(tasks["site-b"].task_id)
        assert failed is not None and failed.state == "failed"
        assert "went silent" in failed.error, failed.error
        assert "went silent mid-upload" in caplog.text
        assert time.monotonic() - went_silent < 20  # not the 60 s deadline
    finally:
        release.set()
        beats.close()


def test_a_slow_upload_of_a_site_that_heartbeats_is_not_cut(quick: InProcessCoordinator) -> None:
    """A site whose chunks come slower than site_timeout_s apart but which heartbeats
    meanwhile (a slow link) keeps its upload: both updates count."""
    run_id, tasks, beats = _round_one(quick)
    never = threading.Event()
    try:
        payload = delta_payload(0.02)
        msgs = messages(tasks["site-b"], "site-b", payload, chunk=len(payload) // 3 + 1)
        slow = quick.site.UploadUpdate.future(_paced(msgs, {1, 2}, never, 2.6), timeout=30)
        upload(quick, messages(tasks["site-a"], "site-a", delta_payload()))
        assert slow.result(timeout=20).bytes_received == len(payload)
        _wait_for(lambda: _run_state(quick, run_id) == "completed", "the run completed", 15)
        accepted = quick.engine._store.get_participation(tasks["site-b"].task_id)
        assert accepted is not None and accepted.state == "accepted"
    finally:
        never.set()
        beats.close()


# -- fault: a second coordinator could share a port in use -----------------------------------


def test_a_second_coordinator_on_a_port_in_use_is_refused(tmp_path: Path) -> None:
    """gRPC shares a port by default (SO_REUSEPORT): two daemons would answer calls in
    turn. The second exits at once, naming the address; the first (port 0) serves on."""
    with LocalCluster(tmp_path / "first", secure=False) as cluster:
        cluster.start_coordinator(port=0)
        port = int(cluster.address.rsplit(":", 1)[1])
        other = tmp_path / "second"
        second = subprocess.Popen(
            [sys.executable, "-m", "fedra", "coordinator", "--state-dir", str(other),
             "--insecure", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            # Either it exits, or (sharing the port) it serves and writes its readiness file.
            _wait_for(
                lambda: second.poll() is not None or (other / "coordinator.json").exists(),
                "the second coordinator exited or served",
                timeout_s=30,
            )
            assert not (other / "coordinator.json").exists(), "the second one serves too"
            _, stderr = second.communicate(timeout=10)
        finally:
            if second.poll() is None:
                second.kill()
                second.communicate(timeout=10)
        assert second.returncode == 2, stderr
        assert f"127.0.0.1:{port}" in stderr and "in use" in stderr, stderr
        assert "Traceback" not in stderr
        with cluster.admin() as admin:
            assert admin.runs() == []  # the first still serves


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("calls_per_site", 0, "--max-calls-per-site"),
        ("calls_per_admin", 5000, "--max-calls-per-admin"),
        ("stream_idle_s", float("inf"), "--stream-idle-s"),
        ("stream_idle_s", 0.0, "--stream-idle-s"),
    ],
)
def test_bad_edge_limits_are_refused_by_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        EdgeLimits(**{field: value})  # type: ignore[arg-type]


def test_a_burst_of_calls_the_busy_loop_has_not_taken_up_waits_rather_than_is_cancelled(
    tmp_path: Path,
) -> None:
    """Thousands of sites call at the instant a round opens, faster than the server's
    event loop takes calls up. gRPC's core would cancel those past 1,000 waiting (some)
    and 3,000 (all) before any handler saw them; the coordinator's server queues them."""
    c = InProcessCoordinator(tmp_path / "state", EngineSettings())
    blocked, release = threading.Event(), threading.Event()
    channels = [
        grpc.insecure_channel(c.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(20)
    ]
    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=10)
        stubs = [site_pb2_grpc.SiteServiceStub(channel) for channel in channels]

        def busy() -> None:  # the loop at a round's opening: no call is taken up
            blocked.set()
            release.wait(30)

        c.server._loop.call_soon_threadsafe(busy)
        assert blocked.wait(10)
        request = site_pb2.HeartbeatRequest(site_id="nobody", task_id="t")
        calls = [stubs[i % len(stubs)].Heartbeat.future(request, timeout=60) for i in range(3500)]
        ended = threading.Event()
        for call in calls:
            call.add_done_callback(lambda _: ended.set())
        # A cancelled call would end now, while the loop is still busy: none may.
        ended_early = ended.wait(2)
        release.set()
        codes = collections.Counter(call.code() for call in calls)  # each waits for its end
        assert grpc.StatusCode.CANCELLED not in codes, codes
        assert not ended_early
    finally:
        release.set()
        for channel in channels:
            channel.close()
        c.close()
