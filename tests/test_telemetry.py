"""The coordinator's Prometheus metrics (``--http``): the series, and a real daemon's."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedra import pki
from fedra.config import READY_FILE, ConfigError
from fedra.coordinator.auth import Guard
from fedra.coordinator.engine import Gauges
from fedra.coordinator.observers import Observers, RoundEnded, RunEnded
from fedra.coordinator.telemetry import HttpEndpoint, Telemetry, check_http_address
from fedra.httpserve import tls_context
from fedra.local import ClusterError, LocalCluster
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until

NOW = Gauges(
    sites_registered=5, sites_online=3, runs_by_state={"running": 1, "completed": 2},
    downloads_in_flight=2, uploads_in_flight=1, waiting_calls=4,
    hearing_lag_s=1.5,
)  # fmt: skip


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=")
        return samples(reply.read().decode())


def test_round_events_become_counters_and_histograms() -> None:
    t = Telemetry(lambda: NOW)
    told = Observers()
    told.add(t)
    stages = {"distribute_s": 0.02, "compute_s": 0.3, "round_s": 1.5}
    told.round_ended(RoundEnded(
        "r1", 1, 1, "retried", 2.0, 0, bytes_down=100, bytes_up=0, lost_bytes=100,
    ))  # fmt: skip
    told.round_ended(RoundEnded(
        "r1", 1, 2, "committed", 1.5, 2, bytes_down=200, bytes_up=80, lost_bytes=10,
        checkpoint_bytes=36, idle_s=0.4, stages=stages,
    ))  # fmt: skip
    told.run_ended(RunEnded("r1", "completed"))
    told.refused("NOT_FOUND")
    told.refused("NOT_FOUND")
    told.committed(0.003, 7)
    got = samples(t.exposition().decode())
    assert got[("fedra_rounds_total", (("outcome", "retried"), ("run", "r1")))] == 1
    assert got[("fedra_rounds_total", (("outcome", "committed"), ("run", "r1")))] == 1
    assert got[("fedra_bytes_total", (("direction", "down"), ("run", "r1")))] == 300
    assert got[("fedra_bytes_total", (("direction", "up"), ("run", "r1")))] == 80
    assert got[("fedra_lost_bytes_total", (("run", "r1"),))] == 110
    assert got[("fedra_checkpoint_bytes_total", (("run", "r1"),))] == 36
    assert got[("fedra_round_duration_seconds_count", (("run", "r1"),))] == 1  # committed only
    assert got[("fedra_round_duration_seconds_sum", (("run", "r1"),))] == 1.5
    assert got[("fedra_round_stage_seconds_sum", (("stage", "compute"),))] == 0.3
    assert ("fedra_round_stage_seconds_sum", (("stage", "round"),)) not in got
    assert got[("fedra_site_idle_seconds_sum", ())] == 0.4
    assert got[("fedra_runs_ended_total", (("state", "completed"),))] == 1
    assert got[("fedra_refusals_total", (("status", "NOT_FOUND"),))] == 2
    assert got[("fedra_db_commit_seconds_count", ())] == 1
    assert got[("fedra_db_writes_total", ())] == 7
    # What the engine says at the scrape.
    assert got[("fedra_sites_registered", ())] == 5
    assert got[("fedra_sites_online", ())] == 3
    assert got[("fedra_runs", (("state", "completed"),))] == 2
    assert got[("fedra_runs", (("state", "failed"),))] == 0
    assert got[("fedra_transfers_in_flight", (("direction", "up"),))] == 1
    assert got[("fedra_waiting_calls", ())] == 4
    assert got[("fedra_hearing_lag_seconds", ())] == 1.5
    # No series carries a site label: those are unbounded.
    assert not [k for k in got if any(name == "site" for name, _ in k[1])]


def test_only_the_latest_ended_runs_keep_their_series() -> None:
    from fedra.coordinator.telemetry import KEPT_ENDED_RUNS

    t = Telemetry(lambda: NOW)
    runs = [f"r{i}" for i in range(KEPT_ENDED_RUNS + 3)]
    for run_id in runs:
        t.round_ended(RoundEnded(run_id, 1, 1, "committed", 1.0, 1, bytes_down=10, bytes_up=5))
        t.round_ended(RoundEnded(run_id, 2, 1, "retried", 1.0, 0, lost_bytes=3))
    t.run_ended(RunEnded("r0", "completed"))
    t.run_ended(RunEnded("r0", "completed"))  # told twice: counted once among the kept
    for run_id in runs[1:-1]:  # the last one still runs
        t.run_ended(RunEnded(run_id, "failed"))

    def by_run() -> set[str]:
        return {
            dict(labels)["run"]
            for (_, labels) in samples(t.exposition().decode())
            if "run" in dict(labels)
        }

    ended = runs[:-1]
    assert by_run() == {*ended[-KEPT_ENDED_RUNS:], runs[-1]}  # the oldest two are dropped
    got = samples(t.exposition().decode())
    assert got[("fedra_runs_ended_total", (("state", "failed"),))] == len(runs) - 2  # kept
    assert ("fedra_lost_bytes_total", (("run", "r0"),)) not in got
    assert got[("fedra_lost_bytes_total", (("run", runs[-1]),))] == 3


def test_a_round_s_bytes_leave_carried_tasks_to_the_round_they_end_in() -> None:
    """Async: a task still training when its round closes moves on to the next round
    (the store moves its row), so it is counted, and lost or not, there only."""
    from fedra.coordinator.engine.rounds import _ended
    from fedra.storage.records import ParticipationRecord

    def task(task_id: str, state: str, down: int, up: int, cut: int = 0) -> ParticipationRecord:
        return ParticipationRecord(
            task_id, "r", 3, 1, f"site-{task_id}", state, 0.0,
            bytes_down=down, bytes_up=up, bytes_cut=cut,
        )  # fmt: skip

    parts = [task("a", "accepted", 10, 5), task("b", "expired", 10, 0, cut=2),
             task("c", "downloaded", 10, 0)]  # fmt: skip
    committed = _ended("r", 3, 1, "committed", 0.0, 1.0, parts, carried=["c"])
    assert (committed.updates, committed.bytes_down, committed.bytes_up) == (1, 20, 5)
    assert committed.lost_bytes == 2 + 10  # the cut bytes and the expired task's
    retried = _ended("r", 3, 1, "retried", 0.0, 1.0, parts, carried=["c"])
    assert (retried.updates, retried.lost_bytes) == (0, 2 + 15 + 10)  # all but the carried
    # Not carried (a synchronous round's straggler, expired by the commit): lost here.
    assert _ended("r", 3, 1, "committed", 0.0, 1.0, parts).lost_bytes == 2 + 10 + 10


def test_a_failing_observer_fails_nothing_else() -> None:
    t = Telemetry(lambda: NOW)
    told = Observers()

    class Broken(Telemetry):
        def refused(self, status: str) -> None:
            raise RuntimeError("broken")

    told.add(Broken(lambda: NOW))
    told.add(t)
    told.refused("UNAVAILABLE")  # no exception, and the next observer still hears it
    assert samples(t.exposition().decode())[("fedra_refusals_total", (("status", "UNAVAILABLE"),))]


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("9100", "must be host:port"),
        ("127.0.0.1:", "must be host:port"),
        ("127.0.0.1:99999", "must be host:port"),
        ("::1:9100", "IPv6 host in brackets"),
        ("0.0.0.0:9100", "admin certificates only: give --tls-dir"),
        ("10.1.2.3:9100", "admin certificates only"),
        ("metrics.example.org:9100", "admin certificates only"),
    ],
)
def test_a_bad_or_exposed_http_address_is_refused(address: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_http_address(address)


def test_loopback_addresses_are_accepted() -> None:
    assert check_http_address("127.0.0.1:0") == ("127.0.0.1", 0, True)
    assert check_http_address("localhost:9100") == ("localhost", 9100, True)
    assert check_http_address("[::1]:9100") == ("::1", 9100, True)
    # Off loopback only with TLS (the coordinator's --tls-dir): admin certificates then.
    assert check_http_address("0.0.0.0:9100", tls=True) == ("0.0.0.0", 9100, False)


def test_the_endpoint_serves_metrics_and_nothing_else() -> None:
    endpoint = HttpEndpoint("127.0.0.1:0", Telemetry(lambda: NOW))
    endpoint.start()
    try:
        assert not endpoint.address.endswith(":0")
        assert scrape(endpoint.address)[("fedra_sites_online", ())] == 3
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://{endpoint.address}/admin", timeout=10)
        assert missing.value.code == 404
        with pytest.raises(ConfigError, match="cannot listen there"):  # the port is taken
            HttpEndpoint(endpoint.address, Telemetry(lambda: NOW))
    finally:
        endpoint.stop()


@pytest.mark.multiprocess
def test_a_coordinator_s_metrics_follow_its_rounds(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--http", "127.0.0.1:0"])
        ready = json.loads((cluster.state_dir / READY_FILE).read_text())
        address = ready["http_address"]
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        before = scrape(address)
        assert before[("fedra_sites_registered", ())] == 0
        start_synthetic_sites(cluster, n=2)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=2, sites_per_round=2, min_sites=2))
            status = wait_until(admin, run_id, finished)
            assert status.state == "completed", status.reason
            with pytest.raises(Exception, match=r"NOT_FOUND|no run"):
                admin.status("no-such-run")
        after = scrape(address)
        cluster.stop()
    run = (("run", run_id),)
    # The initial model's round and two training rounds, each committed once.
    assert after[("fedra_rounds_total", (("outcome", "committed"), *run))] == 3
    assert after[("fedra_round_duration_seconds_count", run)] == 3
    assert after[("fedra_bytes_total", (("direction", "up"), *run))] > 0
    assert after[("fedra_bytes_total", (("direction", "down"), *run))] > 0
    assert after[("fedra_checkpoint_bytes_total", run)] > 0
    assert after[("fedra_round_stage_seconds_count", (("stage", "compute"),))] == 2
    assert after[("fedra_runs", (("state", "completed"),))] == 1
    assert after[("fedra_runs_ended_total", (("state", "completed"),))] == 1
    assert after[("fedra_sites_registered", ())] == 2
    assert after[("fedra_db_commit_seconds_count", ())] >= 1
    assert after[("fedra_refusals_total", (("status", "NOT_FOUND"),))] >= 1


# -- off loopback: TLS, admin certificates only ------------------------------------------


def _client(pki_dir: Path, who: Path | None) -> ssl.SSLContext:
    """A client trusting the project CA, presenting ``who``'s certificate if given."""
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca" / "ca.pem"))
    if who is not None:
        ctx.load_cert_chain(who / "cert.pem", who / "key.pem")
    return ctx


