"""``[train] overlap``: a site trains its next round while its update uploads.

DiLoCo with frequent synchronisation spends much of a slow link's time idle: the site
uploads, the coordinator waits for every site and commits, the site downloads, and only
then trains again. With overlap, once a round's training ends the site starts the next
round's at once, from its own trained model (``y_r``), on a thread of its own, while the
main thread uploads, polls and downloads. When the next round's task and global model
``x_{r+1}`` arrive, the training is moved onto it at its next inner step
(``inner.Rebase``: every weight gains ``x_{r+1} - y_r``), keeping the progress made so
far, and finishes its steps; the update it sends is, as always, its model minus
``x_{r+1}``. The steps taken before the move computed their gradients at points built
on ``y_r`` instead of ``x_{r+1}``: the outer update those steps see is one round late,
as in streaming and eager variants of DiLoCo.

A round trained ahead is used only for the task it was trained for: the same run, the
next round, the same training settings. Another task (the site was not sampled, a round
was retried, the run ended) cancels it at its next step, and the task trains as usual.
Nothing of it is kept on disk: a site that restarts trains its next task as usual.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from fedra.client.connection import Assignment
from fedra.client.inner import Cancelled, KeepState, Rebase
from fedra.runspec import TrainSpec

Trained = tuple[dict[str, torch.Tensor], int, dict[str, float]]  # state, samples, metrics
Fit = Callable[[torch.nn.Module, KeepState | None, Rebase], Trained]


@dataclass(eq=False)
class Ahead:
    """The next round of a run, training on a thread from the site's own model."""

    run_id: str
    round_number: int  # the round it trains for
    train: TrainSpec  # the settings it was started with
    base: dict[str, torch.Tensor]  # the model it started from: the site's last trained one
    rebase: Rebase
    keep: KeepState | None
    _thread: threading.Thread | None = None
    _result: Trained | None = None
    _error: BaseException | None = None
    fit_s: float = 0.0  # how long its training took
    started_at: float = field(default_factory=time.monotonic)

    @staticmethod
    def start(
        task: Assignment,
        trained: Mapping[str, torch.Tensor],
        model: torch.nn.Module,
        keep: KeepState | None,
        fit: Fit,
    ) -> Ahead:
        """Train round ``task.round + 1`` of ``task``'s run on ``model`` (which holds
        ``trained``, the site's model after ``task``) with ``fit``."""
        base = {k: v.detach().clone() for k, v in trained.items()}
        ahead = Ahead(task.run_id, task.round + 1, task.train, base, Rebase(model), keep)
        ahead._thread = threading.Thread(
            target=ahead._run, args=(model, fit), name=f"ahead-{task.run_id}", daemon=True
        )
        ahead._thread.start()
        return ahead

    def _run(self, model: torch.nn.Module, fit: Fit) -> None:
        started = time.monotonic()
        try:
            self._result = fit(model, self.keep, self.rebase)
        except Cancelled:
            pass
        except BaseException as exc:  # handed to whoever takes the result
            self._error = exc
        finally:
            self.fit_s = time.monotonic() - started
            self.rebase.done.set()

    def matches(self, task: Assignment) -> bool:
        """Whether ``task`` is the one this training is for."""
        return (
            not task.init
            and task.run_id == self.run_id
            and task.round == self.round_number
            and task.train == self.train
        )

    def cancel(self) -> BaseException | None:
        """Stop it at its next step, and wait for it: the error it ended with, if any
        (a local world that broke meanwhile must still be restarted)."""
        self.rebase.cancelled.set()
        if self._thread is not None:
            self._thread.join()
        return self._error

    def finish(self, global_state: Mapping[str, torch.Tensor]) -> Trained:
        """Move it onto the round's global model and wait for it to end: (trained state,
        samples, metrics), as the executor gives them. ``overlap_moved_at_step``: the
        inner step before which it moved (its total when it had ended already). A global
        model that does not fit it stops it first (the error is raised)."""
        try:
            self.rebase.move(self.base, global_state)
        except BaseException:
            self.cancel()
            raise
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None, "a training that was not cancelled gives a result"
        state, num_samples, metrics = self._result
        state = self.rebase.settle(state)  # it ended first: every step was taken ahead
        steps = self.rebase.moved_at_step
        metrics = {**metrics, "overlap_moved_at_step": float(-1 if steps is None else steps)}
        return state, num_samples, metrics
