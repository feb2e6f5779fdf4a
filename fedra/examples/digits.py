"""The digits task: scikit-learn's 8x8 handwritten digits, split across sites by label skew.

Every site derives its data from one fixed global split of the 1,797 images: 80% pooled
training set, 20% pooled test set. The pooled training set is divided among sites with a
per-class Dirichlet allocation (Hsu et al., 2019), so sites see different label mixes, and
each site keeps 15% of its share as a local evaluation split. The pooled test set and
``train_centralised`` give the demo a centralised baseline to compare against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedra.client.task import FitResult, FitSettings
from fedra.config import ConfigError, get, require
from fedra.examples.layers import seeded_linear

NUM_FEATURES = 64
NUM_CLASSES = 10
TEST_FRACTION = 0.2
LOCAL_EVAL_FRACTION = 0.15
# Every site and the demo must agree on the pooled split, or a site's training data
# would leak into the pooled test set; so the sites always use this one.
POOLED_SPLIT_SEED = 0
# Two samples per site: one to train on and one to evaluate on.
MIN_PARTITION_SIZE = 2

XY = tuple[torch.Tensor, torch.Tensor]
Indices = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors has no single truth value
class DigitsData:
    """One site's data: its share of the pooled training set, split into local train / eval."""

    x_train: torch.Tensor  # float32 [n, 64], pixels in [0, 1]
    y_train: torch.Tensor  # int64 [n]
    x_eval: torch.Tensor
    y_eval: torch.Tensor


@functools.cache
def _digits_arrays() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    # scikit-learn is an optional extra; importing it here lets a coordinator or a site
    # without it still import this module and build the model.
    try:
        from sklearn.datasets import load_digits  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "the digits task needs scikit-learn: pip install 'fedra[examples]'"
        ) from exc
    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float32) / 16.0).astype(np.float32)
    y = np.asarray(digits.target, dtype=np.int64)
    # Cached and shared between callers, so nobody may change it in place.
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def pooled_split(seed: int = POOLED_SPLIT_SEED) -> tuple[XY, XY]:
    """Split all digits into a stratified 80/20 pooled (train, test) pair, each ``(x, y)``."""
    x, y = _digits_arrays()
    rng = np.random.default_rng(seed)
    train_parts: list[Indices] = []
    test_parts: list[Indices] = []
    for label in range(NUM_CLASSES):
        members = rng.permutation(np.flatnonzero(y == label))
        num_test = round(TEST_FRACTION * len(members))
        test_parts.append(members[:num_test])
        train_parts.append(members[num_test:])
    train = np.sort(np.concatenate(train_parts))
    test = np.sort(np.concatenate(test_parts))
    return _tensors(x, y, train), _tensors(x, y, test)


def _tensors(x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], rows: Indices) -> XY:
    # Fancy indexing copies, so the tensors own writable memory.
    return torch.from_numpy(x[rows]), torch.from_numpy(y[rows])


def partition(
    y_train: npt.NDArray[np.int64] | torch.Tensor,
    num_partitions: int,
    alpha: float,
    seed: int,
    *,
    min_size: int = 1,
) -> list[Indices]:
    """Divide sample indices among ``num_partitions`` sites with per-class Dirichlet(alpha) shares.

    Smaller ``alpha`` means stronger label skew. Partitions are sorted, disjoint, cover every
    index, hold at least ``min_size`` samples each, and depend only on the arguments.
    """
    labels = np.asarray(y_train, dtype=np.int64)
    if labels.ndim != 1:
        raise ValueError(f"y_train: must be 1-D, got shape {labels.shape}")
    if min_size < 1:
        raise ValueError(f"min_size: must be >= 1, got {min_size}")
    if not 1 <= num_partitions <= len(labels) // min_size:
        raise ValueError(
            f"num_partitions: must be in [1, {len(labels) // min_size}] for "
            f"{len(labels)} samples of at least {min_size} per partition, got {num_partitions}"
        )
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha: must be a finite number > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    shares: list[list[Indices]] = [[] for _ in range(num_partitions)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(num_partitions, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
        for site, piece in enumerate(np.split(members, cuts)):
            shares[site].append(piece)
    parts = [np.concatenate(pieces).astype(np.int64) for pieces in shares]
    _top_up(parts, min_size)
    return [np.sort(part) for part in parts]


def _top_up(parts: list[Indices], min_size: int) -> None:
    # Small alpha leaves some sites with (almost) nothing; moving single samples from the
    # largest site keeps the skew everywhere else and always terminates.
    while True:
        short = min(range(len(parts)), key=lambda site: len(parts[site]))
        if len(parts[short]) >= min_size:
            return
        donor = max(range(len(parts)), key=lambda site: len(parts[site]))
        parts[short] = np.append(parts[short], parts[donor][-1])
        parts[donor] = parts[donor][:-1]


def _param_int(params: Mapping[str, str], key: str, default: int) -> int:
    raw = params.get(key)
    try:
        return default if raw is None else int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"params.{key}: must be an integer, got {raw!r}") from None


def _param_float(params: Mapping[str, str], key: str, default: float) -> float:
    raw = params.get(key)
    try:
        value = default if raw is None else float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"params.{key}: must be a number, got {raw!r}") from None
    require(math.isfinite(value), f"params.{key}", "must be finite", raw)
    return value


def _check_config(config: Mapping[str, Any]) -> tuple[int, int, float, int]:
    # Unknown keys are let through: a site has one [data] table for all the tasks it serves.
    num_partitions = get(config, "num_partitions", int, "data")
    require(num_partitions >= 1, "data.num_partitions", "must be >= 1", num_partitions)
    site = get(config, "partition", int, "data")
    require(0 <= site < num_partitions, "data.partition", f"must be in [0, {num_partitions})", site)
    alpha = get(config, "alpha", float, "data", 0.5)
    require(math.isfinite(alpha) and alpha > 0, "data.alpha", "must be a finite number > 0", alpha)
    seed = get(config, "seed", int, "data", 0)
    require(seed >= 0, "data.seed", "must be >= 0", seed)
    return site, num_partitions, alpha, seed


