"""In-memory state of the runs the coordinator is driving. The database is the truth;
this is what can be rebuilt from it at any time (see ``recovery``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from fedra.accounting import Accountant
from fedra.coordinator.aggregation import ServerOptimizer, WeightedSum
from fedra.coordinator.aggregators import Aggregator, StreamingMean, make_aggregator
from fedra.coordinator.promotion import PromotionState
from fedra.protos.codec import TensorSpec
from fedra.runspec import CodecSpec, RunSpec
from fedra.storage.records import ParticipationState

if TYPE_CHECKING:
    from fedra.coordinator.engine.secure import SecureRound

INIT_ROUND = 0
# The ledger event that closes a failed attempt (its data names the attempt).
ATTEMPT_FAILED = "attempt_failed"


# A task a site's policy declined is stored failed with its reason after this: run status
# shows it as "declined", not as a failure. The site is not sampled again for the run
# for EngineSettings.decline_hold_s (an operator may approve the run, or its hours come),
# and an attempt lost only to declines does not count towards max_round_attempts.


class TaskState(str, Enum):
    """Where a site's task of an open round stands, in memory. Equal to its stored state
    (``storage.records.ParticipationState``) but for uploading, which is never stored:
    an upload that a crash cut off leaves the task as it was before."""

    ASSIGNED = "assigned"  # handed to the site (or about to be, at its next poll)
    DOWNLOADED = "downloaded"  # the site has the model
    UPLOADING = "uploading"  # its update is arriving
    ACCEPTED = "accepted"  # its update is durable and counts
    FAILED = "failed"  # it will not count: reported, silent, late, stale, or left out

    def __str__(self) -> str:
        return self.value


# Every move a task may make, in one place; anything else is a bug, refused loudly.
_MOVES: dict[TaskState, frozenset[TaskState]] = {
    TaskState.ASSIGNED: frozenset({TaskState.DOWNLOADED, TaskState.UPLOADING, TaskState.FAILED}),
    TaskState.DOWNLOADED: frozenset({TaskState.UPLOADING, TaskState.FAILED}),
    # An upload that ends early gives the task back as it was (before_upload).
    TaskState.UPLOADING: frozenset(
        {TaskState.ASSIGNED, TaskState.DOWNLOADED, TaskState.ACCEPTED, TaskState.FAILED}
    ),
    TaskState.ACCEPTED: frozenset(),
    TaskState.FAILED: frozenset(),
}


class IllegalMove(RuntimeError):
    """A task asked to move where its state machine does not go."""


@dataclass
class Assignment:
    """One site's task in the open attempt of a round."""

    task_id: str
    site_id: str
    state: TaskState = TaskState.ASSIGNED  # changed only by ``move`` (and ``restore``)
    update_sha256: str | None = None
    num_samples: int = 0
    before_upload: TaskState = TaskState.ASSIGNED  # the state an aborted upload returns to
    nonce: bytes = b""  # of the accepted update: a retry with the same nonce is answered as done
    issued_round: int = 0  # the round named in the site's task (async: may be an earlier one)
    base_round: int | None = None  # the round whose global model the site downloaded
    declined: bool = False  # failed because the site's policy declined it (not a failure)

    def move(self, to: TaskState) -> None:
        """Move the task to ``to`` (engine lock held); IllegalMove if it may not."""
        if to not in _MOVES[self.state]:
            raise IllegalMove(f"task {self.task_id} of {self.site_id}: {self.state} -> {to}")
        if to is TaskState.UPLOADING:
            self.before_upload = self.state
        self.state = to

    def restore(self, state: ParticipationState) -> None:
        """Set a task rebuilt from the database to its stored state (recovery only); an
        expired task is not one of an open round's."""
        if self.state is not TaskState.ASSIGNED:
            raise IllegalMove(f"task {self.task_id}: restored twice")
        self.state = TaskState(state.value)

    @property
    def final(self) -> bool:
        return self.state in (TaskState.ACCEPTED, TaskState.FAILED)

    @property
    def pending(self) -> bool:
        """Waiting for the site to pick up or finish the task."""
        return self.state in (TaskState.ASSIGNED, TaskState.DOWNLOADED)


