"""A durable blob write with its SHA-256 in line against hashed aside, and the floor.

The coordinator writes every round's checkpoint as a blob (hash, write, fsync, rename,
fsync of the folder) before the next round opens, and spools each large update the same
way before it is acknowledged. Three ways of writing the same bytes in the same chunks,
alternated, on the same disk, in one run:

- ``in line``: each chunk hashed, then written (what the store did before);
- ``aside``: ``BlobStore.put_chunks`` as it is, its bytes past the first MiB hashed on a
  pool thread while they are written and synced (``fedra.storage.hashing``);
- ``floor``: the same chunks written and synced with no hash at all.

    OMP_NUM_THREADS=1 .venv/bin/python bench/hash_aside.py [--sizes-mb 4,40] [--repeats 9]

It prints the median time of each and the ratios aside ÷ in line and aside ÷ floor.
MB is 10**6 bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fedra.storage import blobs, hashing
from fedra.storage.blobs import BLOCK_BYTES, BlobStore


def chunks_of(data: bytes, size: int = BLOCK_BYTES) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def in_line(store: BlobStore, data: bytes) -> None:
    saved = hashing.INLINE_BYTES, blobs.WRITEBACK_BYTES
    # the whole stream fits the in-line part, and no writeback starts before the fsync
    hashing.INLINE_BYTES = blobs.WRITEBACK_BYTES = len(data) + 1
    try:
        store.delete(store.put_chunks(chunks_of(data)))
    finally:
        hashing.INLINE_BYTES, blobs.WRITEBACK_BYTES = saved


def aside(store: BlobStore, data: bytes) -> None:
    store.delete(store.put_chunks(chunks_of(data)))


def floor(store: BlobStore, data: bytes) -> None:
    path = Path(store.root) / "floor"
    with open(path, "wb") as f:
        for chunk in chunks_of(data):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


WAYS: dict[str, Callable[[BlobStore, bytes], None]] = {
    "in line": in_line,
    "aside": aside,
    "floor": floor,
}


def measure(store: BlobStore, nbytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of each way, the ways alternated round by round."""
    data = os.urandom(nbytes)
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(repeats + 1):  # the first round warms the page cache and the pool
        for name, way in WAYS.items():
            started = time.perf_counter()
            way(store, data)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="4,40", help="blob sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    sizes = [int(float(s) * 1e6) for s in args.sizes_mb.split(",")]
    print(f"{os.cpu_count()} CPUs; chunks of {BLOCK_BYTES} bytes; median of {args.repeats}")
    print(f"{'MB':>6} {'in line ms':>11} {'aside ms':>9} {'floor ms':>9} "
          f"{'aside/in line':>14} {'aside/floor':>12}")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = BlobStore(tmp)
        for nbytes in sizes:
            t = measure(store, nbytes, args.repeats)
            print(f"{nbytes / 1e6:>6.1f} {t['in line'] * 1e3:>11.1f} {t['aside'] * 1e3:>9.1f} "
                  f"{t['floor'] * 1e3:>9.1f} {t['aside'] / t['in line']:>14.2f} "
                  f"{t['aside'] / t['floor']:>12.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
