"""SCAFFOLD's site side (Karimireddy et al. 2020, Algorithm 1, option II).

Before every step of the task's inner optimiser the site adds ``c - c_i`` to each
parameter's gradient (``inner.InnerHooks``, the same step pre-hook as FedProx). After
training, with ``K`` the steps the hook saw and ``eta`` the run's learning rate:

    c_i+ = c_i - c + (x - y_i) / (K eta)        delta c_i = c_i+ - c_i

``x`` the global model, ``y_i`` the trained one. That estimate of the site's average
gradient holds for plain SGD steps of size ``eta``, so the hook refuses any other inner
optimiser (momentum, Adam, another learning rate) naming ``train.scaffold``.

``delta c_i`` travels in the update as extra tensors (``CONTROL_PREFIX``), compressed by
the run's codec; ``c_i+`` is kept in ``state_dir/scaffold-<run>.safetensors`` (two
generations, ``optstate.TwoGenerations``) once the update is accepted. Tensors that are
not trainable parameters (buffers, frozen weights) have a delta c_i of zero.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save

from fedra.client.optstate import OptimizerStateError, TwoGenerations, read_tagged

CONTROL_PREFIX = "scaffold.delta_c/"  # as the coordinator's update layout names them
_META_KEY = "fedra.scaffold"
_FORMAT = 1


class ScaffoldError(ValueError):
    """The coordinator's c does not fit the task's model."""


@dataclass(eq=False)
class SiteControls:
    """A site's control variate c_i, by parameter name, as a round left it."""

    tensors: dict[str, torch.Tensor]
    after_round: int


def to_bytes(controls: SiteControls) -> bytes:
    """The safetensors file: c_i's tensors; the round that left them in its header."""
    meta = {"format": _FORMAT, "after_round": controls.after_round}
    return save(dict(controls.tensors), metadata={_META_KEY: json.dumps(meta)})


def load_file(path: Path) -> SiteControls:
    """Read a file ``to_bytes`` wrote; OptimizerStateError if it is not one."""
    tensors, meta = read_tagged(path, _META_KEY, _FORMAT, "a SCAFFOLD control file")
    try:
        return SiteControls(tensors, int(meta["after_round"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise OptimizerStateError(f"{path}: not a SCAFFOLD control file: {exc}") from exc


class ControlStates(TwoGenerations[SiteControls]):
    """Each run's c_i, ``scaffold-<run>.safetensors`` in the site's state directory."""

    def __init__(self, state_dir: Path | None) -> None:
        super().__init__(state_dir, "scaffold", to_bytes, load_file)


@dataclass(eq=False)
class ScaffoldRound:
    """One round's SCAFFOLD at a site: c and c_i in (absent tensors are zero); after
    training, ``finish`` gives delta c_i for the update and leaves c_i+ in ``result``."""

    server: dict[str, torch.Tensor]  # c, by model tensor name
    site: dict[str, torch.Tensor]  # c_i, by parameter name
    learning_rate: float
    round_number: int
    from_round: int = 0  # the round whose c_i+ ``site`` is (0: none, c_i is zero)
    steps: int = 0  # K: the inner steps the hook corrected
    param_names: list[str] = field(default_factory=list)
    result: SiteControls | None = None

    def check(self, global_state: Mapping[str, torch.Tensor]) -> None:
        """ScaffoldError unless every tensor of c is a floating tensor of the model."""
        for name, c in self.server.items():
            g = global_state.get(name)
            if g is None or not g.is_floating_point() or tuple(g.shape) != tuple(c.shape):
                raise ScaffoldError(
                    f"train.scaffold: the coordinator's control variate has tensor {name!r} "
                    f"of shape {tuple(c.shape)}, which the model does not have"
                )

    def by_name(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``c - c_i`` in float32 on the CPU for each trainable parameter of the plain
        ``model``, by name (a site's local world shares these and each rank takes its
        parameters' part: ``Runner.local_part``)."""
        out: dict[str, torch.Tensor] = {}
        self.param_names = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            self.param_names.append(name)
            term = torch.zeros(p.shape, dtype=torch.float32)
            if name in self.server:
                term += self.server[name].float()
            if name in self.site:
                term -= self.site[name].float()
            out[name] = term
        return out

    def corrections(self, model: torch.nn.Module) -> dict[int, torch.Tensor]:
        """``c - c_i`` for each trainable parameter, by its id, on its device and dtype."""
        params = dict(model.named_parameters())
        return {
            id(params[name]): term.to(device=params[name].device, dtype=params[name].dtype)
            for name, term in self.by_name(model).items()
        }

    def finish(self, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """delta c_i under ``CONTROL_PREFIX`` for every floating tensor of ``update``
        (``y_i - x``); c_i+ left in ``result``."""
        if self.steps <= 0:
            raise ScaffoldError("train.scaffold: no inner step was taken")
        scale = 1.0 / (self.steps * self.learning_rate)
        trained = set(self.param_names)
        out: dict[str, torch.Tensor] = {}
        kept: dict[str, torch.Tensor] = {}
        for name, d in update.items():
            if not d.is_floating_point():
                continue
            if name not in trained:
                out[CONTROL_PREFIX + name] = torch.zeros_like(d)
                continue
            c = self._get(self.server, name, d)
            c_i = self._get(self.site, name, d)
            # delta c_i = -c + (x - y_i) / (K eta); c_i+ = c_i + delta c_i
            delta_c = (-c).sub_(d.detach().to(torch.float32), alpha=scale)
            kept[name] = (c_i + delta_c).contiguous()
            out[CONTROL_PREFIX + name] = delta_c.to(d.dtype)
        self.result = SiteControls(kept, self.round_number)
        return out

    @staticmethod
    def _get(controls: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        found = controls.get(name)
        if found is None:
            return torch.zeros(like.shape, dtype=torch.float32)
        return found.detach().to("cpu", torch.float32)