def _local_split(x: torch.Tensor, y: torch.Tensor, seed: int, site: int) -> DigitsData:
    rng = np.random.default_rng([seed, site])
    order = torch.from_numpy(rng.permutation(len(y)))
    num_eval = min(max(round(LOCAL_EVAL_FRACTION * len(y)), 1), len(y) - 1)
    eval_rows, train_rows = order[:num_eval], order[num_eval:]
    return DigitsData(x[train_rows], y[train_rows], x[eval_rows], y[eval_rows])


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
    if num_samples < 1:
        raise ValueError("fit: the local training set is empty")
    if settings.batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {settings.batch_size}")
    if settings.local_steps > 0:
        return settings.local_steps
    if settings.local_epochs < 1:
        raise ValueError("local_steps or local_epochs: one of them must be >= 1")
    return settings.local_epochs * math.ceil(num_samples / settings.batch_size)


def _to_model_device(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> XY:
    # Data is loaded on the CPU; a site may have placed the model on an accelerator.
    device = next(model.parameters()).device
    return x.to(device), y.to(device)


def _train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: FitSettings
) -> dict[str, float]:
    """Run SGD with momentum on cross-entropy; return the mean step loss and samples seen."""
    steps = _num_steps(len(y), settings)
    momentum = _param_float(settings.params, "momentum", 0.9)
    optimiser = torch.optim.SGD(model.parameters(), lr=settings.learning_rate, momentum=momentum)
    x, y = _to_model_device(model, x, y)
    model.train()
    total_loss, seen = 0.0, 0
    for rows in _batches(len(y), settings.batch_size, steps, settings.seed):
        optimiser.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        torch.autograd.backward(loss)  # Tensor.backward is unannotated; this is the same call
        optimiser.step()
        total_loss += loss.item()
        seen += len(rows)
    return {"train_loss": total_loss / steps, "samples_seen": float(seen)}


def evaluate_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy ``loss`` and ``accuracy`` of ``model`` on ``(x, y)``."""
    if len(y) == 0:
        raise ValueError("evaluate: the evaluation set is empty")
    x, y = _to_model_device(model, x, y)
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return {"loss": loss, "accuracy": accuracy}


def sites_training_data(num_partitions: int, alpha: float, seed: int) -> XY:
    """The rows ``num_partitions`` sites of this split train on, pooled: the pooled
    training set without the share each site keeps for its own evaluation."""
    parts = [
        task.load_data({"partition": i, "num_partitions": num_partitions, "alpha": alpha,
                        "seed": seed})
        for i in range(num_partitions)
    ]  # fmt: skip
    return torch.cat([d.x_train for d in parts]), torch.cat([d.y_train for d in parts])


def train_centralised(
    seed: int,
    steps: int,
    batch_size: int,
    lr: float,
    params: Mapping[str, str],
    data: XY | None = None,
) -> nn.Module:
    """Train the task's model on ``data`` (the demo's baseline: the sites' training data
    pooled, ``sites_training_data``), by default the whole pooled training set."""
    x_train, y_train = data if data is not None else pooled_split()[0]
    model = task.create_model(seed, params)
    settings = FitSettings(
        local_steps=steps,
        local_epochs=0,
        batch_size=batch_size,
        learning_rate=lr,
        seed=seed,
        params=params,
    )
    _train(model, x_train, y_train, settings)
    return model


class DigitsTask:
    """An MLP classifying 8x8 digits, with label-skewed sites (see the module docstring)."""

    data_keys = frozenset({"partition", "num_partitions", "alpha", "seed"})

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        """An MLP 64 -> ``params["hidden"]`` (default 64) -> 10, initialised from ``seed`` only."""
        hidden = _param_int(params, "hidden", 64)
        require(hidden >= 1, "params.hidden", "must be >= 1", hidden)
        # A private generator: the same seed gives the same weights in any process.
        generator = torch.Generator().manual_seed(seed)
        return nn.Sequential(
            seeded_linear(NUM_FEATURES, hidden, generator),
            nn.ReLU(),
            seeded_linear(hidden, NUM_CLASSES, generator),
        )

    def load_data(self, config: Mapping[str, Any]) -> DigitsData:
        """This site's share; keys ``partition``, ``num_partitions``, ``alpha``=0.5, ``seed``=0."""
        site, num_partitions, alpha, seed = _check_config(config)
        (x_train, y_train), _ = pooled_split()
        most = len(y_train) // MIN_PARTITION_SIZE
        require(num_partitions <= most, "data.num_partitions", f"must be <= {most}", num_partitions)
        parts = partition(y_train, num_partitions, alpha, seed, min_size=MIN_PARTITION_SIZE)
        rows = torch.from_numpy(parts[site])
        return _local_split(x_train[rows], y_train[rows], seed, site)

    def fit(self, model: nn.Module, data: DigitsData, settings: FitSettings) -> FitResult:
        """SGD with momentum (``params["momentum"]``, default 0.9) on the local training split."""
        metrics = _train(model, data.x_train, data.y_train, settings)
        return FitResult(num_samples=len(data.y_train), metrics=metrics)

    def evaluate(self, model: nn.Module, data: DigitsData) -> dict[str, float]:
        """``loss`` and ``accuracy`` on the local evaluation split."""
        return evaluate_on(model, data.x_eval, data.y_eval)


task = DigitsTask()
