"""Counting finished downloads without making the site wait for the database.

A download's record (bytes, seconds, the round whose model it was) is ledger data:
the engine's in-memory state changes at once, and the row is written here, by one
thread, every download that finished meanwhile in one transaction. Written in the
download's own call instead, it held the stream open until the row was durable: SQLite
commits one transaction at a time, each with an fsync, so when eight sites finished
their downloads together the last one started training some 60 ms late (measured in
``bench/round_bench.py``, 8 sites, 1M parameters).

A round is committed only after every download recorded before it is written
(``flush``), so a committed round's ledger is whole; and the ledger knows which tasks
have a download under way or not yet written (``pending``), so that a run watch never
takes a round for final while a row of it can still change. A crash in the
milliseconds between a download and its row loses that row: the task resumes as not
yet downloaded (its site downloads again if it needs to), and an async run counts its
staleness from the round it was issued in rather than the one it downloaded.

Transfers that crossed the wire for nothing are counted here too (``Cut``): a download
cut off midway, an upload cut off or refused. Their bytes go to the task's
``bytes_cut``, never to its completed download or accepted upload.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fedra.storage import Store
from fedra.storage.store import ClaimLostError

log = logging.getLogger("fedra.coordinator")
_RETRY_DELAYS_S = (0.1, 0.5, 2.0)  # a failed write is tried again after these, then dropped


@dataclass(frozen=True)
class Download:
    task_id: str
    nbytes: int
    seconds: float
    base_round: int  # the round whose global model it was


@dataclass(frozen=True)
class Cut:
    """Bytes of one of a task's transfers that was cut off or refused."""

    task_id: str
    nbytes: int


class DownloadLedger:
    """Writes finished downloads to the store in the background, in order.

    A download is ``started`` when a site may begin it, then either ``record``-ed (all
    its bytes sent; written here soon after) or ``abandoned`` (the call ended early;
    the bytes it had sent are counted as cut). An upload is ``started`` when the
    coordinator agrees to receive it and ``ended`` when its call does, with the bytes
    it moved for nothing if it was cut off or refused. ``on_written`` is called after
    each batch is written, so watchers can look again.
    """

    def __init__(
        self,
        store: Store,
        on_written: Callable[[], None] = lambda: None,
        retry_delays_s: tuple[float, ...] = _RETRY_DELAYS_S,
    ) -> None:
        self.store, self.on_written = store, on_written
        self.retry_delays_s = retry_delays_s
        self._cond = threading.Condition()
        self._queue: list[Download | Cut] = []
        self._queued = 0  # entries (downloads, cuts) ever queued
        self._written = 0  # of those, written (or given up on)
        self._pending: Counter[str] = Counter()  # task -> transfers under way or queued
        self._closing = False
        self._stopped = threading.Event()  # wakes a retry's wait at close
        self._thread = threading.Thread(target=self._run, name="download-ledger", daemon=True)
        self._thread.start()

    def started(self, task_id: str) -> None:
        with self._cond:
            self._pending[task_id] += 1

    def ended(self, task_id: str, cut_bytes: int = 0) -> None:
        """A transfer ``started`` for ``task_id`` ended without a download to record: an
        accepted upload (``cut_bytes`` 0), or one whose ``cut_bytes`` crossed the wire for
        nothing (a download cut off, an upload cut off or refused). The task stays
        pending until those are written."""
        if cut_bytes > 0:
            self.record(Cut(task_id, cut_bytes))
            return
        with self._cond:
            self._release([task_id])

    abandoned = ended  # a download that ended early

    def record(self, entry: Download | Cut) -> None:
        with self._cond:
            if not self._closing:
                self._queue.append(entry)
                self._queued += 1
                self._cond.notify_all()
                return
        if isinstance(entry, Cut):  # a call ended by the shutdown: the store may be closed
            log.info("%d bytes of a transfer of task %s cut by the shutdown: not counted",
                     entry.nbytes, entry.task_id)  # fmt: skip
        else:
            self._write([entry])  # after close: write it here, nothing is lost
        with self._cond:
            self._release([entry.task_id])
        self.on_written()

    def pending(self) -> set[str]:
        """The tasks with a download under way, or finished but not yet written."""
        with self._cond:
            return set(self._pending)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every download recorded so far is written; False on timeout."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._written >= target, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stopped.set()
        self._thread.join(timeout_s)

    def _release(self, task_ids: list[str]) -> None:
        for task_id in task_ids:  # the caller holds the lock
            self._pending[task_id] -= 1
            if self._pending[task_id] <= 0:
                del self._pending[task_id]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                batch, self._queue = self._queue, []
                if not batch and self._closing:
                    return
            self._write(batch)
            with self._cond:
                self._written += len(batch)
                self._release([d.task_id for d in batch])
                self._cond.notify_all()
            self.on_written()

    def _write(self, batch: list[Download | Cut]) -> None:
        rows = [
            (d.task_id, d.nbytes, d.seconds, d.base_round) for d in batch if isinstance(d, Download)
        ]
        cuts = [(c.task_id, c.nbytes) for c in batch if isinstance(c, Cut)]
        for attempt, delay in enumerate((*self.retry_delays_s, None)):
            try:
                missing = self.store.mark_downloaded_many(rows, cuts)
                break
            except ClaimLostError:  # no retry: the database is another coordinator's now
                why = "the database is another coordinator's now"
                log.warning("%d finished downloads not recorded: %s", len(batch), why)
                return
            except Exception:  # the database is away for a moment: try again, then give up
                if delay is None or self._stopped.is_set():
                    log.exception(
                        "could not record %d finished downloads after %d tries; the ledger "
                        "misses them",
                        len(batch),
                        attempt + 1,
                    )
                    return
                log.warning("recording %d finished downloads failed; retrying", len(batch))
                self._stopped.wait(delay)
        for task_id in missing:
            log.warning("a transfer of unknown task %s was not recorded", task_id)
