"""Robust aggregation: coordinate-wise median, trimmed mean, Krum and Multi-Krum.

``WeightedSum`` folds updates into a running mean and never holds one whole; a robust rule
needs every complete update of the round at once. ``UpdateStore`` keeps them as flat fp32
vectors, in memory up to a byte limit and past it in memory-mapped files, and ``aggregate``
reads them back in coordinate blocks, so its working memory is bounded by ``block_bytes`` plus
the output, whatever the number of updates.

Every update counts once: sample counts are claims that a malicious site controls, so the
robust rules ignore them (a site claiming a million samples would otherwise outvote the rest).

Optional norm bounding scales update ``i`` by ``min(1, bound / ||u_i||)`` as it is read; the
stored update is never rewritten. Integer tensors are not aggregated, as in ``WeightedSum``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch

from fedra.protos.codec import TensorPiece, TensorSpec
from fedra.protos.compression import SparsePiece

ROBUST_RULES = ("median", "trimmed_mean", "krum", "multikrum")

_NORM_CHUNK = 1 << 20  # elements per step when computing a norm in float64


class RobustError(ValueError):
    """Bad robust-aggregation parameters, too few updates, or a malformed update."""


@dataclass(frozen=True)
class RobustRule:
    """A robust aggregation rule and its parameters (validated on construction)."""

    name: str
    trim: float = 0.1  # trimmed_mean: share of updates cut at each end, in [0, 0.5)
    byzantine: int = 1  # krum/multikrum: f, the number of bad updates tolerated
    select: int = 0  # multikrum: m, how many best-scored updates are averaged (0: n - f)

    def __post_init__(self) -> None:
        if self.name not in ROBUST_RULES:
            raise RobustError(f"rule name must be one of {ROBUST_RULES}, got {self.name!r}")
        if not 0.0 <= self.trim < 0.5:  # also rejects NaN
            raise RobustError(f"trim must lie in [0, 0.5), got {self.trim}")
        if self.byzantine < 0:
            raise RobustError(f"byzantine must be >= 0, got {self.byzantine}")
        if self.select < 0:
            raise RobustError(f"select must be >= 0 (0 means n - byzantine), got {self.select}")

    def trimmed(self, n: int) -> int:
        """trimmed_mean: how many updates are cut at each end, ``floor(trim * n)``."""
        return math.floor(self.trim * n)

    def selected(self, n: int) -> int:
        """How many updates the result is averaged from for ``n`` updates."""
        if self.name == "krum":
            return 1
        if self.name == "multikrum":
            return self.select or n - self.byzantine
        return n

    def check(self, n: int) -> None:
        """RobustError if ``n`` updates are too few for this rule."""
        if n < 1:
            raise RobustError(f"{self.name} needs at least 1 update, got {n}")
        if self.name == "trimmed_mean":
            kept = n - 2 * self.trimmed(n)
            if kept < 1:
                raise RobustError(
                    f"trimmed_mean with trim={self.trim} keeps n - 2*floor(trim*n) = {kept} "
                    f"of n={n} updates, needs at least 1"
                )
        elif self.name in ("krum", "multikrum"):
            need = 2 * self.byzantine + 3
            if n < need:
                raise RobustError(
                    f"{self.name} with byzantine={self.byzantine} needs n >= 2*byzantine+3 = "
                    f"{need} updates, got {n}"
                )
            if self.name == "multikrum" and self.select > n:
                raise RobustError(f"multikrum select={self.select} exceeds the n={n} updates")


class _Slot(NamedTuple):
    start: int
    numel: int
    shape: tuple[int, ...]


class UpdateStore:
    """The complete dense updates of one round: in memory while their total stays under
    ``memory_limit_bytes``, after that each new update goes to an fp32 file in ``spill_dir``
    that is memory-mapped (``torch.from_file(path, shared=True, size=numel, dtype=float32)``).

    An update is one flat float32 vector: every floating-point tensor of ``specs``, in specs'
    order, concatenated. Several writers may be open at once; the store is not thread-safe.
    """

    def __init__(
        self, specs: Mapping[str, TensorSpec], spill_dir: Path, memory_limit_bytes: int
    ) -> None:
        self.specs = dict(specs)
        self.spill_dir = Path(spill_dir)
        self.memory_limit_bytes = memory_limit_bytes
        self._slots: dict[str, _Slot] = {}
        start = 0
        for name, spec in self.specs.items():
            if spec.dtype.is_floating_point:
                self._slots[name] = _Slot(start, spec.numel, spec.shape)
                start += spec.numel
        self._numel = start
        self._layout = list(self._slots.items())
        self._starts = [slot.start for slot in self._slots.values()]
        self._updates: list[torch.Tensor] = []
        self._paths: list[Path | None] = []
        self._norms: list[float] = []
        self._writers: set[UpdateWriter] = set()
        self._memory_bytes = 0  # finished and open in-memory updates
        self._closed = False

    @property
    def numel(self) -> int:
        """Elements of one flat update (the floating-point tensors only)."""
        return self._numel

    @property
    def spilled(self) -> int:
        """How many finished updates live on disk."""
        return sum(path is not None for path in self._paths)

    def __len__(self) -> int:
        return len(self._updates)

    def norms(self) -> list[float]:
        """The L2 norm of each finished update, computed in float64."""
        return list(self._norms)

    def begin(self) -> UpdateWriter:
        """Start a new update: a zeroed flat vector, in memory or in a fresh spill file."""
        if self._closed:
            raise RobustError("the update store is closed")
        nbytes = self._numel * 4
        path: Path | None = None
        if nbytes == 0 or self._memory_bytes + nbytes <= self.memory_limit_bytes:
            flat = torch.zeros(self._numel, dtype=torch.float32)
            self._memory_bytes += nbytes
        else:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="update-", suffix=".f32", dir=self.spill_dir)
            path = Path(name)
            try:
                os.ftruncate(fd, nbytes)  # a sparse file of zeros
            finally:
                os.close(fd)
            try:
                flat = torch.from_file(name, shared=True, size=self._numel, dtype=torch.float32)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        writer = UpdateWriter(self, flat, path)
        self._writers.add(writer)
        return writer

    def _finish(self, writer: UpdateWriter, norm: float) -> int:
        self._writers.discard(writer)
        self._updates.append(writer._flat)
        self._paths.append(writer._path)
        self._norms.append(norm)
        return len(self._updates) - 1

    def _abort(self, writer: UpdateWriter) -> None:
        self._writers.discard(writer)
        if writer._path is None:
            self._memory_bytes -= writer._flat.numel() * 4
        else:
            writer._path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop every update, open writers included, and delete the spill files; idempotent."""
        for writer in list(self._writers):
            writer.abort()
        self._updates.clear()
        self._norms.clear()
        for path in self._paths:
            if path is not None:
                path.unlink(missing_ok=True)
        self._paths.clear()
        with contextlib.suppress(OSError):  # the round's folder, once it is empty
            self.spill_dir.rmdir()
        self._memory_bytes = 0
        self._closed = True

    def __enter__(self) -> UpdateStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class UpdateWriter:
    """Fills one update of an ``UpdateStore`` from codec pieces; ``finish`` or ``abort`` it."""

    def __init__(self, store: UpdateStore, flat: torch.Tensor, path: Path | None) -> None:
        self._store = store
        self._flat = flat
        self._path = path
        self._done = False

    def _slot(self, name: str) -> _Slot | None:
        slot = self._store._slots.get(name)
        if slot is None and name not in self._store.specs:
            raise RobustError(f"piece for unknown tensor {name!r}")
        return slot

    def add_pieces(self, pieces: Iterable[TensorPiece | SparsePiece]) -> None:
        """Write dense runs at their offsets, add sparse values at their indices (cast to fp32).

        Pieces of integer tensors are skipped; an unknown name or a position outside the
        tensor raises RobustError.
        """
        if self._done:
            raise RobustError("the update is already finished or aborted")
        for piece in pieces:
            slot = self._slot(piece.name)
            if slot is None:  # integer buffers are not aggregated
                continue
            target = self._flat[slot.start : slot.start + slot.numel]
            values = piece.values.reshape(-1)
            if isinstance(piece, SparsePiece):
                indices = piece.indices.reshape(-1).to(torch.int64)
                if indices.numel() != values.numel():
                    raise RobustError(
                        f"tensor {piece.name!r}: {indices.numel()} indices for "
                        f"{values.numel()} values"
                    )
                if indices.numel() and not (
                    int(indices.min()) >= 0 and int(indices.max()) < slot.numel
                ):
                    raise RobustError(
                        f"tensor {piece.name!r}: indices must lie in [0, {slot.numel})"
                    )
                target.index_add_(0, indices, values.to(torch.float32))
                continue
            end = piece.offset + values.numel()
            if piece.offset < 0 or end > slot.numel:
                raise RobustError(
                    f"tensor {piece.name!r}: piece [{piece.offset}, {end}) outside "
                    f"[0, {slot.numel})"
                )
            target[piece.offset : end].copy_(values)

    def finish(self) -> int:
        """Record the update and its L2 norm; returns its index in the store.

        An update with a non-finite value is discarded and raises RobustError: NaN or inf
        would poison distances and sorts rather than be outvoted.
        """
        if self._done:
            raise RobustError("the update is already finished or aborted")
        norm = _norm(self._flat)
        if not math.isfinite(norm):
            self.abort()
            raise RobustError(f"update has non-finite values (norm {norm})")
        self._done = True
        return self._store._finish(self, norm)

    def abort(self) -> None:
        """Discard the update (deleting its spill file); a no-op once finished or aborted."""
        if self._done:
            return
        self._done = True
        self._store._abort(self)


