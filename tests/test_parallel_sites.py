"""Sites that train across several local processes, inside real federated runs.

Each parallel site is ``fedra site`` with a ``[parallel]`` table: the elastic agent
starts its local world, rank 0 talks to the coordinator. The coordinator sees one
site and one update, whatever plan ran inside.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedra.local import LocalCluster
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec, TrainSpec

pytestmark = pytest.mark.multiprocess

CHARLM = "fedra.examples.charlm:task"
# A restarted local world needs a few seconds on 2 busy cores before it polls again.
FAST = ["--heartbeat-s", "0.5", "--site-timeout-s", "30", "--poll-timeout-s", "5"]
MODEL = {
    "d_model": "32",
    "seq_len": "32",
    "n_layers": "4",
    "n_heads": "4",
    "n_experts": "4",
    "moe_every": "2",
    "top_k": "2",
}


def spec(rounds: int, sites: int, quorum: int) -> RunSpec:
    return RunSpec(
        task=CHARLM,
        rounds=rounds,
        sites_per_round=sites,
        min_sites=quorum,
        round_deadline_s=180.0,
        join_timeout_s=90.0,
        seed=3,
        train=TrainSpec(local_steps=8, batch_size=8, learning_rate=3e-3, params=MODEL),
    ).validate()


def start(
    cluster: LocalCluster,
    site_id: str,
    part: int,
    parallel: dict[str, object] | None,
    env: dict[str, str] | None = None,
) -> None:
    data = {"part": part, "num_parts": 4, "max_bytes": 200_000}
    cluster.start_site(site_id, [CHARLM], data, extra_env=env, parallel=parallel)


def finished_status(
    cluster: LocalCluster, run_id: str, timeout_s: float = 400.0
) -> admin_pb2.RunStatus:
    with cluster.admin() as admin:
        status = None
        for status in admin.watch(run_id, timeout_s=timeout_s):
            if status.state in ("completed", "failed", "cancelled"):
                return status
    raise AssertionError(f"run {run_id} did not finish: {status}")


def test_heterogeneous_sites_train_one_global_model(cluster: LocalCluster) -> None:
    cluster.start_coordinator(flags=FAST)
    plans: dict[str, dict[str, object] | None] = {
        "tp-site": {"nproc": 2, "plan": "tp"},
        "pp-site": {"nproc": 2, "plan": "pp", "pp_schedule": "1f1b", "microbatches": 2},
        "ep-site": {"nproc": 2, "plan": "ep"},
        "single-site": None,
    }
    for part, (site_id, parallel) in enumerate(plans.items()):
        start(cluster, site_id, part, parallel)
    cluster.wait_for_sites(list(plans), timeout_s=180)
    with cluster.admin() as admin:
        run_id = admin.submit(spec(rounds=3, sites=len(plans), quorum=len(plans)))
    status = finished_status(cluster, run_id)
    assert status.state == "completed", status.reason
    rounds = [r for r in status.rounds if r.number > 0]
    assert all(r.updates == len(plans) for r in rounds)
    for site_id, parallel in plans.items():
        if parallel is not None:  # each parallel site really ran its plan in a local world
            log = cluster.sites[site_id].log_path.read_text()
            assert f"local world of 2 ranks on 1 node, plan {parallel['plan']}" in log
    # The global model improves: the sites' held-out loss of the incoming model drops.
    assert rounds[-1].metrics["eval_loss"] < rounds[0].metrics["eval_loss"] - 0.5


def test_killed_local_rank_fails_the_round_cleanly_and_the_site_rejoins(
    cluster: LocalCluster,
) -> None:
    cluster.start_coordinator(flags=FAST)
    start(
        cluster,
        "dp-site",
        0,
        {"nproc": 2, "plan": "dp"},
        env={"FEDRA_FAULT_CRASH": "rank1_train:2"},
    )
    start(cluster, "single-site", 1, None)
    cluster.wait_for_sites(["dp-site", "single-site"], timeout_s=180)
    with cluster.admin() as admin:
        run_id = admin.submit(spec(rounds=3, sites=2, quorum=1))
    status = finished_status(cluster, run_id)
    assert status.state == "completed", status.reason
    by_round = {r.number: {p.site_id: p for p in r.participations} for r in status.rounds}
    failed = by_round[2]["dp-site"]
    assert failed.status == "failed", failed
    assert by_round[2]["single-site"].status == "accepted"
    # The local world restarted and the site took part in the next round.
    assert by_round[3]["dp-site"].status == "accepted"
    assert cluster.sites["dp-site"].alive()
    log = cluster.sites["dp-site"].log_path.read_text()
    assert "rank1_train" in log or "restart" in log.lower()


# Plain SGD (SCAFFOLD's option II assumes it), dense: tp and fsdp shard every block.
SGD_MODEL = {"d_model": "32", "seq_len": "32", "n_layers": "2", "n_heads": "4", "optimizer": "sgd"}
SCAFFOLD_STEPS = 4


SCAFFOLD = TrainSpec(local_steps=SCAFFOLD_STEPS, batch_size=8, learning_rate=0.05,
                     params=SGD_MODEL, scaffold=True)  # fmt: skip


def _run(
    root: Path, plans: dict[str, dict[str, object] | None], train: TrainSpec
) -> tuple[admin_pb2.RunStatus, dict[str, torch.Tensor], dict[str, Path]]:
    """A 3-round run of charlm on these sites: its status, its final model, and each
    site's state directory."""
    with LocalCluster(root) as cluster:
        cluster.start_coordinator(flags=FAST)
        for part, (site_id, parallel) in enumerate(plans.items()):
            start(cluster, site_id, part, parallel)
        cluster.wait_for_sites(list(plans), timeout_s=180)
        spec = RunSpec(task=CHARLM, rounds=3, sites_per_round=len(plans), min_sites=len(plans),
                       round_deadline_s=180.0, join_timeout_s=90.0, seed=3, train=train,
                       ).validate()  # fmt: skip
        with cluster.admin() as admin:
            run_id = admin.submit(spec)
            status = finished_status(cluster, run_id)
            states = {s: cluster.state_dir / "sites" / s for s in plans}
            return status, admin.export_model(run_id), states


