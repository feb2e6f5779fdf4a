"""What spooling one small update costs: as a file, against in its participation row.

A coordinator must make each update durable before it answers the upload. This measures
the two ways ``storage.spool`` has, with the real classes, on this machine's disk and
database (SQLite, ``synchronous=FULL``, as the daemon runs it):

- **file**: ``BlobStore.put`` of the update (a temporary file, its fsync, a rename and
  an fsync of the directory), then its accept;
- **row**: its accept with the update's bytes (``Store.accept_op(..., data=...)``).

Either way the accepts are written ``--batch`` to a synced transaction, as the group
commit writes them: the difference is the file alone.

Each is timed over ``--updates`` updates of ``--bytes`` bytes, CPU (user + system of this
process) and wall clock per update; the ratio file/row is printed for both.

    .venv/bin/python bench/spool_cost.py --updates 300 --bytes 200
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fedra.storage import Store
from fedra.storage.blobs import BlobStore
from fedra.storage.spool import UpdateSpool

RUN = "spool-bench"


def _tasks(store: Store, number: int, n: int) -> list[str]:
    sites = {f"s{i:05d}": f"t{number}-{i:05d}" for i in range(n)}
    store.open_round(RUN, number, 1, sites, time.time(), time.time() + 600)
    return list(sites.values())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _timed(work: Callable[[], None]) -> tuple[float, float]:
    """(CPU seconds, user and system, of the process; wall seconds) that ``work`` took,
    to the clock's nanoseconds (``os.times`` counts in 10 ms ticks)."""
    t0, w0 = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - t0, time.perf_counter() - w0


def measure(root: Path, updates: int, size: int, batch: int) -> dict[str, float]:
    store = Store(f"sqlite:///{root / 'fedra.db'}")
    try:
        store.create_run(RUN, "bench", "task", "{}", time.time())
        store.set_run_state(RUN, "running", "", time.time())
        spool = UpdateSpool(BlobStore(root / "updates"), store)
        payloads = [os.urandom(size) for _ in range(updates)]

        def accept(task: str, digest: str, data: bytes | None) -> Callable[..., None]:
            return store.accept_op(
                task, nonce=os.urandom(16), sha256=digest, num_samples=1, metrics={},
                bytes_up=size, upload_s=0.0, now=time.time(), data=data,
            )  # fmt: skip

        file_tasks = _tasks(store, 1, updates)

        def write(ops: list[Callable[..., None]]) -> None:
            for start in range(0, len(ops), batch):
                assert not any(store.write_batch(ops[start : start + batch]))

        def as_files() -> None:  # each file fsynced, renamed, its directory fsynced
            write(
                [accept(t, spool.put(d), None) for t, d in zip(file_tasks, payloads, strict=True)]
            )

        row_tasks = _tasks(store, 2, updates)

        def as_rows() -> None:
            pairs = zip(row_tasks, payloads, strict=True)
            write([accept(t, _sha(d), d) for t, d in pairs])

        file_cpu, file_wall = _timed(as_files)
        row_cpu, row_wall = _timed(as_rows)
    finally:
        store.close()
    per = 1e6 / updates
    return {
        "updates": updates,
        "bytes": size,
        "batch": batch,
        "file_cpu_us": file_cpu * per,
        "file_wall_us": file_wall * per,
        "row_cpu_us": row_cpu * per,
        "row_wall_us": row_wall * per,
        "cpu_ratio": file_cpu / max(row_cpu, 1e-9),
        "wall_ratio": file_wall / max(row_wall, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=200, help="each update's size")
    parser.add_argument("--batch", type=int, default=100, help="accepts per group commit")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedra-spool-") as tmp:
        r = measure(Path(tmp), args.updates, args.bytes, args.batch)
    print(f"{r['updates']} updates of {r['bytes']} bytes (rows: {r['batch']} to a commit)")
    print(f"  as files: {r['file_cpu_us']:8.0f} us CPU, {r['file_wall_us']:8.0f} us wall each")
    print(f"  in rows:  {r['row_cpu_us']:8.0f} us CPU, {r['row_wall_us']:8.0f} us wall each")
    print(f"  file / row: {r['cpu_ratio']:.1f}x the CPU, {r['wall_ratio']:.1f}x the time")
    if args.out:
        args.out.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
