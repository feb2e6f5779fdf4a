"""Layers the examples build with weights drawn from a generator of their own."""

from __future__ import annotations

import math

import torch
from torch import nn


class _Undrawn(nn.Linear):
    """An ``nn.Linear`` whose construction draws nothing: its caller draws the weights."""

    def reset_parameters(self) -> None:
        pass


def seeded_linear(in_features: int, out_features: int, generator: torch.Generator) -> nn.Linear:
    """An ``nn.Linear`` with its default init distribution drawn from ``generator`` only.

    Its own init neither draws from nor disturbs the global RNG. It is not built on the meta
    device: a meta init runs ``uniform_``'s Python decomposition, a torch call at a time,
    which a process hosting many sites pays for at each one's first round."""
    # dtype and device spelled out: a process's torch defaults must not change the weights.
    layer: nn.Linear = _Undrawn(in_features, out_features, dtype=torch.float32, device="cpu")
    bound = 1.0 / math.sqrt(in_features)
    with torch.no_grad():
        layer.weight.uniform_(-bound, bound, generator=generator)
        layer.bias.uniform_(-bound, bound, generator=generator)
    layer.__class__ = nn.Linear  # drawn: from here on, a plain nn.Linear in type and repr
    return layer
