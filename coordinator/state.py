"""In-memory state of the runs the coordinator is driving. The database is the truth;
this is what can be rebuilt from it at any time (see ``recovery``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fedra.coordinator.aggregation import ServerOptimizer, WeightedSum
from fedra.coordinator.robust import UpdateStore
from fedra.privacy import RdpAccountant
from fedra.protos.codec import TensorSpec
from fedra.runspec import CodecSpec, RunSpec

if TYPE_CHECKING:
    from fedra.coordinator.secure import SecureRound

INIT_ROUND = 0
# The ledger event that closes a failed attempt (its data names the attempt).
ATTEMPT_FAILED = "attempt_failed"


@dataclass
class Assignment:
    """One site's task in the open attempt of a round."""

    task_id: str
    site_id: str
    state: str  # assigned | downloaded | uploading | accepted | failed
    update_sha256: str | None = None
    num_samples: int = 0
    before_upload: str = "assigned"  # the state an aborted upload returns to
    nonce: bytes = b""  # of the accepted update: a retry with the same nonce is answered as done
    issued_round: int = 0  # the round named in the site's task (async: may be an earlier one)
    base_round: int | None = None  # the round whose global model the site downloaded

    @property
    def final(self) -> bool:
        return self.state in ("accepted", "failed")

    @property
    def pending(self) -> bool:
        """Waiting for the site to pick up or finish the task."""
        return self.state in ("assigned", "downloaded")


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
    # How this attempt's updates are combined: exactly one of these is set (round > 0).
    accumulator: WeightedSum | None = None  # rule "mean": the streaming (clipped) sum
    robust: UpdateStore | None = None  # robust rules: every update, spilled past a limit
    secure: SecureRound | None = None  # [secagg]: the masked sum and its key exchange
    accountant: RdpAccountant | None = None  # [privacy]: the budget spent by committed rounds
    init_sha256: str | None = None  # round 0: the accepted initial model
    cancelled: bool = False
    waiting_reason: str = ""
    broken: str = ""  # why this attempt's running sum cannot be trusted; it is retried
    aggregate_s: float = 0.0  # time spent folding this attempt's updates into the sum
    # Updates are folded outside the engine's lock, one at a time under fold_lock; the
    # driver closes a round only once no fold is in flight.
    folding: int = 0
    fold_lock: threading.Lock = field(default_factory=threading.Lock)
    folded: set[str] = field(default_factory=set)  # sites whose update is in the aggregate
    # perf_counter of the attempt's last acceptance and of the end of its last fold: what
    # folding in site order costs a round is the folding left after the last update is in.
    last_accept_at: float = 0.0
    folded_at: float = 0.0

    @property
    def upload_codec(self) -> CodecSpec:
        """How this round's updates travel: the run's codec, or masked integers."""
        if self.open_round == INIT_ROUND:
            return CodecSpec()
        return CodecSpec("secagg") if self.spec.secagg is not None else self.spec.codec

    @property
    def required_updates(self) -> int:
        return 1 if self.open_round == INIT_ROUND else self.spec.quorum

    def by_task(self, task_id: str) -> Assignment | None:
        for a in (*self.assignments.values(), *self.carried.values()):
            if a.task_id == task_id:
                return a
        return None

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
            s: Assignment(t, s, "assigned", issued_round=number) for s, t in assignments.items()
        }
        self.assignments.update(self.carried)
        self.carried = {}
        self.waiting_reason = ""

    def set_closed(self, next_round: int, next_attempt: int = 1) -> None:
        if self.spec.asynchronous is not None:  # still training: they count in what comes next
            self.carried = {s: a for s, a in self.assignments.items() if not a.final}
        self.open_round, self.closing, self.broken = None, False, ""
        self.next_round, self.next_attempt = next_round, next_attempt
        self.assignments, self.accumulator, self.init_sha256 = {}, None, None
        self.drop_aggregate()

    def drop_aggregate(self) -> None:
        """Forget this attempt's partial aggregate (spill files included)."""
        if self.robust is not None:
            self.robust.close()
        self.accumulator, self.robust, self.secure = None, None, None
        self.folded = set()
