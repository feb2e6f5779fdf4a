"""The admin port: the operators' read process (coordinator/replica.py).

Multi-process: a real daemon, its read process and sites; the admin port's answers
against the site port's, its writes forwarded to the daemon under the caller's identity,
its process started again when it dies and gone when the daemon dies. Unit: the flag,
the forwarded guard, liveness from a stale snapshot."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedra import pki
from fedra.admin import AdminClient
from fedra.audit import AUDIT_FILE, read
from fedra.cli import _admin_port
from fedra.client.connection import Connection
from fedra.config import ConfigError
from fedra.coordinator.errors import PermissionDenied
from fedra.coordinator.replica import (
    FORWARDED_ADMIN,
    READS_DIR,
    READY_FILE,
    ForwardedGuard,
    RefusalsRead,
    RefusalTally,
    Replica,
)
from fedra.local import LocalCluster
from fedra.protos.v1 import admin_pb2
from fedra.storage import Store
from tests.conftest import fedra_cli, postgres_database
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until
from tests.test_telemetry import scrape

DEADLINE_S = 60.0


def _wait(probe: Any, what: str, timeout_s: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result:
            return result
        assert time.monotonic() < deadline, f"did not {what} within {timeout_s:g} s"
        time.sleep(0.1)  # polling a condition, with a deadline


def _reads_pid(state_dir: Path) -> int:
    """The serving read process's pid; 0 while none serves."""
    try:
        return int(json.loads((state_dir / READS_DIR / READY_FILE).read_text())["pid"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_admin_port_answers_as_the_site_port_does(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        assert cluster.admin_address and cluster.admin_address != cluster.address
        with cluster.admin(admin_port=True) as reads, cluster.admin() as direct:
            # A write through the admin port is the daemon's: forwarded, answered as sent.
            run_id = reads.submit(synthetic_spec(rounds=2))
            assert [r.run_id for r in direct.runs()] == [run_id]
            # What only the daemon's memory knows reaches the admin port (its snapshot).
            _wait(lambda: "waiting" in reads.status(run_id).reason, "show the waiting reason")
            ids = start_synthetic_sites(cluster)
            listed = _wait(lambda: [s for s in reads.sites() if s.online], "list sites online")
            assert sorted(s.site_id for s in listed) == ids
            assert reads.site_counts() == (3, 3)
            done = wait_until(reads, run_id, finished)  # WatchRun, served by the read process
            assert done.state == "completed", done.reason
            assert reads.status(run_id) == direct.status(run_id)
            assert list(reads.runs()) == list(direct.runs())
            exported, expected = reads.export_model(run_id), direct.export_model(run_id)
            assert exported.keys() == expected.keys()
            assert all(torch.equal(exported[k], expected[k]) for k in expected)
            # Bad input: a clear status, through either port the same, and nothing changed.
            for admin in (reads, direct):
                with pytest.raises(grpc.RpcError) as missing:
                    admin.status("no-such-run")
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                assert "no-such-run" in (missing.value.details() or "")
                with pytest.raises(grpc.RpcError) as empty:
                    admin.stub.SubmitRun(admin_pb2.SubmitRunRequest(), timeout=10)
                assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "spec" in (empty.value.details() or "")
                with pytest.raises(grpc.RpcError) as token:
                    admin.stub.ListSites(admin_pb2.ListSitesRequest(page_token="x" * 500))
                assert token.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [r.run_id for r in direct.runs()] == [run_id]
            with pytest.raises(grpc.RpcError) as cancelled:
                reads.cancel("no-such-run")
            assert cancelled.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_read_process_is_started_again_and_ends_with_its_daemon(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        state = cluster.state_dir
        first = _reads_pid(state)
        announced = json.loads((state / "coordinator.json").read_text())
        assert announced["admin_address"] == cluster.admin_address
        with cluster.admin(admin_port=True) as reads:
            assert reads.runs() == []
            os.kill(first, signal.SIGKILL)
            second = _wait(
                lambda: (p := _reads_pid(state)) != first and p, "start the read process again"
            )
            assert not _alive(first)
            # The same port: an operator's address still holds.
            assert _wait(lambda: _answers(reads), "answer on the admin port again")
        # Meanwhile the CLI was sent to the site port; now to the admin port again.
        assert cluster.coordinator is not None
        log = cluster.coordinator.log_path.read_text()
        assert "admin calls: the site port meanwhile" in log
        assert _wait(
            lambda: json.loads((state / "coordinator.json").read_text()) == announced,
            "name the admin port in coordinator.json again",
        )
        listed = fedra_cli("run", "list", "--state-dir", str(state))
        assert listed.returncode == 0, listed.stderr
        assert cluster.coordinator is not None
        cluster.coordinator.signal(signal.SIGKILL)  # however the daemon dies, it goes too
        _wait(lambda: not _alive(second), "end the read process with its daemon")


def _answers(admin: AdminClient) -> bool:
    try:
        admin.runs()
    except grpc.RpcError:
        return False
    return True


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_admin_port_checks_identities_and_audits_the_forwarded_admin(
    tmp_path: Path,
) -> None:
    with LocalCluster(tmp_path / "cluster") as cluster:  # mTLS: real identities
        cluster.start_coordinator(flags=FAST)
        with cluster.admin(admin_port=True) as reads:
            run_id = reads.submit(synthetic_spec(rounds=500))
            assert reads.cancel(run_id) in ("cancelled", "cancelling")
        site = pki.load_folder(cluster._pki_folder("site", "site-0"))
        with AdminClient(cluster.admin_address, tls=site) as impostor:
            with pytest.raises(grpc.RpcError) as refused:
                impostor.runs()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "admin" in (refused.value.details() or "")
            with pytest.raises(grpc.RpcError) as refused_write:
                impostor.submit(synthetic_spec(rounds=1))
            assert refused_write.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with (
            pytest.raises(grpc.RpcError) as no_cert,
            AdminClient(cluster.admin_address, timeout_s=5) as anonymous,
        ):
            anonymous.runs()
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS: no handshake
        with cluster.admin() as direct:
            assert [r.run_id for r in direct.runs()] == [run_id]  # the impostor's never came
        log = cluster.state_dir / AUDIT_FILE
        entries = _wait(
            lambda: [e for e in read(log) if e.event in ("run.submit", "run.cancel")] or None,
            "audit the forwarded calls",
        )
        assert [(e.event, e.who) for e in entries] == [
            ("run.submit", "admin admin"), ("run.cancel", "admin admin")
        ]  # fmt: skip


# -- unit --------------------------------------------------------------------------


def test_the_admin_port_flag() -> None:
    assert _admin_port(None, 50051) == 50052
    assert _admin_port(None, 0) == 0
    assert _admin_port("0", 50051) == 0
    assert _admin_port("9000", 50051) == 9000
    assert _admin_port("none", 50051) is None
    assert _admin_port("off", 50051) is None
    for bad, says in (("x", "'x'"), ("70000", "70000"), ("-1", "-1"), ("50051", "--port")):
        with pytest.raises(ConfigError, match="--admin-port") as exc:
            _admin_port(bad, 50051)
        assert says in str(exc.value)


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def test_a_forwarded_call_must_name_its_admin() -> None:
    guard = ForwardedGuard(None, insecure=True)
    assert guard.admin(_Context(((FORWARDED_ADMIN, "admin ops"),))) == "admin ops"
    for metadata in (
        (),
        (("other", "x"),),
        ((FORWARDED_ADMIN, ""),),
        ((FORWARDED_ADMIN, "x" * 300),),
    ):
        with pytest.raises(PermissionDenied, match=FORWARDED_ADMIN):
            guard.admin(_Context(metadata))


def test_liveness_comes_from_the_database_when_the_snapshot_is_stale(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'fedra.db'}")
    try:
        now = time.time()
        store.upsert_site("a", ["t"], "1", now)  # heard from just now
        store.upsert_site("b", ["t"], "1", now - 600)  # long ago
        store.upsert_site("c", ["t"], "1", now - 600)
        snapshot = tmp_path / "live.json"
        live = {"pid": 1, "written_unix_s": now, "site_timeout_s": 20.0, "runs": {}, "pending": []}
        live["sites"] = {"a": 100_000, "b": 0}  # the daemon's view: ms since heard from
        live["offline"] = ["a"]
        snapshot.write_text(json.dumps(live))
        with ThreadPoolExecutor(1) as readers:
            replica = Replica(store, snapshot, readers, daemon_pid=1)
            page, token = replica.list_sites("", 2)
            assert [(s.id, online) for s, online, _ in page] == [("a", False), ("b", True)]
            assert [round(now - seen, 3) for _, _, seen in page] == [100.0, 0.0]
            assert token == "b"
            rest, token = replica.list_sites("b", 2)
            assert [(s.id, online) for s, online, _ in rest] == [("c", False)] and token == ""
            assert replica.site_counts() == (3, 1)
            assert replica.site_counts({"b"}) == (3, 0)
            # A daemon that stopped writing knows no better than the database does.
            live["written_unix_s"] = now - 60
            snapshot.write_text(json.dumps(live))
            os.utime(snapshot, ns=(time.time_ns(), time.time_ns() + 1))
            page, _ = replica.list_sites("", 5)
            assert [(s.id, online) for s, online, _ in page] == [
                ("a", True), ("b", False), ("c", False)
            ]  # fmt: skip
            assert replica.site_counts() == (3, 1)
    finally:
        store.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_admin_port_pages_sites_as_the_site_port_does_on_postgresql(tmp_path: Path) -> None:
    """Ids whose order PostgreSQL's collation and Python's disagree on, paged by twos."""
    ids = ["B-site", "a_site", "a.site", "A-site", "b", "a-site", "Ab", "aB"]
    with (
        postgres_database("fedra_admin_port") as db_url,
        LocalCluster(tmp_path / "cluster", secure=False) as cluster,
    ):
        cluster.start_coordinator(db_url=db_url, flags=FAST)
        for site_id in ids:
            conn = Connection(cluster.address, site_id)
            try:
                conn.register(["fedra.examples.synthetic:task"])
            finally:
                conn.close()
        with cluster.admin(admin_port=True) as reads, cluster.admin() as direct:
            expected = [s.site_id for s in direct.sites(page_size=2)]
            assert sorted(expected) == expected and sorted(ids) == expected
            assert [s.site_id for s in reads.sites(page_size=2)] == expected
            assert [s.site_id for s in reads.sites(page_size=3)] == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_every_admin_port_method_refuses_a_site_and_a_revoked_admin(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster") as cluster:  # mTLS: real identities
        cluster.start_coordinator(flags=[*FAST, "--http", "127.0.0.1:0"])
        http = json.loads((cluster.state_dir / "coordinator.json").read_text())["http_address"]
        site = pki.load_folder(cluster._pki_folder("site", "site-0"))
        calls = {
            "SubmitRun": lambda a: a.submit(synthetic_spec(rounds=1)),
            "GetRun": lambda a: a.status("x"),
            "ListRuns": lambda a: a.runs(),
            "WatchRun": lambda a: list(a.watch("x", timeout_s=10)),
            "CancelRun": lambda a: a.cancel("x"),
            "ListSites": lambda a: a.sites(),
            "ExportModel": lambda a: a.export_model("x"),
        }
        with AdminClient(cluster.admin_address, tls=site, timeout_s=10) as impostor:
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call(impostor)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        fedra_cli("provision", "--out", str(cluster.pki_dir), "--add", "eve", "--role", "admin")
        eve_folder = cluster.pki_dir / "admins" / "eve"
        revoked = fedra_cli("revoke", "--state-dir", str(cluster.state_dir), str(eve_folder))
        assert revoked.returncode == 0, revoked.stderr
        with AdminClient(cluster.admin_address, tls=pki.load_folder(eve_folder)) as eve:
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call(eve)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        with cluster.admin() as direct:
            assert direct.runs() == []  # nothing any of them sent changed anything
        # Refused identities are audited, and the refusals counted in the daemon's metrics.
        audit = cluster.state_dir / AUDIT_FILE
        refused_who = _wait(
            lambda: (
                (w := {e.who for e in read(audit) if e.event == "identity.refused"})
                >= {"site site-0", "admin eve"}
                and w
            ),
            "audit the identities the admin port refused",
        )
        assert refused_who == {"site site-0", "admin eve"}

        def counted() -> bool:
            metrics = scrape(http)
            by_status = {
                dict(labels)["status"]: value
                for (name, labels), value in metrics.items()
                if name == "fedra_refusals_total"
            }
            return by_status.get("PERMISSION_DENIED", 0) >= len(calls) and by_status.get(
                "UNAUTHENTICATED", 0
            ) >= len(calls)

        _wait(counted, "count the admin port's refusals in /metrics")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_admin_port_bounds_each_callers_calls_in_flight(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--max-calls-per-admin", "2"])
        with cluster.admin(admin_port=True) as reads:  # one connection: one caller
            run_id = reads.submit(synthetic_spec(rounds=500))  # no sites: it waits
            watches = [reads.watch(run_id, timeout_s=60) for _ in range(2)]
            for watch in watches:
                assert next(watch).run_id == run_id  # both streams are open now
            with pytest.raises(grpc.RpcError) as refused:
                reads.runs()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--max-calls-per-admin" in (refused.value.details() or "")
            for watch in watches:
                watch.close()  # type: ignore[attr-defined]
            assert _wait(lambda: _answers(reads), "admit a call once a watch ended")
            reads.cancel(run_id)


def test_the_daemon_adds_each_read_process_refusals_once(tmp_path: Path) -> None:
    folder = tmp_path / READS_DIR
    folder.mkdir()
    daemon = RefusalsRead(tmp_path)
    assert daemon.new() == {}  # no read process has counted anything yet
    tally = RefusalTally()
    for status in ("UNAUTHENTICATED", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        tally.refused(status)
    tally.write(folder)
    assert daemon.new() == {"UNAUTHENTICATED": 2, "PERMISSION_DENIED": 1}
    assert daemon.new() == {}  # counted once
    tally.refused("UNAUTHENTICATED")
    tally.write(folder)
    assert daemon.new() == {"UNAUTHENTICATED": 1}
    # A read process started again counts from 0: its counts are all new.
    (folder / "refusals.json").write_text(
        json.dumps({"pid": os.getpid() + 1, "refusals": {"UNAVAILABLE": 4}})
    )
    assert daemon.new() == {"UNAVAILABLE": 4}
    (folder / "refusals.json").write_text("{not json")
    assert daemon.new() == {}  # a half-written file is read next time


def test_a_snapshot_another_daemon_wrote_is_not_used(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'fedra.db'}")
    try:
        now = time.time()
        store.upsert_site("a", ["t"], "1", now - 600)  # long ago, says the database
        snapshot = tmp_path / "live.json"
        live = {"pid": 4242, "seq": 1, "written_unix_s": now, "site_timeout_s": 20.0,
                "runs": {"r": {"waiting": "waiting for sites", "phase": ["driven", False],
                               "changes": 3}},
                "pending": ["t1"], "sites": {"a": 0}, "offline": [],
                "registrations": 1}  # fmt: skip
        snapshot.write_text(json.dumps(live))
        with ThreadPoolExecutor(1) as readers:
            mine = Replica(store, snapshot, readers, daemon_pid=4242)
            assert mine.waiting_reason("r") == "waiting for sites"
            assert mine.downloads_pending() == {"t1"} and mine.site_counts() == (1, 1)
            assert mine.listing_key() is not None
            other = Replica(store, snapshot, readers, daemon_pid=4343)  # a restarted daemon
            assert other.waiting_reason("r") == "" and other.downloads_pending() == set()
            assert other.run_phase("r") == ("not driven",)
            assert other.site_counts() == (1, 0)  # from the row: heard from long ago
            assert other.listing_key() is None  # no snapshot: the rows decide, each time
            assert other.settled_before() == 0.0  # no round counts as final yet
    finally:
        store.close()
