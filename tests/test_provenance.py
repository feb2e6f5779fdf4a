"""Every result has its provenance: what each site's updates of a run came from (its
task's code, its data's fingerprint, its software), recorded by the coordinator, shown
by run status, flagged when it changes mid-run; and a site's bad provenance refused."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

import fedra.examples.synthetic as synthetic_module
from fedra import __version__
from fedra.client import provenance
from fedra.client.provenance import data_fingerprint, of_task, source_sha256
from fedra.examples.synthetic import SyntheticTask
from fedra.local import LocalCluster
from fedra.protos.v1 import common_pb2, site_pb2, site_pb2_grpc
from tests.conftest import fedra_cli
from tests.test_cluster import FAST, SYNTHETIC, finished, synthetic_spec, wait_until

DATA = {"shift": 0.0, "seed": 0, "samples": 128, "fit_delay_s": 0.2}


def test_a_task_s_provenance_is_digests_never_data(tmp_path: Path) -> None:
    config = tmp_path / "site.toml"
    config.write_text("site_id = 'x'\n")
    p = of_task(SYNTHETIC, SyntheticTask(), DATA, config)
    source = Path(synthetic_module.__file__).read_bytes()
    assert p.task_source_sha256 == source_sha256("fedra.examples.synthetic")
    assert hashlib.sha256(b"synthetic.py\0" + source + b"\0").hexdigest() == p.task_source_sha256
    canonical = json.dumps(DATA, sort_keys=True).encode()
    assert p.data_fingerprint == "config:" + hashlib.sha256(canonical).hexdigest()
    assert p.config_sha256 == hashlib.sha256(b"site_id = 'x'\n").hexdigest()
    assert set(p.versions) == {"fedra", "torch", "python"} and p.device.startswith("cpu")
    assert p.digest() == of_task(SYNTHETIC, SyntheticTask(), dict(DATA), config).digest()
    assert p.digest() != of_task(SYNTHETIC, SyntheticTask(), {**DATA, "seed": 1}, config).digest()

    class Manifested(SyntheticTask):
        def data_fingerprint(self, config: dict[str, Any]) -> str:
            return "manifest:v7"

    assert data_fingerprint(Manifested(), DATA) == "manifest:v7"  # the task's own


def test_the_installed_packages_are_scanned_once_a_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many agents in one process (a scale test's workers host thousands) each describe
    their task: the scan of every installed package's metadata is done once, not each time."""
    scans: list[int] = []
    real = importlib.metadata.packages_distributions

    def counted() -> Mapping[str, list[str]]:
        scans.append(1)
        return real()

    monkeypatch.setattr(importlib.metadata, "packages_distributions", counted)
    provenance._distributions.cache_clear()
    try:
        versions = {provenance.distribution_version("fedra.examples.synthetic") for _ in range(5)}
        assert versions == {f"fedra {__version__}"} and len(scans) == 1
        assert provenance.distribution_version("no_such_module_anywhere") == ""
        assert len(scans) == 1
    finally:
        provenance._distributions.cache_clear()


def _provenance(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    shown = fedra_cli("run", "status", "--state-dir", str(cluster.state_dir), "--insecure",
                      run_id, "--json")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    doc: dict[str, Any] = json.loads(shown.stdout)["provenance"]
    return doc


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_run_status_shows_each_site_s_provenance_and_flags_a_change(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        for i in (0, 1):
            cluster.start_site(f"site-{i}", [SYNTHETIC], {**DATA, "seed": i})
        cluster.wait_for_sites(["site-0", "site-1"])
        with cluster.admin() as admin:
            spec = synthetic_spec(rounds=200, sites_per_round=2, min_sites=2)
            run_id = admin.submit(spec)

            def committed(n: int) -> Any:
                return lambda: admin.status(run_id).rounds_completed >= n

            deadline = time.monotonic() + 60
            while not committed(2)():
                assert time.monotonic() < deadline, "no two rounds"
                time.sleep(0.2)  # polling the run's status, with a deadline
            before = _provenance(cluster, run_id)
            # site-1 comes back with other data: its next updates come from something else.
            cluster.sites["site-1"].stop()
            cluster.start_site("site-1", [SYNTHETIC], {**DATA, "seed": 9})
            cluster.wait_for_sites(["site-1"])
            back_at = admin.status(run_id).rounds_completed
            deadline = time.monotonic() + 90
            while admin.status(run_id).rounds_completed < back_at + 2:
                assert time.monotonic() < deadline, "no rounds after site-1 came back"
                time.sleep(0.2)  # polling the run's status, with a deadline
            after = _provenance(cluster, run_id)
            text = fedra_cli("run", "status", "--state-dir", str(cluster.state_dir),
                             "--insecure", run_id).stdout  # fmt: skip
            admin.cancel(run_id)
            wait_until(admin, run_id, finished)
        cluster.stop()
    assert len(before["spec_sha256"]) == 64
    assert before["coordinator_version"] == __version__
    sites = {s["site_id"]: s for s in before["sites"]}
    assert sorted(sites) == ["site-0", "site-1"]
    for site_id, s in sites.items():
        p = s["provenance"]
        assert p["entry_point"] == SYNTHETIC
        assert p["task_source_sha256"] == source_sha256("fedra.examples.synthetic")
        seed = int(site_id[-1])
        canonical = json.dumps({**DATA, "seed": seed}, sort_keys=True).encode()
        assert p["data_fingerprint"] == "config:" + hashlib.sha256(canonical).hexdigest()
        assert p["versions"]["fedra"] == __version__
        assert not s.get("changed", False)
    changed = {s["site_id"]: s for s in after["sites"]}
    assert not changed["site-0"].get("changed", False)
    assert changed["site-1"]["changed"] and changed["site-1"]["since_round"] > 2
    assert (
        changed["site-1"]["provenance"]["data_fingerprint"]
        != (sites["site-1"]["provenance"]["data_fingerprint"])
    )
    assert "WARNING: site site-1's provenance changed from round" in text


@pytest.mark.multiprocess
def test_a_bad_provenance_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = site_pb2_grpc.SiteServiceStub(channel)
            for bad, why in [
                (common_pb2.Provenance(entry_point=SYNTHETIC, device="x" * 201),
                 "provenance.device: at most 200 characters"),
                (common_pb2.Provenance(entry_point="other:task"), "each of a task served"),
            ]:  # fmt: skip
                request = site_pb2.RegisterRequest(
                    site_id="s1", tasks=[SYNTHETIC], version="1", provenance=[bad]
                )
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Register(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert why in str(refused.value.details())
        with cluster.admin() as admin:
            assert admin.sites() == []  # nothing registered
        cluster.stop()
