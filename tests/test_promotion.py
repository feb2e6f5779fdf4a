"""A worse model is never promoted: the [promotion] gate's decisions, its spec, and a
real run with a harmful site whose promoted model never gets worse than allowed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedra.config import ConfigError
from fedra.coordinator.promotion import PromotionState, decide
from fedra.local import LocalCluster
from fedra.runspec import PromotionSpec, RunSpec, runspec_from_toml
from tests.test_cluster import FAST, SYNTHETIC, finished, synthetic_spec, wait_until

SPEC = PromotionSpec(metric="eval_loss", max_regression=0.1, patience=2)


def test_the_first_candidate_judged_is_promoted_then_only_one_within_the_regression() -> None:
    s = PromotionState()
    d = decide(SPEC, s, 1, {"eval_loss": 2.0})  # round 1's sites judge round 0's model
    assert d.promoted and d.state == PromotionState(0, 2.0, 0)
    d = decide(SPEC, d.state, 2, {"eval_loss": 2.05})  # worse, but within 0.1
    assert d.promoted and d.state == PromotionState(1, 2.0, 0)  # the best stays 2.0
    d = decide(SPEC, d.state, 3, {"eval_loss": 1.5})
    assert d.promoted and d.state == PromotionState(2, 1.5, 0)
    d = decide(SPEC, d.state, 4, {"eval_loss": 1.7})  # 0.2 worse than the best: not promoted
    assert not d.promoted and not d.rollback and d.state == PromotionState(2, 1.5, 1)
    d = decide(SPEC, d.state, 5, {"eval_loss": 9.0})  # patience 2 runs out: roll back
    assert d.rollback and not d.stop and d.state == PromotionState(2, 1.5, 0)
    assert "2 candidates in a row without promotion: eval_loss 9" in d.why


def test_stop_instead_of_rollback_and_a_metric_to_maximise() -> None:
    spec = PromotionSpec(metric="eval_accuracy", goal="max", patience=1, on_patience="stop")
    d = decide(spec, PromotionState(), 1, {"eval_accuracy": 0.8})
    d = decide(spec, d.state, 2, {"eval_accuracy": 0.9})
    assert d.promoted and d.state.best == 0.9
    d = decide(spec, d.state, 3, {"eval_accuracy": 0.85})
    assert d.stop.startswith("promotion: stopped: 1 candidates in a row") and not d.rollback


def test_without_the_metric_nothing_is_judged() -> None:
    s = PromotionState(3, 1.0, 1)
    for metrics in ({}, {"eval_loss": math.nan}, {"train_loss": 0.1}):
        d = decide(SPEC, s, 5, metrics)
        assert d.state == s and not (d.promoted or d.rollback or d.stop)


def test_the_state_travels_in_a_round_s_metrics() -> None:
    s = PromotionState(4, 0.25, 1)
    assert PromotionState.from_metrics(s.as_metrics()) == s
    assert PromotionState.from_metrics({}) == PromotionState()
    assert PromotionState.from_metrics(PromotionState().as_metrics()) == PromotionState()


def test_the_spec_s_promotion_table() -> None:
    base: dict[str, Any] = {"task": "m:t", "rounds": 3}
    spec = runspec_from_toml({**base, "promotion": {"max_regression": 0.05, "patience": 4}})
    assert spec.promotion == PromotionSpec(max_regression=0.05, patience=4)
    assert RunSpec.from_json(spec.to_json()) == spec
    for table, why in [
        ({"goal": "lowest"}, "promotion.goal"), ({"max_regression": -1.0}, "promotion.max_regr"),
        ({"patience": 0}, "promotion.patience"), ({"on_patience": "panic"}, "on_patience"),
        ({"metric": ""}, "promotion.metric"), ({"threshold": 1}, "promotion.threshold"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            runspec_from_toml({**base, "promotion": table})
    with pytest.raises(ConfigError, match=r"promotion: cannot be combined with \[async\]"):
        runspec_from_toml({**base, "sites_per_round": 2, "async": {"buffer": 2},
                           "promotion": {}})  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_harmful_site_never_gets_a_worse_model_promoted(tmp_path: Path) -> None:
    regression = 0.05
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=FAST)
        base = {"samples": 128, "fit_delay_s": 0.05}
        cluster.start_site("good-0", [SYNTHETIC], {**base, "seed": 0})
        cluster.start_site("good-1", [SYNTHETIC], {**base, "seed": 1})
        cluster.start_site("harmful", [SYNTHETIC], {**base, "seed": 2, "harm": 1.0})
        cluster.wait_for_sites(["good-0", "good-1", "harmful"])
        with cluster.admin() as admin:
            spec = synthetic_spec(rounds=8, sites_per_round=3, min_sites=3)
            spec = RunSpec.from_json(spec.to_json().replace(
                '"promotion": null',
                f'"promotion": {{"metric": "eval_loss", "goal": "min", "max_regression": '
                f'{regression}, "patience": 2, "on_patience": "rollback"}}',
            ))  # fmt: skip
            run_id = admin.submit(spec)
            status = wait_until(admin, run_id, finished, timeout_s=240)
            assert status.state == "completed", status.reason
            exported = admin.export_model(run_id)  # the promoted model, not the last
            rounds = {r.number: r for r in status.rounds if r.status == "committed"}
            promoted = int(rounds[8].metrics["promoted_round"])
            assert promoted < 8
            assert all(torch.equal(v, admin.export_model(run_id, promoted)[k])
                       for k, v in exported.items())  # fmt: skip
        cluster.stop()
    judged = {n - 1: r.metrics["eval_loss"] for n, r in rounds.items() if n >= 1}
    best = math.inf
    for n in range(1, 9):  # replay: every promotion is within the regression of the best
        now = int(rounds[n].metrics["promoted_round"])
        if now == n - 1:
            assert judged[n - 1] <= best + regression + 1e-9, (n, judged, best)
            best = min(best, judged[n - 1])
    assert judged[promoted] <= best + regression + 1e-9
    # The harmful updates made candidates worse: some rounds were rolled back to the
    # promoted model, their model the promoted round's own.
    rolled = [n for n in range(2, 9) if rounds[n].model_sha256 == rounds[
        int(rounds[n].metrics["promoted_round"])].model_sha256 and n != int(
        rounds[n].metrics["promoted_round"])]  # fmt: skip
    assert rolled, {
        n: (r.metrics["eval_loss"], r.metrics["promoted_round"]) for n, r in rounds.items() if n
    }


@pytest.mark.parametrize("name", ["promoted_round", "promotion_best", "rounds_unpromoted",
                                  "privacy_epsilon", "staleness"])  # fmt: skip
def test_a_site_cannot_report_the_coordinator_s_own_metrics(name: str) -> None:
    from fedra.coordinator.engine.uploads import UpdateHeader, _check_header_fields
    from fedra.coordinator.errors import InvalidArgument

    header = UpdateHeader(
        site_id="s", run_id="r", round=1, task_id="t", num_samples=1, metrics={name: 7.0},
        codec="none", sha256="0" * 64, nonce=b"0" * 16, payload_bytes=10,
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match=f"metric name '{name}' is the coordinator's own"):
        _check_header_fields(header)