def _norm(flat: torch.Tensor) -> float:
    """The L2 norm in float64, a bounded chunk at a time."""
    total = 0.0
    for start in range(0, flat.numel(), _NORM_CHUNK):
        chunk = flat[start : start + _NORM_CHUNK].to(torch.float64)
        total += float(torch.dot(chunk, chunk))
    return math.sqrt(total)


@dataclass
class RobustResult:
    """The robust aggregate and how it was built."""

    mean: dict[str, torch.Tensor]  # one float32 tensor per floating tensor, shaped like specs
    selected: list[int] = field(default_factory=list)  # updates the result is built from
    scales: list[float] = field(default_factory=list)  # norm-bounding factor of each update


def aggregate(
    store: UpdateStore,
    rule: RobustRule,
    *,
    norm_bound: float = 0.0,
    block_bytes: int = 64 << 20,
) -> RobustResult:
    """Aggregate the finished updates of ``store`` with ``rule``, unweighted.

    ``norm_bound > 0`` first scales update ``i`` by ``min(1, norm_bound / ||u_i||)``. Updates
    are read in coordinate blocks of ``B`` elements with ``n * B * 4 <= block_bytes`` (B >= 1).
    """
    n = len(store)
    if n == 0:
        raise RobustError("no updates to aggregate")
    if math.isnan(norm_bound) or norm_bound < 0:
        raise RobustError(f"norm_bound must be >= 0 (0: no bound), got {norm_bound}")
    if block_bytes <= 0:
        raise RobustError(f"block_bytes must be positive, got {block_bytes}")
    rule.check(n)
    scales = [
        min(1.0, norm_bound / norm) if norm_bound > 0 and norm > 0 else 1.0
        for norm in store.norms()
    ]
    block = max(1, block_bytes // (4 * n))
    out = {name: torch.zeros(s.shape, dtype=torch.float32) for name, s in store._slots.items()}
    if rule.name in ("median", "trimmed_mean"):
        _coordinatewise(store, rule, scales, block, out)
        return RobustResult(out, list(range(n)), scales)
    selected = _krum_select(store, rule, scales, block)
    _average(store, selected, scales, block, out)
    return RobustResult(out, selected, scales)


def _blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, block):
        yield start, min(start + block, numel)


