"""Content-addressed blob store: files named by their SHA-256, written atomically.

A blob is written to a temporary name in the store, fsynced, renamed to its digest
and the directory fsynced, so after ``put`` returns the blob survives a crash and a
reader never sees a partial file. A write that fails (a full disk: StorageFullError)
leaves nothing behind. Reads are checked against the digest: a file whose bytes do not
hash to its name raises BlobCorruptError at the end of the read. A blob is hashed once
per process and file (its size, mtime and inode are remembered), so a model read by
every site every round is not hashed each time: a file rewritten since is checked
again, but a bit that flips in place under a running daemon is caught only by the sites
(they check what they download) and by the next start (it checks what it resumes from).
The record goes with the blob (deleted, taken out) or its cached pages (evicted): a blob
evicted and read again is hashed again.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from pathlib import Path

from fedra.files import drop_cached, fsync_dir, start_writeback
from fedra.storage.hashing import AsideHasher

log = logging.getLogger("fedra.storage")

_HEX = frozenset("0123456789abcdef")
# Reads of the store's own files go in blocks of this size: large enough that a read costs
# little more than its copy, small enough that a reader (a fold, a commit) holds 256 KiB, not
# megabytes, and the allocator reuses the same few blocks instead of keeping large ones.
BLOCK_BYTES = 256 * 1024
# A blob's bytes go to disk in the background every this many as they are written, so
# the fsync that makes the blob durable has only the last of them left to wait for.
WRITEBACK_BYTES = 1 << 20


class BlobNotFoundError(KeyError):
    """No blob with that digest."""


class BlobDigestError(ValueError):
    """The bytes written do not hash to the digest the caller promised."""


class BlobCorruptError(ValueError):
    """A stored blob's bytes no longer hash to its name: they changed on disk."""

    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(f"blob {digest} is damaged on disk: its bytes now hash to {actual}")
        self.digest = digest


def digest_mismatch(digest: str, declared: str) -> BlobDigestError:
    return BlobDigestError(f"payload SHA-256 is {digest}, the sender declared {declared}")


class StorageFullError(OSError):
    """No space left (or over quota) for a blob: the write was undone, nothing is left."""


_FULL = (errno.ENOSPC, errno.EDQUOT)


def _raise_if_full(exc: OSError, root: Path) -> None:
    """StorageFullError (from ``exc``) if ``exc`` says the disk is full."""
    if exc.errno in _FULL:
        raise StorageFullError(exc.errno, f"disk full: cannot write a blob under {root}") from exc


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _is_digest(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


def _check_digest(digest: str) -> None:
    if not _is_digest(digest):
        raise ValueError(f"not a lower-case hex SHA-256 digest: {digest!r}")


class BlobStore:
    """Blobs under ``root/ab/abcdef...``; ``root/tmp`` holds writes in progress."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)
        # digest -> (size, mtime_ns, inode) of the file when its bytes last hashed right.
        self._verified: dict[str, tuple[int, int, int]] = {}

    def mark_verified(self, digest: str) -> None:
        """Record that the blob's file, as it is now, was read through and hashed right."""
        self._verified[digest] = _identity(self.path(digest).stat())

    def _known_good(self, digest: str, fd: int) -> bool:
        return self._verified.get(digest) == _identity(os.fstat(fd))

    def _remember_good(self, digest: str, fd: int) -> None:
        """Record the file open as ``fd`` as hashed right, if it is still the blob: a
        read that ends after the blob was taken out or deleted records nothing."""
        held = _identity(os.fstat(fd))
        try:
            placed = _identity(self.path(digest).stat())
        except FileNotFoundError:
            return
        if placed == held:
            self._verified[digest] = held

    def path(self, digest: str) -> Path:
        _check_digest(digest)
        return self.root / digest[:2] / digest

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError as exc:
            raise BlobNotFoundError(digest) from exc

    def put_chunks(self, chunks: Iterable[bytes], expected_digest: str | None = None) -> str:
        """Write ``chunks`` durably and return their digest."""
        with self.writer() as w:
            for chunk in chunks:
                w.write(chunk)
                del chunk  # not held while the next one is made
            return w.commit(expected_digest)

    def put(self, data: bytes) -> str:
        return self.put_chunks([data])

    def writer(self) -> BlobWriter:
        """A file to stream into; ``commit`` makes it a blob, leaving it unused discards it."""
        return BlobWriter(self)

    def read_chunks(
        self,
        digest: str,
        chunk_bytes: int = BLOCK_BYTES,
        frame: Callable[[int], bytes] | None = None,
        verify: bool = True,
    ) -> Iterator[bytes]:
        """The blob in ``chunk_bytes`` pieces; with ``frame``, each led by ``frame(len)``;
        BlobCorruptError after the last one if they do not hash to ``digest`` (unless
        ``verify`` is off: the caller checks them itself).

        The raw read is dropped as soon as it is framed, and each chunk is released before
        the next is read: between yields a consumer that keeps none (``yield from``) holds
        one chunk, not two or three.
        """
        try:
            f = self.path(digest).open("rb")
        except FileNotFoundError as exc:
            raise BlobNotFoundError(digest) from exc
        hasher = hashlib.sha256() if verify and not self._known_good(digest, f.fileno()) else None
        with f:
            while data := f.read(chunk_bytes):
                if hasher is not None:
                    hasher.update(data)
                if frame is not None:
                    data = frame(len(data)) + data
                yield data
                del data
            if hasher is not None:
                self._verify(digest, hasher.hexdigest())
                self._remember_good(digest, f.fileno())

    def read(self, digest: str) -> bytes:
        return b"".join(self.read_chunks(digest))

    def _verify(self, digest: str, actual: str) -> None:
        # At the end of a read: a consumer that streamed the blob (a download, a commit)
        # gets this error instead of the end of the stream, so it never takes it as whole.
        if actual != digest:
            log.error("blob %s under %s is damaged on disk (it now hashes to %s)",
                      digest, self.root, actual)  # fmt: skip
            raise BlobCorruptError(digest, actual)

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)
        self._forget(digest)

    def _forget(self, digest: str) -> None:
        """Drop what ``_verified`` knows of a blob gone or not to be read again soon:
        the record would otherwise outlive it, one per blob ever written (a spooled
        update a site a round). Read again, the blob is hashed again."""
        self._verified.pop(digest, None)

    def take_out(self, digest: str) -> Path | None:
        """Move the blob out of the store, into its folder of writes in progress, and
        return where it went (None: there was none), for the caller to unlink when no
        lock of its waits on it: the rename takes microseconds whatever the size, the
        unlink frees the file's cached pages, about 1 ms per 4 MB here. A crash between
        the two leaves the file to the next start's ``clear_tmp``."""
        gone = self._tmp / f"gone-{digest}-{os.urandom(4).hex()}"
        try:
            os.replace(self.path(digest), gone)
        except FileNotFoundError:
            return None
        finally:
            self._forget(digest)
        return gone

    def evict(self, digest: str) -> None:
        """Drop the blob's bytes from the OS's page cache (they stay on disk): for a blob
        that is durable and will not be read again soon, such as a checkpoint a newer
        one replaced."""
        drop_cached(self.path(digest))
        self._forget(digest)

    def digests(self) -> Iterator[str]:
        """The digests of the blobs in place (not writes in progress, nor other files)."""
        for folder in self.root.iterdir():
            if len(folder.name) != 2 or not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.startswith(folder.name) and _is_digest(entry.name):
                    yield entry.name

    def clear_tmp(self) -> int:
        """Remove writes a crash left behind; returns how many."""
        count = 0
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
            count += 1
        return count


