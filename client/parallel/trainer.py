"""The local training loop every plan shares: same batches, same optimiser, any plan."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fedra.client.inner import InnerHooks
from fedra.client.parallel.plan import Runner, World
from fedra.client.task import FitSettings, ParallelTask


@dataclass(frozen=True)
class TrainStats:
    losses: list[float]  # the global batch's mean loss, per step
    seconds: float
    tokens: int
    inner: dict[str, float] = field(default_factory=dict)  # InnerHooks.metrics

    def metrics(self) -> dict[str, float]:
        return {
            "train_loss": sum(self.losses) / max(1, len(self.losses)),
            "last_loss": self.losses[-1] if self.losses else float("nan"),
            "steps": float(len(self.losses)),
            "tokens": float(self.tokens),
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "train_s": self.seconds,
            **self.inner,
        }


def train(
    runner: Runner,
    task: ParallelTask,
    data: Any,
    settings: FitSettings,
    world: World,
    corrections: Mapping[str, torch.Tensor] | None = None,
    scaffold_lr: float = 0.0,
) -> TrainStats:
    """Run the round's local steps with ``runner``; every rank of the world calls this.

    ``corrections``: SCAFFOLD's ``c - c_i`` for every trainable parameter of the plain
    model, by name, on every rank; each rank adds its parameters' part to their gradients
    before each step of plain SGD at ``scaffold_lr`` (``inner.InnerHooks``)."""
    params = runner.parameters()
    by_id = None
    if corrections is not None:
        by_id = {
            id(p): runner.local_part(name, p, corrections[name])
            for name, p in runner.named_parameters()
            if p.requires_grad
        }
    # Before the first step: w_global, for FedProx.
    hooks = InnerHooks(params, settings.proximal_mu, corrections=by_id, learning_rate=scaffold_lr)
    optimizer = task.optimizer(params, settings)
    hooks.attach(optimizer)
    steps = task.num_steps(data, settings)
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(data, settings, step)
        tokens += y.numel()
        x, y = x.to(world.device), y.to(world.device)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.train_step(x, y, task.loss)
        optimizer.step()
        losses.append(_global_mean(loss, world))
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    hooks.finish(f"{type(task).__name__} under a parallel plan")
    return TrainStats(losses, time.perf_counter() - started, tokens, hooks.metrics())


def _global_mean(loss: torch.Tensor | None, world: World) -> float:
    """Mean over the ranks that know a loss (see ``Runner.train_step``)."""
    if world.size == 1:
        return float(loss) if loss is not None else float("nan")
    known = torch.zeros(2, dtype=torch.float64, device=world.device)
    if loss is not None:
        known[0], known[1] = loss.double(), 1.0
    dist.all_reduce(known)
    return float(known[0] / known[1])
