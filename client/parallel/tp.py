"""Tensor-parallel plans: ``tp`` (DTensor TP over the local world) and ``fsdp+tp`` (2-D).

Per block, Megatron style: ``attn.wq/wk/wv`` and a dense MLP's ``w1`` are split by
output columns (each rank keeps whole heads, which ``Attention`` counts from the
projection width), ``attn.wo`` and ``w2`` by input rows, whose partial sums are
all-reduced in forward. Everything else stays replicated as plain tensors: the
embeddings, layer norms and head (small here; sharding the head would need a
loss-parallel loss), and a MoE block's router and experts (the ``Dispatch`` contract
takes whole expert tensors; the ``ep`` plan is the one that splits experts).

Replicated parameters see identical inputs on every rank and, because each
column-parallel input all-reduces its gradient in backward, identical gradients:
no extra gradient synchronisation is needed for them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from fedra.client.parallel.dp import (
    DataParallelRunner,
    FSDPRunner,
    blocks,
    require_group,
    shard_model,
)
from fedra.client.parallel.plan import PlanOptions, World


class TPRunner(DataParallelRunner):
    """Every rank runs the whole global batch through its shard of the model."""

    def __init__(self, model: nn.Module, world: World) -> None:
        super().__init__(model, world, dp_rank=0, dp_size=1)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        full: dict[str, torch.Tensor] = {}
        for name, value in self.wrapped.state_dict().items():
            # full_tensor() is collective: every rank walks the same names in the same order.
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if self.world.rank == 0:
                full[name] = tensor.detach().cpu().clone()
        return full if self.world.rank == 0 else None


def check_heads(model: nn.Module, tp: int) -> None:
    """ValueError unless every block's attention heads split evenly over ``tp`` ranks."""
    for i, block in enumerate(blocks(model)):
        attn = block.get_submodule("attn")
        # nn.Module types unknown attributes as Tensor | Module; Attention's head_dim is an int.
        head_dim = cast(int, attn.head_dim)
        heads = attn.get_submodule("wq").get_parameter("weight").shape[0] // head_dim
        if heads % tp:
            raise ValueError(
                f"block {i}: n_heads ({heads}) must be divisible by the tensor-parallel "
                f"degree ({tp}); each rank keeps whole heads"
            )


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """The TP styles of one block's submodules (a MoE block's ``ffn`` stays replicated)."""
    plan: dict[str, ParallelStyle] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
    }
    ffn = block.get_submodule("ffn")
    if isinstance(getattr(ffn, "w1", None), nn.Linear):  # dense MLP; MoE holds raw tensors
        plan.update({"ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel()})
    return plan


def tensor_parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every block's projections over the 1-D ``mesh``, in place."""
    for block in blocks(model):
        parallelize_module(block, mesh, block_plan(block))


def apply_tp(model: nn.Module, world: World, options: PlanOptions) -> TPRunner:
    """Tensor parallelism over the whole local world; every rank sees the full batch."""
    tp = options.tp_size or world.size
    if tp != world.size:
        raise ValueError(
            f"plan 'tp' shards over the whole local world ({world.size} ranks), got "
            f"tp_size {tp}; use plan 'fsdp+tp' for data parallelism across TP groups"
        )
    check_heads(model, tp)
    require_group("tp")
    model.to(world.device)
    mesh = init_device_mesh(world.device.type, (tp,), mesh_dim_names=("tp",))
    tensor_parallelize(model, mesh)
    return TPRunner(model, world)


def apply_fsdp_tp(model: nn.Module, world: World, options: PlanOptions) -> FSDPRunner:
    """TP within groups of ``tp_size`` consecutive ranks, FSDP2 across the groups."""
    tp = options.tp_size or world.size
    if tp < 1 or world.size % tp:
        raise ValueError(
            f"tp_size ({tp}) must divide the local world size ({world.size}) for plan 'fsdp+tp'"
        )
    check_heads(model, tp)
    require_group("fsdp+tp")
    model.to(world.device)
    dp = world.size // tp
    mesh = init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    tensor_parallelize(model, mesh["tp"])
    shard_model(model, mesh["dp"])
    # Ranks of one TP group share a batch slice: the slice is chosen by the dp coordinate.
    return FSDPRunner(model, world, mesh["dp"].get_local_rank(), dp)
