"""Data- and tensor-parallel plans (``dp``, ``fsdp``, ``tp``, ``fsdp+tp``): clear errors,
a world of one in-process, and real torchrun worlds matching one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fedra.client.parallel.dp import DataParallelRunner, apply_ddp, local_batch
from fedra.client.parallel.plan import PlanOptions, SingleRunner, World, get_plan
from fedra.client.parallel.tp import apply_fsdp_tp, apply_tp
from fedra.client.parallel.trainer import train
from fedra.client.task import FitSettings
from fedra.examples.charlm import task
from tests.torchrun import assert_matches_one_process, moved_at, run_check

CPU = torch.device("cpu")
# Two blocks: block 0 dense, block 1 MoE (moe_every defaults to 2), so one model has both.
PARAMS = {"n_layers": "2", "d_model": "32", "n_heads": "4", "d_ff": "64", "seq_len": "16"}
MOE = PARAMS | {"n_experts": "4", "top_k": "2"}
TWO = World(0, 2, "gloo", CPU)  # worlds that are never initialised: errors come first
FOUR = World(0, 4, "gloo", CPU)
# Measured through check.py (d_model 32, 2 layers, batch 8, AdamW lr 1e-3, 3 steps, gloo,
# float32): parameters differ from one process by <= 3e-8 (dp, fsdp dense), 2.2e-7 (tp,
# fsdp+tp dense) and 2.6e-6 (MoE under tp, fsdp+tp); losses by <= 7.2e-7. Reduction order
# differs from one process and Adam's normalisation magnifies it for tiny gradients; a
# missed all-reduce or a wrong gradient scale shows up as >= 1e-4.
PARAM_TOL = 1e-5
LOSS_TOL = 1e-5


# --- in-process: errors before any collective ---------------------------------------------


def test_local_batch_slices_partition_the_batch() -> None:
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    slices = [local_batch(x, y, rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat([s[0] for s in slices]), x)
    assert torch.equal(torch.cat([s[1] for s in slices]), y)
    assert all(s[0].shape == (2, 2) for s in slices)


def test_batch_not_divisible_by_data_parallel_ranks_fails_clearly() -> None:
    runner = DataParallelRunner(nn.Linear(2, 2), TWO, dp_rank=0, dp_size=2)
    x, y = torch.zeros(3, 2), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="batch size 3 must be divisible by the 2 data-parallel"):
        runner.train_step(x, y, nn.functional.mse_loss)


@pytest.mark.parametrize(
    ("plan", "world", "options", "n_heads", "message"),
    [
        ("tp", TWO, PlanOptions(), "1", r"n_heads \(1\) must be divisible by .* degree \(2\)"),
        ("tp", TWO, PlanOptions(tp_size=1), "4", "use plan 'fsdp\\+tp'"),
        ("fsdp+tp", FOUR, PlanOptions(tp_size=4), "2", r"n_heads \(2\) must be divisible"),
        ("fsdp+tp", FOUR, PlanOptions(tp_size=3), "4", r"tp_size \(3\) must divide .* \(4\)"),
    ],
)
def test_bad_tensor_parallel_degree_fails_before_any_collective(
    plan: str, world: World, options: PlanOptions, n_heads: str, message: str
) -> None:
    model = task.create_model(0, PARAMS | {"n_heads": n_heads})
    apply = apply_tp if plan == "tp" else apply_fsdp_tp
    with pytest.raises(ValueError, match=message):
        apply(model, world, options)


def test_data_parallel_without_a_process_group_fails_clearly() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs an initialised process group"):
        apply_ddp(task.create_model(0, PARAMS), TWO, PlanOptions())


# --- in-process: a world of one runs every plan's plumbing --------------------------------


def _corrections(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["plain", "fedprox", "scaffold"])
@pytest.mark.parametrize("plan", ["dp", "fsdp", "tp", "fsdp+tp"])
def test_world_of_one_trains_like_one_process(world_of_one: World, plan: str, mode: str) -> None:
    """FedProx and SCAFFOLD too: a plan's own (sharded, DTensor) parameters take the
    proximal term, and their part of each SCAFFOLD correction."""
    mu, params = (0.5 if mode == "fedprox" else 0.0), dict(MOE)
    lr = 0.05 if mode == "scaffold" else 1e-3
    if mode == "scaffold":
        params["optimizer"] = "sgd"
    settings = FitSettings(2, 0, 4, lr, 0, params, proximal_mu=mu)
    data = task.load_data({"max_bytes": 20_000})
    model = task.create_model(0, params)
    corrections = _corrections(model) if mode == "scaffold" else None
    scaffold_lr = lr if mode == "scaffold" else 0.0
    runner = get_plan(plan)(model, world_of_one, PlanOptions())
    stats = train(runner, task, data, settings, world_of_one, corrections, scaffold_lr)
    reference = SingleRunner(task.create_model(0, params))
    one = World(0, 1, "none", CPU)
    ref_stats = train(reference, task, data, settings, one, corrections, scaffold_lr)
    assert stats.losses == pytest.approx(ref_stats.losses, abs=1e-6)
    inner = {"fedprox": {"proximal_steps": 2.0}, "scaffold": {"scaffold_steps": 2.0}}
    assert stats.inner == ref_stats.inner == inner.get(mode, {})
    if mode == "scaffold":  # the corrections moved the model: not trained without them
        bare = SingleRunner(task.create_model(0, params))
        train(bare, task, data, settings, one)
        moved = bare.full_state_dict()
        assert moved is not None
        assert any(not torch.allclose(moved[k], v) for k, v in reference.model.state_dict().items())
    full, expected = runner.full_state_dict(), reference.full_state_dict()
    assert full is not None and expected is not None
    assert list(full) == list(expected)  # plain names, same order: no `module.` prefix
    for name, tensor in expected.items():
        assert full[name].device == CPU
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-6, msg=name)


# --- real worlds under torchrun -----------------------------------------------------------


IDS = [
    "dp2",
    "dp2-moe-overlap",
    "fsdp2",
    "fsdp2-moe",
    "tp2",
    "tp2-moe-overlap",
    "fsdp2xtp2",
    "fsdp2xtp2-moe",
    "fsdp2-fedprox",
    "fsdp2-scaffold",
    "tp2-moe-scaffold",
    "fsdp2xtp2-keep-overlap",
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "plan", "extra"),
    [
        (2, "dp", ()),
        # [train] overlap: a round trained ahead moves onto its global model before step
        # K's optimiser step, every rank by its part of a seeded shift: a rank that left
        # its part out takes the later steps' gradients elsewhere (or holds the wrong
        # shard) and the world ends ~0.2 off.
        (2, "dp", ("--experts", "4", "--move-at", "0")),
        (2, "fsdp", ()),
        (2, "fsdp", ("--experts", "4")),
        (2, "tp", ()),
        (2, "tp", ("--experts", "4", "--move-at", "0")),
        (4, "fsdp+tp", ("--tp-size", "2")),
        (4, "fsdp+tp", ("--tp-size", "2", "--experts", "4")),
        (2, "fsdp", ("--proximal-mu", "0.5")),
        # SCAFFOLD: each rank adds its parameters' part of c - c_i (a DTensor's shard
        # under fsdp and tp); a rank that left it out moves them by ~1e-2.
        (2, "fsdp", ("--scaffold", "--lr", "0.05")),
        (2, "tp", ("--experts", "4", *("--scaffold", "--lr", "0.05"))),
        # keep_optimizer_state: a second round from the AdamW state the first left,
        # gathered whole on rank 0 and each rank's part loaded again; DTensors sharded
        # over both mesh dimensions; each round also trained ahead and moved at step 1,
        # after a round trained ahead that rank 0 stopped at its first step.
        (4, "fsdp+tp", ("--tp-size", "2", "--keep", "--move-at", "1", "--cancel-first")),
    ],
    ids=IDS,
)
def test_parallel_world_matches_one_process(
    tmp_path: Path, nproc: int, plan: str, extra: tuple[str, ...]
) -> None:
    report = run_check(tmp_path / "report.json", nproc, plan, *extra)
    assert_matches_one_process(report, nproc, PARAM_TOL, LOSS_TOL)
    assert report["proximal_steps"] == (3.0 if "--proximal-mu" in extra else 0.0)
    assert report["scaffold_steps"] == (3.0 if "--scaffold" in extra else 0.0)
    assert report["inner_state_rounds"] == (1.0 if "--keep" in extra else 0.0)
    assert report["moved_at_step"] == moved_at(extra)
    assert report["state_max_abs_diff"] < PARAM_TOL