@dataclass
class ActiveRun:
    """A run being driven: its global model, optimiser, and the round in progress."""

    run_id: str
    spec: RunSpec
    optimizer: ServerOptimizer
    model_specs: dict[str, TensorSpec] | None = None
    model_sha256: str = ""
    model_bytes: int = 0
    # Compressed downloads: the model before the last step, the step, and the server's
    # error-feedback residual (topk), so a site holding the old model fetches the step.
    base_sha256: str = ""
    delta_sha256: str = ""
    delta_bytes: int = 0
    download_residual: dict[str, torch.Tensor] = field(default_factory=dict)
    # [train] scaffold: the server's control variate c as published to the sites ('':
    # none yet, c is zero), from the optimiser state of the last commit.
    controls_sha256: str = ""
    controls_bytes: int = 0
    next_round: int = INIT_ROUND
    next_attempt: int = 1
    # The round in progress (open_round is None between rounds):
    open_round: int | None = None
    attempt: int = 0
    closing: bool = False  # set when the driver starts closing; later uploads are late
    opened_at: float = 0.0
    deadline_at: float = 0.0
    assignments: dict[str, Assignment] = field(default_factory=dict)  # by site id
    # Async runs: tasks still being trained when their round closed, by site id; they
    # join the next attempt or round (and stay valid in between).
    carried: dict[str, Assignment] = field(default_factory=dict)
    accountant: Accountant | None = None  # [privacy]: the budget spent by committed rounds
    init_sha256: str | None = None  # round 0: the accepted initial model
    cancelled: bool = False
    waiting_reason: str = ""
    # Sites whose policy declined this run's task, and when: left out of its sampling
    # for EngineSettings.decline_hold_s (the site may approve it, or its hours come).
    declined: dict[str, float] = field(default_factory=dict)
    # The digest of each site's provenance as last recorded for this run (engine).
    provenance: dict[str, str] = field(default_factory=dict)
    # [promotion]: the promoted round, the best metric, candidates since (promotion.py).
    promotion: PromotionState = field(default_factory=PromotionState)
    broken: str = ""  # why this attempt's running sum cannot be trusted; it is retried
    aggregate_s: float = 0.0  # time spent folding this attempt's updates into the sum
    # Updates are folded outside the engine's lock, one at a time under fold_lock; the
    # driver closes a round only once no fold is in flight.
    folding: int = 0
    fold_lock: threading.Lock = field(default_factory=threading.Lock)
    # fold_order's sites, the (assignments, folded) pair they are of, and how many of them
    # at the front are folded or failed: done with for this attempt.
    _fold_order: list[str] = field(default_factory=list, repr=False)
    _fold_order_of: tuple[dict[str, Assignment], set[str]] | None = field(default=None, repr=False)
    fold_from: int = 0
    # by_task's (assignments, carried) pair and the index built from it.
    _task_index: (
        tuple[dict[str, Assignment], dict[str, Assignment], dict[str, Assignment]] | None
    ) = field(default=None, repr=False)
    folded: set[str] = field(default_factory=set)  # sites whose update is in the aggregate
    # perf_counter of the attempt's last acceptance and of the end of its last fold: what
    # folding in site order costs a round is the folding left after the last update is in.
    last_accept_at: float = 0.0
    folded_at: float = 0.0
    # How the run combines each attempt's updates: chosen once, from the spec.
    aggregator: Aggregator = field(init=False)

    def __post_init__(self) -> None:
        self.aggregator = make_aggregator(self.spec)

    @property
    def secure(self) -> SecureRound | None:
        """The open attempt's secure-aggregation key exchange, if the run has one."""
        return self.aggregator.secure

    @property
    def accumulator(self) -> WeightedSum | None:
        """The running sum of a streaming-mean attempt, else None (tests look into it)."""
        agg = self.aggregator
        return agg.running_sum if isinstance(agg, StreamingMean) else None

    @property
    def update_specs(self) -> dict[str, TensorSpec] | None:
        """What a training round's update holds before the codec (the aggregator says:
        the model's tensors, and SCAFFOLD's control deltas); None before the first model."""
        if self.model_specs is None:
            return None
        return self.aggregator.update_specs(self.model_specs)

    @property
    def upload_codec(self) -> CodecSpec:
        """How this round's updates travel: the run's codec, or masked integers."""
        if self.open_round == INIT_ROUND:
            return CodecSpec()
        return self.aggregator.upload_codec

    def privacy_spent(self) -> Accountant:
        """[privacy]: what the committed rounds spent (nothing before the first)."""
        assert self.spec.privacy is not None
        if self.accountant is not None:
            return self.accountant
        return Accountant(self.spec.privacy.round_event(self.spec.sites_per_round))

    @property
    def cohort_size(self) -> int:
        """The cohort a round's tasks tell the sites (their policy's ``min_sites``): the
        sites sampled, or ``sites_per_round`` for Poisson rounds, whose random size would
        make a site's answer depend on whether another site was sampled."""
        privacy = self.spec.privacy
        if privacy is not None and privacy.sampling == "poisson":
            return self.spec.sites_per_round
        return len(self.assignments)

    @property
    def required_updates(self) -> int:
        return 1 if self.open_round == INIT_ROUND else self.spec.quorum

    def fold_order(self) -> tuple[list[str], int]:
        """The attempt's sites in fold order (by id), and how many at its front are done
        with (``fold_from``): a fold looks from there, not through thousands each time."""
        held = self._fold_order_of
        if held is None or held[0] is not self.assignments or held[1] is not self.folded:
            self._fold_order = sorted(self.assignments)
            self._fold_order_of = (self.assignments, self.folded)
            self.fold_from = 0
        return self._fold_order, self.fold_from

    def by_task(self, task_id: str) -> Assignment | None:
        """The open attempt's (or a carried) assignment of ``task_id``: a lookup, not a
        scan, as every heartbeat and transfer of thousands of sites asks it."""
        # The two dicts are only ever replaced whole (set_open, set_closed): an index of
        # the pair held now stays right until one of them is replaced. Built from the pair
        # as read once, and kept with it in one attribute, so that a look without the lock
        # (Engine.is_async_task) never labels an old pair's index with a new pair.
        assignments, carried = self.assignments, self.carried
        held = self._task_index
        if held is None or held[0] is not assignments or held[1] is not carried:
            index = {a.task_id: a for a in (*assignments.values(), *carried.values())}
            held = (assignments, carried, index)
            self._task_index = held
        return held[2].get(task_id)

    def staleness(self, a: Assignment) -> int:
        """How many global models behind the open round the assignment's model is."""
        assert self.open_round is not None
        base = a.base_round if a.base_round is not None else a.issued_round
        return max(0, self.open_round - base)

    def accepting(self, round_number: int, attempt: int) -> bool:
        return self.open_round == round_number and self.attempt == attempt and not self.closing

    def set_open(
        self, number: int, attempt: int, assignments: dict[str, str], now: float, deadline: float
    ) -> None:
        self.open_round, self.attempt, self.closing = number, attempt, False
        self.opened_at, self.deadline_at = now, deadline
        self.aggregate_s, self.folded = 0.0, set()
        self.last_accept_at = self.folded_at = 0.0
        self.assignments = {
            s: Assignment(t, s, issued_round=number) for s, t in assignments.items()
        }
        self.assignments.update(self.carried)
        self.carried = {}
        self.waiting_reason = ""

    def set_closed(self, next_round: int, next_attempt: int = 1) -> None:
        if self.spec.asynchronous is not None:  # still training: they count in what comes next
            self.carried = {s: a for s, a in self.assignments.items() if not a.final}
        self.open_round, self.closing, self.broken = None, False, ""
        self.next_round, self.next_attempt = next_round, next_attempt
        self.assignments, self.init_sha256 = {}, None
        self.drop_aggregate()

    def drop_aggregate(self) -> None:
        """Forget this attempt's partial aggregate (spill files included)."""
        self.aggregator.drop()
        self.folded = set()
