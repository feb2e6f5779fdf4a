"""The contract between a site and the training code it has installed.

A task is an object reachable by an entry point ``package.module:attr``. The site
imports it only if the entry point is in its own allow list; the coordinator only
ever names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from fedra.config import ConfigError


@dataclass(frozen=True)
class FitSettings:
    """What the run asks of one site's local training in one round."""

    local_steps: int  # optimiser steps; 0 means "use local_epochs"
    local_epochs: int
    batch_size: int
    learning_rate: float
    seed: int  # differs per (run, round, site): shuffling and dropout
    params: Mapping[str, str] = field(default_factory=dict)
    # FedProx's mu: the site adds mu (w - w_global) to each gradient before every step of
    # the task's torch.optim optimiser (fedra.client.inner); a task need not read it.
    proximal_mu: float = 0.0


@dataclass(frozen=True)
class FitResult:
    """The outcome of local training; the trained weights stay in the model."""

    num_samples: int  # size of the local training set: the FedAvg weight
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """Training code a site runs. Implementations must be deterministic given their seeds."""

    def create_model(self, seed: int, params: Mapping[str, str]) -> torch.nn.Module:
        """Build the model with initial weights drawn from ``seed``.

        A site may reuse the model in the run's later rounds, after ``load_state_dict``
        of the global model: state outside the state dict must not change in ``fit``."""
        ...

    def load_data(self, config: Mapping[str, Any]) -> Any:
        """Load this site's data from the site's own ``[data]`` configuration.

        A task may also say which keys it reads, as a ``data_keys`` attribute (a set of
        names): a site whose allowed tasks all say so refuses a ``[data]`` key none of
        them reads, a typo, at start. A task that does not say lets any key through.
        """
        ...

    def fit(self, model: torch.nn.Module, data: Any, settings: FitSettings) -> FitResult:
        """Train ``model`` in place on the site's training split. The site then turns
        the trained state into the update in the model's own memory (README: Writing a
        task): a model shares no tensor memory with anything used again outside it."""
        ...

    def evaluate(self, model: torch.nn.Module, data: Any) -> dict[str, float]:
        """Evaluate ``model`` on the site's held-out split (``loss``, ``accuracy``, ...)."""
        ...


@runtime_checkable
class ParallelTask(Task, Protocol):
    """A task a site may train across several local processes with a parallel plan.

    The site's trainer owns the loop: it draws the step's global batch, splits it as
    the plan requires (data-parallel ranks take equal slices of the batch dimension),
    and calls ``loss``, which must be a mean over the batch so that every plan computes
    the same gradient as one process would.
    """

    def batch(
        self, data: Any, settings: FitSettings, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global (inputs, targets) of optimiser step ``step``; deterministic."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (or microbatch)."""
        ...

    def optimizer(
        self, params: list[torch.nn.Parameter], settings: FitSettings
    ) -> torch.optim.Optimizer:
        """The local (inner) optimiser."""
        ...

    def num_steps(self, data: Any, settings: FitSettings) -> int:
        """Optimiser steps of one round: ``local_steps`` or epochs' worth."""
        ...

    def num_samples(self, data: Any) -> int:
        """Size of the local training set: the site's FedAvg weight."""
        ...


class TaskLoadError(ConfigError):
    """An entry point that cannot be imported or does not name a task."""


def load_task(entry_point: str) -> Task:
    """Import ``package.module:attr`` and check that it is a task."""
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise TaskLoadError(
            f"task entry point {entry_point!r} must look like 'package.module:attr'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskLoadError(f"cannot import task module {module_name!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise TaskLoadError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Task):
        raise TaskLoadError(
            f"{entry_point!r} is not a task: it needs create_model, load_data, fit and evaluate"
        )
    return obj
