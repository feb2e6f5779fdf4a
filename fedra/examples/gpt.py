"""A small GPT-style transformer with optional mixture-of-experts layers.

Written once, plainly, for every parallel plan to act on from outside (the way
torchtitan keeps ``model.py`` apart from ``parallelize.py``):

- attention works out its head count from the width of its projections, so a
  tensor-parallel plan can shard ``wq``/``wk``/``wv`` by columns and ``wo`` by rows;
- blocks live in ``layers``, an ``nn.ModuleDict`` keyed "0", "1", ..., so a pipeline
  stage that keeps some of them keeps their names, and ``tok_emb``/``pos_emb`` and
  ``norm``/``head`` may be ``None`` on stages that do not own them;
- a ``MoE`` layer computes its experts through ``self.dispatch``; the
  expert-parallel plan swaps in an all-to-all dispatcher and keeps only the local
  experts' weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# (tokens sorted by expert, tokens per expert, w1, w2) -> outputs in the same order
Dispatch = Callable[[torch.Tensor, list[int], torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes: no tokenizer to build or ship
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    n_experts: int = 0  # 0: every block has a dense MLP
    moe_every: int = 2  # with experts: blocks 1, 3, ... (every moe_every-th) are MoE
    top_k: int = 1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        for name in (
            "vocab_size",
            "seq_len",
            "d_model",
            "n_layers",
            "n_heads",
            "d_ff",
            "moe_every",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallelism

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.gelu(self.w1(x)))
        return out


def local_experts(
    tokens: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Run each expert on its contiguous run of tokens (tokens sorted by expert)."""
    outs = []
    for e, chunk in enumerate(torch.split(tokens, counts)):
        outs.append(F.gelu(chunk @ w1[e]) @ w2[e])
    return torch.cat(outs) if outs else tokens.new_zeros(0, w2.shape[-1])


class MoE(nn.Module):
    """Top-k routed experts, no capacity limit (no token is dropped)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_ff, cfg.d_model))
        self.dispatch: Dispatch = local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_experts = experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        source = order // self.top_k  # which token each sorted slot came from
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        out_sorted = self.dispatch(tokens[source], counts, self.w1, self.w2)
        out = torch.zeros_like(tokens)
        out.index_add_(0, source, out_sorted * weights.reshape(-1)[order].unsqueeze(-1))
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn: nn.Module = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.ffn(self.ln2(x))
        return out


class GPT(nn.Module):
    """Byte-level causal language model: (batch, seq) ids -> (batch, seq, vocab) logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Parameter | None = nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model))
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None and self.pos_emb is not None:
            x = self.tok_emb(x) + self.pos_emb[: x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def init_weights(model: GPT, seed: int) -> GPT:
    """Deterministic initialisation from ``seed`` alone, without touching the global RNG."""
    g = torch.Generator().manual_seed(seed)
    std = 0.02
    residual_std = std / math.sqrt(2 * model.cfg.n_layers)  # GPT-2's scaled residual init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "norm.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("wo.weight", "w2.weight", ".w2")):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
    return model


def build(cfg: GPTConfig, seed: int) -> GPT:
    return init_weights(GPT(cfg), seed)
