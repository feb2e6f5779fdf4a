"""What a site adds to a task's inner (local) optimiser, whichever task it is.

FedProx (Li et al. 2020) adds ``(mu / 2) ||w - w_global||^2`` to the local loss. Its
gradient, ``mu (w - w_global)``, is added to each parameter's gradient just before every
step of the inner optimiser: the same step as the term in the loss, for any task and any
``torch.optim`` optimiser, however the task computed the gradients (one backward or
several accumulated microbatches). The site finds the optimiser through a step pre-hook:
the trainer's own (``ParallelTask``), or, around a task's ``fit``, torch's global one,
which acts only on optimisers stepping this model's parameters.

With ``[train] scaffold`` the hook adds SCAFFOLD's correction ``c - c_i`` to each
gradient instead (``client/scaffold.py``), after checking the optimiser is plain SGD at
the run's learning rate, which option II's control update assumes.

With ``[train] keep_optimizer_state`` the same hook gives the task's optimiser, before its
first step, the state the site's previous round left (``KeepState``), and takes its state
after training, to carry to the next.

With ``[train] overlap`` a round's training starts before its global model is here, from
the site's own model; when the global model arrives the same hook moves the model onto
it before the next step (``Rebase``): the progress made so far is kept, its base
replaced. A training that is no longer wanted (the site was not sampled, the round was
retried) is stopped at its next step.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fedra.client.optstate import CarriedState

log = logging.getLogger("fedra.site")


class InnerOptimizerError(RuntimeError):
    """A task's training that the run's inner-optimiser options cannot apply to."""


@dataclass(eq=False)
class KeepState:
    """One round of a run that keeps its inner optimiser's state: what comes in (None:
    a fresh optimiser), and, after training, what goes to the next round."""

    carried: CarriedState | None
    round_number: int
    result: CarriedState | None = None
    used: bool = False  # whether ``carried`` was loaded into the task's optimiser


class Cancelled(Exception):
    """A round's training stopped at a step because it is no longer wanted."""


