"""Counting finished downloads without making the site wait for the database.

A download's record (bytes, seconds, the round whose model it was) is ledger data:
the engine's in-memory state changes at once, and the row is written here, by one
thread, every download that finished meanwhile in one transaction. Written in the
download's own call instead, it held the stream open until the row was durable: SQLite
commits one transaction at a time, each with an fsync, so when eight sites finished
their downloads together the last one started training some 60 ms late (measured in
``bench/round_bench.py``, 8 sites, 1M parameters).

A round is committed only after every download recorded before it is written
(``flush``), so a committed round's ledger is whole. A crash in the milliseconds between
a download and its row loses only that row, of a round that is not committed: its
updates are requested again after the restart anyway.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from fedra.storage import Store

log = logging.getLogger("fedra.coordinator")


@dataclass(frozen=True)
class Download:
    task_id: str
    nbytes: int
    seconds: float
    base_round: int  # the round whose global model it was


class DownloadLedger:
    """Writes finished downloads to the store in the background, in order."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._queue: list[Download] = []
        self._queued = 0  # downloads ever queued
        self._written = 0  # of those, written (or given up on)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="download-ledger", daemon=True)
        self._thread.start()

    def record(self, download: Download) -> None:
        with self._cond:
            if self._closing:  # after close: write it here, nothing is lost
                self._write([download])
                return
            self._queue.append(download)
            self._queued += 1
            self._cond.notify_all()

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
        self._thread.join(timeout_s)

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
                self._cond.notify_all()

    def _write(self, batch: list[Download]) -> None:
        try:
            missing = self.store.mark_downloaded_many(
                [(d.task_id, d.nbytes, d.seconds, d.base_round) for d in batch]
            )
        except Exception:  # the database is away: the ledger misses these, nothing else
            log.exception("could not record %d finished downloads", len(batch))
            return
        for task_id in missing:
            log.warning("a finished download of unknown task %s was not recorded", task_id)
