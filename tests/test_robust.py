"""Tests for robust aggregation: median, trimmed mean, Krum, Multi-Krum and norm bounding.

References are computed directly on a stacked float64 tensor of the same updates (sort-based
median and trimmed mean, brute-force Krum), and compared whatever the storage (in memory,
spilled, mixed) and the block size.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from fedra.coordinator.robust import (
    ROBUST_RULES,
    RobustError,
    RobustRule,
    UpdateStore,
    UpdateWriter,
    aggregate,
)
from fedra.protos.codec import StreamDecoder, TensorPiece, TensorSpec, encode_chunks
from fedra.protos.compression import SparsePiece

SPECS: dict[str, TensorSpec] = {
    "conv.weight": TensorSpec(torch.float32, (4, 3, 3)),
    "conv.bias": TensorSpec(torch.float32, ()),  # 0-d
    "bn.num_batches_tracked": TensorSpec(torch.int64, (2,)),  # ignored
    "half": TensorSpec(torch.float16, (7, 2)),
    "empty": TensorSpec(torch.float32, (0, 3)),
    "f64": TensorSpec(torch.float64, (2, 3, 2)),
    "bf": TensorSpec(torch.bfloat16, (5,)),
}
FLOATS = [name for name, spec in SPECS.items() if spec.dtype.is_floating_point]
NUMEL = sum(SPECS[name].numel for name in FLOATS)
UPDATE_BYTES = NUMEL * 4

RULES = [
    RobustRule("median"),
    RobustRule("trimmed_mean", trim=0.2),
    RobustRule("krum", byzantine=1),
    RobustRule("multikrum", byzantine=1),
    RobustRule("multikrum", byzantine=2, select=3),
]
RULE_IDS = ["median", "trimmed", "krum", "multikrum", "multikrum-m3"]


# ---------------------------------------------------------------- helpers and references


def _update(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in SPECS.items():
        if spec.dtype.is_floating_point:
            out[name] = (torch.randn(spec.shape, generator=g) * scale).to(spec.dtype)
        else:
            out[name] = torch.tensor([seed, -3], dtype=spec.dtype)
    return out


def _flat(update: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The update as the store lays it out: float tensors in spec order, as fp32 -> fp64."""
    parts = [update[name].reshape(-1).float() for name in FLOATS]
    return torch.cat(parts).double()


def _flat_result(mean: Mapping[str, torch.Tensor]) -> torch.Tensor:
    assert list(mean) == FLOATS
    for name, tensor in mean.items():
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == SPECS[name].shape
    return torch.cat([mean[name].reshape(-1) for name in FLOATS]).double()


