"""The local training loop every plan shares: same batches, same optimiser, any plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fedra.client.inner import Cancelled, InnerHooks, InnerOptimizerError, KeepState, Rebase
from fedra.client.optstate import CarriedState
from fedra.client.parallel.plan import Runner, World
from fedra.client.task import FitSettings, ParallelTask

log = logging.getLogger("fedra.site")


@dataclass(frozen=True)
class TrainStats:
    losses: list[float]  # the global batch's mean loss, per step
    seconds: float
    tokens: int
    inner: dict[str, float] = field(default_factory=dict)  # InnerHooks.metrics

    def metrics(self) -> dict[str, float]:
        return {
            "train_loss": sum(self.losses) / max(1, len(self.losses)),
            "last_loss": self.losses[-1] if self.losses else float("nan"),
            "steps": float(len(self.losses)),
            "tokens": float(self.tokens),
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "train_s": self.seconds,
            **self.inner,
        }


def train(
    runner: Runner,
    task: ParallelTask,
    data: Any,
    settings: FitSettings,
    world: World,
    corrections: Mapping[str, torch.Tensor] | None = None,
    scaffold_lr: float = 0.0,
    keep: KeepState | None = None,
    plain: Sequence[tuple[str, torch.Size, bool]] = (),
    rebase: Rebase | None = None,
    overlap: bool = False,
    buffers: Collection[str] = (),
) -> TrainStats:
    """Run the round's local steps with ``runner``; every rank of the world calls this.

    ``plain``: the plain model's parameters (name, shape, trainable), in order, as they
    were before the plan (``runner.named_parameters()`` by default: a world of one).

    ``scaffold_lr`` > 0: SCAFFOLD's ``corrections``, ``c - c_i`` for every trainable
    parameter by name, given on rank 0, go to every rank a tensor at a time, and each
    rank adds its parameters' part to their gradients before each step of plain SGD at
    ``scaffold_lr`` (``inner.InnerHooks``).

    ``keep`` (``[train] keep_optimizer_state``): the optimiser starts from ``keep.carried``,
    a state laid out as one process's over ``plain``, each rank taking its parameters'
    part; after training rank 0 gets the whole state, laid out the same way, in
    ``keep.result``. The task's optimiser must hold the runner's parameters, in order, in
    one param group (as a task's ``fit`` in one process would over the model).

    ``overlap`` (``[train] overlap``: every rank says so; rank 0 gives its ``rebase``):
    a round trained ahead, moved onto the global model at a step on every rank at once,
    or stopped (``Cancelled``) at a step on every rank at once (``WorldMove``); the
    move's part for ``buffers`` (the plain model's floating buffers) is left to the end."""
    plain = list(plain) or [(n, p.shape, p.requires_grad) for n, p in runner.named_parameters()]
    params = runner.parameters()
    by_id = _corrections(runner, corrections, plain, world) if scaffold_lr > 0 else None
    # Before the first step: w_global, for FedProx.
    hooks = InnerHooks(params, settings.proximal_mu, corrections=by_id, learning_rate=scaffold_lr)
    optimizer = task.optimizer(params, settings)
    hooks.attach(optimizer)
    if keep is not None:
        names = _agreed(lambda: _local_names(runner, optimizer), world)
        keep.used = keep.carried is not None and _load_carried(
            optimizer, runner, keep, plain, names
        )
        if world.rank != 0:
            keep.carried = None  # its part is loaded: the whole state is rank 0's to keep
    moving = overlap or rebase is not None
    mover = WorldMove(runner, plain, world, rebase, buffers) if moving else None
    steps = task.num_steps(data, settings)
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(data, settings, step)
        tokens += y.numel()
        x, y = x.to(world.device), y.to(world.device)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.train_step(x, y, task.loss)
        if mover is not None:  # where a one-process site moves: after the gradient, before the step
            mover.at_step(step)
        optimizer.step()
        losses.append(_global_mean(loss, world))
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    hooks.finish(f"{type(task).__name__} under a parallel plan")
    inner = hooks.metrics()
    if keep is not None:
        keep.result = _gather_carried(optimizer, runner, keep, plain, names, world)
        carried = keep.carried
        inner["inner_state_rounds"] = float(carried.rounds if carried and keep.used else 0)
    return TrainStats(losses, time.perf_counter() - started, tokens, inner)


class WorldMove:
    """``[train] overlap`` across a local world. Before each step of the optimiser rank 0
    asks its ``Rebase`` and tells every rank, in one broadcast, whether to go on, to stop
    (every rank raises ``Cancelled`` at the same step, so none waits in a collective), or
    to move: rank 0 then broadcasts the shift ``x_{r+1} - y_r`` a parameter at a time (no
    rank holds more of it whole than one parameter's) and each rank adds its part to the
    parameters it holds (``Runner.local_part``: a shard, a stage's layers, an expert's
    rows). A floating buffer's part rank 0 adds to the gathered state after training
    (``Rebase.late``, ``Rebase.settle``); a second name of a tied parameter moves with it."""

    GO, MOVE, STOP = 0, 1, 2

    def __init__(
        self,
        runner: Runner,
        plain: Sequence[tuple[str, torch.Size, bool]],
        world: World,
        rebase: Rebase | None,
        buffers: Collection[str] = (),
    ) -> None:
        if world.rank == 0 and rebase is None:
            raise ValueError("a round trained ahead needs rank 0's Rebase: none was given")
        self.runner, self.plain, self.world, self.rebase = runner, plain, world, rebase
        self.buffers = set(buffers)

    def at_step(self, step: int) -> None:
        """Collective, on every rank at the same step (``step`` taken so far)."""
        shift: dict[str, torch.Tensor] | None = None
        code = self.GO
        if self.rebase is not None:  # rank 0
            try:
                shift = self.rebase.poll(step)
            except Cancelled:
                code = self.STOP
            else:
                code = self.GO if shift is None else self.MOVE
        said = torch.tensor([code], dtype=torch.int64, device=self.world.device)
        if self.world.size > 1:
            dist.broadcast(said, 0)
        code = int(said.item())
        if code == self.STOP:
            raise Cancelled("the round's training is no longer wanted")
        if code == self.MOVE:
            self._move(shift)

    def _move(self, shift: dict[str, torch.Tensor] | None) -> None:
        mine = dict(self.runner.named_parameters())
        for name, shape, _ in self.plain:  # every rank, in the same order
            if shift is not None:  # rank 0; a parameter that is not floating moves by 0
                part = shift.pop(name, None)
                full = torch.zeros(shape) if part is None else part
                full = full.to(device=self.world.device, dtype=torch.float32)
            else:
                full = torch.empty(shape, dtype=torch.float32, device=self.world.device)
            if self.world.size > 1:
                dist.broadcast(full, 0)
            p = mine.get(name)
            if p is not None and p.is_floating_point():
                with torch.no_grad():
                    p.add_(self.runner.local_part(name, p, full))
        if self.rebase is not None and shift:  # buffers: added to the state at the end
            self.rebase.late = {k: v for k, v in shift.items() if k in self.buffers}


def _corrections(
    runner: Runner,
    corrections: Mapping[str, torch.Tensor] | None,
    plain: Sequence[tuple[str, torch.Size, bool]],
    world: World,
) -> dict[int, torch.Tensor]:
    """Collective: rank 0's ``c - c_i`` to every rank, one tensor at a time (a rank never
    holds more of it whole than one parameter's), each rank keeping its parameters' part,
    by parameter id."""
    if world.rank == 0 and corrections is None:
        raise ValueError("a SCAFFOLD round needs rank 0's corrections: none were given")
    mine = dict(runner.named_parameters())
    out: dict[int, torch.Tensor] = {}
    for name, shape, trainable in plain:
        if not trainable:
            continue
        if world.rank == 0:
            assert corrections is not None
            full = corrections[name].to(device=world.device, dtype=torch.float32)
        else:
            full = torch.empty(shape, dtype=torch.float32, device=world.device)
        if world.size > 1:
            dist.broadcast(full, 0)
        p = mine.get(name)
        if p is not None and p.requires_grad:
            out[id(p)] = runner.local_part(name, p, full)
    return out


def _agreed(step: Callable[[], list[str]], world: World) -> list[str]:
    """``step()``, or its InnerOptimizerError raised on every rank if any rank's raised:
    a rank that refused alone would leave the others waiting in a collective."""
    refused: InnerOptimizerError | None = None
    out: list[str] = []
    try:
        out = step()
    except InnerOptimizerError as exc:
        refused = exc
    if world.size > 1 and _any_rank(refused is not None, world) and refused is None:
        refused = InnerOptimizerError(
            "train.keep_optimizer_state: another rank of the site's local world refused "
            "the task's optimiser"
        )
    if refused is not None:
        raise refused
    return out


def _local_names(runner: Runner, optimizer: torch.optim.Optimizer) -> list[str]:
    """The plain model's name of each parameter, in the optimiser's index order, which
    must be the runner's own order (the layout one process's optimiser has)."""
    if len(optimizer.param_groups) != 1:
        raise InnerOptimizerError(
            "train.keep_optimizer_state: on a site of several processes the task's optimiser "
            f"must have one param group, it has {len(optimizer.param_groups)}"
        )
    named = runner.named_parameters()
    names = {id(p): name for name, p in named}
    held = [names.get(id(p), "") for p in optimizer.param_groups[0]["params"]]
    if held != [name for name, _ in named]:
        raise InnerOptimizerError(
            "train.keep_optimizer_state: on a site of several processes the task's optimiser "
            "must hold the model's parameters, all of them, in the model's order"
        )
    return held


def _load_carried(
    optimizer: torch.optim.Optimizer,
    runner: Runner,
    keep: KeepState,
    plain: Sequence[tuple[str, torch.Size, bool]],
    names: list[str],
) -> bool:
    """Give this rank's optimiser its parameters' part of ``keep.carried``; False (a
    fresh optimiser, with a warning) if it was another layout's."""
    carried = keep.carried
    assert carried is not None
    if carried.groups != [list(range(len(plain)))]:
        log.warning(
            "inner optimiser state of round %d does not fit this round's optimiser "
            "(param groups %s, now one of %d); starting afresh", carried.after_round,
            [len(g) for g in carried.groups], len(plain),
        )  # fmt: skip
        return False
    index = {name: i for i, (name, _, _) in enumerate(plain)}
    shapes = {name: shape for name, shape, _ in plain}
    params = dict(runner.named_parameters())
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        entries = carried.state.get(index[name])
        if entries is None:
            continue
        state[i] = {
            key: runner.local_part(name, params[name], value)
            if isinstance(value, torch.Tensor) and value.shape == shapes[name] and value.dim()
            else value
            for key, value in entries.items()
        }
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


