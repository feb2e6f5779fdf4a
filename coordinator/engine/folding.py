"""Folding accepted updates into a round's aggregate, in an order that does not depend
on when they arrived.

A round's result must be the same bits whatever order its updates came in, and after
any crash: fp32 sums depend on the order of their terms, so synchronous rounds fold
their updates in the order of their sites' ids. An accepted update whose predecessors
in that order are all final (folded, or failed) is folded at once, on the thread that
accepted it; one that arrives early waits in the spool (on disk, not in memory) until
they are, or until the round closes (``fold_remaining``). Async rounds (their result
depends on arrival by design) and secure rounds (a sum of integers modulo 2**32, exact
in any order) fold each update as it comes: the run's aggregator says which
(``Aggregator.ordered``), and takes each update as a ``SpooledUpdate`` to read through.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedra.coordinator.state import INIT_ROUND, ActiveRun, Assignment, TaskState
from fedra.faults import crash_point
from fedra.protos.codec import StreamDecoder
from fedra.protos.compression import (
    Piece,
    StreamingDecompressor,
    compressed_specs,
    from_wire_u32,
)
from fedra.runspec import CodecSpec

if TYPE_CHECKING:
    from fedra.coordinator.engine.core import Engine


def fold_ready(engine: Engine, run: ActiveRun) -> None:
    """Fold every accepted update whose turn has come (call without the engine's lock).

    One thread folds at a time; a thread that finds another folding leaves its update
    to it: the folder looks again after letting go of ``fold_lock``."""
    while True:
        if not run.fold_lock.acquire(blocking=False):
            return
        try:
            _fold_turns(engine, run, to_the_end=False)
        finally:
            run.fold_lock.release()
        with engine._lock:
            if _next_turn(run, to_the_end=False) is None:
                return


def has_turn(run: ActiveRun) -> bool:
    """Whether an accepted update waits for a fold it could have now (engine lock held):
    the site before it failed, and no upload's thread is folding."""
    return run.folding == 0 and _next_turn(run, to_the_end=False) is not None


def fold_remaining(engine: Engine, run: ActiveRun) -> None:
    """The round has closed (no upload can be accepted): fold what still waits, skipping
    the sites that never delivered."""
    with run.fold_lock:
        _fold_turns(engine, run, to_the_end=True)


def _fold_turns(engine: Engine, run: ActiveRun, *, to_the_end: bool) -> None:
    while True:
        with engine._lock:
            turn = _next_turn(run, to_the_end)
            if turn is None:
                return
            digest, samples, site = turn.update_sha256, turn.num_samples, turn.site_id
        assert digest is not None
        fold(engine, run, digest, samples, site)
        with engine._lock:
            run.folded.add(site)
            run.folded_at = time.perf_counter()


def _next_turn(run: ActiveRun, to_the_end: bool) -> Assignment | None:
    """The next accepted update to fold (engine lock held), or None if there is none yet:
    in site order, a site still training or uploading blocks the ones after it."""
    ordered = run.aggregator.ordered
    order, start = run.fold_order()
    for i in range(start, len(order)):
        site = order[i]
        a = run.assignments[site]
        if site in run.folded or a.state is TaskState.FAILED:
            if i == start:  # done with for good: the next look starts after it
                start += 1
                run.fold_from = start
            continue
        if a.state is TaskState.ACCEPTED:
            return a
        if ordered and not to_the_end:
            return None
    return None


def fold(engine: Engine, run: ActiveRun, digest: str, num_samples: int, site_id: str) -> None:
    """Stream a spooled update into the round's aggregate (``run.fold_lock`` held)."""
    started = time.perf_counter()
    try:
        _fold(engine, run, digest, num_samples, site_id)
    finally:
        run.aggregate_s += time.perf_counter() - started


def _fold(engine: Engine, run: ActiveRun, digest: str, num_samples: int, site_id: str) -> None:
    if run.open_round == INIT_ROUND:
        run.init_sha256 = digest
        return
    a = run.assignments.get(site_id)
    staleness = run.staleness(a) if a is not None else 0
    run.aggregator.fold(site_id, _Spooled(engine, run, digest), num_samples, staleness)


@dataclass(frozen=True)
class _Spooled:
    """An accepted update in the spool (``aggregators.SpooledUpdate``)."""

    engine: Engine
    run: ActiveRun
    digest: str

    def dense(self) -> Iterator[Piece]:
        return _dense_pieces(self.engine, self.run, self.digest)

    def masked(self) -> Iterator[tuple[int, torch.Tensor]]:
        return _masked_pieces(self.engine, self.run, self.digest)


def _dense_pieces(engine: Engine, run: ActiveRun, digest: str) -> Iterator[Piece]:
    """The decompressed pieces of a spooled update, chunk by chunk."""
    specs = run.update_specs
    assert specs is not None
    codec = run.spec.codec
    decoder = StreamDecoder(compressed_specs(specs, codec), copy=False)
    dense = StreamingDecompressor(specs, codec)
    first = True  # (not enumerate: its cached result tuple would hold the last block)
    for chunk in engine.updates.read_chunks(digest):
        yield from dense.feed(decoder.feed(chunk))
        del chunk  # not held while the next block is read
        if first:
            crash_point("mid_fold", run.open_round or 0)
            first = False
    decoder.finish()
    dense.finish()


def _masked_pieces(
    engine: Engine, run: ActiveRun, digest: str
) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset, values in [0, 2**32)) runs of a spooled masked update."""
    assert run.model_specs is not None
    decoder = StreamDecoder(compressed_specs(run.model_specs, CodecSpec("secagg")), copy=False)
    for chunk in engine.updates.read_chunks(digest):
        for piece in decoder.feed(chunk):
            yield piece.offset, from_wire_u32(piece.values)
        del chunk
    decoder.finish()
