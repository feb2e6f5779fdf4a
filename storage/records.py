"""Plain, immutable views of stored rows: what the rest of fedra sees of the database."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class StoredState(str, Enum):
    """A state as the database stores it: each member equals, and is stored as, its value
    (``RunState.RUNNING == "running"``), so rows written before these enums read the same."""

    def __str__(self) -> str:
        return str(self.value)


class RunState(StoredState):
    """Where a run stands. It moves pending → running → one of the three ends, or from
    pending straight to an end; an ended run never moves again."""

    PENDING = "pending"  # submitted; its initial model not yet made
    RUNNING = "running"
    COMPLETED = "completed"  # its last round committed, or a stop rule ended it
    FAILED = "failed"  # a round gave up, or the run could not go on
    CANCELLED = "cancelled"  # by an operator

    @property
    def ended(self) -> bool:
        return self in ENDED_RUN_STATES


ENDED_RUN_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})


class RoundState(StoredState):
    """Where an attempt of a round stands: open until it commits, is retried (a new attempt
    of the same number follows) or fails; a round left open by a run that ended takes the
    run's end (failed or cancelled). Also the outcome a closed attempt reports."""

    OPEN = "open"
    COMMITTED = "committed"
    RETRIED = "retried"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The states a round left open by a run that ended takes: the run's own.
ENDED_ROUND_STATES = (RoundState.FAILED, RoundState.CANCELLED)


class ParticipationState(StoredState):
    """A site's task as stored. In memory an open round's tasks have one more state,
    uploading (``coordinator.state.TaskState``, with every move a task may make)."""

    ASSIGNED = "assigned"
    DOWNLOADED = "downloaded"
    ACCEPTED = "accepted"  # its update is durable and counts
    FAILED = "failed"  # reported, silent, late, refused or left out
    EXPIRED = "expired"  # its round closed (or its run ended) before its update came


# A participation in one of these states never changes again.
FINAL_PARTICIPATION_STATES = (
    ParticipationState.ACCEPTED,
    ParticipationState.FAILED,
    ParticipationState.EXPIRED,
)
# A participation in one of these is waiting for its site.
PENDING_PARTICIPATION_STATES = (ParticipationState.ASSIGNED, ParticipationState.DOWNLOADED)


@dataclass(frozen=True)
class RunRecord:
    id: str
    name: str
    task: str
    spec_json: str
    state: RunState
    reason: str
    rounds_completed: int
    created_at: float
    updated_at: float

    @property
    def finished(self) -> bool:
        return self.state in ENDED_RUN_STATES


@dataclass(frozen=True)
class SiteRecord:
    id: str
    tasks: tuple[str, ...]
    version: str
    registered_at: float
    last_seen_at: float


@dataclass(frozen=True)
class RoundRecord:
    run_id: str
    number: int
    attempt: int
    state: RoundState
    sampled: tuple[str, ...]
    opened_at: float
    deadline_at: float
    closed_at: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage, once committed


# A site's own measure of its download, compute or upload time counts within [0, this]
# seconds wherever a sum is made of it (a site sends any finite number: 1e308 twice is
# inf in Python and an error in PostgreSQL).
MAX_MEASURED_S = 1e9


@dataclass(frozen=True)
class ParticipationRecord:
    task_id: str
    run_id: str
    round_number: int
    attempt: int
    site_id: str
    state: ParticipationState
    assigned_at: float
    update_sha256: str | None = None
    num_samples: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_cut: int = 0  # of transfers cut off or refused: moved for nothing
    download_s: float = 0.0
    upload_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    finished_at: float | None = None
    nonce: bytes | None = None  # of the accepted update
    issued_round: int | None = None  # the round in the site's task (async: may be earlier)
    base_round: int | None = None  # the round whose global model the site downloaded

    @property
    def finished(self) -> bool:
        return self.state in FINAL_PARTICIPATION_STATES


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    round_number: int
    model_sha256: str
    model_bytes: int
    optimizer_sha256: str | None
    created_at: float
    delta_sha256: str | None = None  # compressed downloads: the step from the round before


@dataclass(frozen=True)
class EventRecord:
    id: int
    run_id: str
    round_number: int | None
    kind: str
    message: str
    data: dict[str, float | int | str] = field(default_factory=dict)
    created_at: float = 0.0


@dataclass(frozen=True)
class RunView:
    """A run and some of its rounds, read at one moment (``Store.read_run``)."""

    run: RunRecord
    rounds: list[RoundRecord]
    participations: list[ParticipationRecord]
    checkpoints: list[CheckpointRecord]
    more_rounds: bool = False  # rounds after these exist (a read with a limit)


@dataclass(frozen=True)
class ParticipationTally:
    """The participations of one round's attempt in one state, counted and summed by the
    database (``Store.read_run_summary``): a round's figures without its rows."""

    round_number: int
    attempt: int
    state: ParticipationState
    flagged: bool  # its error starts with the prefix the read was asked to flag
    count: int
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_cut: int = 0

    @property
    def finished(self) -> bool:
        return self.state in FINAL_PARTICIPATION_STATES


