"""SHA-256 of a stream being written, computed beside the writes instead of between them.

A blob writer hashes every byte it writes; done in line, the hash and the file's writes
(then its fsync) take turns on one core. ``AsideHasher`` hashes a stream's first
``INLINE_BYTES`` in line, as before, and queues the rest to a small shared pool of hashing
threads (hashlib and file writes both release the GIL), so on a machine with a second
core the hash of a large blob runs while its bytes are written and synced: a 4 MB model
checkpoint went from 12 to 8 ms on two cores, a 40 MB one from 105 to 65 ms
(``bench/hash_aside.py``).

No thread waits on a stream: a pool thread hashes what one stream has queued and goes
back to the pool, so thousands of uploads in flight hold no thread between their chunks.
At most ``QUEUE_BYTES`` of a stream wait to be hashed; a writer ahead of its hash waits
for room, so memory stays bounded whatever the disk's speed. The bytes queued are never
copied unless they could change under the hash: ``bytes`` and read-only views of
``bytes`` travel as they are, anything else (a ``bytearray`` a caller may reuse) is
copied first.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

Buffer = bytes | bytearray | memoryview

# A stream's first bytes are hashed in line: a small blob (most updates at scale) never
# costs a hand-off. Past this many, the rest is hashed aside.
INLINE_BYTES = 1 << 20
# At most this many bytes of one stream wait for the hash (beyond one chunk bigger than it):
# with its bytes already on their way to disk, a writer gains nothing from running further ahead.
QUEUE_BYTES = 1 << 20

_pool_lock = threading.Lock()


def _hashing_pool() -> ThreadPoolExecutor:
    with _pool_lock:  # one pool per process, made on first use
        return _new_pool()


@functools.cache
def _new_pool() -> ThreadPoolExecutor:
    workers = max(1, min(4, os.cpu_count() or 1))
    return ThreadPoolExecutor(workers, thread_name_prefix="fedra-hash")


# A forked child has none of the pool's threads: it makes a pool of its own.
os.register_at_fork(after_in_child=_new_pool.cache_clear)


def _unchanging(data: Buffer) -> bytes | memoryview:
    """``data`` if nothing can change it before it is hashed, else a copy of it."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and data.readonly and isinstance(data.obj, bytes):
        return data
    return bytes(data)


class AsideHasher:
    """SHA-256 of the bytes given to ``update``, in order; ``hexdigest`` waits for them."""

    def __init__(self, inline_bytes: int | None = None, queue_bytes: int | None = None) -> None:
        self._hash = hashlib.sha256()
        self._inline_left = INLINE_BYTES if inline_bytes is None else inline_bytes
        self._queue_bytes = QUEUE_BYTES if queue_bytes is None else queue_bytes
        self._queue: deque[bytes | memoryview] = deque()
        self._queued = 0  # bytes in ``_queue`` or being hashed
        self._draining = False  # a pool thread owns ``_hash`` until it sets this False
        self._failed: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())

    def update(self, data: Buffer) -> None:
        if not data:
            return
        if self._inline_left >= len(data) and not self._queued:
            self._inline_left -= len(data)
            self._hash.update(data)
            return
        self._inline_left = 0  # from here on everything goes aside, in order
        data = _unchanging(data)
        with self._cond:
            while self._queued and self._queued + len(data) > self._queue_bytes:
                self._cond.wait()
            self._queue.append(data)
            self._queued += len(data)
            if self._draining:
                return
            self._draining = True
        try:
            _hashing_pool().submit(self._drain)
        except RuntimeError:  # the interpreter is shutting its pools down: hash here
            self._drain()

    def _drain(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._queue:
                        break
                    data = self._queue.popleft()
                self._hash.update(data)
                with self._cond:
                    self._queued -= len(data)
                    self._cond.notify_all()
        except BaseException as exc:  # never leave a waiter behind
            self._failed = exc
            with self._cond:
                self._queue.clear()
                self._queued = 0
        with self._cond:
            self._draining = False
            self._cond.notify_all()

    def wait(self) -> None:
        """Until every byte given so far is hashed."""
        with self._cond:
            while self._draining:
                self._cond.wait()
        if self._failed is not None:
            raise RuntimeError("hashing a stream failed") from self._failed

    def hexdigest(self) -> str:
        self.wait()
        return self._hash.hexdigest()
