"""The coordinator's Prometheus metrics (``--http``): the series, and a real daemon's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedra.config import READY_FILE, ConfigError
from fedra.coordinator.engine import Gauges
from fedra.coordinator.observers import Observers, RoundEnded, RunEnded
from fedra.coordinator.telemetry import HttpEndpoint, Telemetry, check_http_address
from fedra.local import LocalCluster
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until

NOW = Gauges(
    sites_registered=5, sites_online=3, runs_by_state={"running": 1, "completed": 2},
    downloads_in_flight=2, uploads_in_flight=1, waiting_calls=4,
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
    # No series carries a site label: those are unbounded.
    assert not [k for k in got if any(name == "site" for name, _ in k[1])]


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
        ("9100", "expected HOST:PORT"),
        ("127.0.0.1:", "expected HOST:PORT"),
        ("127.0.0.1:99999", "expected HOST:PORT"),
        ("0.0.0.0:9100", "loopback address only"),
        ("10.1.2.3:9100", "loopback address only"),
        ("metrics.example.org:9100", "loopback address only"),
    ],
)
def test_a_bad_or_exposed_http_address_is_refused(address: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_http_address(address)


def test_loopback_addresses_are_accepted() -> None:
    assert check_http_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert check_http_address("localhost:9100") == ("localhost", 9100)
    assert check_http_address("[::1]:9100") == ("::1", 9100)


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
