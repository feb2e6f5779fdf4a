"""Pipeline parallelism (``pp``) and pipelines replicated for data parallelism (``pp+dp``).

Torchtitan's way: every rank holds the plain model, keeps only its own stage's
contiguous run of ``layers`` (deleted from the ``ModuleDict`` otherwise, so the kept
blocks keep their names), the embeddings on the first stage and ``norm``/``head`` on the
last, and runs a ``torch.distributed.pipelining`` schedule over microbatches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from fedra.client.parallel.plan import LossFn, PlanOptions, World, plain_part
from fedra.protos import codec

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
FIRST_STAGE_ONLY = ("tok_emb", "pos_emb")  # the model's attributes kept by the first stage
LAST_STAGE_ONLY = ("norm", "head")  # ... and by the last
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The contiguous layer indices of ``stage``; earlier stages take any extra layer."""
    # The last stage also runs the head and the loss, so it is the one left lighter.
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_stage(model: ModuleT, stage: int, n_stages: int) -> ModuleT:
    """Cut ``model`` down, in place, to pipeline stage ``stage`` of ``n_stages``."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("pipeline plans need the model's blocks in `layers`, an nn.ModuleDict")
    if len(layers) < n_stages:
        raise ValueError(f"{len(layers)} layers cannot be split into {n_stages} pipeline stages")
    keep = {str(i) for i in stage_layers(len(layers), n_stages, stage)}
    for name in list(layers.keys()):
        if name not in keep:
            del layers[name]
    dropped = (FIRST_STAGE_ONLY if stage > 0 else ()) + (
        LAST_STAGE_ONLY if stage < n_stages - 1 else ()
    )
    for name in dropped:
        setattr(model, name, None)  # the model's forward skips what is None
    return model


def _schedule_class(options: PlanOptions, n_stages: int) -> type[PipelineScheduleSingle]:
    """The schedule named by the options, after checking the microbatch count fits it."""
    schedule = SCHEDULES.get(options.pp_schedule)
    if schedule is None:
        raise ValueError(
            f"unknown pipeline schedule {options.pp_schedule!r} (expected one of "
            f"{', '.join(SCHEDULES)})"
        )
    if options.microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {options.microbatches}")
    if schedule is Schedule1F1B and options.microbatches < n_stages:
        raise ValueError(
            f"the 1f1b schedule needs at least as many microbatches as stages "
            f"({options.microbatches} < {n_stages})"
        )
    return schedule


class PipelineRunner:
    """One pipeline stage of one replica; replicas of a stage average their gradients."""

    def __init__(
        self,
        module: nn.Module,
        options: PlanOptions,
        world: World,
        pp_group: dist.ProcessGroup | None,
        dp_group: dist.ProcessGroup | None,
        replica0_ranks: list[int],
    ) -> None:
        self.module = module
        self.world = world
        self.microbatches = options.microbatches
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.replica0_ranks = replica0_ranks  # global ranks of replica 0's stages, in order
        n_stages = len(replica0_ranks)
        schedule = _schedule_class(options, n_stages)
        stage_index = dist.get_rank(pp_group) if pp_group is not None else world.rank
        self.stage = PipelineStage(module, stage_index, n_stages, world.device, group=pp_group)
        # The schedule sums microbatch gradients; _scaled_loss divides each microbatch's loss
        # by the count instead of relying on the schedule's own (version-dependent) scaling.
        self.schedule = schedule(
            self.stage, self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        self._loss_fn: LossFn | None = None

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())  # the stage's blocks keep their names

    def local_part(self, name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        return plain_part(name, param, full)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A microbatch's mean loss over the microbatch count: the summed grads are the mean's."""
        assert self._loss_fn is not None, "set by train_step before the schedule runs"
        return self._loss_fn(output, target) / self.microbatches

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        """Run the schedule on this replica's slice of the global batch; loss on the last stage."""
        if x.shape[0] % (self.dp_size * self.microbatches):
            raise ValueError(
                f"batch of {x.shape[0]} does not split into {self.dp_size} replica(s) x "
                f"{self.microbatches} equal microbatches"
            )
        share = x.shape[0] // self.dp_size
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        inputs = (x[rows],) if self.stage.is_first else ()
        target = y[rows] if self.stage.is_last else None
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        self._average_grads()
        if not self.stage.is_last:
            return None
        return torch.stack(losses).sum().detach()  # each term was divided by the count

    def _average_grads(self) -> None:
        """Average the stage's gradients over its replicas: one all-reduce per dtype."""
        if self.dp_group is None or self.dp_size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        used = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.int32, device=self.world.device
        )
        dist.all_reduce(used, group=self.dp_group)
        # Unused by every replica: left None, as one process would leave it. Used by some:
        # the others join with zeros so that every replica reduces the same tensors.
        params = [p for p, n in zip(params, used.tolist(), strict=True) if n]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.dtype for p in params}, key=str):
            grads = [p.grad for p in params if p.grad is not None and p.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Rank 0 gathers replica 0's stages: each sent as codec bytes in a uint8 tensor."""
        if self.world.rank == 0:
            full = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
            for src in self.replica0_ranks[1:]:
                full.update(self._receive_state(src))
            return full
        if self.world.rank in self.replica0_ranks:
            self._send_state(dst=0)
        return None

    def gather(
        self, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, str]
    ) -> dict[str, torch.Tensor] | None:
        """Rank 0 takes replica 0's stages' tensors (each stage holds its own layers')."""
        if self.world.rank == 0:
            whole = {k: v.detach().cpu().clone() for k, v in tensors.items()}
            for src in self.replica0_ranks[1:]:
                whole.update(self._receive_state(src))
            return whole
        if self.world.rank in self.replica0_ranks:
            self._send_state(dst=0, tensors=tensors)
        return None

    def _send_state(self, dst: int, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Send this stage's state (or ``tensors``) as its size, then its codec bytes (no
        pickle)."""
        source = self.module.state_dict() if tensors is None else tensors
        state = {k: v.detach().cpu() for k, v in source.items()}
        payload = torch.frombuffer(bytearray(codec.encode(state)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.send(size.to(self.world.device), dst)
        dist.send(payload.to(self.world.device), dst)

    def _receive_state(self, src: int) -> dict[str, torch.Tensor]:
        """The state dict another stage sent with ``_send_state``."""
        size = torch.zeros(1, dtype=torch.int64, device=self.world.device)
        dist.recv(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.world.device)
        dist.recv(payload, src)
        return codec.decode(payload.cpu().numpy().data)


def apply_pp(model: nn.Module, world: World, options: PlanOptions) -> PipelineRunner:
    """Pipeline parallelism: the world's ranks are the stages, in order."""
    _schedule_class(options, world.size)  # fail on bad options before cutting the model
    module = split_stage(model, world.rank, world.size).to(world.device)
    return PipelineRunner(module, options, world, None, None, list(range(world.size)))


def apply_pp_dp(model: nn.Module, world: World, options: PlanOptions) -> PipelineRunner:
    """``world.size // pp_size`` data-parallel replicas of a ``pp_size``-stage pipeline."""
    pp_size = options.pp_size or world.size
    if pp_size < 1 or world.size % pp_size:
        raise ValueError(f"pp_size {pp_size} must divide the local world of {world.size}")
    _schedule_class(options, pp_size)
    # Rank = replica * pp_size + stage: a replica's stages are neighbouring ranks.
    mesh = init_device_mesh(
        world.device.type, (world.size // pp_size, pp_size), mesh_dim_names=("dp", "pp")
    )
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    module = split_stage(model, dist.get_rank(pp_group), pp_size).to(world.device)
    replica0 = [int(r) for r in mesh.mesh[0].tolist()]
    return PipelineRunner(module, options, world, pp_group, dp_group, replica0)
