"""SCAFFOLD's coordinator side (Karimireddy et al. 2020, Algorithm 1, option II).

The server control variate ``c`` has one tensor per floating-point tensor of the model.
It lives in the server optimiser's state under ``STATE_PREFIX`` (so the checkpoint,
a restart and a promotion rollback carry it like momenta), and is published to the
sites as a blob of its own, named like the model's tensors. Each site's update carries
its ``delta c_i`` beside the model delta, as extra tensors under ``CONTROL_PREFIX``
compressed by the run's codec; the run's update layout (``update_specs``) names exactly
those, so the upload checks refuse anything else. Once a round's updates are in,
``c <- c + (|S| / N) mean_i(delta c_i)``, the unweighted mean over the accepted sites.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedra.coordinator.aggregation import accumulation_dtype
from fedra.coordinator.errors import InvalidArgument
from fedra.protos.codec import TensorSpec

CONTROL_PREFIX = "scaffold.delta_c/"  # a site's delta c_i for tensor <name>, in its update
STATE_PREFIX = "scaffold.c/"  # the server's c for tensor <name>, in the optimiser's state


def control_specs(model: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The delta c_i tensors an update carries: one per floating-point model tensor."""
    return {
        CONTROL_PREFIX + name: spec for name, spec in model.items() if spec.dtype.is_floating_point
    }


def update_specs(model: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """A SCAFFOLD update's layout: the model's tensors and their delta c_i."""
    clash = [name for name in model if name.startswith(CONTROL_PREFIX)]
    if clash:  # never let a model tensor pass for a control (nor the reverse): refused
        raise InvalidArgument(
            f"train.scaffold: model tensor {clash[0]!r} uses SCAFFOLD's prefix "
            f"{CONTROL_PREFIX!r}; rename it to run with train.scaffold"
        )
    return {**model, **control_specs(model)}


def split(
    mean: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model's mean delta, the mean delta c_i by model tensor name)."""
    model, controls = {}, {}
    for name, tensor in mean.items():
        if name.startswith(CONTROL_PREFIX):
            controls[name[len(CONTROL_PREFIX) :]] = tensor
        else:
            model[name] = tensor
    return model, controls


def absorb(
    state: dict[str, torch.Tensor],
    mean_delta_c: Mapping[str, torch.Tensor],
    accepted: int,
    population: int,
) -> None:
    """``c += (accepted / population) * mean delta c_i``, in ``state`` (in place)."""
    fraction = accepted / population
    for name, d in mean_delta_c.items():
        key = STATE_PREFIX + name
        c = state.get(key)
        if c is None:
            c = state[key] = torch.zeros(d.shape, dtype=accumulation_dtype(d.dtype))
        c.add_(d.to(c.dtype), alpha=fraction)


def controls_of(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The server's c, by model tensor name (empty before the first training round)."""
    return {k[len(STATE_PREFIX) :]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