@dataclass(frozen=True)
class RunSummaryView:
    """A run and some of its rounds counted instead of listed, read at one moment
    (``Store.read_run_summary``)."""

    run: RunRecord
    rounds: list[RoundRecord]
    tallies: list[ParticipationTally]
    # Per committed round: the mean time a site whose update it accepted sat idle in it
    # (``ledger.idle_s``); a committed round that accepted none is not in it.
    idle: dict[int, float]
    checkpoints: list[CheckpointRecord]
    held: frozenset[int] = frozenset()  # the rounds with a task among those asked after
    more_rounds: bool = False


@dataclass(frozen=True)
class SiteTally:
    """One site's participations in a run, counted and summed by the database
    (``Store.read_site_tallies``): a row of the status page's table of sites."""

    site_id: str
    participations: int  # its tasks in the run, every attempt of every round
    accepted: int
    failed: int  # failed or expired, less those it declined
    declined: int  # failed with an error that starts with the prefix the read flags
    bytes: int  # down, up and cut
    busy_s: float  # its own download, compute and upload, as it measured them
    # Accepted in the last attempt of a committed round: the time it sat idle, as
    # ``ledger.idle_s`` works it out, and the time that is counted over.
    idle_s: float
    counted_s: float
    latest_state: ParticipationState  # its latest task's (the last round, the last attempt)
    latest_flagged: bool
    failures: tuple[tuple[int, str], ...] = ()  # (round, error) of its first failed tasks

    def then(self, later: SiteTally, failures: int) -> SiteTally:
        """This site's tally and ``later``'s, of rounds after this one's, as one tally of
        both ranges (at most ``failures`` errors kept, the first ones)."""
        return SiteTally(  # not dataclasses.replace: thousands of sites a refresh
            site_id=later.site_id,
            participations=self.participations + later.participations,
            accepted=self.accepted + later.accepted,
            failed=self.failed + later.failed,
            declined=self.declined + later.declined,
            bytes=self.bytes + later.bytes,
            busy_s=self.busy_s + later.busy_s,
            idle_s=self.idle_s + later.idle_s,
            counted_s=self.counted_s + later.counted_s,
            latest_state=later.latest_state,
            latest_flagged=later.latest_flagged,
            failures=(self.failures + later.failures)[:failures],
        )


class RunReads(Protocol):
    """The reads a run's status is built from: ``Store`` is one. What a reader that must
    not write is handed (the engine's ``records``, the read process's database)."""

    def list_runs(self, states: Sequence[RunState] | None = None) -> list[RunRecord]: ...

    def read_run(
        self, run_id: str, *, since: int = 0, limit: int | None = None
    ) -> RunView | None: ...

    def read_run_summary(
        self,
        run_id: str,
        *,
        since: int = 0,
        limit: int | None = None,
        flag_error: str = "",
        tasks: Collection[str] = (),
    ) -> RunSummaryView | None: ...

    def read_site_tallies(
        self,
        run_id: str,
        *,
        since: int = 0,
        until: int | None = None,
        flag_error: str = "",
        failures: int = 5,
    ) -> list[SiteTally]: ...

    def list_events(self, run_id: str, kinds: tuple[str, ...] = ()) -> list[EventRecord]: ...

    def last_event_id(self, run_id: str, kinds: tuple[str, ...]) -> int: ...


class ReadsOf:
    """Only the ``RunReads`` of a store that also writes: what its owner hands a reader,
    which then has no write to reach for. Keep one per store (readers cache by it)."""

    def __init__(self, store: RunReads) -> None:
        self._store = store

    def list_runs(self, states: Sequence[RunState] | None = None) -> list[RunRecord]:
        return self._store.list_runs(states)

    def read_run(self, run_id: str, *, since: int = 0, limit: int | None = None) -> RunView | None:
        return self._store.read_run(run_id, since=since, limit=limit)

    def read_run_summary(
        self,
        run_id: str,
        *,
        since: int = 0,
        limit: int | None = None,
        flag_error: str = "",
        tasks: Collection[str] = (),
    ) -> RunSummaryView | None:
        return self._store.read_run_summary(
            run_id, since=since, limit=limit, flag_error=flag_error, tasks=tasks
        )

    def read_site_tallies(
        self,
        run_id: str,
        *,
        since: int = 0,
        until: int | None = None,
        flag_error: str = "",
        failures: int = 5,
    ) -> list[SiteTally]:
        return self._store.read_site_tallies(
            run_id, since=since, until=until, flag_error=flag_error, failures=failures
        )

    def list_events(self, run_id: str, kinds: tuple[str, ...] = ()) -> list[EventRecord]:
        return self._store.list_events(run_id, kinds)

    def last_event_id(self, run_id: str, kinds: tuple[str, ...]) -> int:
        return self._store.last_event_id(run_id, kinds)
