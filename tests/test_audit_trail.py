"""Both sides' audit logs from a real federation: the coordinator's admin actions with
the admin's identity, its commits with their digests and the identities it refused; a
site's tasks and what left it; and ``fedra audit --verify`` finding an edit."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from fedra.audit import AUDIT_FILE, AuditLog, Entry
from fedra.client.agent import SiteAgent
from fedra.client.config import SiteConfig
from fedra.client.executor import LocalExecutor
from fedra.client.task import FitResult, FitSettings
from fedra.coordinator.engine import EngineSettings
from fedra.examples.synthetic import SyntheticData, SyntheticTask
from fedra.local import LocalCluster
from tests.conftest import InProcessCoordinator, fedra_cli
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until
from tests.test_site_service import TASK, serve_one_run


def _entries(result: Any) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_federation_s_audit_logs_record_who_did_what(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster") as cluster:  # mTLS: real identities
        cluster.start_coordinator(flags=FAST)
        start_synthetic_sites(cluster, n=2)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=2, sites_per_round=2, min_sites=2))
            status = wait_until(admin, run_id, finished)
            assert status.state == "completed", status.reason
            admin.export_model(run_id)
            long_run = admin.submit(synthetic_spec(rounds=500, sites_per_round=2, min_sites=2))
            admin.cancel(long_run)
            wait_until(admin, long_run, finished)
        site_1 = cluster.pki_dir / "sites" / "site-1"
        revoked = fedra_cli("revoke", "--state-dir", str(cluster.state_dir), str(site_1))
        assert revoked.returncode == 0, revoked.stderr
        log = cluster.state_dir / AUDIT_FILE
        deadline = time.monotonic() + 60
        while '"identity.refused"' not in log.read_text():  # site-1's next call
            assert time.monotonic() < deadline, "the revoked site's refusal was not audited"
            time.sleep(0.2)  # polling a file the daemon appends to, with a deadline
        cluster.stop()
        state = cluster.state_dir
    entries = _entries(fedra_cli("audit", "--state-dir", str(state), "--verify", "--json"))
    by_event: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_event.setdefault(e["event"], []).append(e)
    submits = by_event["run.submit"]
    assert [(e["who"], e["data"]["run"]) for e in submits] == [
        ("admin admin", run_id), ("admin admin", long_run)
    ]  # fmt: skip
    assert all(len(e["data"]["spec_sha256"]) == 64 for e in submits)
    commits = [e["data"] for e in by_event["round.commit"] if e["data"]["run"] == run_id]
    digests = {r.number: r.model_sha256 for r in status.rounds if r.status == "committed"}
    assert {c["round"]: c["model_sha256"] for c in commits} == digests  # rounds 0, 1 and 2
    [export] = by_event["model.export"]
    assert export["who"] == "admin admin" and export["data"]["model_sha256"] == digests[2]
    [cancel] = by_event["run.cancel"]
    assert (cancel["who"], cancel["data"]["run"]) == ("admin admin", long_run)
    [revoke] = by_event["cert.revoke"]
    assert revoke["who"].startswith("operator ")
    assert (revoke["data"]["role"], revoke["data"]["name"]) == ("site", "site-1")
    refused = by_event["identity.refused"]
    assert refused[0]["who"] == "site site-1" and refused[0]["data"]["reason"] == "revoked"
    ends = {e["data"]["run"]: e["data"]["state"] for e in by_event["run.end"]}
    assert ends == {run_id: "completed", long_run: "cancelled"}
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))

    # A site's own log: the tasks it took and what left it, each update with its digest.
    site = _entries(
        fedra_cli("audit", "--config", str(state / "site-0.toml"), "--verify", "--json")
    )
    assert site[0]["event"] == "site.start" and len(site[0]["data"]["config_sha256"]) == 64
    accepted = [e["data"] for e in site if e["event"] == "task.accept"]
    sent = [e["data"] for e in site if e["event"] == "update.sent"]
    assert {(a["run"], a["round"]) for a in accepted} >= {(run_id, 0), (run_id, 1), (run_id, 2)}
    assert [(s["run"], s["round"]) for s in sent if s["run"] == run_id] == [
        (run_id, 0), (run_id, 1), (run_id, 2)
    ]  # fmt: skip
    assert all(len(s["update_sha256"]) == 64 and s["payload_bytes"] > 0 for s in sent)

    # An edited entry: --verify exits 1 and names it.
    lines = (state / AUDIT_FILE).read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if '"model.export"' in line)
    doc = json.loads(lines[n])
    doc["who"] = "admin someone-else"
    lines[n] = json.dumps(doc, sort_keys=True)
    (state / AUDIT_FILE).write_text("\n".join(lines) + "\n")
    broken = fedra_cli("audit", "--state-dir", str(state), "--verify")
    assert broken.returncode == 1
    assert f"line {n + 1} (seq {n + 1}): edited" in broken.stderr


class _SlowAcceptLog(AuditLog):
    """The site's real audit log, each task's accept written a while after it is asked
    for: the model's download is long over by then."""

    def append(self, event: str, who: str = "", **data: Any) -> Entry:
        if event == "task.accept":
            time.sleep(0.3)
        return super().append(event, who, **data)


class _AuditReadingTask(SyntheticTask):
    """The synthetic task, reading the site's audit log as its work for a task begins:
    building the initial model (round 0's task), training (every later round's). (A site
    that rebuilds the initial model from the seed in round 1, instead of downloading it,
    builds it as it would download it: that is not the task's work.)"""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.agent: SiteAgent | None = None
        self.begun: list[tuple[int, bool]] = []  # (round, its accept was on record)

    def _begins(self, building: bool = False) -> None:
        assert self.agent is not None
        task = self.agent.current
        if task is None or (building and not task.init):  # not the work of a task
            return
        entries = [json.loads(line) for line in self.log.read_text().splitlines()]
        on_record = any(
            e["event"] == "task.accept" and e["data"]["task_id"] == task.task_id for e in entries
        )
        self.begun.append((task.round, on_record))

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        self._begins(building=True)
        return super().create_model(seed, params)

    def fit(self, model: nn.Module, data: SyntheticData, settings: FitSettings) -> FitResult:
        self._begins()
        return super().fit(model, data, settings)


def test_a_task_s_accept_is_on_record_before_its_work_begins(tmp_path: Path) -> None:
    """The accept is written while the model downloads, off the round's path, and the
    task's work waits for it: a site never works on a task its log does not show."""
    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=5.0, site_timeout_s=30.0)
    c = InProcessCoordinator(tmp_path / "coordinator", settings)
    state = tmp_path / "site"
    config = SiteConfig("site-a", c.address, (TASK,), insecure=True, state_dir=state)
    task = _AuditReadingTask(state / AUDIT_FILE)
    data = {TASK: task.load_data({"samples": 64, "seed": 1})}
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={TASK: task}, data=data)
    task.agent = agent
    assert agent.audit is not None
    agent.audit = _SlowAcceptLog(agent.audit.path)
    try:
        serve_one_run(c, agent, rounds=2)
    finally:
        c.close()
    # Round 0 built the initial model, rounds 1 and 2 trained: each task's accept was on
    # record before its work began.
    assert [r for r, _ in task.begun] == [0, 1, 2]
    assert all(on_record for _, on_record in task.begun), task.begun
