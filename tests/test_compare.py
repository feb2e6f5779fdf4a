"""`fedra bench compare`: the measures on hand-made rounds, and the whole report end to end.

The end-to-end test runs ``python -m fedra bench compare --quick`` (a coordinator and two
sites as real processes, each behind an emulated link) and checks the report's files and
that its headline numbers follow from the per-configuration numbers in report.json.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedra import compare_metrics as m
from fedra.cli import main
from fedra.compare import CompareConfig, configurations, pooled_data, train_centralised
from fedra.config import ConfigError
from fedra.examples import charlm

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def participation(
    site: str, status: str = "accepted", down: int = 100, up: int = 50, **kw: float
) -> m.ParticipationRow:
    return m.ParticipationRow(site, 1, status, down, up, 0.0, 0.0, metrics=dict(kw))


def round_row(
    number: int, opened: float, closed: float, parts: list[m.ParticipationRow], **metrics: float
) -> m.RoundRow:
    return m.RoundRow(
        number=number,
        attempt=1,
        status="committed",
        opened_unix_s=opened,
        closed_unix_s=closed,
        duration_s=closed - opened,
        metrics=dict(metrics),
        stages={"round_s": closed - opened},
        participations=parts,
    )


def two_rounds() -> list[m.RoundRow]:
    """Round 0 (initial model, excluded) and two training rounds of two sites."""
    init = round_row(0, 90.0, 99.0, [participation("a", down=0, up=400)])
    first = round_row(
        1,
        100.0,
        104.0,
        [
            participation("a", compute_s=3.0),
            participation("b", compute_s=2.0),
            participation("b", status="failed", down=100, up=0),
        ],
        eval_loss=5.0,
    )
    second_parts = [participation("a", compute_s=4.0), participation("b", compute_s=5.0)]
    second = round_row(2, 104.5, 110.0, second_parts, eval_loss=4.0)
    return [second, init, first]  # any order


def test_percentiles_interpolate_like_numpy() -> None:
    assert m.percentiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx(
        {"p50": 2.5, "p95": 3.85, "p99": 3.97}
    )
    assert m.percentiles([7.0]) == {"p50": 7.0, "p95": 7.0, "p99": 7.0}
    assert all(math.isnan(v) for v in m.percentiles([]).values())
    values = list(np.random.default_rng(0).exponential(size=101))
    got = m.percentiles(values, qs=(10, 50, 90, 99))
    assert list(got.values()) == pytest.approx(list(np.percentile(values, [10, 50, 90, 99])))


def test_utilisation_is_compute_over_wall_time() -> None:
    rows = two_rounds()
    assert m.wall_time_s(rows) == pytest.approx(
        10.0
    )  # round 1 opens at 100, round 2 commits at 110
    compute = m.compute_by_site(rows)
    assert compute == pytest.approx({"a": 7.0, "b": 7.0})  # the failed participation's work: none
    assert m.utilisation(compute, 10.0) == pytest.approx({"a": 0.7, "b": 0.7})
    assert math.isnan(m.utilisation({"a": 1.0}, 0.0)["a"])


def test_bytes_count_every_participation_of_the_training_rounds() -> None:
    by_site = m.bytes_by_site(two_rounds())
    assert by_site == {"a": {"down": 200, "up": 100}, "b": {"down": 300, "up": 100}}
    per_site = m.mean_bytes_per_site(by_site)
    assert per_site == {"down": 250.0, "up": 100.0, "total": 350.0}
    assert m.bytes_per_step(per_site["total"], 7) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="inner_steps"):
        m.bytes_per_step(1.0, 0)


def test_failures_count_failed_participations() -> None:
    assert m.failures(two_rounds()) == {"failed": 1, "participations": 5, "rate": 0.2}


def test_time_to_target_is_the_first_time_at_or_below() -> None:
    points = [(2.0, 2.5), (0.0, 5.0), (1.0, 3.0), (3.0, 2.9)]
    assert m.time_to_target(points, 3.0) == 1.0
    assert m.time_to_target(points, 2.5) == 2.0
    assert m.time_to_target(points, 1.0) is None


def test_loss_curve_places_each_model_at_the_commit_that_made_it() -> None:
    curve = m.loss_curve(two_rounds(), final_eval_loss=3.5)
    # Round 1 measured the initial model (t 0, nothing sent); round 2 the model of round 1.
    assert [(p.seconds, p.bytes_per_site, p.eval_loss) for p in curve] == [
        (0.0, 0.0, 5.0),
        (4.0, 200.0, 4.0),  # round 1: a moved 150, b 250
        (10.0, 350.0, 3.5),
    ]


def test_headline_ratios_and_targets() -> None:
    def config(bytes_per_step: float, loss: float, util: float) -> dict[str, object]:
        return {
            "bytes_per_inner_step": bytes_per_step,
            "final_eval_loss": loss,
            "utilisation": {"mean": util},
        }

    by_name = {"every": config(8000.0, 2.0, 0.3), "dl": config(16.0, 2.05, 0.95)}
    h = m.headline(by_name, "every", "dl")
    assert h["bytes_per_inner_step"]["ratio"] == pytest.approx(500.0)
    assert h["final_eval_loss"]["relative_difference"] == pytest.approx(0.025)
    assert h["bytes_target_met"] and h["utilisation"]["met"]
    by_name["dl"] = config(40.0, 2.1, 0.5)
    h = m.headline(by_name, "every", "dl")
    assert not h["bytes_per_inner_step"]["met"]  # 200x
    assert not h["final_eval_loss"]["met"]  # 5 % worse
    assert not h["utilisation"]["met"]


def test_overlap_is_judged_against_the_same_h_without_it() -> None:
    def config(name: str, loss: float, util: float) -> dict[str, object]:
        return {"name": name, "final_eval_loss": loss, "utilisation": {"mean": util}}

    by_name = {n: config(n, loss, u) for n, loss, u in [
        ("diloco-h32", 2.40, 0.83), ("diloco-h32-overlap", 2.41, 0.97),
        ("diloco-h8-overlap", 2.0, 0.5),  # no diloco-h8 to judge it against: left out
    ]}  # fmt: skip
    (o,) = m.overlap_headlines(by_name)
    assert (o["configuration"], o["without"]) == ("diloco-h32-overlap", "diloco-h32")
    assert o["utilisation"]["met"] and o["final_eval_loss"]["met"]
    assert o["final_eval_loss"]["relative_difference"] == pytest.approx(0.01 / 2.40)
    by_name["diloco-h32-overlap"] = config("diloco-h32-overlap", 2.5, 0.9)
    (o,) = m.overlap_headlines(by_name)
    assert not o["utilisation"]["met"] and not o["final_eval_loss"]["met"]


def test_config_errors_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"--h: must divide --steps 16"):
        CompareConfig(steps=16, h_values=(4, 5))
    with pytest.raises(ConfigError, match="--bandwidth-mbit"):
        CompareConfig(bandwidth_mbit=0.0)
    assert main(["bench", "compare", "--quick", "--steps", "10", "--h", "3"]) == 2
    assert "--h: must divide --steps 10" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--overlap-h: every value must be one of --h"):
        CompareConfig(steps=16, h_values=(4, 16), overlap_h=(8,))
    only = CompareConfig.build(quick=True, only=("diloco-h4-overlap", "ddp"))
    assert [c.name for c in configurations(only)] == ["ddp", "diloco-h4-overlap"]
    with pytest.raises(ConfigError, match="--only: must name configurations of"):
        CompareConfig.build(quick=True, only=("diloco-h5",))
    with pytest.raises(ConfigError, match="--price-gb"):
        CompareConfig(price_gb=-1.0)
    assert [c.name for c in configurations(CompareConfig.build(quick=True))] == [
        "centralised",
        "ddp",
        "every-step",
        "diloco-h4",
        "diloco-h4-int8",
        "diloco-h4-overlap",
        "diloco-h16",
        "diloco-h16-int8",
    ]


def test_centralised_training_is_the_tasks_fit() -> None:
    config = CompareConfig.build(quick=True)
    data = pooled_data(config)
    evals: list[int] = []
    ours = train_centralised(config, data, lambda step, _: evals.append(step))
    reference = charlm.task.create_model(config.seed, config.params)
    charlm.task.fit(reference, data, config.settings(config.steps, config.seed))
    assert evals == [4, 8, 12, 16]
    torch.testing.assert_close(ours.state_dict(), reference.state_dict())


@pytest.mark.multiprocess
def test_quick_compare_writes_a_consistent_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-m", "fedra", "bench", "compare", "--quick", "--out", str(out)]
    cmd += ["--state-dir", str(tmp_path / "state")]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("loss_vs_time.png", "loss_vs_bytes.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
    assert "## Headline" in (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())

    configs = {c["name"]: c for c in report["configurations"]}
    assert list(configs) == [c.name for c in configurations(CompareConfig.build(quick=True))]
    steps = report["setup"]["steps"]
    every = configs["every-step"]
    assert "## Provenance" in (out / "report.md").read_text()
    # DDP: every step, each rank sends and receives 2 (n - 1) / n of the fp32 gradients.
    ddp, n = configs["ddp"], report["setup"]["sites"]
    assert ddp["state"] == "completed", ddp
    grads = report["setup"]["model_bytes_fp32"]
    assert ddp["bytes_per_inner_step"] == pytest.approx(2 * 2 * (n - 1) / n * grads)
    assert ddp["bytes_per_site"]["down"] == ddp["bytes_per_site"]["up"]
    assert 0.0 < ddp["utilisation"]["mean"] <= 1.0
    assert 0.0 < ddp["round_time_s"]["p50"] <= ddp["round_time_s"]["p95"]
    evals = steps // report["setup"]["centralised_eval_every"]
    assert [p.get("step", 0) for p in ddp["curve"]] == [
        k * (steps // evals) for k in range(evals + 1)
    ]
    assert ddp["final_eval_loss"] < ddp["curve"][0]["eval_loss"]  # it learned
    for c in configs.values():  # the cost line: compute-hours and bytes at the stated prices
        k, prices = c["cost"], report["setup"]["prices"]
        gb = (
            c["bytes_per_site"]["total"] * len(c["bytes_by_site"]) / 1e9
            if c.get("bytes_by_site")
            else 0.0
        )
        assert k["gb"] == pytest.approx(gb)
        assert k["total"] == pytest.approx(
            k["compute_hours"] * prices["compute_hour"] + gb * prices["gb"]
        )
    assert "## Cost" in (out / "report.md").read_text()
    for name, c in configs.items():
        assert c["state"] == "completed", c
        assert math.isfinite(c["final_eval_loss"])
        if name == "ddp":
            continue  # above
        if name != "centralised":  # each federated run: what its sites' updates came from
            sites = c["provenance"]["sites"]
            assert sites and all(len(p["task_source_sha256"]) == 64 for p in sites.values())
            assert len(c["provenance"]["run"]["spec_sha256"]) == 64
        if name == "centralised":
            continue
        assert c["rounds_committed"] == c["num_rounds"] == steps // c["local_steps"]
        # bytes per inner step, recomputed from the participations of the training rounds
        moved = sum(
            p["bytes_down"] + p["bytes_up"]
            for r in c["rounds"]
            if r["number"] >= 1
            for p in r["participations"]
        )
        assert c["bytes_per_inner_step"] == pytest.approx(moved / len(c["bytes_by_site"]) / steps)
        assert 0.0 < c["utilisation"]["mean"] <= 1.0
        assert all(0.0 <= u <= 1.0 for u in c["utilisation"]["by_site"].values())
        rt = c["round_time_s"]
        assert 0.0 < rt["p50"] <= rt["p95"] <= rt["p99"]
        assert c["failures"]["failed"] == 0
        if name != "every-step":
            assert every["bytes_per_inner_step"] > c["bytes_per_inner_step"]
    assert configs["diloco-h16-int8"]["bytes_per_site"]["up"] < (
        configs["diloco-h16"]["bytes_per_site"]["up"] / 3
    )

    headline = report["headline"]
    diloco = configs[headline["diloco_configuration"]]
    assert headline["diloco_configuration"] == "diloco-h16-int8"
    ratio = every["bytes_per_inner_step"] / diloco["bytes_per_inner_step"]
    assert headline["bytes_per_inner_step"]["ratio"] == pytest.approx(ratio)
    assert headline["bytes_per_inner_step"]["met"] == (ratio >= 400)
    gap = diloco["final_eval_loss"] / every["final_eval_loss"] - 1
    assert headline["final_eval_loss"]["relative_difference"] == pytest.approx(gap)
    assert headline["utilisation"]["every-step"] == every["utilisation"]["mean"]
    target = report["setup"]["target_loss"]
    assert target == pytest.approx(1.1 * configs["centralised"]["final_eval_loss"])
