"""The ``none`` plan: one process, no parallelism."""

from __future__ import annotations

from torch import nn

from fedra.client.parallel.plan import PlanOptions, SingleRunner, World


def apply_none(model: nn.Module, world: World, options: PlanOptions) -> SingleRunner:
    if world.size != 1:
        raise ValueError(f"plan 'none' runs in one process, the local world has {world.size}")
    return SingleRunner(model.to(world.device))
