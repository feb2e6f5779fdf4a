"""Where received updates wait for their round: small ones in the database, the rest as
files.

An update must be durable before its upload is answered. As a file that is a temporary
file, an fsync, a rename and an fsync of its directory: on a small machine about a
millisecond of CPU for each update however small it is, a thousand of them for a round of
a thousand sites. An update of at most ``small_bytes`` is instead written into its own
participation row, in the very statement that records it as accepted (``Store.accept_op``
with ``data``), so it is durable with that write's group commit and costs no file at all.
Larger ones are spooled as before, in the content-addressed ``BlobStore``.

Reads look in a bounded memory cache of the small updates accepted lately (a round's
fold reads each one right after its accept), then the file spool, then the database, and
check what they read against its digest either way. A round's rows let go of their
updates' bytes when it ends (``Store.clear_update_data``), as its files are deleted.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator
from pathlib import Path

from fedra.storage.blobs import (
    BLOCK_BYTES,
    BlobCorruptError,
    BlobNotFoundError,
    BlobStore,
    BlobWriter,
    digest_mismatch,
)
from fedra.storage.store import Store

SMALL_UPDATE_BYTES = 64 * 1024  # an update this small goes into its participation row
CACHE_BYTES = 64 << 20  # small updates kept in memory, at most


class SmallWriter:
    """Collects a small update in memory; ``commit`` checks its digest. Durable only once
    its accept is committed with ``data`` (it writes nothing itself)."""

    def __init__(self, limit: int) -> None:
        self._parts: list[bytes] = []
        self._hash = hashlib.sha256()
        self.limit = limit
        self.bytes_written = 0
        self.data: bytes | None = None  # after commit: the whole update

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.bytes_written + len(data) > self.limit:
            raise ValueError(f"a small update is at most {self.limit} bytes")
        self._parts.append(bytes(data))
        self._hash.update(data)
        self.bytes_written += len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def sync(self, expected_digest: str | None = None) -> str:
        """Check the digest (``BlobWriter.sync``; there is nothing to sync in memory)."""
        digest = self._hash.hexdigest()
        if expected_digest is not None and digest != expected_digest:
            self.discard()
            raise digest_mismatch(digest, expected_digest)
        return digest

    def commit(self, expected_digest: str | None = None) -> str:
        digest = self.sync(expected_digest)
        self.data = b"".join(self._parts)
        self._parts = []
        return digest

    def discard(self) -> None:
        self._parts = []

    def __enter__(self) -> SmallWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class UpdateSpool:
    """The coordinator's received updates, by digest (see the module's docstring)."""

    def __init__(
        self,
        blobs: BlobStore,
        store: Store,
        small_bytes: int = SMALL_UPDATE_BYTES,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.blobs, self.store = blobs, store
        self.small_bytes, self.cache_bytes = small_bytes, cache_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()  # newest last
        self._cached = 0  # bytes in it
        # Digests of files an upload put in place and has not yet handed to its accept:
        # no clean-up deletes them meanwhile (identical updates share one file).
        self._holds: Counter[str] = Counter()
        self._lock = threading.Lock()  # the loop, executor threads and the round drivers

    @property
    def root(self) -> Path:
        return self.blobs.root

    def is_small(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.small_bytes

    def writer(self, nbytes: int | None = None) -> BlobWriter | SmallWriter:
        """Somewhere to receive an update of ``nbytes``: memory if it is small (its bytes
        then go with its accept), else a spool file."""
        if nbytes is not None and self.is_small(nbytes):
            return SmallWriter(nbytes)
        return self.blobs.writer()

    def put(self, data: bytes) -> str:
        """Spool ``data`` as a file, whatever its size (tests, tools)."""
        return self.blobs.put(data)

    def accepted(self, digest: str, data: bytes) -> None:
        """A small update's accept was committed: keep it at hand for its fold."""
        with self._lock:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                return
            self._cache[digest] = data
            self._cached += len(data)
            while self._cached > self.cache_bytes and len(self._cache) > 1:
                _, gone = self._cache.popitem(last=False)
                self._cached -= len(gone)

    def exists(self, digest: str) -> bool:
        with self._lock:
            cached = digest in self._cache
        return cached or self.blobs.exists(digest) or self.store.update_data(digest) is not None

    def read_chunks(self, digest: str, chunk_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
        """The update in pieces; BlobCorruptError after the last if they do not hash to
        ``digest``, BlobNotFoundError if it is nowhere."""
        with self._lock:
            data = self._cache.get(digest)
        if data is None:
            if self.blobs.exists(digest):
                yield from self.blobs.read_chunks(digest, chunk_bytes)
                return
            data = self.store.update_data(digest)
            if data is None:
                raise BlobNotFoundError(digest)
            actual = hashlib.sha256(data).hexdigest()
            if actual != digest:
                raise BlobCorruptError(digest, actual)
        for start in range(0, len(data), chunk_bytes):
            yield data[start : start + chunk_bytes]

    def hold(self, digest: str) -> None:
        """An upload is about to put ``digest``'s file in place: keep it until ``release``,
        whatever a clean-up of another update with the same bytes deletes meanwhile."""
        with self._lock:
            self._holds[digest] += 1

    def release(self, digest: str) -> None:
        """The upload that held ``digest`` accepted it (its round keeps it now) or gave up."""
        with self._lock:
            if self._holds[digest] <= 0:
                raise RuntimeError(f"spool: {digest} released more often than held")
            self._holds[digest] -= 1
            if not self._holds[digest]:
                del self._holds[digest]

    def delete(self, digest: str, taken_out: list[Path] | None = None) -> bool:
        """Forget the update: its file and its memory copy, unless an upload holds it
        (``hold``); whether it went. (Its rows' bytes go with their round:
        ``Store.clear_update_data``.) The file leaves the spool at once; it is unlinked
        once this lock is released, or, given ``taken_out``, added there for the caller
        to unlink once it holds no lock (``BlobStore.take_out``)."""
        with self._lock:
            if digest in self._holds:
                return False
            data = self._cache.pop(digest, None)
            if data is not None:
                self._cached -= len(data)
            gone = self.blobs.take_out(digest)  # under the lock: no hold begins while it goes
        if gone is not None:
            if taken_out is None:
                gone.unlink(missing_ok=True)
            else:
                taken_out.append(gone)
        return True

    def sweep(self, keep: Collection[str]) -> int:
        """Delete the spool files that are not in ``keep`` nor held: what a crash between
        an upload's file and its accept left behind, which no round refers to. Returns how
        many went."""
        return sum(self.delete(d) for d in list(self.blobs.digests()) if d not in keep)

    def clear_tmp(self) -> int:
        return self.blobs.clear_tmp()
