"""SHA-256 of a stream being written, computed beside the writes instead of between them.

A blob writer hashes every byte it writes; done in line, the hash and the file's writes
(then its fsync) take turns on one core. ``AsideHasher`` hashes a stream's first
``INLINE_BYTES`` in line, as before, and queues the rest to a small shared pool of hashing
threads (hashlib and file writes both release the GIL), so on a machine with a second
core the hash of a large blob runs while its bytes are written and synced. With the
writer also sending its bytes to disk as they go (``BlobWriter``), a durable 4 MB blob
took 0.70 to 0.86 of the time it took hashed in line on two cores, a 40 MB one 0.57 to 0.63,
about what the same writes cost with no hash at all (``bench/hash_aside.py``).

No thread waits on a stream: a pool thread hashes what one stream has queued and goes
back to the pool, so thousands of uploads in flight hold no thread between their chunks.
At most ``QUEUE_BYTES`` of a stream wait to be hashed; a writer ahead of its hash waits
for room, so memory stays bounded whatever the disk's speed. The bytes queued are never
copied unless they could change under the hash: ``bytes`` and read-only views of
``bytes`` travel as they are, anything else (a ``bytearray`` a caller may reuse) is
copied first.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

Buffer = bytes | bytearray | memoryview

# A stream's first bytes are hashed in line: a small blob (most updates at scale) never
# costs a hand-off. Past this many, the rest is hashed aside.
INLINE_BYTES = 1 << 20
# At most this many bytes of one stream wait for the hash (beyond one chunk bigger than it):
# with its bytes already on their way to disk, a writer gains nothing from running further ahead.
QUEUE_BYTES = 1 << 20


class _Pool:
    """The process's hashing pool, made on first use; a forked child has none of the
    parent's threads, so it forgets the pool (and its lock) and makes its own."""

    def __init__(self) -> None:
        self.workers = max(1, min(4, os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="fedra-hash")
            executor = self._executor
        executor.submit(fn)

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._executor = None


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)


def _unchanging(data: Buffer) -> bytes | memoryview:
    """``data`` if nothing can change it before it is hashed, else a copy of it (also of a
    view that is not plain contiguous bytes, so that its length counts bytes)."""
    if isinstance(data, bytes):
        return data
    if (
        isinstance(data, memoryview)
        and data.readonly
        and isinstance(data.obj, bytes)
        and data.c_contiguous
        and data.itemsize == 1
    ):
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
        self._turn = threading.Lock()  # held by the drain that is hashing

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
            _POOL.submit(self._drain)
        except RuntimeError:  # the interpreter is shutting its pools down: hash here
            self._drain()  # (a second drain, if the pool ran one after all, waits its turn)

    def _drain(self) -> None:
        """Hash what is queued until the queue is empty. The queue found empty and the
        drain's end are one step under the lock, so a chunk queued after it finds no drain
        running and starts one. Drains take turns (``_turn``): the bytes go in order."""
        with self._turn:
            while True:
                with self._cond:
                    if not self._queue or self._failed is not None:
                        self._queue.clear()
                        self._queued = 0
                        self._draining = False
                        self._cond.notify_all()
                        return
                    data = self._queue.popleft()
                nbytes = len(data)
                try:
                    self._hash.update(data)
                except BaseException as exc:  # raised by hexdigest; never leave a waiter
                    self._failed = exc.with_traceback(None)  # not the chunk's frame
                del data
                with self._cond:
                    self._queued -= nbytes
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