@pytest.mark.timeout(600)
def test_a_scaffold_run_on_local_worlds_matches_the_same_run_on_single_processes(
    tmp_path: Path,
) -> None:
    """SCAFFOLD at sites whose training is sharded (fsdp, tp over 2 ranks each): every
    rank adds its shard of c - c_i to its gradients, rank 0 keeps c_i+ from the gathered
    model; the run's model is the one single-process sites reach, round by round."""
    worlds: dict[str, dict[str, object] | None] = {
        "site-a": {"nproc": 2, "plan": "fsdp"},
        "site-b": {"nproc": 2, "plan": "tp"},
    }
    status, model, _ = _run(tmp_path / "worlds", worlds, SCAFFOLD)
    assert status.state == "completed", status.reason
    for r in (r for r in status.rounds if r.number > 0):
        accepted = [p for p in r.participations if p.status == "accepted"]
        assert sorted(p.site_id for p in accepted) == sorted(worlds)
        for p in accepted:  # corrected at every step, from the c_i of the round before
            assert p.metrics["scaffold_steps"] == SCAFFOLD_STEPS
            assert p.metrics["scaffold_from_round"] == r.number - 1, (p.site_id, r.number)
    single, reference, _ = _run(tmp_path / "single", dict.fromkeys(worlds), SCAFFOLD)
    assert single.state == "completed", single.reason
    assert sorted(model) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(model[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(600)
def test_kept_optimiser_state_on_local_worlds_matches_the_same_run_on_single_processes(
    tmp_path: Path,
) -> None:
    """keep_optimizer_state at sites whose AdamW state is sharded (fsdp, tp over 2 ranks):
    rank 0 gathers the state whole after each round and keeps it as a site of one process
    does; the next round each rank loads its part. The run's model is the one
    single-process sites reach, and each round after the first carried the rounds before."""
    worlds: dict[str, dict[str, object] | None] = {
        "site-a": {"nproc": 2, "plan": "fsdp"},
        "site-b": {"nproc": 2, "plan": "tp"},
    }
    dense = {k: v for k, v in SGD_MODEL.items() if k != "optimizer"}  # AdamW: state to keep
    train = TrainSpec(local_steps=4, batch_size=8, learning_rate=3e-3, params=dense,
                      keep_optimizer_state=True)  # fmt: skip
    status, model, states = _run(tmp_path / "worlds", worlds, train)
    assert status.state == "completed", status.reason
    for r in (r for r in status.rounds if r.number > 0):
        accepted = [p for p in r.participations if p.status == "accepted"]
        assert sorted(p.site_id for p in accepted) == sorted(worlds)
        for p in accepted:
            assert p.metrics["inner_state_rounds"] == r.number - 1, (p.site_id, r.number)
    for folder in states.values():  # kept by rank 0, in the one-process layout
        files = sorted(f.name for f in folder.glob("optimizer-*.safetensors"))
        assert [f.count(".") for f in files] == [2, 1], files  # .prev, then the latest
    single, reference, _ = _run(tmp_path / "single", dict.fromkeys(worlds), train)
    assert single.state == "completed", single.reason
    assert sorted(model) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(model[name], tensor, rtol=0, atol=1e-5, msg=name)
