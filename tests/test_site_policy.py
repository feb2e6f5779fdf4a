"""A site's [policy]: what it declines and why, manual approval of runs, and a real
federation in which a site's decline is recorded as one (not a failure) while the
rounds go on with the other sites, until its operator approves the run."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from fedra.client.config import SiteConfig
from fedra.client.connection import Assignment
from fedra.client.policy import Policy, PolicyConfig, approve, list_runs
from fedra.config import ConfigError
from fedra.local import LocalCluster
from fedra.runspec import CodecSpec, PrivacySpec, TrainSpec
from fedra.secagg_round import SecAggRound
from tests.conftest import fedra_cli
from tests.test_cluster import (
    FAST,
    SYNTHETIC,
    finished,
    start_synthetic_sites,
    synthetic_spec,
    wait_until,
)

BASE: dict[str, Any] = {
    "site_id": "s1", "coordinator": "127.0.0.1:9", "allowed_tasks": ["m:t"], "insecure": True,
}  # fmt: skip


def task(**kw: Any) -> Assignment:
    fields: dict[str, Any] = {
        "task_id": "t1", "run_id": "r1", "round": 3, "init": False, "entry_point": "m:t",
        "train": TrainSpec(local_steps=10, local_epochs=1), "seed": 0, "model_sha256": "x",
        "model_bytes": 1000, "deadline_in_s": 60.0, "codec": CodecSpec("none"),
    }  # fmt: skip
    fields.update(kw)
    return Assignment(**fields)


def at(hour: int, minute: int = 0) -> Any:
    return lambda: dt.datetime(2026, 12, 3, hour, minute)


@pytest.mark.parametrize(
    ("policy", "asked", "why"),
    [
        (PolicyConfig(max_rounds=2), {"round": 3}, "round 3 is past this site's cap of 2"),
        (PolicyConfig(max_local_steps=5), {}, "10 local steps a round, more than this site's 5"),
        (PolicyConfig(max_local_epochs=1), {"train": TrainSpec(local_epochs=3)},
         "3 local epochs a round, more than this site's 1"),
        (PolicyConfig(max_model_bytes=999), {}, "a model of 1000 bytes, larger than"),
        (PolicyConfig(require_secagg=True), {}, "only for runs with secure aggregation"),
        (PolicyConfig(min_noise_multiplier=1.0), {}, "only for runs with differential privacy"),
        (PolicyConfig(max_epsilon=4.0), {}, "only for runs with differential privacy"),
        (PolicyConfig(min_noise_multiplier=1.0), {"privacy": PrivacySpec(noise_multiplier=0.5)},
         "privacy.noise_multiplier 0.5 is below this site's minimum 1"),
        (PolicyConfig(max_epsilon=4.0), {"privacy": PrivacySpec(epsilon=8.0)},
         "privacy.epsilon 8 is above this site's maximum 4"),
        (PolicyConfig(min_sites=5), {"sites_in_round": 3},
         "3 sites in this round, fewer than this site's minimum 5 (small cohorts leak)"),
    ],
)  # fmt: skip
def test_what_a_site_declines_and_why(
    policy: PolicyConfig, asked: dict[str, Any], why: str
) -> None:
    assert why in (Policy(policy, None).decline_reason(task(**asked)) or "")
    assert Policy(PolicyConfig(), None).decline_reason(task(**asked)) is None  # no caps


def test_within_its_caps_a_task_is_taken() -> None:
    policy = PolicyConfig(max_rounds=3, max_local_steps=10, max_model_bytes=1000,
                          require_secagg=True)  # fmt: skip
    secagg = SecAggRound(context=b"c", threshold=2, clip=1.0, bits=16)
    assert Policy(policy, None).decline_reason(task(secagg=secagg)) is None
    strict = PolicyConfig(min_noise_multiplier=1.0, max_epsilon=8.0, min_sites=3)
    private = task(privacy=PrivacySpec(noise_multiplier=1.2, epsilon=8.0), sites_in_round=3)
    assert Policy(strict, None).decline_reason(private) is None
    # The initial model is built from the run's seed: caps on training do not apply.
    assert Policy(PolicyConfig(max_rounds=1), None).decline_reason(task(round=0, init=True)) is None


@pytest.mark.parametrize(
    ("hours", "hour", "takes"),
    [("08:00-18:00", 9, True), ("08:00-18:00", 18, False), ("08:00-18:00", 7, False),
     ("20:00-06:00", 23, True), ("20:00-06:00", 5, True), ("20:00-06:00", 12, False)],
)  # fmt: skip
def test_hours_may_wrap_past_midnight(hours: str, hour: int, takes: bool) -> None:
    why = Policy(PolicyConfig(hours=hours), None, now=at(hour)).decline_reason(task())
    assert (why is None) == takes
    if not takes:
        assert why == f"outside the hours this site trains ({hours} local time)"


def test_a_manual_site_declines_until_its_operator_approves(tmp_path: Path) -> None:
    policy = Policy(PolicyConfig(approve="manual"), tmp_path)
    why = policy.decline_reason(task(round=0, init=True))
    assert why is not None and "run r1 is not approved" in why and "fedra site approve r1" in why
    [(request, approved)] = list_runs(tmp_path)
    assert (request.run_id, request.task, approved) == ("r1", "m:t", False)
    assert request.train["local_steps"] == 10 and request.model_bytes == 1000
    approve(tmp_path, "r1", "operator test")
    assert policy.decline_reason(task()) is None
    assert list_runs(tmp_path)[0][1] is True
    with pytest.raises(ConfigError, match="no such run has asked this site"):
        approve(tmp_path, "r2", "operator test")
    with pytest.raises(ConfigError, match="no such run"):
        approve(tmp_path, "../etc", "operator test")


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ({"approve": "sometimes"}, "policy.approve: must be one of"),
        ({"max_rounds": -1}, "policy.max_rounds: must be >= 0"),
        ({"hours": "8-18"}, 'policy.hours: must be "HH:MM-HH:MM"'),
        ({"hours": "08:00-24:00"}, "policy.hours"),
        ({"require_secagg": "yes"}, "policy.require_secagg"),
        ({"max_epsilon": -1.0}, "policy.max_epsilon: must be finite and >= 0"),
        ({"min_noise_multiplier": "1"}, "policy.min_noise_multiplier"),
        ({"min_sites": -2}, "policy.min_sites: must be >= 0"),
        ({"max_sites": 1}, "policy.max_sites: unknown key"),
        ({"approve": "manual"}, '"manual" needs a state_dir'),
    ],
)
def test_a_bad_policy_is_refused_naming_the_key(table: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        SiteConfig.from_toml({**BASE, "policy": table})


# -- a real federation -------------------------------------------------------------------


def _wait(probe: Any, timeout_s: float, what: str) -> Any:
    import time

    deadline = time.monotonic() + timeout_s
    while not (result := probe()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)  # polling a condition, with a deadline
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_site_that_has_not_approved_a_run_declines_and_the_rounds_go_on(
    tmp_path: Path,
) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--decline-hold-s", "2"])
        start_synthetic_sites(cluster, n=1)  # site-0: approve = "auto"
        data = {"shift": 1.0, "seed": 1, "samples": 128, "fit_delay_s": 0.2}
        cluster.start_site("manual", [SYNTHETIC], data, tables={"policy": {"approve": "manual"}})
        cluster.wait_for_sites(["site-0", "manual"])
        toml = str(cluster.state_dir / "manual.toml")
        with cluster.admin() as admin:
            spec = synthetic_spec(rounds=30, sites_per_round=2, min_sites=1, join_timeout_s=1.0)
            run_id = admin.submit(spec)

            def declined() -> Any:
                parts = [p for r in admin.status(run_id).rounds for p in r.participations]
                return [p for p in parts if p.site_id == "manual" and p.status == "declined"]

            [first, *_] = _wait(declined, 60, "decline by the manual site")
            assert "not approved at this site" in first.error
            runs = fedra_cli("site", "runs", "--config", toml, "--json")
            assert runs.returncode == 0, runs.stderr
            assert [(r["run_id"], r["approved"]) for r in json.loads(runs.stdout)] == [
                (run_id, False)
            ]
            approved = fedra_cli("site", "approve", run_id, "--config", toml)
            assert approved.returncode == 0, approved.stderr

            def took_part() -> bool:
                parts = [p for r in admin.status(run_id).rounds for p in r.participations]
                return any(p.site_id == "manual" and p.status == "accepted" for p in parts)

            _wait(took_part, 90, "accepted update from the site once approved")
            admin.cancel(run_id)
            status = wait_until(admin, run_id, finished)
        cluster.stop()
        state = cluster.state_dir
    committed = [r for r in status.rounds if r.status == "committed"]
    assert len(committed) >= 2  # the rounds went on with site-0 while "manual" declined
    assert all(p.status != "failed" for r in status.rounds for p in r.participations
               if p.site_id == "manual")  # fmt: skip
    audit = fedra_cli("audit", "--config", str(state / "manual.toml"), "--verify", "--json")
    events = [json.loads(line)["event"] for line in audit.stdout.splitlines()]
    assert audit.returncode == 0, audit.stderr
    assert "task.decline" in events and "run.approve" in events and "update.sent" in events
    assert events.index("task.decline") < events.index("run.approve") < events.index("update.sent")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_site_declines_a_cohort_smaller_than_its_minimum(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        start_synthetic_sites(cluster, n=1)
        data = {"shift": 1.0, "seed": 1, "samples": 128}
        cluster.start_site("strict", [SYNTHETIC], data, tables={"policy": {"min_sites": 3}})
        cluster.wait_for_sites(["site-0", "strict"])
        with cluster.admin() as admin:
            spec = synthetic_spec(rounds=2, sites_per_round=2, min_sites=1, join_timeout_s=1.0)
            status = wait_until(admin, admin.submit(spec), finished)
        cluster.stop()
    assert status.state == "completed", status.reason
    mine = [p for r in status.rounds if r.number > 0 for p in r.participations
            if p.site_id == "strict"]  # fmt: skip
    assert mine and all(p.status == "declined" for p in mine)
    assert "2 sites in this round, fewer than this site's minimum 3" in mine[0].error


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_attempts_lost_only_to_declines_do_not_fail_the_run(tmp_path: Path) -> None:
    """Every site declines until approved: the run waits for them, however many attempts
    its rounds take, instead of giving up after max_round_attempts."""
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--decline-hold-s", "0.5"])
        data = {"seed": 1, "samples": 64}
        cluster.start_site("manual", [SYNTHETIC], data, tables={"policy": {"approve": "manual"}})
        cluster.wait_for_sites(["manual"])
        with cluster.admin() as admin:
            spec = synthetic_spec(rounds=1, sites_per_round=1, min_sites=1, join_timeout_s=1.0,
                                  max_round_attempts=1)  # fmt: skip
            run_id = admin.submit(spec)
            _wait(lambda: max((r.attempt for r in admin.status(run_id).rounds), default=0) >= 3,
                  90, "a third attempt")  # fmt: skip
            assert admin.status(run_id).state in ("pending", "running")
            toml = str(cluster.state_dir / "manual.toml")
            assert fedra_cli("site", "approve", run_id, "--config", toml).returncode == 0
            status = wait_until(admin, run_id, finished)
        cluster.stop()
    assert status.state == "completed", status.reason
