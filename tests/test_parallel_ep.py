"""The ``ep`` plan: dispatch logic in-process, real all-to-all across processes, and
the equivalence check against one process through torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import spawn

from fedra.client.parallel.ep import (
    AllToAllDispatch,
    EPRunner,
    apply_ep,
    expert_major_order,
    rank_splits,
)
from fedra.client.parallel.plan import PlanOptions, World
from fedra.examples.gpt import GPT, GPTConfig, build, local_experts
from tests.torchrun import assert_matches_one_process, moved_at, run_check

CPU = torch.device("cpu")
# Measured on CPU/gloo, 3 AdamW steps: max |param diff| 1.2e-7 (2 ranks) and 1.1e-6
# (4 ranks), loss diff <= 5e-7. Dropping the experts' 1/W gradient factor gives 1.1e-4.
PARAM_TOL = 1e-5
LOSS_TOL = 1e-5
CHECK_TIMEOUT_S = 240


def _moe_config(n_experts: int = 4) -> GPTConfig:
    return GPTConfig(
        seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32, n_experts=n_experts, top_k=2
    )


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _batch(cfg: GPTConfig, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# --- in-process -----------------------------------------------------------------------


def test_rank_splits_sum_each_ranks_contiguous_experts() -> None:
    assert rank_splits([1, 2, 3, 4], 2) == [3, 7]
    assert rank_splits([1, 2, 3, 4], 4) == [1, 2, 3, 4]
    assert rank_splits([5, 0, 0, 1, 2, 2], 3) == [5, 1, 4]


def test_expert_major_order_groups_by_expert_keeping_source_order() -> None:
    # Rows arrive source-major: rank 0 sends 1 row for expert 0 and 2 for expert 1,
    # rank 1 sends 3 for expert 0 and none for expert 1.
    received = torch.tensor([[1, 2], [3, 0]])
    assert expert_major_order(received).tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []


def test_dispatch_in_a_world_of_one_matches_local_experts() -> None:
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    counts = [3, 0, 2, 5]
    tokens = torch.randn(sum(counts), 8, generator=g)
    dispatch = AllToAllDispatch(World(0, 1, "none", CPU), n_experts=4)
    torch.testing.assert_close(
        dispatch(tokens, counts, w1, w2), local_experts(tokens, counts, w1, w2)
    )
    assert (dispatch.stats.sent, dispatch.stats.received) == (0, 0)


def test_world_of_one_trains_like_the_plain_model() -> None:
    cfg = _moe_config()
    reference, model = build(cfg, 0), build(cfg, 0)
    x, y = _batch(cfg, 4)
    _loss(reference(x), y).backward()  # type: ignore[no-untyped-call]
    runner = apply_ep(model, World(0, 1, "none", CPU), PlanOptions())
    runner.train_step(x, y, _loss)
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad)
    full = runner.full_state_dict()
    assert full is not None
    assert full.keys() == reference.state_dict().keys()


def test_rejects_a_model_without_moe_layers() -> None:
    dense = build(GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32), 0)
    with pytest.raises(ValueError, match="needs a model with MoE layers"):
        apply_ep(dense, World(0, 2, "gloo", CPU), PlanOptions())


def test_rejects_experts_not_divisible_by_the_world() -> None:
    with pytest.raises(ValueError, match=r"4 experts, not divisible by the local world size 3"):
        apply_ep(build(_moe_config(4), 0), World(0, 3, "gloo", CPU), PlanOptions())


def test_rejects_a_batch_not_divisible_by_the_world() -> None:
    cfg = _moe_config()
    runner = apply_ep(build(cfg, 0), World(0, 2, "gloo", CPU), PlanOptions())
    x, y = _batch(cfg, 3)
    with pytest.raises(ValueError, match="batch size 3 must be divisible"):
        runner.train_step(x, y, _loss)  # raises before any collective


# --- two real processes (gloo over a FileStore: no port) ------------------------------


def _init(rank: int, world_size: int, store: str) -> World:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    return World.current()


def _two_rank_worker(rank: int, store: str) -> None:
    world = _init(rank, 2, store)
    try:
        _check_dispatch(world)
        _check_gradients(world)
    finally:
        dist.destroy_process_group()


def _check_dispatch(world: World) -> None:
    """Rank 0's tokens are processed by rank 1's experts; gradients go back the same way."""
    rank = world.rank
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    # Rank 0 only routes to experts 2 and 3, which live on rank 1; rank 1 uses all four.
    counts = [[0, 0, 3, 2], [2, 1, 1, 3]][rank]
    tokens = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(10 + rank))
    upstream = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(20 + rank))
    mine = slice(2 * rank, 2 * rank + 2)
    local = [t.clone().requires_grad_() for t in (tokens, w1[mine], w2[mine])]
    full = [t.clone().requires_grad_() for t in (tokens, w1, w2)]

    dispatch = AllToAllDispatch(world, n_experts=4)
    out = dispatch(local[0], counts, local[1], local[2])
    expected = local_experts(full[0], counts, full[1], full[2])
    torch.testing.assert_close(out, expected)  # rank 0's output needs rank 1's experts
    (out * upstream).sum().backward()  # type: ignore[no-untyped-call]
    (expected * upstream).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(local[0].grad, full[0].grad)
    for shard, whole in zip(local[1:], full[1:], strict=True):
        assert whole.grad is not None
        dist.all_reduce(whole.grad)  # an expert's grad sums every rank's tokens
        torch.testing.assert_close(shard.grad, whole.grad[mine])
    assert (dispatch.stats.sent, dispatch.stats.received) == [(5, 3), (3, 5)][rank]


def _check_gradients(world: World) -> None:
    """One EP step's gradients equal one process's on the whole batch (the 1/W factor)."""
    rank = world.rank
    cfg = _moe_config()
    reference, model = build(cfg, 0), build(cfg, 0)
    x, y = _batch(cfg, 4)
    ref_loss = _loss(reference(x), y)
    ref_loss.backward()  # type: ignore[no-untyped-call]
    runner = apply_ep(model, world, PlanOptions())
    loss = runner.train_step(x, y, _loss)
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / 2, ref_loss.detach())
    _assert_grads_match(runner, reference, rank, per_rank=2)
    assert sum(d.stats.sent for d in runner.dispatchers) > 0
    full = runner.full_state_dict()
    if rank == 0:
        assert full is not None
        torch.testing.assert_close(full, reference.state_dict(), rtol=0, atol=0)
    else:
        assert full is None


def _assert_grads_match(runner: EPRunner, reference: GPT, rank: int, per_rank: int) -> None:
    """Every local gradient is the one-process gradient (the expert shard's slice of it)."""
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in runner.model.named_parameters():
        expected = ref_grads[name]
        assert expected is not None and p.grad is not None
        if name in runner.expert_names:
            expected = expected[rank * per_rank : (rank + 1) * per_rank]
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.multiprocess
def test_two_ranks_exchange_tokens_and_match_one_process(tmp_path: Path) -> None:
    # One spawn for both checks: each child's start (importing torch) costs seconds here.
    spawn(_two_rank_worker, args=(str(tmp_path / "store"),), nprocs=2)  # type: ignore[no-untyped-call]


# --- the equivalence check through torchrun -------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "extra"),
    [(2, ()), (4, ()), (2, ("--scaffold", "--lr", "0.05")), (2, ("--keep", "--move-at", "1"))],
    ids=["ep2", "ep4", "ep2-scaffold", "ep2-keep-overlap"],  # each rank: its experts' rows
)
def test_check_matches_one_process(nproc: int, extra: tuple[str, ...], tmp_path: Path) -> None:
    report = run_check(tmp_path / "ep.json", nproc, "ep", "--experts", "4", *extra)
    assert_matches_one_process(report, nproc, PARAM_TOL, LOSS_TOL)
    assert report["scaffold_steps"] == (3.0 if "--scaffold" in extra else 0.0)
    assert report["inner_state_rounds"] == (1.0 if "--keep" in extra else 0.0)
    assert report["moved_at_step"] == moved_at(extra)
    assert report["state_max_abs_diff"] < PARAM_TOL