def _pieces(update: Mapping[str, torch.Tensor], mode: str, seed: int) -> list[Any]:
    """One update as codec pieces: whole tensors, shuffled runs, or sparse index sets."""
    rng = random.Random(seed)
    pieces: list[Any] = []
    for name, tensor in update.items():
        flat = tensor.reshape(-1)
        if mode == "dense":
            pieces.append(TensorPiece(name, 0, flat))
        elif mode == "runs":
            cuts = sorted({0, flat.numel(), *(rng.randrange(flat.numel() + 1) for _ in range(3))})
            pieces += [TensorPiece(name, a, flat[a:b]) for a, b in itertools.pairwise(cuts)]
        else:  # sparse: the values split in two parts, the second in two overlapping halves
            if not tensor.dtype.is_floating_point:
                pieces.append(TensorPiece(name, 0, flat))
                continue
            perm = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))
            half = flat.float() / 2
            first, second = perm[: flat.numel() // 2], perm[flat.numel() // 2 :]
            pieces.append(SparsePiece(name, first.to(torch.int32), flat[first].float()))
            pieces.append(SparsePiece(name, second, half[second]))
            pieces.append(SparsePiece(name, second.flip(0), half[second.flip(0)]))
    rng.shuffle(pieces)
    return pieces


def _fill(store: UpdateStore, updates: Sequence[Mapping[str, torch.Tensor]], mode: str) -> None:
    for i, update in enumerate(updates):
        writer = store.begin()
        writer.add_pieces(_pieces(update, mode, seed=i))
        assert writer.finish() == i


def _ref_median(x: torch.Tensor) -> torch.Tensor:
    ordered = x.sort(dim=0).values
    n = x.shape[0]
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _ref_trimmed(x: torch.Tensor, trim: float) -> torch.Tensor:
    n = x.shape[0]
    k = math.floor(trim * n)
    return x.sort(dim=0).values[k : n - k].mean(dim=0)


def _ref_krum(x: torch.Tensor, f: int, m: int) -> tuple[torch.Tensor, list[int]]:
    """Blanchard et al. 2017, written plainly: scores, the m best, their mean."""
    n = x.shape[0]
    scores = []
    for i in range(n):
        distances = sorted(float(((x[i] - x[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(distances[: n - f - 2]))
    best = sorted(range(n), key=lambda i: (scores[i], i))[:m]
    return x[best].mean(dim=0), sorted(best)


def _reference(x: torch.Tensor, rule: RobustRule) -> tuple[torch.Tensor, list[int]]:
    n = x.shape[0]
    if rule.name == "median":
        return _ref_median(x), list(range(n))
    if rule.name == "trimmed_mean":
        return _ref_trimmed(x, rule.trim), list(range(n))
    m = 1 if rule.name == "krum" else (rule.select or n - rule.byzantine)
    return _ref_krum(x, rule.byzantine, m)


def _check(
    store: UpdateStore, x: torch.Tensor, rule: RobustRule, *, block_bytes: int = 64 << 20
) -> None:
    result = aggregate(store, rule, block_bytes=block_bytes)
    expected, selected = _reference(x, rule)
    assert result.selected == selected
    assert result.scales == [1.0] * x.shape[0]
    assert_close(_flat_result(result.mean), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- rules against references


@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("storage", ["memory", "spilled", "mixed"])
@pytest.mark.parametrize("block_bytes", [64 << 20, 3 * 4 * 8], ids=["one-block", "tiny"])
def test_rules_match_reference(
    tmp_path: Path, n: int, rule: RobustRule, storage: str, block_bytes: int
) -> None:
    updates = [_update(seed) for seed in range(n)]
    x = torch.stack([_flat(u) for u in updates])
    limit = {"memory": 1 << 30, "spilled": 0, "mixed": int(2.5 * UPDATE_BYTES)}[storage]
    with UpdateStore(SPECS, tmp_path / "spill", limit) as store:
        _fill(store, updates, "dense")
        assert len(store) == n
        assert store.numel == NUMEL == x.shape[1]
        assert store.spilled == {"memory": 0, "spilled": n, "mixed": n - 2}[storage]
        _check(store, x, rule, block_bytes=block_bytes)


@pytest.mark.parametrize("block_bytes", [1, 4 * 7, 4 * 7 * 5 + 3])
def test_block_sizes_do_not_change_the_result(tmp_path: Path, block_bytes: int) -> None:
    updates = [_update(seed) for seed in range(7)]
    x = torch.stack([_flat(u) for u in updates])
    with UpdateStore(SPECS, tmp_path, 4 * UPDATE_BYTES) as store:
        _fill(store, updates, "dense")
        for rule in RULES:
            _check(store, x, rule, block_bytes=block_bytes)


def test_single_update(tmp_path: Path) -> None:
    update = _update(3)
    with UpdateStore(SPECS, tmp_path, 0) as store:
        _fill(store, [update], "dense")
        for rule in (RobustRule("median"), RobustRule("trimmed_mean", trim=0.4)):
            result = aggregate(store, rule)
            assert result.selected == [0]
            assert_close(_flat_result(result.mean), _flat(update))


def test_krum_ties_go_to_the_lowest_index(tmp_path: Path) -> None:
    same = _update(1)
    with UpdateStore(SPECS, tmp_path, 1 << 20) as store:
        _fill(store, [same] * 5, "dense")
        assert aggregate(store, RobustRule("krum")).selected == [0]
        assert aggregate(store, RobustRule("multikrum", select=2)).selected == [0, 1]


def test_krum_scores_the_n_minus_f_minus_2_closest(tmp_path: Path) -> None:
    # On a line (dyadic, so every distance is exact): 1.25 has the best two closest neighbours
    # (0.0625 + 0.0625), while 1.0 would win with three, so counting one too many picks another.
    positions = [0.0, 0.125, 1.0, 1.25, 1.5]
    specs = {"w": TensorSpec(torch.float64, (2,))}
    with UpdateStore(specs, tmp_path, 0) as store:
        for p in positions:
            writer = store.begin()
            writer.add_pieces([TensorPiece("w", 0, torch.tensor([p, 0.0]))])
            writer.finish()
        result = aggregate(store, RobustRule("krum", byzantine=1))
        assert result.selected == [3]
        assert result.mean["w"].tolist() == [1.25, 0.0]
        result = aggregate(store, RobustRule("multikrum", byzantine=1, select=2))
        assert result.selected == [2, 3]  # 1.0 and 1.5 tie at 0.3125: the lower index wins
        assert result.mean["w"].tolist() == [1.125, 0.0]


# ---------------------------------------------------------------- storage and pieces


def test_spill_files_live_while_open_and_go_on_close(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    store = UpdateStore(SPECS, spill, 0)
    _fill(store, [_update(seed) for seed in range(4)], "dense")
    files = sorted(spill.iterdir())
    assert store.spilled == len(files) == 4
    assert all(path.stat().st_size == UPDATE_BYTES for path in files)
    store.close()
    assert not spill.exists(), "close() removes the files and their now empty folder"
    assert len(store) == 0
    store.close()  # idempotent
    with pytest.raises(RobustError, match="closed"):
        store.begin()


def test_mixed_limit_keeps_the_first_in_memory(tmp_path: Path) -> None:
    with UpdateStore(SPECS, tmp_path, 2 * UPDATE_BYTES) as store:
        _fill(store, [_update(seed) for seed in range(5)], "dense")
        assert store.spilled == 3
        assert len(list(tmp_path.iterdir())) == 3
    assert not tmp_path.exists()


def test_abort_frees_memory_and_deletes_spill_file(tmp_path: Path) -> None:
    with UpdateStore(SPECS, tmp_path, UPDATE_BYTES) as store:
        writer = store.begin()  # in memory
        writer.add_pieces(_pieces(_update(0), "dense", 0))
        writer.abort()
        writer.abort()  # no-op
        _fill(store, [_update(1)], "dense")  # still fits in memory: the abort freed it
        assert store.spilled == 0
        spilled = store.begin()
        assert len(list(tmp_path.iterdir())) == 1
        spilled.abort()
        assert list(tmp_path.iterdir()) == []
        assert len(store) == 1
        with pytest.raises(RobustError, match="already finished or aborted"):
            spilled.add_pieces([])
        open_writer = store.begin()
        assert len(list(tmp_path.iterdir())) == 1
    assert not tmp_path.exists()  # close() aborts open writers too
    with pytest.raises(RobustError, match="already finished or aborted"):
        open_writer.finish()


@pytest.mark.parametrize("mode", ["runs", "sparse"])
@pytest.mark.parametrize("limit", [1 << 30, 0], ids=["memory", "spilled"])
def test_pieces_in_runs_and_sparse(tmp_path: Path, mode: str, limit: int) -> None:
    updates = [_update(seed) for seed in range(6)]
    x = torch.stack([_flat(u) for u in updates])
    with UpdateStore(SPECS, tmp_path, limit) as store:
        _fill(store, updates, mode)
        for i, update in enumerate(updates):
            assert_close(store.norms()[i], float(_flat(update).norm()), rtol=1e-6, atol=0)
        for rule in (RobustRule("median"), RobustRule("krum"), RobustRule("multikrum")):
            _check(store, x, rule)


def test_dense_runs_write_and_sparse_pieces_add(tmp_path: Path) -> None:
    specs = {"w": TensorSpec(torch.float32, (6,))}
    with UpdateStore(specs, tmp_path, 0) as store:
        writer = store.begin()
        writer.add_pieces([TensorPiece("w", 2, torch.tensor([1.0, 2.0]))])
        writer.add_pieces([SparsePiece("w", torch.tensor([3, 5, 3]), torch.tensor([10.0, 1, 1]))])
        writer.add_pieces([TensorPiece("w", 0, torch.tensor([7.0], dtype=torch.float64))])
        writer.finish()
        result = aggregate(store, RobustRule("median"))
    assert result.mean["w"].tolist() == [7.0, 0.0, 1.0, 13.0, 0.0, 1.0]


def test_updates_from_the_codec_stream(tmp_path: Path) -> None:
    updates = [_update(seed) for seed in range(5)]
    x = torch.stack([_flat(u) for u in updates])
    with UpdateStore(SPECS, tmp_path, 2 * UPDATE_BYTES) as store:
        for update in updates:
            decoder = StreamDecoder(SPECS)
            writer = store.begin()
            for chunk in encode_chunks(update, 7):
                writer.add_pieces(decoder.feed(chunk))
            decoder.finish()
            writer.finish()
        _check(store, x, RobustRule("median"))


def test_bad_pieces_and_updates(tmp_path: Path) -> None:
    with UpdateStore(SPECS, tmp_path, 0) as store:
        writer = store.begin()
        with pytest.raises(RobustError, match="unknown tensor 'nope'"):
            writer.add_pieces([TensorPiece("nope", 0, torch.zeros(1))])
        with pytest.raises(RobustError, match=r"'bf': piece \[3, 6\) outside \[0, 5\)"):
            writer.add_pieces([TensorPiece("bf", 3, torch.zeros(3))])
        with pytest.raises(RobustError, match=r"'bf': indices must lie in \[0, 5\)"):
            writer.add_pieces([SparsePiece("bf", torch.tensor([5]), torch.zeros(1))])
        with pytest.raises(RobustError, match="2 indices for 1 values"):
            writer.add_pieces([SparsePiece("bf", torch.tensor([0, 1]), torch.zeros(1))])
        writer.add_pieces([TensorPiece("conv.bias", 0, torch.tensor([math.inf]))])
        with pytest.raises(RobustError, match="non-finite values"):
            writer.finish()
        assert len(store) == 0
        assert list(tmp_path.iterdir()) == []  # the poisoned update's file is gone


# ---------------------------------------------------------------- norm bounding


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_norm_bounding(tmp_path: Path, rule: RobustRule) -> None:
    updates = [_update(seed, scale=0.5 + seed) for seed in range(7)]
    updates[2] = {name: torch.zeros_like(t) for name, t in updates[2].items()}  # norm 0
    x = torch.stack([_flat(u) for u in updates])
    norms = x.norm(dim=1).tolist()
    bound = sorted(norms)[3]
    with UpdateStore(SPECS, tmp_path, 3 * UPDATE_BYTES) as store:
        _fill(store, updates, "dense")
        assert_close(store.norms(), norms, rtol=1e-12, atol=0)
        result = aggregate(store, rule, norm_bound=bound)
        expected_scales = [1.0 if n == 0 else min(1.0, bound / n) for n in norms]
        assert_close(result.scales, expected_scales, rtol=1e-12, atol=0)
        assert sum(s < 1 for s in result.scales) == 3
        scaled = x * torch.tensor(result.scales, dtype=torch.float64)[:, None]
        expected, selected = _reference(scaled, rule)
        assert result.selected == selected
        assert_close(_flat_result(result.mean), expected, rtol=1e-5, atol=1e-6)
        # Applied lazily: the stored updates are unchanged.
        assert_close(store.norms(), norms, rtol=1e-12, atol=0)
        _check(store, x, rule)
        # A bound above every norm changes nothing; inf means no bound.
        for loose in (max(norms) * 2, math.inf):
            assert aggregate(store, rule, norm_bound=loose).scales == [1.0] * 7


# ---------------------------------------------------------------- Byzantine updates


@pytest.mark.parametrize(
    "attacks", [(-10.0, -10.0), (100.0, 100.0), (-10.0, 100.0)], ids=["flip", "scale", "mixed"]
)
def test_byzantine_updates_are_outvoted(tmp_path: Path, attacks: tuple[float, float]) -> None:
    g = torch.Generator().manual_seed(0)
    true = {name: torch.randn(SPECS[name].shape, generator=g) for name in FLOATS}
    honest = [
        {name: (t + 0.05 * torch.randn(t.shape, generator=g)).to(SPECS[name].dtype)
         for name, t in true.items()}
        for _ in range(7)
    ]  # fmt: skip
    direction = _flat(true)
    honest_mean = torch.stack([_flat(u) for u in honest]).mean(dim=0)
    attackers = [(honest_mean * a).float() for a in attacks]
    x = torch.stack([*(_flat(u) for u in honest), *(a.double() for a in attackers)])
    plain = x.mean(dim=0)

    def error(v: torch.Tensor) -> float:
        return float((v - direction).norm() / direction.norm())

    assert error(plain) > 1.0
    if attacks == (-10.0, -10.0):
        assert float(plain @ direction) < 0  # the plain mean points away
    with UpdateStore(SPECS, tmp_path, 4 * UPDATE_BYTES) as store:
        for update in honest:
            writer = store.begin()
            writer.add_pieces(_pieces(update, "dense", 0))
            writer.finish()
        for attacker in attackers:
            writer = store.begin()
            start = 0
            for name in FLOATS:
                numel = SPECS[name].numel
                writer.add_pieces([TensorPiece(name, 0, attacker[start : start + numel])])
                start += numel
            writer.finish()
        for rule in (
            RobustRule("median"),
            RobustRule("trimmed_mean", trim=0.25),
            RobustRule("krum", byzantine=2),
            RobustRule("multikrum", byzantine=2),
        ):
            result = aggregate(store, rule)
            assert error(_flat_result(result.mean)) < 0.1, rule
            if rule.name in ("krum", "multikrum"):
                assert all(i < 7 for i in result.selected), rule


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "mean"}, r"rule name must be one of .*got 'mean'"),
        ({"name": "trimmed_mean", "trim": 0.5}, r"trim must lie in \[0, 0.5\), got 0.5"),
        ({"name": "trimmed_mean", "trim": -0.1}, r"trim must lie in \[0, 0.5\), got -0.1"),
        ({"name": "trimmed_mean", "trim": math.nan}, r"trim must lie in \[0, 0.5\), got nan"),
        ({"name": "krum", "byzantine": -1}, "byzantine must be >= 0, got -1"),
        ({"name": "multikrum", "select": -2}, "select must be >= 0 .* got -2"),
    ],
)
def test_bad_rule_parameters(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RobustError, match=message):
        RobustRule(**kwargs)


@pytest.mark.parametrize(
    ("rule", "n", "message"),
    [
        (RobustRule("median"), 0, "median needs at least 1 update, got 0"),
        (RobustRule("trimmed_mean", trim=0.3), 0, "trimmed_mean needs at least 1 update, got 0"),
        (RobustRule("krum", byzantine=2), 6, r"n >= 2\*byzantine\+3 = 7 updates, got 6"),
        (RobustRule("multikrum", byzantine=0), 2, r"n >= 2\*byzantine\+3 = 3 updates, got 2"),
        (RobustRule("multikrum", select=6), 5, "multikrum select=6 exceeds the n=5 updates"),
    ],
)
def test_too_few_updates(rule: RobustRule, n: int, message: str) -> None:
    with pytest.raises(RobustError, match=message):
        rule.check(n)


def test_check_accepts_the_minimum() -> None:
    RobustRule("median").check(1)
    RobustRule("trimmed_mean", trim=0.49).check(1)
    RobustRule("krum", byzantine=2).check(7)
    RobustRule("multikrum", byzantine=1, select=5).check(5)
    assert issubclass(RobustError, ValueError)
    assert set(ROBUST_RULES) == {"median", "trimmed_mean", "krum", "multikrum"}


def test_bad_aggregate_arguments(tmp_path: Path) -> None:
    with UpdateStore(SPECS, tmp_path, 1 << 20) as store:
        with pytest.raises(RobustError, match="no updates to aggregate"):
            aggregate(store, RobustRule("median"))
        _fill(store, [_update(seed) for seed in range(4)], "dense")
        with pytest.raises(RobustError, match=r"norm_bound must be >= 0 .*got -1\.0"):
            aggregate(store, RobustRule("median"), norm_bound=-1.0)
        with pytest.raises(RobustError, match=r"norm_bound must be >= 0 .*got nan"):
            aggregate(store, RobustRule("median"), norm_bound=math.nan)
        with pytest.raises(RobustError, match="block_bytes must be positive, got 0"):
            aggregate(store, RobustRule("median"), block_bytes=0)
        with pytest.raises(RobustError, match=r"krum with byzantine=1 needs .* = 5 .*got 4"):
            aggregate(store, RobustRule("krum"))


def test_writers_may_overlap(tmp_path: Path) -> None:
    updates = [_update(seed) for seed in range(3)]
    with UpdateStore(SPECS, tmp_path, UPDATE_BYTES) as store:
        writers: list[UpdateWriter] = [store.begin() for _ in range(3)]  # 1 in memory
        for writer, update in zip(reversed(writers), reversed(updates), strict=True):
            writer.add_pieces(_pieces(update, "runs", 1))
        assert [w.finish() for w in writers] == [0, 1, 2]
        assert store.spilled == 2
        x = torch.stack([_flat(u) for u in updates])
        _check(store, x, RobustRule("median"))