def _get(url: str, ctx: ssl.SSLContext) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=ctx) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    pki.provision(out, coordinator_hosts=["127.0.0.1"], sites=["s1"], admins=["ops", "gone"])
    return out


def test_off_loopback_only_an_admin_certificate_of_the_ca_is_served(
    federation: Path, tmp_path: Path
) -> None:
    deny = tmp_path / "deny.json"
    guard = Guard(pki.DenyList(deny))
    tls = tls_context(federation / "coordinator")
    endpoint = HttpEndpoint(
        "0.0.0.0:0", Telemetry(lambda: NOW), tls=tls, admit=guard.admin_certificate
    )
    endpoint.start()
    try:
        assert endpoint.scheme == "https"
        port = int(endpoint.address.rpartition(":")[2])
        url = f"https://127.0.0.1:{port}/metrics"
        admin = federation / "admins" / "ops"
        code, body = _get(url, _client(federation, admin))
        assert code == 200 and samples(body.decode())[("fedra_sites_online", ())] == 3
        # A site's certificate is the project's, but not an admin's.
        code, body = _get(url, _client(federation, federation / "sites" / "s1"))
        assert code == 403 and b"needs an admin certificate" in body
        # A revoked admin is refused from its next request on.
        pki.revoke(deny, federation / "admins" / "gone")
        code, body = _get(url, _client(federation, federation / "admins" / "gone"))
        assert code == 401 and b"revoked" in body
        assert _get(url, _client(federation, admin))[0] == 200
        # No client certificate, or one of another CA: no TLS session at all.
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(url, _client(federation, None))
        other = tmp_path / "other"
        pki.provision(other, coordinator_hosts=["127.0.0.1"], sites=[], admins=["ops"])
        foreign = _client(federation, None)
        foreign.load_cert_chain(
            other / "admins" / "ops" / "cert.pem", other / "admins" / "ops" / "key.pem"
        )
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(url, foreign)
        # Plain HTTP to the TLS port answers nothing.
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(url.replace("https", "http"), timeout=10)
        # A stalled handshake holds its own thread only: others are served meanwhile.
        with socket.create_connection(("127.0.0.1", port)):
            assert _get(url, _client(federation, admin))[0] == 200
    finally:
        endpoint.stop()


