"""How a site trains a task: in this process, or across its local world with a plan.

The agent (rank 0) hands an executor the global model and gets back the trained,
full, unsharded state and metrics; it never needs to know which plan ran.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fedra.client.config import ParallelConfig
from fedra.client.inner import Cancelled, InnerHooks, InnerOptimizerError, KeepState, Rebase
from fedra.client.optstate import CarriedState, from_bytes, to_bytes
from fedra.client.parallel.extract import HostStager
from fedra.client.parallel.plan import PlanOptions, World, broadcast_module, get_plan
from fedra.client.parallel.trainer import TrainStats, train
from fedra.client.scaffold import ScaffoldRound
from fedra.client.task import FitSettings, ParallelTask, Task
from fedra.client.world import ControlChannel
from fedra.faults import crash_point

log = logging.getLogger("fedra.site")


class Executor(Protocol):
    def train(
        self,
        impl: Task,
        entry_point: str,
        round_number: int,
        model: torch.nn.Module,
        data: Any,
        settings: FitSettings,
        keep: KeepState | None = None,
        scaffold: ScaffoldRound | None = None,
        rebase: Rebase | None = None,
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        """Train ``model`` (it holds the global weights): (trained state, samples, metrics).

        With ``keep``, the task's optimiser starts from ``keep.carried`` and its state after
        training is left in ``keep.result``. With ``scaffold``, every inner step is
        corrected by its ``c - c_i`` and the steps are counted in ``scaffold.steps``.
        With ``rebase`` (``[train] overlap``), ``model`` holds the site's own model and is
        moved onto the global one when it arrives, at a step; ``Cancelled`` if it is no
        longer wanted."""
        ...

    def close(self) -> None: ...


class WorldBroken(RuntimeError):
    """A rank of the local world failed mid-round: its process group is unusable."""


class LocalExecutor:
    """One process: the task's own ``fit``, on the GPU when there is one."""

    def __init__(self, device: torch.device | None = None) -> None:
        cuda = torch.cuda.is_available()
        self.device = device or torch.device("cuda" if cuda else "cpu")
        self.stager = HostStager()

    def train(
        self,
        impl: Task,
        entry_point: str,
        round_number: int,
        model: torch.nn.Module,
        data: Any,
        settings: FitSettings,
        keep: KeepState | None = None,
        scaffold: ScaffoldRound | None = None,
        rebase: Rebase | None = None,
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        model = model.to(self.device)
        corrections, lr = None, 0.0  # SCAFFOLD: c - c_i, and the rate its c_i+ assumes
        if scaffold is not None:
            corrections, lr = scaffold.corrections(model), scaffold.learning_rate
        hooks = InnerHooks(model.parameters(), settings.proximal_mu, keep, corrections, lr, rebase)
        with hooks.around_fit(entry_point):
            result = impl.fit(model, data, settings)
        if scaffold is not None:
            scaffold.steps = hooks.steps
        state = self.stager.to_host(model.state_dict())
        metrics = {**result.metrics, **hooks.metrics()}
        if self.device.type == "cuda":
            metrics["extract_gbps"] = self.stager.last_gbps
        return state, result.num_samples, metrics

    def close(self) -> None:
        pass


def plan_options(config: ParallelConfig) -> PlanOptions:
    return PlanOptions(config.tp_size, config.pp_size, config.pp_schedule, config.microbatches)


@dataclass(frozen=True)
class WorldResult:
    state: dict[str, torch.Tensor] | None  # the full trained state on rank 0, None elsewhere
    stats: TrainStats
    scatter_s: float  # global model to every rank, plan applied
    gather_s: float  # full state back on rank 0

    def metrics(self) -> dict[str, float]:
        return {**self.stats.metrics(), "scatter_s": self.scatter_s, "gather_s": self.gather_s}


def share_carried(carried: CarriedState | None, world: World) -> CarriedState | None:
    """Collective: rank 0's kept optimiser state (or its having none) on every rank, as
    the safetensors bytes it is kept in (no pickle), in two broadcasts."""
    payload = to_bytes(carried) if world.rank == 0 and carried is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=world.device)
    if world.size > 1:
        dist.broadcast(size, 0)
    if int(size.item()) == 0:
        return None
    if world.rank == 0:
        if world.size > 1:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data.to(world.device), 0)
        return carried
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=world.device)
    dist.broadcast(data, 0)
    return from_bytes(data.cpu().numpy().tobytes())