class BlobWriter:
    """Streams into a temporary file while hashing; ``commit`` renames it into place.

    A write or commit that fails removes the temporary file before it raises; a full
    disk raises StorageFullError."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        try:
            fd, name = tempfile.mkstemp(dir=store._tmp, prefix="blob-")
        except OSError as exc:
            _raise_if_full(exc, store.root)
            raise
        self._file = os.fdopen(fd, "wb")
        self._tmp_path = Path(name)
        self._hash = AsideHasher()  # a large blob is hashed while its bytes are written
        self.bytes_written = 0
        self._written_back = 0  # bytes before this offset are on their way to disk
        self._done = self._synced = False
        self.placed = False  # renamed into place by ``commit`` (which may still fail after)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)  # first: hashed aside, it runs while the file is written
        try:
            self._file.write(data)
        except OSError as exc:
            self.discard()
            _raise_if_full(exc, self._store.root)
            raise
        self.bytes_written += len(data)
        if self.bytes_written - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._file.fileno(), self._written_back, 0)  # 0: to the end
            self._written_back = self.bytes_written

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def sync(self, expected_digest: str | None = None) -> str:
        """Check the digest (BlobDigestError on mismatch) and make the bytes durable in
        the temporary file: ``commit``'s slow part, done ahead of it. Nothing is in place
        until ``commit``, and ``discard`` still removes it all. The fsync goes first, so
        the last of a large blob's hash runs beside it."""
        if not self._synced:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                self.discard()
                _raise_if_full(exc, self._store.root)
                raise
            self._synced = True
        digest = self._hash.hexdigest()
        if expected_digest is not None and digest != expected_digest:
            self.discard()
            raise digest_mismatch(digest, expected_digest)
        return digest

    def commit(self, expected_digest: str | None = None) -> str:
        """Make the blob durable under its digest; raises BlobDigestError on mismatch."""
        digest = self.sync(expected_digest)
        final = self._store.path(digest)
        try:
            self._file.close()
            final.parent.mkdir(exist_ok=True)
            os.replace(self._tmp_path, final)
        except OSError as exc:
            self.discard()
            _raise_if_full(exc, self._store.root)
            raise
        self._done = self.placed = True
        fsync_dir(final.parent)
        self._store._verified[digest] = _identity(final.stat())  # hashed as it was written
        return digest

    def discard(self) -> None:
        if not self._done:
            self._done = True
            # Closing flushes what is buffered, which fails again on a full disk: the
            # temporary file goes all the same.
            with suppress(OSError):
                self._file.close()
            self._tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