class Rebase:
    """``[train] overlap``: a round's training that began on the site's own model, moved
    onto the round's global model when that arrives, at the next step of the optimiser
    (before the step: its gradient was taken at the old point, one step stale).

    ``move(base, target)`` is called from another thread; the model gains
    ``target - base`` in every floating tensor of its state (parameters and buffers; a
    tensor under two names, tied weights, once). After training, ``settle`` applies a
    move that came too late for any step. A site of several processes moves through
    ``trainer.WorldMove``, which asks ``poll`` at each step, moves the parameters across
    the ranks, and leaves the buffers' part in ``late``, added by ``settle``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._shift: dict[str, torch.Tensor] | None = None
        self.late: dict[str, torch.Tensor] = {}  # moved, but added to the state only at the end
        self.moved_at_step: int | None = None  # the steps taken before it moved
        self.steps_seen = 0  # the steps the training has taken
        self.cancelled = threading.Event()
        self.done = threading.Event()  # the training ended (or was cancelled)

    def move(self, base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
        """Ask for ``target - base`` to be added; KeyError if the two do not match."""
        shift = {
            k: (target[k].detach().to(torch.float32) - v.detach().to(torch.float32))
            for k, v in base.items()
            if v.is_floating_point()
        }
        with self._lock:
            self._shift = shift

    def poll(self, steps: int) -> dict[str, torch.Tensor] | None:
        """At a step (``steps`` taken so far): Cancelled if the training is no longer
        wanted, else the move asked for since the last step (taken: it is this step's),
        or None."""
        if self.cancelled.is_set():
            raise Cancelled("the round's training is no longer wanted")
        self.steps_seen = steps + 1
        with self._lock:
            shift, self._shift = self._shift, None
        if shift is not None:
            self.moved_at_step = steps
        return shift

    def apply(self, steps: int) -> None:
        """At a step of a training in this process: move the model now if asked."""
        shift = self.poll(steps)
        if shift is None:
            return
        seen: set[int] = set()  # tied weights: one tensor under two names moves once
        with torch.no_grad():
            for name, tensor in self._model.state_dict().items():
                if name in shift and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    tensor.add_(shift[name].to(device=tensor.device, dtype=tensor.dtype))

    def pending(self) -> bool:
        with self._lock:
            return self._shift is not None

    def settle(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A trained ``state`` with what no step moved added: a move that came after the
        training ended (every step was then taken before it), and ``late``."""
        with self._lock:
            shift, self._shift = self._shift, None
        out = dict(state)
        if shift is not None:
            self.moved_at_step = self.steps_seen
        for part in (shift or {}, self.late):
            for name, add in part.items():
                t = out[name]
                out[name] = (t.to(torch.float32) + add).to(t.dtype)
        self.late = {}
        return out


class InnerHooks:
    """The site's additions to the inner optimiser of one round's training."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        proximal_mu: float = 0.0,
        keep: KeepState | None = None,
        corrections: Mapping[int, torch.Tensor] | None = None,
        learning_rate: float = 0.0,
        rebase: Rebase | None = None,
    ) -> None:
        trainable = [p for p in params if p.requires_grad]
        self.rebase = rebase
        self.proximal_mu = proximal_mu
        self.keep = keep
        # SCAFFOLD: c - c_i by parameter id, and the run's learning rate its steps must take.
        self.corrections = corrections
        self.learning_rate = learning_rate
        self._optimizers: list[torch.optim.Optimizer] = []  # those seen stepping ours
        # By identity: the global hook sees every optimiser of the process (another site's
        # too, in tests), and acts only on these parameters. The parameters are held, so
        # their ids stay theirs.
        self._params = {id(p): p for p in trainable}
        # w_global: each parameter as training starts (the global model), in its own
        # layout (a plan's sharded DTensor too), taken before the first step.
        self._anchors = {id(p): p.detach().clone() for p in trainable} if proximal_mu > 0 else {}
        self.steps = 0  # steps of an optimiser over these parameters that the hooks saw

    def before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Step pre-hook: add ``mu (w - w_global)`` to the gradients of our parameters."""
        ours = [p for group in optimizer.param_groups for p in group["params"]
                if id(p) in self._params]  # fmt: skip
        if not ours:
            return
        # args: (optimizer, *step's own arguments), as torch passes them to pre-hooks.
        if self._anchors and (args[1:] or kwargs.get("closure") is not None):
            raise InnerOptimizerError(
                "train.proximal_mu: the task's optimiser steps with a closure (it computes "
                "the gradients inside step), which the proximal term cannot be added to"
            )
        if self.rebase is not None:  # before anything else looks at the parameters
            self.rebase.apply(self.steps)
        self.steps += 1
        if self.corrections is not None:
            self._correct(optimizer, ours, args, kwargs)
        if self.keep is not None and not any(o is optimizer for o in self._optimizers):
            self._first_step(optimizer, self.keep)
        if not self._anchors:
            return
        with torch.no_grad():
            for p in ours:
                if p.grad is not None:
                    p.grad.add_(p.detach() - self._anchors[id(p)], alpha=self.proximal_mu)

    def _correct(
        self,
        optimizer: torch.optim.Optimizer,
        ours: list[torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """SCAFFOLD: refuse what option II's c_i+ does not hold for; add ``c - c_i``."""
        assert self.corrections is not None
        if args[1:] or kwargs.get("closure") is not None:
            raise InnerOptimizerError(
                "train.scaffold: the task's optimiser steps with a closure, which the "
                "control-variate correction cannot be added to"
            )
        why = _not_plain_sgd(optimizer, self.learning_rate)
        if why:
            raise InnerOptimizerError(
                f"train.scaffold: option II's control update assumes plain SGD steps at "
                f"train.learning_rate ({self.learning_rate:g}), but the task's optimiser {why}"
            )
        with torch.no_grad():
            for p in ours:
                if p.grad is not None:
                    p.grad.add_(self.corrections[id(p)])

    def _first_step(self, optimizer: torch.optim.Optimizer, keep: KeepState) -> None:
        self._optimizers.append(optimizer)
        carried = keep.carried
        if len(self._optimizers) > 1 or carried is None:
            return
        if carried.fits(optimizer):
            carried.load_into(optimizer)
            keep.used = True
        else:  # the task's model or optimiser changed shape: nothing to carry over
            log.warning(
                "inner optimiser state of round %d does not fit this round's optimiser "
                "(param groups %s, now %s); starting afresh", carried.after_round,
                [len(g) for g in carried.groups],
                [len(g["params"]) for g in optimizer.param_groups],
            )  # fmt: skip

    def finish(self, entry_point: str) -> None:
        """After training: check what the run asked for could be done; take the state."""
        if self.corrections is not None and self.steps == 0:
            raise InnerOptimizerError(
                f"train.scaffold: task {entry_point!r} stepped no torch.optim optimiser over "
                "the model's parameters, so the control variates had nowhere to go"
            )
        if self._anchors and self.steps == 0:
            raise InnerOptimizerError(
                f"train.proximal_mu: task {entry_point!r} stepped no torch.optim optimiser "
                "over the model's parameters, so the proximal term had nowhere to go (a fit "
                "that updates the weights by hand cannot take it)"
            )
        keep = self.keep
        if keep is None:
            return
        if len(self._optimizers) != 1:
            raise InnerOptimizerError(
                f"train.keep_optimizer_state: task {entry_point!r} stepped "
                f"{len(self._optimizers)} torch.optim optimisers over the model's parameters; "
                "keeping the state needs exactly one"
            )
        rounds = keep.carried.rounds + 1 if keep.used and keep.carried is not None else 1
        keep.result = CarriedState.of(self._optimizers[0], rounds, keep.round_number)

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Hook the optimiser a trainer built itself."""
        return optimizer.register_step_pre_hook(self.before_step)

    @contextmanager
    def around_fit(self, entry_point: str) -> Iterator[None]:
        """Hook whatever ``torch.optim`` optimiser the task's ``fit`` steps over the model;
        then ``finish``."""
        handle = register_optimizer_step_pre_hook(self.before_step)
        try:
            yield
        finally:
            handle.remove()
        self.finish(entry_point)

    def metrics(self) -> dict[str, float]:
        """What the site reports of them: the inner steps that took the proximal term, the
        earlier rounds the optimiser's state carried (0: fresh)."""
        out = {"proximal_steps": float(self.steps)} if self._anchors else {}
        if self.corrections is not None:
            out["scaffold_steps"] = float(self.steps)
        if self.keep is not None:
            carried = self.keep.carried
            out["inner_state_rounds"] = float(carried.rounds if carried and self.keep.used else 0)
        return out


def _not_plain_sgd(optimizer: torch.optim.Optimizer, learning_rate: float) -> str:
    """Why ``optimizer`` is not plain SGD at ``learning_rate`` ('' when it is)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return f"is {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or group.get("nesterov", False):
            return f"has momentum {group.get('momentum')}"
        lr = float(group["lr"])
        if not math.isclose(lr, learning_rate, rel_tol=1e-6):
            return f"steps at lr {lr:g} (a schedule, or another rate)"
    return ""
