"""WAN emulation: the proxy holds a link to its bandwidth and latency, and fedra runs over it."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from fedra.local import LocalCluster
from fedra.wan import Link, WanProxy


@pytest.fixture
def echo_server() -> Iterator[str]:
    """A TCP server that echoes what it receives (until the client shuts its side)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        thread.join(timeout=10)


def _round_trip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = address.rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sender = threading.Thread(
            target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR))
        )
        sender.start()
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
        sender.join()
    return bytes(received), time.monotonic() - started


def test_latency_is_paid_each_way(echo_server: str) -> None:
    with WanProxy(echo_server, Link(bandwidth_mbit=1000, latency_ms=100)) as proxy:
        data, seconds = _round_trip(proxy.address, b"ping")
    assert data == b"ping"
    assert 0.2 <= seconds < 2.0  # 100 ms there, 100 ms back


def test_bandwidth_limits_a_transfer(echo_server: str) -> None:
    payload = bytes(range(256)) * 2048  # 512 KiB
    with WanProxy(echo_server, Link(bandwidth_mbit=16, latency_ms=0)) as proxy:  # 2 MB/s
        data, seconds = _round_trip(proxy.address, payload)
    assert data == payload  # nothing lost or reordered
    # Up and back down overlap (full duplex): about 0.26 s for 524 kB at 2 MB/s.
    assert 0.24 <= seconds < 3.0


def test_loss_caps_a_flow_at_the_mathis_rate(echo_server: str) -> None:
    """2% loss at 20 ms RTT: 1448 / 0.02 * sqrt(3 / 0.04) = 627 kB/s, far below 100 Mbit/s."""
    link = Link(bandwidth_mbit=100, latency_ms=10, loss_pct=2)
    assert link.bytes_per_s == pytest.approx(1448 / 0.02 * math.sqrt(75))
    assert Link(100, 10).bytes_per_s == pytest.approx(12.5e6)
    assert Link(1, 10, loss_pct=0.0001).bytes_per_s == pytest.approx(125e3)  # bandwidth-bound
    payload = bytes(range(256)) * 1024  # 256 KiB: 0.42 s at the lossy rate, 0.02 s without
    with WanProxy(echo_server, link) as proxy:
        data, seconds = _round_trip(proxy.address, payload)
    assert data == payload
    assert 0.4 <= seconds < 4.0


def test_bad_link_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        Link(bandwidth_mbit=0)
    with pytest.raises(ValueError, match="latency_ms"):
        Link(bandwidth_mbit=1, latency_ms=-1)
    with pytest.raises(ValueError, match="loss_pct"):
        Link(bandwidth_mbit=1, latency_ms=10, loss_pct=100)
    with pytest.raises(ValueError, match="needs a latency > 0"):
        Link(bandwidth_mbit=1, loss_pct=1)


@pytest.mark.multiprocess
def test_a_site_behind_a_slow_link_takes_part_and_pays_for_it(cluster: LocalCluster) -> None:
    from fedra.runspec import RunSpec, TrainSpec

    address = cluster.start_coordinator(flags=["--heartbeat-s", "0.5", "--site-timeout-s", "10"])
    task = "fedra.examples.synthetic:task"
    data = {"samples": 64, "seed": 0}
    cluster.start_site("near", [task], data)
    # 8 Mbit/s, 50 ms: the ~400 kB model takes about half a second to arrive.
    with WanProxy(address, Link(bandwidth_mbit=8, latency_ms=50)) as far_link:
        cluster.start_site("far", [task], {"samples": 64, "seed": 1}, coordinator=far_link.address)
        cluster.wait_for_sites(["near", "far"])
        spec = RunSpec(
            task=task,
            rounds=2,
            sites_per_round=2,
            round_deadline_s=120,
            train=TrainSpec(
                local_steps=2, batch_size=16, learning_rate=0.05, params={"extra_params": "100000"}
            ),
        ).validate()
        with cluster.admin() as admin:
            run_id = admin.submit(spec)
            status = None
            for status in admin.watch(run_id, timeout_s=180):
                if status.state in ("completed", "failed"):
                    break
        cluster.stop()  # the far site's connection goes through the proxy
    assert status is not None and status.state == "completed", status
    # Round 2: in round 1 the sites rebuild the initial model from the seed, no download.
    r2 = next(r for r in status.rounds if r.number == 2)
    # The sites' own download times (the coordinator's end when its bytes leave it).
    times = {p.site_id: p.metrics["download_s"] for p in r2.participations}
    assert times["far"] >= 0.4  # 400 kB at 1 MB/s
    assert times["near"] < times["far"] / 4
