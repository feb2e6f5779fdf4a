"""Riding out a storage fault in a running daemon: a full disk, a database that dropped
its connections (a PostgreSQL restart).

The run's driver does what a restart would: after a backoff (``fedra.retry``) it reads
the run back from the database and blob store (``recovery.restore_run``), the last
committed round and the open one with its accepted updates folded again from the spool,
and carries on. A commit is one transaction made after its blobs are durable, so a fault
leaves a round committed whole or not at all, and the reload finds which: never half a
round, never one twice. The run's state is rebuilt in place, in the object every call
holds, under the engine's lock, so an upload under way lands in the rebuilt round.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fedra.coordinator.state import ActiveRun, Assignment
from fedra.retry import Backoff
from fedra.storage.store import transient_fault

if TYPE_CHECKING:
    from fedra.coordinator.engine.core import Engine

log = logging.getLogger("fedra.coordinator")
FAULT_EVENT = "storage_fault"  # the ledger's record of a fault the run rode out
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.5, 30.0
_RECHECK_S = 1.0
# What the running daemon knows better than the database: its locks and an operator's
# cancel that came in while the fault lasted.
_LIVE_FIELDS = frozenset({"fold_lock", "folding", "cancelled"})

__all__ = ["FAULT_EVENT", "StorageFaults", "transient_fault"]


class StorageFaults:
    """One run's storage faults: its backoff, and the reload that follows each fault."""

    def __init__(
        self, engine: Engine, run: ActiveRun, tag: str, drop_round: Callable[[int], None]
    ) -> None:
        self.engine, self.run, self.tag = engine, run, tag
        self.drop_round = drop_round  # deletes a closed round's spooled updates
        self.backoff = Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S)
        self.tries = 0

    def carried_on(self) -> None:
        """A step went through: the next fault starts a fresh backoff."""
        self.tries = 0
        self.backoff.reset()

    def ride_out(self, why: str) -> bool:
        """Wait, reload the run from storage, and again until storage answers; False if
        the run ended meanwhile (in the database) or the engine is stopping."""
        was_open = self.run.open_round
        while True:
            self.tries += 1
            delay = self.backoff.next_delay_s()
            log.warning(
                "%s: %s; going back to its last committed state in %.1f s (try %d)",
                self.tag, why, delay, self.tries,
            )  # fmt: skip
            if self._stopping_within(delay):
                return False
            try:
                return self._reload(why, was_open)
            except Exception as exc:
                again = transient_fault(exc)
                if not again:
                    raise
                why = again

    def _stopping_within(self, delay_s: float) -> bool:
        engine = self.engine
        deadline = time.monotonic() + delay_s  # not engine.clock: a test's may stand still
        with engine._lock:
            while not engine.stopping and (left := deadline - time.monotonic()) > 0:
                engine._changed.wait(min(left, _RECHECK_S))
            return engine.stopping

    def _reload(self, why: str, was_open: int | None) -> bool:
        from fedra.coordinator.engine.recovery import restore_run  # noqa: PLC0415 - it imports rounds

        run, engine = self.run, self.engine
        # Under the lock throughout: no upload is accepted into a half-rebuilt round. It
        # costs the other calls a pause while the accepted updates are folded again.
        with engine._lock:
            while run.folding and not engine.stopping:
                engine._changed.wait(_RECHECK_S)
            if engine.stopping:
                return False
            record = engine._store.get_run(run.run_id)
            if record is None or record.state.ended:
                log.info("%s: ended meanwhile (%s)", self.tag, record.state if record else "gone")
                return False
            run.drop_aggregate()  # its spill files: the reload makes the attempt's again
            fresh = restore_run(engine, record)
            if fresh is None:  # it cannot go on (a damaged checkpoint): it says why
                return False
            adopt(run, fresh)
            for site in run.assignments:  # their heartbeats waited for this lock
                engine.mark_seen_for_recovery(site, engine.clock(), refresh=True)
            resumed = run.open_round if run.open_round is not None else run.next_round
            done = resumed - 1
            message = f"{why}; carried on from " + (
                f"round {done}, the last committed" if done >= 0 else "the start"
            )
            engine._store.add_event(
                run.run_id, FAULT_EVENT, message, engine.clock(), run.open_round,
                {"tries": self.tries},
            )  # fmt: skip
            engine.notify()
        log.warning("%s: storage answers again: %s", self.tag, message)
        if was_open is not None and resumed > was_open:  # its commit landed all the same
            self.drop_round(was_open)
        return True


def adopt(run: ActiveRun, fresh: ActiveRun) -> None:
    """Give ``run`` (the object every call holds) ``fresh``'s state, keeping its Assignment
    objects where the task is the same: an upload under way holds one."""
    held = {a.task_id: a for a in (*run.assignments.values(), *run.carried.values())}
    for f in dataclasses.fields(ActiveRun):
        if f.name not in _LIVE_FIELDS:
            setattr(run, f.name, getattr(fresh, f.name))
    for table in (run.assignments, run.carried):
        for site, a in table.items():
            old = held.get(a.task_id)
            if old is not None:
                for f in dataclasses.fields(Assignment):
                    setattr(old, f.name, getattr(a, f.name))
                table[site] = old