def train_in_world(
    impl: ParallelTask,
    model: torch.nn.Module,
    data: Any,
    settings: FitSettings,
    round_number: int,
    plan: str,
    options: PlanOptions,
    world: World,
    scaffold_lr: float = 0.0,
    corrections: Mapping[str, torch.Tensor] | None = None,
    keep: KeepState | None = None,
    rebase: Rebase | None = None,
    overlap: bool = False,
) -> WorldResult:
    """Every rank: take rank 0's weights, apply the plan, train, gather the full state.

    ``scaffold_lr`` > 0: a SCAFFOLD round at that learning rate, whose ``corrections``
    rank 0 gives (the other ranks receive theirs: ``trainer.train``). ``keep``: the run
    keeps its inner optimiser's state; rank 0's ``keep.carried`` goes to every rank, and rank 0's
    ``keep.result`` is the whole state after training (``trainer.train``). ``overlap``:
    a round trained ahead (rank 0 gives its ``rebase``), moved or stopped at a step on
    every rank at once; ``Cancelled`` on every rank if it is stopped."""
    started = time.perf_counter()
    model = model.to(world.device)
    broadcast_module(model)  # rank 0 holds the global model
    # The plain model's parameters, before a plan cuts or shards them: what rank 0's
    # corrections and kept state are laid out over.
    plain = [(name, p.shape, p.requires_grad) for name, p in model.named_parameters()]
    if keep is not None:
        keep.carried = share_carried(keep.carried, world)
    crash_point(f"rank{world.rank}_train", round_number)
    # [train] overlap: what of a move is not a parameter's, added to the state at the end.
    buffers = {name for name, b in model.named_buffers() if b.is_floating_point()}
    runner = get_plan(plan)(model, world, options)
    scattered = time.perf_counter()
    stats = train(
        runner, impl, data, settings, world, corrections, scaffold_lr, keep, plain, rebase,
        overlap, buffers,
    )  # fmt: skip
    trained = time.perf_counter()
    state = runner.full_state_dict()
    return WorldResult(state, stats, scattered - started, time.perf_counter() - trained)


class WorldExecutor:
    """Rank 0 of a local world: tells the other ranks what to train, then trains with them."""

    def __init__(self, config: ParallelConfig, world: World, control: ControlChannel) -> None:
        self.config, self.world, self.control = config, world, control
        # One training at a time from rank 0, whichever thread asks ([train] overlap trains
        # on a thread of its own): two would interleave their collectives.
        self._training = threading.Lock()

    def train(
        self,
        impl: Task,
        entry_point: str,
        round_number: int,
        model: torch.nn.Module,
        data: Any,
        settings: FitSettings,
        keep: KeepState | None = None,
        scaffold: ScaffoldRound | None = None,
        rebase: Rebase | None = None,
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        if not isinstance(impl, ParallelTask):
            raise TypeError(f"task {entry_point!r} does not support parallel plans")
        message: dict[str, Any] = {"cmd": "train", "entry_point": entry_point}
        message["round"] = round_number
        message["settings"] = {**asdict(settings), "params": dict(settings.params)}
        corrections, lr = None, 0.0  # SCAFFOLD: every rank takes its part of c - c_i
        if scaffold is not None:
            corrections, lr = scaffold.by_name(model), scaffold.learning_rate
            message["scaffold_lr"] = lr
        if keep is not None:  # rank 0's kept state goes to every rank before the plan
            message["keep_round"] = keep.round_number
        if rebase is not None:  # a round trained ahead: moved, or stopped, at a step
            message["overlap"] = True
        options = plan_options(self.config)
        with self._training:
            result = self._train(impl, model, data, settings, round_number, options, message,
                                 lr, corrections, keep, rebase)  # fmt: skip
        assert result.state is not None  # rank 0 receives the full state
        if scaffold is not None:
            scaffold.steps = int(result.stats.inner.get("scaffold_steps", 0))
        return result.state, impl.num_samples(data), result.metrics()

    def _train(
        self,
        impl: ParallelTask,
        model: torch.nn.Module,
        data: Any,
        settings: FitSettings,
        round_number: int,
        options: PlanOptions,
        message: dict[str, Any],
        lr: float,
        corrections: Mapping[str, torch.Tensor] | None,
        keep: KeepState | None,
        rebase: Rebase | None,
    ) -> WorldResult:
        try:
            self.control.send(message)
            return train_in_world(
                impl, model, data, settings, round_number, self.config.plan, options,
                self.world, lr, corrections, keep, rebase,
            )  # fmt: skip
        except (InnerOptimizerError, Cancelled):
            # Every rank refuses the same optimiser at its first step, or stops a round
            # trained ahead at the same step, outside any collective: the world goes on.
            raise
        except Exception as exc:  # the other ranks may be stuck in a collective: restart all
            raise WorldBroken(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self.control.send({"cmd": "stop"})


def follow(
    tasks: Mapping[str, Task],
    data: Mapping[str, Any],
    config: ParallelConfig,
    world: World,
    control: ControlChannel,
) -> None:
    """Ranks other than 0: train whatever rank 0 says until it says stop."""
    while True:
        message = control.recv()
        if message["cmd"] == "stop":
            return
        impl = tasks[message["entry_point"]]
        assert isinstance(impl, ParallelTask)
        settings = FitSettings(**message["settings"])
        model = impl.create_model(settings.seed, settings.params)
        options = plan_options(config)
        shard = data[message["entry_point"]]
        lr = float(message.get("scaffold_lr", 0.0))
        keep = KeepState(None, int(message["keep_round"])) if "keep_round" in message else None
        overlap = bool(message.get("overlap", False))
        try:
            train_in_world(
                impl, model, shard, settings, message["round"], config.plan, options, world,
                lr, None, keep, None, overlap,
            )  # fmt: skip
        except InnerOptimizerError as exc:  # rank 0 refused the same and reports it
            log.warning("rank %d: the task's training was refused: %s", world.rank, exc)
        except Cancelled:  # a round trained ahead that rank 0 no longer wants
            log.info("rank %d: the round trained ahead was dropped", world.rank)