def _read(
    store: UpdateStore, scales: list[float], start: int, end: int, buf: torch.Tensor
) -> torch.Tensor:
    """Rows ``[start, end)`` of every norm-bounded update, stacked into ``buf``."""
    rows = buf[:, : end - start]
    for i, scale in enumerate(scales):
        row = rows[i]
        row.copy_(store._updates[i][start:end])
        if scale != 1.0:
            row.mul_(scale)
    return rows


def _scatter(
    store: UpdateStore, out: dict[str, torch.Tensor], start: int, values: torch.Tensor
) -> None:
    """Write the flat block ``values``, beginning at ``start``, into the output tensors."""
    end = start + values.numel()
    # The last slot starting at or before ``start`` holds it (empty slots before it share its
    # start and need nothing); later ones are visited until one starts past the block.
    first = bisect.bisect_right(store._starts, start) - 1
    for index in range(max(first, 0), len(store._layout)):
        name, slot = store._layout[index]
        if slot.start >= end:
            break
        lo, hi = max(start, slot.start), min(end, slot.start + slot.numel)
        if lo < hi:
            flat = out[name].view(-1)
            flat[lo - slot.start : hi - slot.start].copy_(values[lo - start : hi - start])


def _coordinatewise(
    store: UpdateStore,
    rule: RobustRule,
    scales: list[float],
    block: int,
    out: dict[str, torch.Tensor],
) -> None:
    n = len(scales)
    k = rule.trimmed(n) if rule.name == "trimmed_mean" else 0
    buf = torch.empty(n, min(block, store.numel), dtype=torch.float32)
    for start, end in _blocks(store.numel, block):
        ordered = _read(store, scales, start, end, buf).sort(dim=0).values
        if rule.name == "median":
            mid = n // 2
            if n % 2:
                values = ordered[mid]
            else:  # the mean of the two middle values, not torch.median's lower one
                low, high = ordered[mid - 1].to(torch.float64), ordered[mid].to(torch.float64)
                values = ((low + high) / 2).to(torch.float32)
        else:
            kept = ordered[k : n - k]
            values = (kept.sum(dim=0, dtype=torch.float64) / kept.shape[0]).to(torch.float32)
        _scatter(store, out, start, values)


