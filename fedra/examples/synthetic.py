"""The synthetic task, for tests and benchmarks: linear regression plus an optional big block.

Every site fits the same true weights w* (drawn from a fixed seed) on inputs x ~ N(shift, 1)
drawn from its own ``seed``, so learning is real but instant. The model's optional ``extra``
parameter exists only to make the model big for transfer and aggregation benchmarks; it takes
no part in the forward pass and gets a cheap deterministic update in ``fit``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedra.client.task import FitResult, FitSettings
from fedra.config import ConfigError, get, require
from fedra.examples.layers import seeded_linear

TRUE_WEIGHT_SEED = 1234
NOISE_STD = 0.01
EVAL_SAMPLES = 64
EXTRA_INIT_STD = 0.01
EXTRA_DECAY = 1e-3  # per step, times the learning rate


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors has no single truth value
class SyntheticData:
    """One site's regression data and its test aids ``fit_delay_s`` and ``harm``."""

    x_train: torch.Tensor  # float32 [samples, dim]
    y_train: torch.Tensor  # float32 [samples]
    x_eval: torch.Tensor  # float32 [64, dim]
    y_eval: torch.Tensor
    fit_delay_s: float
    harm: float = 0.0  # > 0: a harmful site, its trained weights pushed off by this much


class SyntheticModel(nn.Module):
    """``nn.Linear(dim, 1)`` plus, when ``extra_params > 0``, a 1-D float32 ``extra`` parameter."""

    def __init__(self, dim: int, extra_params: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear = seeded_linear(dim, 1, generator)
        self.extra: nn.Parameter | None = None
        if extra_params > 0:
            # Random, not zero, so the decay in fit gives codecs a varied delta. Frozen to
            # autograd: it is unused in forward, which DistributedDataParallel rejects.
            values = torch.empty(extra_params, dtype=torch.float32, device="cpu")
            values.normal_(0.0, EXTRA_INIT_STD, generator=generator)
            self.extra = nn.Parameter(values, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predictions of shape ``[n]`` for inputs ``[n, dim]``."""
        out: torch.Tensor = self.linear(x)
        return out.squeeze(-1)


def _param_int(params: Mapping[str, str], key: str, default: int, minimum: int) -> int:
    raw = params.get(key)
    try:
        value = default if raw is None else int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"params.{key}: must be an integer, got {raw!r}") from None
    require(value >= minimum, f"params.{key}", f"must be >= {minimum}", value)
    return value


def _check_config(config: Mapping[str, Any]) -> tuple[int, int, float, int, float]:
    # Unknown keys are let through: a site has one [data] table for all the tasks it serves.
    dim = get(config, "dim", int, "data", 8)
    require(dim > 0, "data.dim", "must be > 0", dim)
    samples = get(config, "samples", int, "data", 256)
    require(samples > 0, "data.samples", "must be > 0", samples)
    shift = get(config, "shift", float, "data", 0.0)
    require(math.isfinite(shift), "data.shift", "must be finite", shift)
    seed = get(config, "seed", int, "data", 0)
    require(seed >= 0, "data.seed", "must be >= 0", seed)
    fit_delay_s = get(config, "fit_delay_s", float, "data", 0.0)
    require(0 <= fit_delay_s < math.inf, "data.fit_delay_s", "must be finite and >= 0", fit_delay_s)
    return dim, samples, shift, seed, fit_delay_s


def true_weights(dim: int) -> torch.Tensor:
    """The weights w* every site's data is drawn from (no bias)."""
    return torch.randn(dim, generator=torch.Generator().manual_seed(TRUE_WEIGHT_SEED))


def _batches(num_samples: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Yield ``steps`` mini-batches of row indices, reshuffling at every pass over the data."""
    generator = torch.Generator().manual_seed(seed)
    taken = 0
    while True:
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples, batch_size):
            if taken == steps:
                return
            yield order[start : start + batch_size]
            taken += 1


def _num_steps(num_samples: int, settings: FitSettings) -> int:
    if settings.batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {settings.batch_size}")
    if settings.local_steps > 0:
        return settings.local_steps
    if settings.local_epochs < 1:
        raise ValueError("local_steps or local_epochs: one of them must be >= 1")
    return settings.local_epochs * math.ceil(num_samples / settings.batch_size)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Data is loaded on the CPU; a site may have placed the model on an accelerator.
    device = next(model.parameters()).device
    return nn.functional.mse_loss(model(x.to(device)), y.to(device))


def _decay_extra(model: nn.Module, factor: float) -> None:
    # Matched by name rather than attribute so that a wrapped model (``module.extra``) works.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "extra":
                param.mul_(factor)


class SyntheticTask:
    """Linear regression on synthetic sites (see the module docstring)."""

    data_keys = frozenset({"dim", "samples", "shift", "seed", "fit_delay_s", "harm"})

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        """A model sized by ``params`` ``dim`` (8) and ``extra_params`` (0), drawn from ``seed``."""
        dim = _param_int(params, "dim", 8, minimum=1)
        extra_params = _param_int(params, "extra_params", 0, minimum=0)
        return SyntheticModel(dim, extra_params, seed)

    def load_data(self, config: Mapping[str, Any]) -> SyntheticData:
        """Keys ``dim`` (8, must match the model), ``samples`` (256), ``shift`` (0.0), ``seed`` (0).

        ``fit_delay_s`` (0.0) is a test aid: ``fit`` sleeps that long first, making a slow site;
        so is ``harm`` (0.0): ``fit`` then adds that much Gaussian noise to every trained
        weight, making a site whose updates make the global model worse.
        """
        dim, samples, shift, seed, fit_delay_s = _check_config(config)
        harm = get(config, "harm", float, "data", 0.0)
        require(0 <= harm < math.inf, "data.harm", "must be finite and >= 0", harm)
        generator = torch.Generator().manual_seed(seed)
        total = samples + EVAL_SAMPLES
        x = torch.randn(total, dim, generator=generator) + shift
        y = x @ true_weights(dim) + NOISE_STD * torch.randn(total, generator=generator)
        return SyntheticData(x[:samples], y[:samples], x[samples:], y[samples:], fit_delay_s, harm)

    def fit(self, model: nn.Module, data: SyntheticData, settings: FitSettings) -> FitResult:
        """Plain SGD on mean squared error; ``extra`` decays by ``lr * 1e-3`` per step."""
        time.sleep(data.fit_delay_s)
        num_samples = len(data.y_train)
        steps = _num_steps(num_samples, settings)
        trainable = [param for param in model.parameters() if param.requires_grad]
        model.train()
        total_loss, seen = 0.0, 0
        for rows in _batches(num_samples, settings.batch_size, steps, settings.seed):
            loss = _mse(model, data.x_train[rows], data.y_train[rows])
            grads = torch.autograd.grad(loss, trainable)
            # SGD by hand: torch.optim's first use imports torch._dynamo (~1 s per process).
            with torch.no_grad():
                for param, grad in zip(trainable, grads, strict=True):
                    param.sub_(grad, alpha=settings.learning_rate)
            total_loss += loss.item()
            seen += len(rows)
        # One O(n) pass, equal to decaying at every step.
        _decay_extra(model, (1.0 - settings.learning_rate * EXTRA_DECAY) ** steps)
        if data.harm > 0:  # a harmful site (test aid): its update pushes the model off
            noise = torch.Generator().manual_seed(settings.seed)
            with torch.no_grad():
                for param in trainable:
                    harm = torch.randn(param.shape, generator=noise).to(param.device)
                    param.add_(data.harm * harm)
        metrics = {"train_loss": total_loss / steps, "samples_seen": float(seen)}
        return FitResult(num_samples=num_samples, metrics=metrics)

    def evaluate(self, model: nn.Module, data: SyntheticData) -> dict[str, float]:
        """Mean squared error ``loss`` on the site's 64 held-out samples."""
        model.eval()
        with torch.no_grad():
            return {"loss": _mse(model, data.x_eval, data.y_eval).item()}


task = SyntheticTask()
