"""Streaming aggregation: fold updates in as they arrive, in O(model) memory.

``WeightedSum`` accumulates ``sum_i n_i * delta_i`` piece by piece from the codec's
stream, so an update is never held whole. Server optimisers then turn the mean delta
into the next global model, FedAvg being the plain step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch

from fedra.config import ConfigError
from fedra.protos.codec import TensorPiece, TensorSpec
from fedra.protos.compression import SparsePiece
from fedra.runspec import RunSpec


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 weights, fp64 for fp64 ones."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class WeightedSum:
    """Running ``sum_i n_i * delta_i`` over the floating-point tensors of a model.

    ``reuse``: sums of an earlier attempt that nothing reads any more, whose memory is
    zeroed and used again where it fits: zeroing memory in use costs a fraction of what
    fresh memory costs (the kernel's page faults, each zeroing a page)."""

    def __init__(
        self, specs: Mapping[str, TensorSpec], reuse: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self.specs = dict(specs)
        self.sums = {
            name: _zeros(spec.numel, accumulation_dtype(spec.dtype), (reuse or {}).get(name))
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


def _zeros(numel: int, dtype: torch.dtype, old: torch.Tensor | None) -> torch.Tensor:
    if old is not None and old.numel() == numel and old.dtype == dtype and old.is_contiguous():
        return old.view(-1).zero_()
    return torch.zeros(numel, dtype=dtype)


STEP_KEY = "outer_step"  # the outer steps taken, in the state of a rule that counts them


class ServerOptimizer:
    """FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad and DiLoCo: x <- x + step(mean delta),
    with state.

    The rule is the strategy's entry in ``_RULES``, looked up once. Each outer step begins
    with ``begin_step`` (``step`` calls it), then moves the model tensor by tensor or
    piece by piece (``step_piece``)."""

    def __init__(self, spec: RunSpec) -> None:
        rule = _RULES.get(spec.strategy)
        if rule is None:
            raise ConfigError(
                f"strategy.name: unknown strategy {spec.strategy!r} "
                f"(expected one of {', '.join(_RULES)})"
            )
        self.kind = spec.strategy
        self.lr = spec.strategy_param("server_lr")
        self.params = {k: spec.strategy_param(k) for k in rule.params}
        self.state: dict[str, torch.Tensor] = {}
        self._direction = rule.direction
        self._counts_steps = rule.counts_steps(self.params)
        self._t = 0  # the outer step being taken (1 for the first), if the rule counts them

    def begin_step(self) -> None:
        """Start the next outer step (before any of its ``step_piece`` calls)."""
        if self._counts_steps:
            done = self.state.get(STEP_KEY)
            self._t = (int(done) if done is not None else 0) + 1
            self.state[STEP_KEY] = torch.tensor(self._t, dtype=torch.int64)

    def step(self, model: dict[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor]) -> None:
        """Apply one outer step to ``model`` in place."""
        self.begin_step()
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
        run = slice(offset, offset + param.numel())

        def state(kind: str) -> torch.Tensor:  # the run of state tensor "<kind>.<name>"
            return self._state(f"{kind}.{name}", shape, run, delta)

        if self._counts_steps and self._t == 0:
            raise RuntimeError("step_piece before begin_step: the outer step is not counted")
        update = self._direction(self.params, state, delta, self._t)
        param.add_(update.to(param.dtype), alpha=self.lr)

    def _state(
        self, key: str, shape: torch.Size | tuple[int, ...], run: slice, like: torch.Tensor
    ) -> torch.Tensor:
        whole = self.state.get(key)
        if whole is None:
            whole = self.state[key] = torch.zeros(shape, dtype=like.dtype)
        return whole.view(-1)[run]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


# ``state(kind)``: the run of the rule's state tensor ``kind`` (momenta) matching the delta's.
_State = Callable[[str], torch.Tensor]
# A rule's step direction for a run ``d`` of the mean delta, given the strategy's parameters
# and ``t``, the outer step being taken (1 for the first; 0 for a rule that counts none).
Direction = Callable[[Mapping[str, float], _State, torch.Tensor, int], torch.Tensor]


def _fedavg(p: Mapping[str, float], state: _State, d: torch.Tensor, t: int) -> torch.Tensor:
    return d


def _fedavgm(p: Mapping[str, float], state: _State, d: torch.Tensor, t: int) -> torch.Tensor:
    # Hsu et al. 2019: v <- beta v + delta; x <- x + lr v
    m = state("m")
    m.mul_(p["momentum"]).add_(d)
    return m


def _diloco(p: Mapping[str, float], state: _State, d: torch.Tensor, t: int) -> torch.Tensor:
    # DiLoCo (Douillard et al. 2023): outer SGD with Nesterov momentum on the
    # pseudo-gradient g = global - local = -delta, as torch.optim.SGD(nesterov=True):
    # b <- mu b + g; x <- x - lr (g + mu b). With b' = -b: x <- x + lr (d + mu b').
    mu = p["momentum"]
    b = state("m")
    b.mul_(mu).add_(d)
    return d + mu * b


def _adaptive(
    second_moment: Callable[[torch.Tensor, torch.Tensor, Mapping[str, float]], None],
) -> Direction:
    """FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021, Algorithm 2), no bias correction
    as in the paper: m <- b1 m + (1-b1) d; x <- x + lr m / (sqrt(v) + tau), v by
    ``second_moment``. With ``bias_correction`` (FedAdam only), Adam's: the step is
    scaled by sqrt(1 - b2^t) / (1 - b1^t), tau staying outside, as Flower's FedAdam does
    (Kingma & Ba's alpha_t; Flower's t is its round number + 1, fedra's the outer step)."""

    def direction(p: Mapping[str, float], state: _State, d: torch.Tensor, t: int) -> torch.Tensor:
        b1, tau = p["beta1"], p["tau"]
        m, v = state("m"), state("v")
        m.mul_(b1).add_(d, alpha=1 - b1)
        second_moment(v, d * d, p)
        step = m / (v.sqrt() + tau)
        if t > 0:  # counted only with bias correction
            step.mul_(math.sqrt(1 - p["beta2"] ** t) / (1 - b1**t))
        return step

    return direction


def _adam_v(v: torch.Tensor, squared: torch.Tensor, p: Mapping[str, float]) -> None:
    v.mul_(p["beta2"]).add_(squared, alpha=1 - p["beta2"])  # v <- b2 v + (1-b2) d^2


def _yogi_v(v: torch.Tensor, squared: torch.Tensor, p: Mapping[str, float]) -> None:
    # v <- v - (1-b2) d^2 sign(v - d^2)
    v.sub_((1 - p["beta2"]) * squared * torch.sign(v - squared))


def _adagrad_v(v: torch.Tensor, squared: torch.Tensor, p: Mapping[str, float]) -> None:
    v.add_(squared)  # v <- v + d^2


def _never(params: Mapping[str, float]) -> bool:
    return False


def _if_bias_corrected(params: Mapping[str, float]) -> bool:
    return params["bias_correction"] != 0.0


class _Rule(NamedTuple):
    params: tuple[str, ...]  # the strategy parameters its direction reads
    direction: Direction
    # Whether, with these parameters, it needs the count of outer steps (kept in the state).
    counts_steps: Callable[[Mapping[str, float]], bool] = _never


_RULES: dict[str, _Rule] = {
    "fedavg": _Rule((), _fedavg),
    "fedavgm": _Rule(("momentum",), _fedavgm),
    "fedadam": _Rule(
        ("beta1", "beta2", "tau", "bias_correction"), _adaptive(_adam_v), _if_bias_corrected
    ),
    "fedyogi": _Rule(("beta1", "beta2", "tau"), _adaptive(_yogi_v)),
    "fedadagrad": _Rule(("beta1", "tau"), _adaptive(_adagrad_v)),
    "diloco": _Rule(("momentum",), _diloco),
}
