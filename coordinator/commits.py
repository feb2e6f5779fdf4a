"""Group commit: the writes calls wait on, batched into one synced transaction each.

An accepted update (and a site's registration) must be durable before its call is
answered, and on SQLite with ``synchronous=FULL`` every commit is an fsync: one per
update made a round of a thousand sites a thousand fsyncs in a row. Here each waiting
write is queued; one thread takes everything queued, writes it in one transaction
(``Store.write_batch``, a savepoint per write so that one refused write is undone
alone), commits once, and only then lets each caller go on. The promise is unchanged
(a write is acknowledged only once it is durable). An idle coordinator waits for
nothing: a write that comes after a quiet spell is committed at once, and so is the
batch behind it (a round of a few sites loses no time). Under a stream of writes (the
last two batches began within ``MIN_INTERVAL_S`` of each other), batches begin at most
every ``MIN_INTERVAL_S``, and what arrives meanwhile joins the next one: a commit costs
about half a millisecond of CPU whatever its size, and at a thousand sites uploads
arrive a few at a time, so committing as soon as the disk was free made batches of one
or two (PostgreSQL's ``commit_delay`` does the same for the same reason).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from fedra.storage import Store
from fedra.storage.writes import WriteOp

log = logging.getLogger("fedra.coordinator")
MAX_BATCH = 1024  # writes in one transaction, at most
MIN_INTERVAL_S = 0.01  # under load, a batch at most this often (a write waits at most this)


class GroupCommit:
    """A writer thread for ``store``; ``write`` blocks until its write is durable."""

    def __init__(
        self,
        store: Store,
        max_batch: int = MAX_BATCH,
        on_commit: Callable[[float, int], None] = lambda seconds, writes: None,
        min_interval_s: float = MIN_INTERVAL_S,
    ) -> None:
        self.store, self.max_batch, self.on_commit = store, max_batch, on_commit
        self.min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._queue: list[tuple[WriteOp, Future[None]]] = []
        self._closing = False
        self.batches = 0  # transactions committed
        self.writes = 0  # writes in them
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def write(self, op: WriteOp) -> None:
        """Run ``op`` in the next batch and return once that batch is committed; raises
        the op's own refusal (DuplicateError, ...) or the batch's failure."""
        self.submit(op).result()

    def submit(self, op: WriteOp) -> Future[None]:
        """Run ``op`` in the next batch: its future is done once that batch is committed
        (with the op's own refusal, DuplicateError say, or the batch's failure). Nothing
        need wait on it with a thread: an event loop awaits it."""
        done: Future[None] = Future()
        with self._cond:
            closing = self._closing
            if not closing:
                self._queue.append((op, done))
                self._cond.notify()
        if closing:  # stopping: written here, alone
            try:
                [error] = self.store.write_batch([op])
            except BaseException as exc:
                done.set_exception(exc)
                return done
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        return done

    def write_later(self, op: WriteOp) -> None:
        """Run ``op`` in the next batch without waiting for it (a failure is logged)."""
        done: Future[None] = Future()
        done.add_done_callback(_log_failure)
        with self._cond:
            if self._closing:
                return  # stopping: whoever closes writes what must survive
            self._queue.append((op, done))
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is queued and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        log.info("group commit: %d writes in %d transactions", self.writes, self.batches)

    def _run(self) -> None:
        before, began = -math.inf, -math.inf  # when the last two batches began
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closing)
                closing = self._closing
            gather = began + self.min_interval_s - time.monotonic()
            if gather > 0 and began - before < self.min_interval_s and not closing:
                time.sleep(gather)  # a stream: the writes that arrive meanwhile join in
            with self._cond:
                batch = self._queue[: self.max_batch]
                del self._queue[: len(batch)]
                if not batch:
                    return  # closing, and nothing left
            before, began = began, time.monotonic()
            try:
                errors = self.store.write_batch([op for op, _ in batch])
            except BaseException as exc:  # nothing of the batch was written
                for _, done in batch:
                    done.set_exception(exc)
                continue
            took = time.monotonic() - began
            self.batches += 1
            self.writes += len(batch)
            for (_, done), error in zip(batch, errors, strict=True):
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
            self.on_commit(took, len(batch))  # its latency, for metrics: once all may go on


def _log_failure(done: Future[None]) -> None:
    error = done.exception()
    if error is not None:
        log.warning("a batched write nobody waits on failed: %s", error)
