"""What the coordinator tells those who watch it: metrics, experiment tracking.

The engine and its round drivers report what happened as typed events to an
``Observers`` fan-out, after the fact and outside the engine's lock. An observer is
anything with the methods of ``Observer`` (``coordinator.telemetry``'s Prometheus
metrics, ``fedra.coordinator.tracking``'s TensorBoard and MLflow writers); one that fails or is slow
must not fail or slow a round, so each is called guarded, and one that does I/O hands
the event to a thread of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fedra.storage.records import RoundState, RunState

log = logging.getLogger("fedra.coordinator")


@dataclass(frozen=True)
class RunStarted:
    """A run was submitted (or found unfinished at a restart: ``resumed``)."""

    run_id: str
    spec: Mapping[str, object]  # the run spec as its JSON object (RunSpec.to_json)
    resumed: bool = False


@dataclass(frozen=True)
class RoundEnded:
    """A round's attempt closed: committed, or failed (``retried`` if another attempt
    follows). Bytes are those of this attempt's tasks that ended in it (an async task
    still training moves on to the next round, and is counted where it ends);
    ``lost_bytes`` the part of them that cannot count (tasks that failed or expired,
    transfers cut off, or all of them for an attempt that failed)."""

    run_id: str
    number: int
    attempt: int
    outcome: RoundState  # committed, retried or failed
    duration_s: float  # from its opening to its close
    updates: int  # accepted
    bytes_down: int = 0
    bytes_up: int = 0
    lost_bytes: int = 0
    checkpoint_bytes: int = 0  # the committed model's (0 unless committed)
    idle_s: float = 0.0  # the mean time a site whose update counted sat idle (committed)
    # The round's ledger (status.md: download_s, compute_s, upload_s, aggregate_s,
    # checkpoint_s and the rest) and its weighted metrics (loss, accuracy, ...).
    stages: Mapping[str, float] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""
    model_sha256: str = ""  # the committed model's digest (committed only)


@dataclass(frozen=True)
class RunEnded:
    run_id: str
    state: RunState  # an ended one: completed, failed or cancelled
    reason: str = ""


class Observer:
    """What an observer may hear of; each method does nothing unless overridden."""

    def run_started(self, event: RunStarted) -> None:
        """A run was submitted, or resumed at a restart."""

    def round_ended(self, event: RoundEnded) -> None:
        """A round's attempt closed (after its commit is durable)."""

    def run_ended(self, event: RunEnded) -> None:
        """A run finished: completed, failed or cancelled."""

    def refused(self, status: str) -> None:
        """A call was refused with gRPC status ``status`` (its name: NOT_FOUND, ...)."""

    def committed(self, seconds: float, writes: int) -> None:
        """One group commit (a synced transaction of ``writes`` writes) took ``seconds``."""

    def close(self) -> None:
        """The coordinator is stopping: write out what is held."""


class Observers:
    """The engine's observers; each event goes to all of them, each guarded."""

    def __init__(self) -> None:
        self._all: tuple[Observer, ...] = ()
        self._lock = threading.Lock()

    def add(self, observer: Observer) -> None:
        with self._lock:
            self._all = (*self._all, observer)

    def __len__(self) -> int:
        return len(self._all)

    def run_started(self, event: RunStarted) -> None:
        for o in self._all:
            _guarded(o.run_started, event)

    def round_ended(self, event: RoundEnded) -> None:
        for o in self._all:
            _guarded(o.round_ended, event)

    def run_ended(self, event: RunEnded) -> None:
        for o in self._all:
            _guarded(o.run_ended, event)

    def refused(self, status: str) -> None:
        for o in self._all:
            _guarded(o.refused, status)

    def committed(self, seconds: float, writes: int) -> None:
        for o in self._all:
            _guarded(o.committed, seconds, writes)

    def close(self) -> None:
        with self._lock:
            everyone, self._all = self._all, ()
        for o in everyone:
            _guarded(o.close)


def _guarded(method: Callable[..., None], *args: object) -> None:
    try:
        method(*args)
    except Exception:  # an observer's failure is its own, never the round's
        log.exception("an observer (%s) failed", getattr(method, "__qualname__", method))
