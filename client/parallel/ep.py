"""The ``ep`` plan: expert parallelism combined with data parallelism.

Rank r keeps experts [r*E/W, (r+1)*E/W) of every MoE layer and trains on its
equal slice of the global batch. Each MoE layer's ``dispatch`` becomes an
all-to-all: tokens travel to the rank owning their expert and their outputs come
back. Non-expert parameters are replicated and their gradients averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fedra.client.parallel.plan import LossFn, PlanOptions, World, plain_part
from fedra.examples.gpt import MoE, local_experts


def _all_to_all(tokens: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows ``send[s]`` go to rank s; rows ``recv[s]`` arrive from rank s, in rank order."""
    out = tokens.new_empty((sum(recv), *tokens.shape[1:]))
    dist.all_to_all_single(
        out, tokens.contiguous(), output_split_sizes=recv, input_split_sizes=send
    )
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        return _all_to_all(tokens, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_to_all(grad, ctx.recv, ctx.send), None, None


def exchange(tokens: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """The differentiable all-to-all of ``tokens`` rows (see ``_all_to_all``)."""
    return cast(torch.Tensor, _AllToAll.apply(tokens, send, recv))  # type: ignore[no-untyped-call]


def rank_splits(counts: list[int], world_size: int) -> list[int]:
    """Tokens per destination rank, from tokens per (global) expert; experts are contiguous."""
    per_rank = len(counts) // world_size
    return [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """Row order grouping arrived tokens by local expert, source ranks in order within each.

    ``received[s, j]``: rows from rank s for local expert j; they arrive source-major
    (rank 0's expert 0, rank 0's expert 1, ..., rank 1's expert 0, ...).
    """
    world_size, per_rank = received.shape
    segment = torch.arange(world_size * per_rank, device=received.device)
    row_segment = segment.repeat_interleave(received.reshape(-1))
    # Sort key: (local expert, source rank); stable, so order within a segment is kept.
    key = (row_segment % per_rank) * world_size + row_segment // per_rank
    return key.argsort(stable=True)


@dataclass
class ExchangeStats:
    """Token rows this rank's dispatcher exchanged with other ranks (not with itself)."""

    sent: int = 0
    received: int = 0


class AllToAllDispatch:
    """``MoE.dispatch`` for expert parallelism; the weights given are the local experts."""

    def __init__(self, world: World, n_experts: int) -> None:
        self.world = world
        self.n_experts = n_experts
        self.stats = ExchangeStats()

    def __call__(
        self, tokens: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        received = self._exchange_counts(counts, tokens.device)
        send, recv = rank_splits(counts, self.world.size), received.sum(dim=1).tolist()
        self._count(send, recv)
        arrived = exchange(tokens, send, recv) if self.world.size > 1 else tokens
        order = expert_major_order(received)
        done = local_experts(arrived[order], received.sum(dim=0).tolist(), w1, w2)
        back = done[order.argsort()]  # source-major again, as the rows arrived
        return exchange(back, recv, send) if self.world.size > 1 else back

    def _exchange_counts(self, counts: list[int], device: torch.device) -> torch.Tensor:
        """[W, E/W]: how many rows each rank sends this rank, per local expert."""
        if len(counts) != self.n_experts:
            raise ValueError(f"expected counts for {self.n_experts} experts, got {len(counts)}")
        mine = torch.tensor(counts, dtype=torch.int64, device=device)
        if self.world.size == 1:
            return mine.view(1, -1)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine)
        return theirs.view(self.world.size, -1)

    def _count(self, send: list[int], recv: list[int]) -> None:
        me = self.world.rank
        self.stats.sent += sum(send) - send[me]
        self.stats.received += sum(recv) - recv[me]


class EPRunner:
    """Experts sharded across ranks, everything else replicated (data parallel)."""

    def __init__(self, model: nn.Module, world: World, dispatchers: list[AllToAllDispatch]) -> None:
        self.model = model
        self.world = world
        self.dispatchers = dispatchers
        self.expert_names = sorted(_expert_names(model))
        params = dict(model.named_parameters())
        experts = set(self.expert_names)
        self._experts = [params[n] for n in self.expert_names]
        self._replicated = [p for n, p in params.items() if n not in experts]

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def gather(
        self, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, str]
    ) -> dict[str, torch.Tensor] | None:
        """An expert's tensor (its rows this rank's experts) is all-gathered, key by key
        in the same order on every rank; the replicated ones are rank 0's own."""
        experts = set(self.expert_names)
        out: dict[str, torch.Tensor] = {}
        for key in sorted(tensors):
            value = tensors[key].detach().contiguous()
            if owners[key] in experts and value.dim() > 0 and self.world.size > 1:
                parts = [torch.empty_like(value) for _ in range(self.world.size)]
                dist.all_gather(parts, value)
                value = torch.cat(parts)
            if self.world.rank == 0:
                out[key] = value.cpu().clone()
        return out if self.world.rank == 0 else None

    def local_part(self, name: str, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """An expert tensor: this rank's experts, the rows ``apply_ep`` kept."""
        if name in self.expert_names:
            per_rank = full.shape[0] // self.world.size
            full = full.narrow(0, self.world.rank * per_rank, per_rank).clone()  # not a view
        return plain_part(name, param, full)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        if x.shape[0] % self.world.size:
            raise ValueError(
                f"plan 'ep': batch size {x.shape[0]} must be divisible by "
                f"the local world size {self.world.size}"
            )
        share = x.shape[0] // self.world.size
        start = self.world.rank * share
        loss = loss_fn(self.model(x.narrow(0, start, share)), y.narrow(0, start, share))
        loss.backward()  # type: ignore[no-untyped-call]
        self._sync_grads()
        return loss.detach()

    def _sync_grads(self) -> None:
        """Make every gradient the gradient of the global batch's mean loss."""
        if self.world.size == 1:
            return
        # Each expert's grad sums all ranks' local-mean losses through the all-to-all;
        # the global mean is their average, hence 1/W.
        for p in self._experts:
            if p.grad is not None:
                p.grad.div_(self.world.size)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._replicated]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce, not one per tensor
        dist.all_reduce(flat)
        flat.div_(self.world.size)
        offset = 0
        for p in self._replicated:
            p.grad = flat.narrow(0, offset, p.numel()).view_as(p).to(p.dtype, copy=True)
            offset += p.numel()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        state = dict(self.model.state_dict())
        if self.world.size > 1:
            for name in self.expert_names:  # same order on every rank: collectives pair up
                shard = state[name].detach().contiguous()
                parts = [torch.empty_like(shard) for _ in range(self.world.size)]
                dist.all_gather(parts, shard)
                state[name] = torch.cat(parts)
        if self.world.rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in state.items()}


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def _expert_names(model: nn.Module) -> list[str]:
    return [f"{name}.{w}" for name, _ in _moe_layers(model) for w in ("w1", "w2")]


def apply_ep(model: nn.Module, world: World, options: PlanOptions) -> EPRunner:
    """Shard every MoE layer's experts across the world and install all-to-all dispatch."""
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("plan 'ep' needs a model with MoE layers (set train.params.n_experts)")
    for name, moe in layers:
        if moe.n_experts % world.size:
            raise ValueError(
                f"plan 'ep': {name} has {moe.n_experts} experts, not divisible by "
                f"the local world size {world.size}"
            )
    model.to(world.device)
    dispatchers = []
    for _, moe in layers:
        per_rank = moe.n_experts // world.size
        keep = slice(world.rank * per_rank, (world.rank + 1) * per_rank)
        moe.w1 = nn.Parameter(moe.w1.detach()[keep].clone())
        moe.w2 = nn.Parameter(moe.w2.detach()[keep].clone())
        dispatcher = AllToAllDispatch(world, moe.n_experts)
        moe.dispatch = dispatcher
        dispatchers.append(dispatcher)
    return EPRunner(model, world, dispatchers)
