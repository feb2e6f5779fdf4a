"""The SHA-256 a blob writer takes beside its writes: the same digest as in line, its
queue bounded, nothing changed under it, and a failure that cannot hang a writer."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from fedra import files
from fedra.storage import blobs, hashing
from fedra.storage.blobs import BlobDigestError, BlobStore
from fedra.storage.hashing import AsideHasher

_SIZES = [0, 1, 1000, hashing.INLINE_BYTES, hashing.INLINE_BYTES + 1, 9_000_001]
_CHUNKS = [7, 65_536, 1 << 20, 5 << 20]


@pytest.mark.parametrize(
    ("size", "chunk"),
    [(s, c) for s in _SIZES for c in _CHUNKS if s < 100_000 or c > 1000],  # not a million tiny
)
def test_the_digest_is_the_in_line_one_whatever_the_chunks(size: int, chunk: int) -> None:
    data = os.urandom(size)
    hasher = AsideHasher()
    for start in range(0, size, chunk):
        piece = data[start : start + chunk]
        # bytes, a read-only view of bytes, a bytearray: each kind a caller may hand over
        kind = (start // chunk) % 3
        hasher.update(piece if kind == 0 else memoryview(piece) if kind == 1 else bytearray(piece))
    assert hasher.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_buffer_the_caller_reuses_is_hashed_as_it_was_given() -> None:
    buffer, expected, hasher = bytearray(1 << 20), hashlib.sha256(), AsideHasher(inline_bytes=0)
    for fill in range(8):
        buffer[:] = bytes([fill]) * len(buffer)
        expected.update(buffer)
        hasher.update(buffer)  # then overwritten at once, maybe before the pool hashes it
        hasher.update(memoryview(buffer)[:100])  # a writable view: copied too
        expected.update(buffer[:100])
    assert hasher.hexdigest() == expected.hexdigest()


def test_a_writer_ahead_of_its_hash_waits_for_room() -> None:
    """With every pool thread busy, a stream queues at most its bound and then waits; once
    the pool is free the rest goes through and the digest is right."""
    release, started = threading.Event(), threading.Semaphore(0)

    def busy() -> None:
        started.release()
        release.wait(30)

    hashing._POOL.submit(lambda: None)  # the pool exists: its size is known
    workers = hashing._POOL.workers
    for _ in range(workers):
        hashing._POOL.submit(busy)
    for _ in range(workers):
        assert started.acquire(timeout=30)
    chunk, bound = 1 << 20, 3 << 20
    hasher, data = AsideHasher(inline_bytes=0, queue_bytes=bound), os.urandom(8 << 20)
    fed: list[int] = []

    def feed() -> None:
        for start in range(0, len(data), chunk):
            hasher.update(data[start : start + chunk])
            fed.append(start)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while len(fed) < bound // chunk and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # room for a fourth chunk, were the bound not kept
        assert writer.is_alive()
        assert len(fed) == bound // chunk and hasher._queued == bound  # the fourth waits
    finally:
        release.set()
    writer.join(30)
    assert not writer.is_alive()
    assert hasher.hexdigest() == hashlib.sha256(data).hexdigest()


class _SlowExits(threading.Condition):
    """The hasher's lock, held up for a moment each time a pool thread leaves it with the
    queue empty, after saying so: a chunk can be queued at just that instant."""

    def __init__(self, hasher: AsideHasher) -> None:
        super().__init__(threading.Lock())
        self.hasher, self.exits = hasher, threading.Semaphore(0)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if threading.current_thread().name.startswith("fedra-hash") and not self.hasher._queue:
            self.exits.release()
            time.sleep(0.05)


@pytest.mark.parametrize("instant", [1, 2, 3])
def test_a_chunk_queued_as_the_hash_finds_its_queue_empty_is_hashed(instant: int) -> None:
    """Whichever of the drain's looks at an empty queue a chunk comes after, it is hashed:
    the digest covers it, and the next update finds room."""
    hasher = AsideHasher(inline_bytes=0, queue_bytes=1 << 20)
    slow = hasher._cond = _SlowExits(hasher)
    a, b, c = b"a" * 1000, b"b" * 1000, os.urandom(1 << 20)
    hasher.update(a)
    for _ in range(instant):  # the drain has just left the lock, its queue empty
        assert slow.exits.acquire(timeout=10)
    hasher.update(b)
    done = threading.Thread(target=hasher.update, args=(c,), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()  # room was made: nothing stayed queued for nobody
    assert hasher.hexdigest() == hashlib.sha256(a + b + c).hexdigest()


def test_a_failed_hash_is_raised_not_waited_for() -> None:
    class Broken:
        def update(self, data: bytes) -> None:
            raise MemoryError("no room to hash")

    hasher = AsideHasher(inline_bytes=0)
    hasher._hash = Broken()  # type: ignore[assignment]
    hasher.update(b"x" * 4096)
    with pytest.raises(RuntimeError, match="hashing a stream failed"):
        hasher.hexdigest()


def test_a_blob_written_from_a_reused_buffer_is_named_by_what_it_holds(tmp_path: Path) -> None:
    store, buffer, written = BlobStore(tmp_path), bytearray(2 << 20), bytearray()
    with store.writer() as w:
        for fill in (1, 2, 3):
            buffer[:] = bytes([fill]) * len(buffer)
            w.write(buffer)
            written += buffer
        digest = w.commit()
    assert digest == hashlib.sha256(written).hexdigest()
    assert store.read(digest) == bytes(written)


def test_a_large_blob_that_does_not_hash_to_its_promise_leaves_nothing(tmp_path: Path) -> None:
    store, data = BlobStore(tmp_path), os.urandom(3 << 20)
    with pytest.raises(BlobDigestError), store.writer() as w:
        w.write(data)
        w.commit(expected_digest="0" * 64)
    assert list(store.digests()) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_writeback_is_asked_for_where_the_kernel_offers_it(tmp_path: Path) -> None:
    """A hint only: on Linux the call is there; on a file it starts writing, on what is no
    file (a pipe) it fails quietly; a blob written with it reads back whole."""
    if sys.platform.startswith("linux"):
        assert files._SYNC_FILE_RANGE is not None
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
        files.start_writeback(f.fileno(), 0, 0)
        if files._SYNC_FILE_RANGE is not None:  # its signature is right: the kernel took it
            assert files._SYNC_FILE_RANGE(f.fileno(), 0, 0, 2) == 0
    read, write = os.pipe()
    try:
        files.start_writeback(write, 0, 0)  # ESPIPE, ignored
    finally:
        os.close(read)
        os.close(write)
    store, data = BlobStore(tmp_path / "blobs"), os.urandom(5 * blobs.WRITEBACK_BYTES + 3)
    digest = store.put_chunks(data[i : i + 300_000] for i in range(0, len(data), 300_000))
    assert store.read(digest) == data


def test_a_forked_child_hashes_aside_with_a_pool_of_its_own() -> None:
    AsideHasher(inline_bytes=0).update(b"x" * 4096)  # the parent's pool is running
    data = os.urandom(3 << 20)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the right digest, never hang (alarm)
        code = 1
        try:
            signal.alarm(20)
            hasher = AsideHasher(inline_bytes=0)
            for start in range(0, len(data), 1 << 18):
                hasher.update(data[start : start + (1 << 18)])
            code = 0 if hasher.hexdigest() == hashlib.sha256(data).hexdigest() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