def _gather_carried(
    optimizer: torch.optim.Optimizer,
    runner: Runner,
    keep: KeepState,
    plain: Sequence[tuple[str, torch.Size, bool]],
    names: list[str],
    world: World,
) -> CarriedState | None:
    """Collective: the optimiser's state, whole, laid out over ``plain`` (rank 0)."""
    tensors: dict[str, torch.Tensor] = {}
    owners: dict[str, str] = {}
    others: dict[str, Any] = {}
    for i, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            slot = f"{names[int(i)]}/{key}"  # parameter names hold no "/"
            if isinstance(value, torch.Tensor):
                tensors[slot], owners[slot] = value, names[int(i)]
            else:
                others[slot] = value
    if world.size > 1 and _any_rank(bool(others), world):  # every rank raises, or none
        # A pipeline's rank 0 would not hold the other stages' entries.
        raise InnerOptimizerError(
            "train.keep_optimizer_state: the task's optimiser keeps state that is not a "
            "tensor, which a site of several processes cannot gather"
        )
    whole = runner.gather(tensors, owners)
    if world.rank != 0:
        return None
    assert whole is not None
    index = {name: i for i, (name, _, _) in enumerate(plain)}
    state: dict[int, dict[str, Any]] = {}
    for slot, value in [*whole.items(), *others.items()]:
        name, _, key = slot.rpartition("/")
        state.setdefault(index[name], {})[key] = value
    carried = keep.carried
    rounds = carried.rounds + 1 if keep.used and carried is not None else 1
    return CarriedState(state, [list(range(len(plain)))], rounds, keep.round_number)


def _any_rank(flag: bool, world: World) -> bool:
    """Collective: whether ``flag`` is set on any rank of the world."""
    value = torch.tensor([float(flag)], device=world.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _global_mean(loss: torch.Tensor | None, world: World) -> float:
    """Mean over the ranks that know a loss (see ``Runner.train_step``)."""
    if world.size == 1:
        return float(loss) if loss is not None else float("nan")
    known = torch.zeros(2, dtype=torch.float64, device=world.device)
    if loss is not None:
        known[0], known[1] = loss.double(), 1.0
    dist.all_reduce(known)
    return float(known[0] / known[1])
