"""The reference task for parallel sites: a byte-level GPT language model.

The corpus is the Python standard library's own source, present on every machine
without a download. Site ``part`` of ``num_parts`` reads every ``num_parts``-th file,
so sites see different code. The model is ``fedra.examples.gpt`` (optionally with
mixture-of-experts layers); its size comes from the run's ``[train.params]``.
"""

from __future__ import annotations

import contextlib
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fedra.client.task import FitResult, FitSettings
from fedra.config import get, require
from fedra.examples.gpt import GPT, GPTConfig, build

EVAL_BATCHES = 4
EVAL_BATCH_SIZE = 16
_INT_PARAMS = (
    "seq_len",
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "n_experts",
    "moe_every",
    "top_k",
)


def model_config(params: Mapping[str, str]) -> GPTConfig:
    """GPTConfig from the run's task params (strings), e.g. ``{"n_experts": "4"}``."""
    values: dict[str, int] = {}
    for key in _INT_PARAMS:
        if key in params:
            try:
                values[key] = int(params[key])
            except ValueError as exc:
                raise ValueError(
                    f"train.params.{key}: expected an integer, got {params[key]!r}"
                ) from exc
    try:
        return GPTConfig(**values)
    except ValueError as exc:
        raise ValueError(f"train.params: {exc}") from exc


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, in a fixed order."""
    base = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in base.rglob("*.py") if "site-packages" not in p.parts)


@dataclass(frozen=True, eq=False)
class CharLMData:
    train: torch.Tensor  # uint8 bytes
    eval: torch.Tensor


def load_corpus(part: int, num_parts: int, max_bytes: int) -> torch.Tensor:
    """Bytes of every ``num_parts``-th stdlib file starting at ``part``, up to ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    for path in corpus_files()[part::num_parts]:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


class CharLMTask:
    """Byte-level language modelling; implements ``ParallelTask``."""

    data_keys = frozenset({"part", "num_parts", "max_bytes"})

    def create_model(self, seed: int, params: Mapping[str, str]) -> GPT:
        return build(model_config(params), seed)

    def load_data(self, config: Mapping[str, Any]) -> CharLMData:
        part = get(config, "part", int, "data", 0)
        num_parts = get(config, "num_parts", int, "data", 1)
        max_bytes = get(config, "max_bytes", int, "data", 1_000_000)
        require(num_parts >= 1, "data.num_parts", "must be >= 1", num_parts)
        require(0 <= part < num_parts, "data.part", f"must be in [0, {num_parts})", part)
        require(max_bytes >= 10_000, "data.max_bytes", "must be >= 10000", max_bytes)
        text = load_corpus(part, num_parts, max_bytes)
        split = int(len(text) * 0.9)
        return CharLMData(train=text[:split], eval=text[split:])

    def num_steps(self, data: CharLMData, settings: FitSettings) -> int:
        if settings.local_steps > 0:
            return settings.local_steps
        tokens_per_step = settings.batch_size * self._seq_len(settings)
        return max(1, settings.local_epochs * len(data.train) // tokens_per_step)

    def num_samples(self, data: CharLMData) -> int:
        return len(data.train)

    def batch(
        self, data: CharLMData, settings: FitSettings, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._seq_len(settings)
        g = torch.Generator().manual_seed((settings.seed * 1_000_003 + step) % 2**63)
        return _windows(data.train, settings.batch_size, seq, g)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def optimizer(
        self, params: list[torch.nn.Parameter], settings: FitSettings
    ) -> torch.optim.Optimizer:
        """AdamW; ``[train.params] optimizer = "sgd"``: plain SGD, which SCAFFOLD needs."""
        wd = float(settings.params.get("weight_decay", "0.0"))
        kind, lr = settings.params.get("optimizer", "adamw"), settings.learning_rate
        if kind == "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=wd, foreach=False)
        if kind != "adamw":
            raise ValueError(f"train.params.optimizer: {kind!r} is not adamw or sgd")
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=False)

    def fit(self, model: torch.nn.Module, data: CharLMData, settings: FitSettings) -> FitResult:
        """Single-process training: the reference every parallel plan must match."""
        model.train()
        device = next(model.parameters()).device
        opt = self.optimizer(list(model.parameters()), settings)
        steps = self.num_steps(data, settings)
        loss_sum = torch.zeros((), device=device)  # summed on the device: no sync per step
        started = time.perf_counter()
        for step in range(steps):
            x, y = (t.to(device, non_blocking=True) for t in self.batch(data, settings, step))
            with _autocast(device, settings):
                output = model(x)
            loss = self.loss(output, y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            loss_sum += loss.detach()
        train_loss = float(loss_sum) / steps  # waits for the device to finish
        seconds = time.perf_counter() - started
        tokens = steps * settings.batch_size * self._seq_len(settings)
        metrics = {"train_loss": train_loss, "tokens": float(tokens)}
        metrics["tokens_per_s"] = tokens / max(seconds, 1e-9)
        return FitResult(num_samples=len(data.train), metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, data: CharLMData) -> dict[str, float]:
        model.eval()
        device = next(model.parameters()).device
        seq = model.cfg.seq_len if isinstance(model, GPT) else 64
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(EVAL_BATCHES):
            x, y = _windows(data.eval, EVAL_BATCH_SIZE, seq, g)
            losses.append(float(self.loss(model(x.to(device)), y.to(device))))
        model.train()
        return {"loss": sum(losses) / len(losses)}

    @staticmethod
    def _seq_len(settings: FitSettings) -> int:
        return int(settings.params.get("seq_len", GPTConfig.seq_len))


def _autocast(
    device: torch.device, settings: FitSettings
) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on CUDA unless the run's params say ``autocast = "none"``."""
    if device.type == "cuda" and settings.params.get("autocast", "bf16") == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _windows(
    text: torch.Tensor, batch: int, seq: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(seq + 1)
    window = text[idx].long()
    return window[:, :-1], window[:, 1:]


task = CharLMTask()
