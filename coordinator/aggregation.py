"""Streaming aggregation: fold updates in as they arrive, in O(model) memory.

``WeightedSum`` accumulates ``sum_i n_i * delta_i`` piece by piece from the codec's
stream, so an update is never held whole. Server optimisers then turn the mean delta
into the next global model, FedAvg being the plain step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fedra.protos.codec import TensorPiece, TensorSpec
from fedra.protos.compression import SparsePiece
from fedra.runspec import RunSpec


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 weights, fp64 for fp64 ones."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class WeightedSum:
    """Running ``sum_i n_i * delta_i`` over the floating-point tensors of a model."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self.specs = dict(specs)
        self.sums = {
            name: torch.zeros(spec.numel, dtype=accumulation_dtype(spec.dtype))
            for name, spec in specs.items()
            if spec.dtype.is_floating_point
        }
        self.total_weight = 0.0
        self.count = 0

    def add_pieces(self, pieces: Iterable[TensorPiece | SparsePiece], weight: float) -> None:
        """Fold pieces of one update (dense runs, or top-k entries) in with ``weight``.

        Pieces are only read: they may be views of the spooled bytes, and none is held
        while the next is made (a view keeps its whole block alive)."""
        for piece in pieces:
            self._add(piece, weight)
            del piece

    def _add(self, piece: TensorPiece | SparsePiece, weight: float) -> None:
        acc = self.sums.get(piece.name)
        if acc is None:  # integer buffers are not averaged; they keep the global value
            return
        if isinstance(piece, SparsePiece):
            acc.index_add_(0, piece.indices, piece.values.to(acc.dtype), alpha=weight)
            return
        end = piece.offset + piece.values.numel()
        acc[piece.offset : end].add_(piece.values.to(acc.dtype), alpha=weight)

    def finish_update(self, weight: float) -> None:
        """Count one complete update of ``weight`` (call after all its pieces)."""
        self.total_weight += weight
        self.count += 1

    def mean(self, denominator: float | None = None) -> dict[str, torch.Tensor]:
        """The weighted mean delta, shaped like the model (computed in place).

        ``denominator`` replaces the total weight (DP-FedAvg divides by a fixed count).
        """
        total = self.total_weight if denominator is None else denominator
        if total <= 0:
            raise ValueError("no updates to average")
        out = {}
        for name, acc in self.sums.items():
            acc.div_(total)
            out[name] = acc.view(self.specs[name].shape)
        return out


class ServerOptimizer:
    """FedAvg, FedAvgM, FedAdam, FedYogi and DiLoCo: x <- x + step(mean delta), with state."""

    def __init__(self, spec: RunSpec) -> None:
        self.kind = spec.strategy
        self.lr = spec.strategy_param("server_lr")
        self.params = {k: spec.strategy_param(k) for k in _STATE_PARAMS[self.kind]}
        self.state: dict[str, torch.Tensor] = {}

    def step(self, model: dict[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor]) -> None:
        """Apply one outer step to ``model`` in place."""
        for name, delta in mean_delta.items():
            param = model[name]
            self.step_piece(name, param.shape, 0, param.view(-1), delta.reshape(-1))

    def step_piece(
        self,
        name: str,
        shape: torch.Size | tuple[int, ...],
        offset: int,
        param: torch.Tensor,
        delta: torch.Tensor,
    ) -> None:
        """Apply the step to elements ``offset ..`` of tensor ``name`` (of ``shape``): the
        flat run ``param`` moves in place by the matching run ``delta`` of the mean update.
        Every rule is elementwise, so a model streamed through in pieces gets the same step;
        the state (momenta) is kept whole, shaped like the tensor."""
        update = self._direction(name, shape, slice(offset, offset + param.numel()), delta)
        param.add_(update.to(param.dtype), alpha=self.lr)

    def _state(
        self, key: str, shape: torch.Size | tuple[int, ...], run: slice, like: torch.Tensor
    ) -> torch.Tensor:
        whole = self.state.get(key)
        if whole is None:
            whole = self.state[key] = torch.zeros(shape, dtype=like.dtype)
        return whole.view(-1)[run]

    def _direction(
        self, name: str, shape: torch.Size | tuple[int, ...], run: slice, delta: torch.Tensor
    ) -> torch.Tensor:
        if self.kind == "fedavg":
            return delta
        if self.kind == "fedavgm":
            # Hsu et al. 2019: v <- beta v + delta; x <- x + lr v
            m = self._state(f"m.{name}", shape, run, delta)
            m.mul_(self.params["momentum"]).add_(delta)
            return m
        if self.kind == "diloco":
            # DiLoCo (Douillard et al. 2023): outer SGD with Nesterov momentum on the
            # pseudo-gradient g = global - local = -delta, as torch.optim.SGD(nesterov=True):
            # b <- mu b + g; x <- x - lr (g + mu b). With b' = -b: x <- x + lr (d + mu b').
            mu = self.params["momentum"]
            b = self._state(f"m.{name}", shape, run, delta)
            b.mul_(mu).add_(delta)
            return delta + mu * b
        # FedAdam / FedYogi (Reddi et al. 2021), no bias correction as in the paper:
        # m <- b1 m + (1-b1) d; x <- x + lr m / (sqrt(v) + tau), with
        # Adam: v <- b2 v + (1-b2) d^2;  Yogi: v <- v - (1-b2) d^2 sign(v - d^2)
        b1, b2, tau = self.params["beta1"], self.params["beta2"], self.params["tau"]
        m = self._state(f"m.{name}", shape, run, delta)
        v = self._state(f"v.{name}", shape, run, delta)
        m.mul_(b1).add_(delta, alpha=1 - b1)
        squared = delta * delta
        if self.kind == "fedyogi":
            v.sub_((1 - b2) * squared * torch.sign(v - squared))
        else:
            v.mul_(b2).add_(squared, alpha=1 - b2)
        return m / (v.sqrt() + tau)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


_STATE_PARAMS = {
    "fedavg": (),
    "fedavgm": ("momentum",),
    "fedadam": ("beta1", "beta2", "tau"),
    "fedyogi": ("beta1", "beta2", "tau"),
    "diloco": ("momentum",),
}
