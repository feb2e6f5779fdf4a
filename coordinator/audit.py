"""The coordinator's audit trail: who did what, in ``STATE_DIR/audit.jsonl``.

Every admin action with the admin's identity (a run submitted, cancelled, a model
exported; a certificate revoked, from ``fedra revoke``), every round commit with its
model's digest, every run's end, and every identity refused at the edge, in the chained
log of ``fedra.audit``. An observer of the engine's events (rounds, runs), and called
by the engine for the admin actions it carries out.

Writing is durable (fsync) and happens after the fact it records: a crash between a
commit and its entry leaves the commit without one, never an entry without its fact.
An admin action's entry is written before its reply (on the executor's thread that
carries it out); the rest (commits, run ends, refusals, which happen on the round
driver's and the event loop's threads) go to a writer thread of their own, so that no
round and no call waits on a disk. An entry that cannot be written is logged as an
error; the action it records stands.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from fedra.audit import AuditLog
from fedra.coordinator.observers import Observer, RoundEnded, RunEnded
from fedra.storage.records import RoundState

if TYPE_CHECKING:  # identities come from the edge: the engine's audit trail loads no gRPC
    from fedra import pki

REFUSAL_EVERY_S = 60.0  # one entry per refused identity and reason this often, at most
MAX_REFUSERS = 10_000  # identities whose last refusal is remembered (then forgotten)
INSECURE = "insecure"  # who acted, on a coordinator without identities


def who_of(identity: pki.Identity | None) -> str:
    """How an entry names a caller: "admin ops", "site hospital-a"."""
    return INSECURE if identity is None else f"{identity.role} {identity.name}"


class AuditTrail(Observer):
    """Writes the coordinator's entries; with no log (``None``), writes nothing."""

    def __init__(self, audit_log: AuditLog | None, clock: Any = time.monotonic) -> None:
        self.log = audit_log
        self.clock = clock
        self._lock = threading.Lock()
        self._refused: dict[tuple[str, str], tuple[float, int]] = {}  # last entry, since
        self._later: queue.Queue[tuple[str, str, dict[str, Any]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    def record(self, event: str, who: str = "", **data: Any) -> None:
        """Write an entry now (durable when this returns)."""
        if self.log is not None:
            self.log.record(event, who, **data)

    def record_later(self, event: str, who: str = "", **data: Any) -> None:
        """Write an entry on the writer thread, in the order given."""
        if self.log is None:
            return
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="audit", daemon=True)
                self._writer.start()
        self._later.put((event, who, data))

    def _write(self) -> None:
        assert self.log is not None
        while (item := self._later.get()) is not None:
            event, who, data = item
            self.log.record(event, who, **data)

    def close(self) -> None:
        """Write out what is queued (at shutdown)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._later.put(None)
            writer.join(30.0)

    # -- the engine's events ---------------------------------------------------

    def round_ended(self, event: RoundEnded) -> None:
        if event.outcome == RoundState.COMMITTED:
            self.record_later(
                "round.commit", "coordinator", run=event.run_id, round=event.number,
                attempt=event.attempt, updates=event.updates, model_sha256=event.model_sha256,
            )  # fmt: skip

    def run_ended(self, event: RunEnded) -> None:
        self.record_later("run.end", "coordinator", run=event.run_id, state=event.state,
                          reason=event.reason)  # fmt: skip

    # -- the edge --------------------------------------------------------------

    def identity_refused(self, who: str, why: str) -> None:
        """An identity the edge refused: an entry at once, then at most one per
        ``REFUSAL_EVERY_S`` for the same identity and reason (a revoked site retries
        with backoff for as long as it runs), saying how many it stands for."""
        now = self.clock()
        key = (who, why)
        with self._lock:
            last, since = self._refused.get(key, (-float("inf"), 0))
            if now - last < REFUSAL_EVERY_S:
                self._refused[key] = (last, since + 1)
                return
            if len(self._refused) >= MAX_REFUSERS:
                self._refused.clear()
            self._refused[key] = (now, 0)
        self.record_later("identity.refused", who, reason=why, repeats_before=since)