def _krum_select(
    store: UpdateStore, rule: RobustRule, scales: list[float], block: int
) -> list[int]:
    """Krum scores (Blanchard et al. 2017) and the indices of the best ``rule.selected(n)``."""
    n = len(scales)
    squared = torch.zeros(n, n, dtype=torch.float64)
    buf = torch.empty(n, min(block, store.numel), dtype=torch.float32)
    for start, end in _blocks(store.numel, block):
        rows = _read(store, scales, start, end, buf).to(torch.float64)
        gram = rows @ rows.T
        sq = gram.diagonal()
        # ||a - b||^2 = ||a||^2 + ||b||^2 - 2 a.b; products of fp32 values are exact in fp64.
        squared += (sq[:, None] + sq[None, :] - 2 * gram).clamp_min_(0)
    squared.fill_diagonal_(0)
    closest = n - rule.byzantine - 2
    scores: list[tuple[float, int]] = []
    for i in range(n):
        others = torch.cat([squared[i, :i], squared[i, i + 1 :]])
        score = float(others.sort().values[:closest].sum())
        scores.append((score, i))
    scores.sort()  # lowest score first, ties to the lowest index
    return sorted(i for _, i in scores[: rule.selected(n)])


def _average(
    store: UpdateStore,
    selected: list[int],
    scales: list[float],
    block: int,
    out: dict[str, torch.Tensor],
) -> None:
    """The plain mean of the selected norm-bounded updates, block by block in float64."""
    for start, end in _blocks(store.numel, block):
        acc = torch.zeros(end - start, dtype=torch.float64)
        for i in selected:
            acc.add_(store._updates[i][start:end].to(torch.float64), alpha=scales[i])
        _scatter(store, out, start, (acc / len(selected)).to(torch.float32))