@pytest.mark.multiprocess
def test_a_secure_daemon_serves_its_page_off_loopback_to_admins(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster") as cluster:  # mTLS, as in production
        cluster.start_coordinator(flags=[*FAST, "--http", "0.0.0.0:0"])
        ready = json.loads((cluster.state_dir / READY_FILE).read_text())
        assert ready["http_url"].startswith("https://0.0.0.0:")
        port = ready["http_address"].rpartition(":")[2]
        admin = cluster.pki_dir / "admins" / "admin"
        code, body = _get(f"https://127.0.0.1:{port}/api/runs", _client(cluster.pki_dir, admin))
        assert code == 200 and json.loads(body) == []
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(f"https://127.0.0.1:{port}/", _client(cluster.pki_dir, None))
        cluster.stop()
        log = cluster.coordinator.log_path.read_text() if cluster.coordinator else ""
    assert f"status page at https://0.0.0.0:{port}/" in log


@pytest.mark.multiprocess
def test_an_insecure_daemon_refuses_to_serve_off_loopback(tmp_path: Path) -> None:
    with (
        LocalCluster(tmp_path / "cluster", secure=False) as cluster,
        pytest.raises(ClusterError, match=r"--http '0\.0\.0\.0:0'.*give --tls-dir"),
    ):
        cluster.start_coordinator(flags=[*FAST, "--http", "0.0.0.0:0"], timeout_s=30)


def test_garbage_collections_are_counted_and_timed_by_generation() -> None:
    """The collector holds the interpreter's lock while it runs: its collections and
    their seconds are in the metrics, by generation, counted once however often the
    timing is asked for."""
    import gc

    from fedra.coordinator import gctune

    timers = list(gc.callbacks)
    gctune.time_collections()
    gctune.time_collections()  # once a process
    try:
        t = Telemetry(lambda: NOW)
        before = samples(t.exposition().decode())
        gc.collect()  # a full collection: generation 2
        got = samples(t.exposition().decode())
    finally:
        gc.callbacks[:] = timers  # this test process's collections are not logged
    key = ("fedra_gc_collections_total", (("generation", "2"),))
    assert got[key] == before[key] + 1
    seconds = ("fedra_gc_seconds_total", (("generation", "2"),))
    assert got[seconds] > before[seconds]
    assert {g for (name, labels) in got if name == "fedra_gc_seconds_total"
            for _, g in labels} == {"0", "1", "2"}  # fmt: skip
