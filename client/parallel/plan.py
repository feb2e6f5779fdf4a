"""What every parallel plan provides, and the registry of plans by name.

A plan takes the plain model (the same weights on every rank) and the local world,
and returns a ``Runner``: the model sharded or wrapped as the plan needs, able to
take one training step on a global batch and to hand back the full, unsharded
state dict under the plain model's names, shapes and dtypes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class World:
    """This process's place in the site's local world (the default process group)."""

    rank: int
    size: int
    backend: str  # gloo | nccl
    device: torch.device

    @staticmethod
    def current() -> World:
        """The world of the initialised default process group (or a world of one)."""
        if not dist.is_available() or not dist.is_initialized():
            return World(0, 1, "none", torch.device("cpu"))
        backend = str(dist.get_backend())
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return World(dist.get_rank(), dist.get_world_size(), backend, device)


@dataclass(frozen=True)
class PlanOptions:
    tp_size: int = 0  # 2-D plans: the tensor-parallel degree (0: the whole world)
    pp_size: int = 0  # 2-D plans: the pipeline degree (0: the whole world)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b
    microbatches: int = 4


class Runner(Protocol):
    """A model with a plan applied, ready to train."""

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, for the optimiser."""
        ...

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The same parameters under the plain model's names (a pipeline stage: its own)."""
        ...

    def local_part(self, name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """What this rank's ``param`` holds of ``full``, a tensor shaped like the plain
        model's ``name``: in the parameter's own layout (a DTensor's shard, a slice of the
        experts), so that it adds to the parameter's gradient (SCAFFOLD's ``c - c_i``)."""
        ...

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        """Forward and backward on the step's *global* batch (the runner takes its slice).

        Returns this rank's loss, detached, such that the mean over the ranks that
        return one is the global batch's mean loss; None where no loss is known (a
        pipeline stage other than the last). Gradients are left in ``.grad`` ready
        for ``optimizer.step()``: averaged as one process would have them.
        """
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: every rank calls it; rank 0 gets the full CPU state dict, others None."""
        ...

    def gather(
        self, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, str]
    ) -> dict[str, torch.Tensor] | None:
        """Collective, the inverse of ``local_part``: each of this rank's ``tensors`` is
        laid out as the parameter ``owners[key]`` (an optimiser's moments; a 0-d step
        count is kept as it is); rank 0 gets them whole on the CPU, others None."""
        ...


Plan = Callable[[nn.Module, World, PlanOptions], Runner]

# name -> "module:function"; imported on first use so a plan's imports cost nothing otherwise.
PLANS: dict[str, str] = {
    "none": "fedra.client.parallel.single:apply_none",
    "dp": "fedra.client.parallel.dp:apply_ddp",
    "fsdp": "fedra.client.parallel.dp:apply_fsdp",
    "tp": "fedra.client.parallel.tp:apply_tp",
    "fsdp+tp": "fedra.client.parallel.tp:apply_fsdp_tp",
    "pp": "fedra.client.parallel.pp:apply_pp",
    "pp+dp": "fedra.client.parallel.pp:apply_pp_dp",
    "ep": "fedra.client.parallel.ep:apply_ep",
}


def get_plan(name: str) -> Plan:
    """The plan function registered as ``name``; ValueError naming the known ones."""
    target = PLANS.get(name)
    if target is None:
        raise ValueError(f"unknown parallel plan {name!r} (expected one of {', '.join(PLANS)})")
    module, _, attr = target.partition(":")
    plan: Plan = getattr(importlib.import_module(module), attr)
    return plan


def plain_part(name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """``full`` in ``param``'s layout: distributed as the DTensor parameter is (every rank
    holds ``full``: nothing is sent), or as it is for a plain parameter of its shape."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"tensor {name!r} is {tuple(full.shape)} in the plain model but this rank's "
            f"parameter is {tuple(param.shape)}"
        )
    return full


def broadcast_module(model: nn.Module, src: int = 0) -> None:
    """Make every rank's weights equal to rank ``src``'s (before a plan is applied)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src)


class SingleRunner:
    """No parallelism: the plain model in one process (also the reference for tests)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def local_part(self, name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        return plain_part(name, param, full)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        loss = loss_fn(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def gather(
        self, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, str]
    ) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}
