"""Data-parallel plans: ``dp`` (DistributedDataParallel) and ``fsdp`` (FSDP2 ``fully_shard``).

Every rank trains on its equal slice of the step's global batch and returns the
slice's mean loss; both wrappers average gradients over the ranks, so with equal
slices the step is the one a single process takes on the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fedra.client.parallel.plan import LossFn, PlanOptions, World, plain_part


def local_batch(
    x: torch.Tensor, y: torch.Tensor, rank: int, parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``rank`` of ``parts`` equal slices of the batch dimension; ValueError if uneven."""
    batch = x.shape[0]
    if batch % parts:
        raise ValueError(
            f"batch size {batch} must be divisible by the {parts} data-parallel ranks "
            "(equal slices keep the averaged gradient equal to one process's)"
        )
    size = batch // parts
    return x.narrow(0, rank * size, size), y.narrow(0, rank * size, size)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the modules of its ``layers`` ModuleDict."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"{type(model).__name__} has no `layers` ModuleDict of blocks to shard")
    return list(layers.values())


def require_group(plan: str) -> None:
    """ValueError unless the default process group this plan communicates over is up."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"plan {plan!r} needs an initialised process group (run under torchrun)")


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of a plain (unsharded) module's state dict."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


class DataParallelRunner:
    """Runs ``wrapped`` on this rank's slice of the batch; the wrapper averages gradients."""

    def __init__(self, wrapped: nn.Module, world: World, dp_rank: int, dp_size: int) -> None:
        self.wrapped = wrapped
        self.world = world
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def parameters(self) -> list[nn.Parameter]:
        return list(self.wrapped.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.wrapped.named_parameters())

    def local_part(self, name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        return plain_part(name, param, full)

    def gather(
        self, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, str]
    ) -> dict[str, torch.Tensor] | None:
        """A DTensor (fsdp, tp: sharded like its parameter) is all-gathered, key by key in
        the same order on every rank; a plain one (dp: replicas agree) is rank 0's own."""
        out: dict[str, torch.Tensor] = {}
        for key in sorted(tensors):
            value = tensors[key]
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if self.world.rank == 0:
                out[key] = whole.detach().cpu().clone()
        return out if self.world.rank == 0 else None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        x, y = local_batch(x, y, self.dp_rank, self.dp_size)
        loss = loss_fn(self.wrapped(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach()


class DDPRunner(DataParallelRunner):
    """DistributedDataParallel: every rank holds the whole model."""

    def __init__(self, ddp: DistributedDataParallel, world: World) -> None:
        super().__init__(ddp, world, world.rank, world.size)
        self.module: nn.Module = ddp.module

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())  # plain names: no `module.`

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        # Replicas are identical, so rank 0 needs no communication (plain names: no `module.`).
        return cpu_state(self.module) if self.world.rank == 0 else None


class FSDPRunner(DataParallelRunner):
    """FSDP2: parameters are DTensors sharded over the data-parallel mesh (maybe also TP)."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        # Collective: all-gathers every shard; with cpu_offload only rank 0 keeps the result.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.wrapped, options=options)
        if self.world.rank != 0:
            return None
        return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def apply_ddp(model: nn.Module, world: World, options: PlanOptions) -> DDPRunner:
    """Wrap ``model`` in DistributedDataParallel over the whole local world."""
    require_group("dp")
    model.to(world.device)
    device_ids = [world.device] if world.device.type == "cuda" else None
    return DDPRunner(DistributedDataParallel(model, device_ids=device_ids), world)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each block, then the root (embeddings, norm, head) over ``mesh``."""
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_fsdp(model: nn.Module, world: World, options: PlanOptions) -> FSDPRunner:
    """Shard ``model`` with FSDP2 over a 1-D mesh of the whole local world."""
    blocks(model)  # fail on an unsuitable model before any collective
    require_group("fsdp")
    model.to(world.device)
    mesh = init_device_mesh(world.device.type, (world.size,), mesh_dim_names=("dp",))
    shard_model(model, mesh)
    return FSDPRunner(model, world, world.rank, world.size)
