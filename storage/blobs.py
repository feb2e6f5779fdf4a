"""Content-addressed blob store: files named by their SHA-256, written atomically.

A blob is written to a temporary name in the store, fsynced, renamed to its digest
and the directory fsynced, so after ``put`` returns the blob survives a crash and a
reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from fedra.files import fsync_dir

_HEX = frozenset("0123456789abcdef")
# Reads of the store's own files go in blocks of this size: large enough that a read costs
# little more than its copy, small enough that a reader (a fold, a commit) holds 256 KiB, not
# megabytes, and the allocator reuses the same few blocks instead of keeping large ones.
BLOCK_BYTES = 256 * 1024


class BlobNotFoundError(KeyError):
    """No blob with that digest."""


class BlobDigestError(ValueError):
    """The bytes written do not hash to the digest the caller promised."""


def _check_digest(digest: str) -> None:
    if len(digest) != 64 or not set(digest) <= _HEX:
        raise ValueError(f"not a lower-case hex SHA-256 digest: {digest!r}")


class BlobStore:
    """Blobs under ``root/ab/abcdef...``; ``root/tmp`` holds writes in progress."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

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
    ) -> Iterator[bytes]:
        """The blob in ``chunk_bytes`` pieces; with ``frame``, each led by ``frame(len)``.

        The raw read is dropped as soon as it is framed, and each chunk is released before
        the next is read: between yields a consumer that keeps none (``yield from``) holds
        one chunk, not two or three.
        """
        try:
            f = self.path(digest).open("rb")
        except FileNotFoundError as exc:
            raise BlobNotFoundError(digest) from exc
        with f:
            while data := f.read(chunk_bytes):
                if frame is not None:
                    data = frame(len(data)) + data
                yield data
                del data

    def read(self, digest: str) -> bytes:
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError as exc:
            raise BlobNotFoundError(digest) from exc

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def clear_tmp(self) -> int:
        """Remove writes a crash left behind; returns how many."""
        count = 0
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
            count += 1
        return count


class BlobWriter:
    """Streams into a temporary file while hashing; ``commit`` renames it into place."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        fd, name = tempfile.mkstemp(dir=store._tmp, prefix="blob-")
        self._file = os.fdopen(fd, "wb")
        self._tmp_path = Path(name)
        self._hash = hashlib.sha256()
        self.bytes_written = 0
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.bytes_written += len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def commit(self, expected_digest: str | None = None) -> str:
        """Make the blob durable under its digest; raises BlobDigestError on mismatch."""
        digest = self._hash.hexdigest()
        if expected_digest is not None and digest != expected_digest:
            self.discard()
            raise BlobDigestError(
                f"payload SHA-256 is {digest}, the sender declared {expected_digest}"
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = self._store.path(digest)
        final.parent.mkdir(exist_ok=True)
        os.replace(self._tmp_path, final)
        fsync_dir(final.parent)
        self._done = True
        return digest

    def discard(self) -> None:
        if not self._done:
            self._file.close()
            self._tmp_path.unlink(missing_ok=True)
            self._done = True

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
