"""A site's own Prometheus endpoint: ``[metrics] http`` parsed and refused like the rest of
site.toml, the series a round leaves, read back over real HTTP from a port-0 address, and a
real site process whose /metrics shows the run it took part in."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fedra import __version__
from fedra.client.agent import SiteAgent
from fedra.client.config import MetricsConfig, SiteConfig
from fedra.client.connection import Assignment, Sent, Session
from fedra.client.executor import LocalExecutor
from fedra.client.heartbeat import Heartbeat
from fedra.client.metrics import MAX_RUNS, SITE_FILE, RoundMeasures, SiteMetrics
from fedra.config import ConfigError
from fedra.examples.synthetic import SyntheticTask
from fedra.local import LocalCluster, write_site_config
from fedra.runspec import CodecSpec, TrainSpec
from tests.test_cluster import FAST, SYNTHETIC, finished, synthetic_spec, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
BASE = {"site_id": "s1", "coordinator": "127.0.0.1:9", "allowed_tasks": ["m:t"], "insecure": True}


def parsed(text: str) -> Samples:
    """The Prometheus text format, parsed: {(sample name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(address: str, timeout_s: float = 5.0) -> Samples:
    """GET http://address/metrics, parsed."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        assert reply.status == 200
        return parsed(reply.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


# -- [metrics] in site.toml --------------------------------------------------------------


def test_no_metrics_table_means_no_endpoint() -> None:
    config = SiteConfig.from_toml(BASE)
    assert config.metrics == MetricsConfig() and config.metrics.http == ""


@pytest.mark.parametrize("address", ["127.0.0.1:9101", "127.0.0.1:0", "[::1]:9101", "localhost:0"])
def test_a_loopback_address_is_taken(address: str) -> None:
    config = SiteConfig.from_toml({**BASE, "metrics": {"http": address}})
    assert config.metrics.http == address


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "must be host:port"),
        ("127.0.0.1:99999", "must be host:port"),
        (":9101", "must be host:port"),
        ("::1:9101", "IPv6 host in brackets"),
        ("10.1.2.3:9101", "must be a loopback address"),
        ("0.0.0.0:9101", "must be a loopback address"),
        ("metrics.hospital.org:9101", "must be a loopback address"),
    ],
)
def test_a_bad_address_is_refused_naming_the_key_and_the_value(address: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        SiteConfig.from_toml({**BASE, "metrics": {"http": address}})
    message = str(info.value)
    assert message.startswith("metrics.http: "), message
    assert reason in message and repr(address) in message


def test_unknown_keys_and_wrong_types_in_metrics_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^metrics\.port: unknown key \(expected one of http\)"):
        SiteConfig.from_toml({**BASE, "metrics": {"http": "127.0.0.1:0", "port": 9101}})
    with pytest.raises(ConfigError, match=r"^metrics\.http: expected str, got int 9101"):
        SiteConfig.from_toml({**BASE, "metrics": {"http": 9101}})
    with pytest.raises(ConfigError, match=r"^metrics: expected dict"):
        SiteConfig.from_toml({**BASE, "metrics": "127.0.0.1:9101"})
    path = tmp_path / "site.toml"
    path.write_text(
        'site_id = "s1"\ncoordinator = "127.0.0.1:9"\nallowed_tasks = ["m:t"]\ninsecure = true\n'
        '[metrics]\nhtpp = "127.0.0.1:0"\n'
    )
    with pytest.raises(ConfigError, match=rf"^{path}: metrics\.htpp: unknown key"):
        SiteConfig.load(path)


# -- SiteMetrics ---------------------------------------------------------------------------


@pytest.fixture
def served() -> Any:
    metrics = SiteMetrics("hospital-a", world_restarts=2)
    metrics.serve("127.0.0.1:0")
    try:
        yield metrics
    finally:
        metrics.close()


def test_recorded_rounds_read_back_over_http(served: SiteMetrics) -> None:
    host, port = served.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # the port bound, not 0
    served.round_done(
        RoundMeasures("r1", compute_s=2.0, samples=640, tokens=0, download_bytes=4000,
                      download_s=0.5, upload_bytes=3000, upload_s=0.25)
    )  # fmt: skip
    served.round_done(
        RoundMeasures("r1", compute_s=1.0, samples=320, tokens=100, download_bytes=0,
                      download_s=0.0, upload_bytes=1000, upload_s=0.5)
    )  # fmt: skip
    served.round_failed("r1", "task")
    s = scrape(served.address)
    assert value(s, "fedra_site_info", site="hospital-a", version=__version__) == 1
    assert value(s, "fedra_site_rounds_total", run="r1") == 2
    assert value(s, "fedra_site_rounds_failed_total", run="r1", reason="task") == 1
    assert value(s, "fedra_site_compute_seconds_total", run="r1") == 3.0
    assert value(s, "fedra_site_samples_total", run="r1") == 960
    assert value(s, "fedra_site_tokens_total", run="r1") == 100
    assert value(s, "fedra_site_samples_per_second", run="r1") == 320.0  # the last round's
    assert value(s, "fedra_site_tokens_per_second", run="r1") == 100.0
    assert value(s, "fedra_site_bytes_total", run="r1", direction="down") == 4000
    assert value(s, "fedra_site_bytes_total", run="r1", direction="up") == 4000
    assert value(s, "fedra_site_transfer_seconds_total", run="r1", direction="down") == 0.5
    assert value(s, "fedra_site_transfer_seconds_total", run="r1", direction="up") == 0.75
    # A round with nothing downloaded (the model held) leaves the last download's rate.
    assert value(s, "fedra_site_transfer_bytes_per_second", run="r1", direction="down") == 8000
    assert value(s, "fedra_site_transfer_bytes_per_second", run="r1", direction="up") == 2000
    assert value(s, "fedra_site_world_restarts_total") == 2


def test_only_the_last_runs_keep_series(served: SiteMetrics) -> None:
    runs = [f"run-{i}" for i in range(MAX_RUNS + 3)]
    for run in runs:
        served.round_done(RoundMeasures(run, compute_s=1.0, samples=1, upload_bytes=1, upload_s=1))
    served.round_failed(runs[-1], "refused")
    labelled = {dict(labels).get("run") for _, labels in scrape(served.address)} - {None}
    assert labelled == set(runs[-MAX_RUNS:])
    with pytest.raises(ValueError, match="unknown failure reason"):
        served.round_failed("r", "because")  # a free-text reason would be an unbounded label


def test_each_site_has_its_own_registry_and_stops_serving_on_close() -> None:
    a, b = SiteMetrics("a"), SiteMetrics("b")
    a.serve("127.0.0.1:0")
    b.serve("127.0.0.1:0")
    try:
        a.round_done(RoundMeasures("r1", compute_s=1.0))
        assert value(scrape(a.address), "fedra_site_rounds_total", run="r1") == 1
        assert ("fedra_site_rounds_total", frozenset({("run", "r1")})) not in scrape(b.address)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://{a.address}/", timeout=5)
        assert info.value.code == 404
    finally:
        b.close()
    address = a.address
    a.close()
    a.close()  # twice is fine
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)


def test_restarts_of_the_local_world_come_from_the_elastic_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedra.client.metrics import world_restarts

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert world_restarts() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert world_restarts() == 3
    agent = SiteAgent(SiteConfig.from_toml(BASE), executor=LocalExecutor(), tasks={}, data={})
    samples = {
        (f.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(agent.metrics.exposition().decode())
        for s in f.samples
    }
    assert samples[("fedra_site_world_restarts", ())] == 3
    agent.conn.close()


# -- the agent feeds it --------------------------------------------------------------------

EP = "fedra.examples.synthetic:task"


def _agent(config: SiteConfig | None = None) -> SiteAgent:
    task = SyntheticTask()
    config = config or SiteConfig("s1", "127.0.0.1:9", (EP,), insecure=True)
    data = {EP: task.load_data({"samples": 64, "seed": 1})}
    return SiteAgent(config, executor=LocalExecutor(), tasks={EP: task}, data=data)


def _assignment(model_bytes: int) -> Assignment:
    return Assignment(
        task_id="t-2", run_id="r1", round=2, init=False, entry_point=EP,
        train=TrainSpec(local_steps=3, batch_size=8, learning_rate=0.05), seed=7,
        model_sha256="sha-of-round-1", model_bytes=model_bytes, deadline_in_s=60.0,
        codec=CodecSpec("none"),
    )  # fmt: skip


def test_a_round_s_own_measures_are_what_the_agent_records() -> None:
    """The download and compute seconds the coordinator is sent, the bytes the model took
    to come and the bytes the coordinator says it received."""
    agent = _agent()
    impl = agent.tasks[EP]
    start = {k: v.detach().clone() for k, v in impl.create_model(7, {}).state_dict().items()}
    sent: dict[str, float] = {}

    def download(
        task: Assignment,
        timeout_s: float,
        delta: bool = False,
        reuse: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in start.items()}

    def upload(
        task: Assignment,
        tensors: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        nonce: bytes,
        timeout_s: float,
        header_only: bool = False,
        then_poll_s: float = 0.0,
    ) -> Sent:
        sent.update(metrics, then_poll_s=then_poll_s)
        # Held far longer than the call took: the upload's own seconds leave the hold out.
        return Sent(4321, "0" * 64, 4000, held_s=1e6)

    agent.conn.download = download  # type: ignore[method-assign]
    agent.conn.upload = upload  # type: ignore[method-assign]
    task = _assignment(model_bytes=1234)
    beat = Heartbeat(agent.conn, task.task_id, 60.0)  # never started: nothing to beat
    accepted = agent._audit_soon("task.accept", task)
    agent._train_and_upload(task, Session(60.0, 5.0, 1 << 20), "test", beat, accepted)
    s = parsed(agent.metrics.exposition().decode())
    assert agent.rounds_done == 1
    assert value(s, "fedra_site_rounds_total", run="r1") == 1
    assert value(s, "fedra_site_bytes_total", run="r1", direction="down") == 1234
    assert value(s, "fedra_site_bytes_total", run="r1", direction="up") == 4321
    down_s = value(s, "fedra_site_transfer_seconds_total", run="r1", direction="down")
    assert down_s == pytest.approx(sent["download_s"])
    compute_s = value(s, "fedra_site_compute_seconds_total", run="r1")
    assert compute_s == pytest.approx(sent["compute_s"]) and compute_s > 0
    assert value(s, "fedra_site_samples_total", run="r1") == sent["samples_seen"] == 3 * 8
    # The upload asks to be held as the next poll, up to the session's poll timeout; the
    # seconds it was held are no upload time.
    assert sent["then_poll_s"] == 5.0
    assert value(s, "fedra_site_transfer_seconds_total", run="r1", direction="up") == 0.0
    agent.conn.close()


def test_a_failing_task_counts_as_a_failed_round() -> None:
    agent = _agent()
    reported: list[str] = []
    agent.conn.report_failure = lambda task_id, reason, **kw: reported.append(reason)  # type: ignore[method-assign]

    def broken(
        task: Assignment,
        timeout_s: float,
        delta: bool = False,
        reuse: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        raise RuntimeError("disk full")

    agent.conn.download = broken  # type: ignore[method-assign]
    agent._run_task(_assignment(model_bytes=10), Session(60.0, 5.0, 1 << 20))
    agent._run_task(replace(_assignment(10), entry_point="other:task"), Session(60, 5, 1 << 20))
    s = parsed(agent.metrics.exposition().decode())
    assert value(s, "fedra_site_rounds_failed_total", run="r1", reason="task") == 1
    assert value(s, "fedra_site_rounds_failed_total", run="r1", reason="not_allowed") == 1
    assert reported == ["RuntimeError: disk full", "task 'other:task' is not allowed here"]
    agent.conn.close()


def test_a_running_agent_writes_its_address_and_stops_serving_when_stopped(
    tmp_path: Path,
) -> None:
    """Against a coordinator that is not there: the endpoint serves while the agent retries,
    its port-0 address is in site.json, and it is gone once the agent stops."""
    with socket.socket() as closed:  # bound, never listening: every dial is refused
        closed.bind(("127.0.0.1", 0))
        config = SiteConfig(
            "s1", f"127.0.0.1:{closed.getsockname()[1]}", (EP,), insecure=True,
            reconnect_max_s=0.2, state_dir=tmp_path / "state",
            metrics=MetricsConfig("127.0.0.1:0"),
        )  # fmt: skip
        agent = _agent(config)
        runner = threading.Thread(target=agent.run, daemon=True)
        runner.start()
        try:
            info = _poll(lambda: _read_site_file(tmp_path / "state", os.getpid()), 30, "site.json")
            assert info["site_id"] == "s1" and info["metrics_address"] == agent.metrics.address
            s = scrape(info["metrics_address"])
            assert value(s, "fedra_site_info", site="s1", version=__version__) == 1
        finally:
            agent.shutdown()
            runner.join(30)
    assert not runner.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{info['metrics_address']}/metrics", timeout=5)


def test_a_port_in_use_is_refused_at_start_naming_the_key() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        agent = _agent(replace(SiteConfig.from_toml({**BASE, "allowed_tasks": [EP]}),
                               metrics=MetricsConfig(address)))  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^metrics\.http {address}: cannot listen there"):
            agent.run()
    agent.conn.close()


def _read_site_file(state_dir: Path, pid: int) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = json.loads((state_dir / SITE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return info if info.get("pid") == pid else None


def _poll(probe: Any, timeout_s: float, what: str) -> Any:
    """``probe()`` once it is truthy; AssertionError naming ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        result = probe()
        if result:
            return result
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(delay)  # polling a condition, with a deadline
        delay = min(delay * 1.5, 0.5)


# -- a real site process -------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_real_site_serves_the_rounds_it_did(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        state = cluster.state_dir / "sites" / "site-0"
        metrics = {"metrics": {"http": "127.0.0.1:0"}}
        proc = cluster.start_site("site-0", [SYNTHETIC], {"samples": 64}, tables=metrics)
        cluster.wait_for_sites(["site-0"])
        info = cluster.wait_for(
            lambda: _read_site_file(state, proc.pid), proc, 30, "write site.json"
        )
        address = str(info["metrics_address"])
        assert not address.endswith(":0")
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=2, sites_per_round=1, min_sites=1))
            status = wait_until(admin, run_id, finished, timeout_s=180)
        assert status.state == "completed", status.reason

        def after_run() -> Samples | None:
            s = scrape(address)
            done = s.get(("fedra_site_rounds_total", frozenset({("run", run_id)})), 0)
            return s if done >= 3 else None  # the initial model's round and two trained

        s = cluster.wait_for(after_run, proc, 30, "show the run's rounds at /metrics")
        assert value(s, "fedra_site_info", site="site-0", version=__version__) == 1
        assert value(s, "fedra_site_bytes_total", run=run_id, direction="down") > 0
        assert value(s, "fedra_site_bytes_total", run=run_id, direction="up") > 0
        assert value(s, "fedra_site_compute_seconds_total", run=run_id) > 0
        assert value(s, "fedra_site_samples_total", run=run_id) > 0
        assert value(s, "fedra_site_world_restarts_total") == 0
        cluster.stop()
        assert proc.popen.returncode == 0, proc.log_tail()
    assert "metrics at http://" + address in proc.log_path.read_text()


@pytest.mark.multiprocess
def test_a_parallel_site_with_its_port_in_use_stops_before_its_world_starts(
    tmp_path: Path,
) -> None:
    """Not once per restart of the local world: at once, naming the key, no worker run."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        site = {**BASE, "allowed_tasks": [SYNTHETIC], "state_dir": str(tmp_path / "state")}
        toml = write_site_config(
            tmp_path / "site.toml", site, {"samples": 64},
            parallel={"nproc": 2, "plan": "dp", "max_restarts": 3},
            tables={"metrics": {"http": address}},
        )  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "fedra", "site", "--config", str(toml)],
            check=False, capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert done.returncode != 0
    assert f"metrics.http {address}: cannot listen there" in done.stderr
    assert "fedra.client.worker" not in done.stderr and "restart" not in done.stderr.lower()
