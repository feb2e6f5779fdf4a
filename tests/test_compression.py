"""Tests for upload compression: codec maths, error feedback, and the coordinator's streaming fold.

References are computed directly (per-block loops, sorted magnitudes, float64 sums); streamed
results go through the real codec (``encode_chunks`` -> ``StreamDecoder``) and must equal
``decompress`` bit for bit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from fedra.coordinator.aggregation import WeightedSum
from fedra.protos.codec import (
    CodecError,
    StreamDecoder,
    TensorSpec,
    decode,
    encode,
    encode_chunks,
    spec_of,
)
from fedra.protos.compression import (
    CODECS,
    SUFFIXES,
    CodecSpec,
    Compressor,
    Piece,
    SparsePiece,
    StreamingDecompressor,
    apply_step,
    compressed_bytes,
    compressed_specs,
    decompress,
    dense_dtype,
    topk_count,
)

SPECS = {
    "none": CodecSpec("none"),
    "fp16": CodecSpec("fp16"),
    "bf16": CodecSpec("bf16"),
    "int8": CodecSpec("int8", block=16),
    "topk": CodecSpec("topk", fraction=0.1),
}
CHUNK_SIZES = [1, 7, 4096]


def make_delta(seed: int) -> dict[str, torch.Tensor]:
    """A site's delta: several float dtypes, odd shapes, a name prefixing another, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(4, 3, 5, generator=g),
        "fc.weight": torch.randn(37, 11, generator=g),  # many blocks, the last partial
        "fc.bias": torch.randn((), generator=g),  # 0-d
        "half": (torch.randn(7, 3, generator=g) * 10).half(),
        "bf": torch.randn(3, 50, generator=g).to(torch.bfloat16),
        "f64": torch.randn(2, 3, 9, dtype=torch.float64, generator=g),
        "empty": torch.zeros(0, 3),
        "w": torch.randn(20, generator=g),
        "w/0x": torch.randn(9, generator=g),  # its wire names sort between those of "w"
        "bn.num_batches_tracked": torch.zeros(2, dtype=torch.int64),
    }


def accumulate(
    model: Mapping[str, TensorSpec], pieces: Iterable[Piece], weight: float = 1.0
) -> dict[str, torch.Tensor]:
    """Mirror of ``WeightedSum.add_pieces`` with the proposed ``SparsePiece`` branch."""
    sums = {
        n: torch.zeros(s.numel, dtype=dense_dtype(s.dtype))
        for n, s in model.items()
        if s.dtype.is_floating_point
    }
    for piece in pieces:
        acc = sums[piece.name]  # a KeyError here means an integer buffer leaked through
        if isinstance(piece, SparsePiece):
            acc.index_add_(0, piece.indices, piece.values.to(acc.dtype), alpha=weight)
            continue
        end = piece.offset + piece.values.numel()
        acc[piece.offset : end].add_(piece.values.to(acc.dtype), alpha=weight)
    return {n: acc.view(model[n].shape) for n, acc in sums.items()}


def stream(
    compressed: Mapping[str, torch.Tensor],
    model: Mapping[str, TensorSpec],
    codec: CodecSpec,
    chunk: int,
) -> dict[str, torch.Tensor]:
    """Fold one compressed update as the coordinator would: codec stream, then decompressor."""
    decoder = StreamDecoder(expected=compressed_specs(model, codec))
    decompressor = StreamingDecompressor(model, codec)
    pieces = (p for data in encode_chunks(compressed, chunk) for p in decoder.feed(data))
    result = accumulate(model, decompressor.feed(pieces))
    decoder.finish()
    decompressor.finish()
    return result


def assert_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


# --- layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_compressed_specs_match_the_compressed_tensors(name: str) -> None:
    delta, codec = make_delta(0), SPECS[name]
    compressed = Compressor(codec).compress(delta)
    assert spec_of(compressed) == compressed_specs(spec_of(delta), codec)


@pytest.mark.parametrize("name", CODECS)
def test_metadata_sorts_before_its_values(name: str) -> None:
    model, codec = spec_of(make_delta(0)), SPECS[name]
    order = sorted(compressed_specs(model, codec))
    floats = [n for n, s in model.items() if s.dtype.is_floating_point]
    if name not in SUFFIXES:
        assert order == sorted(model if name == "none" else floats)
        return
    meta, values = SUFFIXES[name]
    assert len(order) == 2 * len(floats)
    for tensor in floats:
        assert order.index(tensor + meta) < order.index(tensor + values)


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_naming_rule_holds_for_arbitrary_names(name: str) -> None:
    rng = random.Random(0)
    names = {"".join(rng.choices("ab/01_.", k=rng.randint(1, 6))) for _ in range(300)}
    model = {n: TensorSpec(torch.float32, (3,)) for n in names}
    order = sorted(compressed_specs(model, SPECS[name]))
    meta, values = SUFFIXES[name]
    assert len(order) == 2 * len(names)  # no two tensors share a wire name
    position = {n: i for i, n in enumerate(order)}
    assert all(position[n + meta] < position[n + values] for n in names)


def test_stream_delivers_metadata_before_values() -> None:
    delta = make_delta(0)
    for name in ("int8", "topk"):
        compressed = Compressor(SPECS[name]).compress(delta)
        decoder = StreamDecoder(expected=spec_of(compressed))
        seen = [p.name for data in encode_chunks(compressed, 5) for p in decoder.feed(data)]
        meta, values = SUFFIXES[name]
        for tensor in ("fc.weight", "w", "w/0x"):
            assert seen.index(tensor + meta) < seen.index(tensor + values)


# --- codec maths ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_round_trip(name: str, dtype: torch.dtype) -> None:
    delta = make_delta(1)
    model = spec_of(delta)
    out = decompress(Compressor(SPECS[name]).compress(delta), model, SPECS[name])
    eps = torch.finfo(dtype).eps
    for tensor, spec in model.items():
        if not spec.dtype.is_floating_point:
            assert tensor not in out
            continue
        dense = dense_dtype(spec.dtype)
        assert torch.equal(out[tensor], delta[tensor].to(dtype).to(dense))
        assert_close(out[tensor], delta[tensor].to(dense), rtol=eps / 2, atol=1e-6)


def test_fp16_overflow_is_refused_at_the_site() -> None:
    with pytest.raises(ValueError, match=r"'big' overflows fp16"):
        Compressor(SPECS["fp16"]).compress({"big": torch.tensor([7e4])})


def test_int8_blocks_against_reference() -> None:
    block = 16
    g = torch.Generator().manual_seed(2)
    big = torch.randn(100, generator=g) * torch.logspace(-3, 3, 100)  # scales differ per block
    big[:block] = 0  # an all-zero block
    delta = {
        "big": big,  # 6 whole blocks and a partial one of 4
        "small": torch.randn(5, generator=g),  # smaller than a block
        "empty": torch.zeros(0),
        "scalar": torch.tensor(-3.25),
        "f64": torch.randn(40, dtype=torch.float64, generator=g),
    }
    codec = CodecSpec("int8", block=block)
    compressed = Compressor(codec).compress(delta)
    out = decompress(compressed, spec_of(delta), codec)
    for name, x in delta.items():
        flat = x.reshape(-1).float()
        scales, q = compressed[name + "/0_scale"], compressed[name + "/1_q"]
        assert scales.numel() == -(-flat.numel() // block)
        for b in range(scales.numel()):
            part = flat[b * block : (b + 1) * block]
            scale = part.abs().max() / 127
            assert scales[b] == scale
            if scale == 0:  # all-zero block: nothing to scale
                assert not q[b * block : (b + 1) * block].any()
                continue
            assert torch.equal(
                q[b * block : (b + 1) * block], torch.round(part / scale).to(torch.int8)
            )
            err = (out[name].reshape(-1)[b * block : (b + 1) * block] - part).abs()
            assert bool((err <= scale * (0.5 + 1e-5)).all()), (name, b)
    assert not out["big"][:block].any()
    assert out["empty"].shape == (0,) and out["scalar"].shape == ()


def test_topk_keeps_exactly_the_largest() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(25, 40, generator=g)
    codec = CodecSpec("topk", fraction=0.05)
    compressor = Compressor(codec)
    compressed = compressor.compress({"x": x})
    indices, values = compressed["x/0_index"], compressed["x/1_value"]
    k = 50
    assert indices.shape == values.shape == (k,)
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    want = torch.sort(x.reshape(-1).abs(), descending=True).indices[:k]
    assert indices.tolist() == sorted(want.tolist())
    assert torch.equal(values, x.reshape(-1)[indices.long()])
    dense = decompress(compressed, spec_of({"x": x}), codec)["x"].reshape(-1)
    assert torch.equal(dense[indices.long()], values)
    assert torch.count_nonzero(dense) == k
    residual = compressor.residual["x"].reshape(-1)
    assert torch.equal(residual + dense, x.reshape(-1))
    assert not residual[indices.long()].any()


@pytest.mark.parametrize(
    ("numel", "fraction", "k"),
    [(0, 0.01, 0), (1, 0.01, 1), (99, 0.01, 1), (150, 0.01, 2), (100, 0.29, 29), (7, 1.0, 7)],
)
def test_topk_count(numel: int, fraction: float, k: int) -> None:
    assert topk_count(numel, fraction) == k


def test_topk_indices_widen_past_int32() -> None:
    specs = compressed_specs({"huge": TensorSpec(torch.float16, (2**31,))}, CodecSpec("topk"))
    assert specs["huge/0_index"] == TensorSpec(torch.int64, (round(0.01 * 2**31),))


# --- error feedback ------------------------------------------------------------------------


def test_error_feedback_conserves_the_sum_of_deltas() -> None:
    codec = SPECS["topk"]
    compressor = Compressor(codec)
    deltas = [make_delta(seed) for seed in range(6)]
    model = spec_of(deltas[0])
    sent: dict[str, torch.Tensor] = {}
    for delta in deltas:
        for name, dense in decompress(compressor.compress(delta), model, codec).items():
            sent[name] = sent.get(name, torch.zeros_like(dense, dtype=torch.float64)) + dense
    residual = compressor.residual
    assert residual.keys() == sent.keys()
    for name, total in sent.items():
        raw = sum(d[name].double() for d in deltas)
        assert residual[name].any() or model[name].numel <= 1, name  # something was held back
        assert_close(total + residual[name].double(), raw, rtol=1e-6, atol=1e-6)


def test_residual_survives_save_and_load(tmp_path: Path) -> None:
    codec = SPECS["topk"]
    before = Compressor(codec)
    for seed in range(3):
        before.compress(make_delta(seed))
    path = tmp_path / "residual.safetensors"
    before.save(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    after = Compressor.load(codec, path, model=spec_of(make_delta(0)))
    assert_equal(after.residual, before.residual)
    assert_equal(after.compress(make_delta(9)), before.compress(make_delta(9)))
    assert decode(path.read_bytes()).keys() == before.residual.keys()  # plain safetensors


def test_load_refuses_a_residual_for_another_model(tmp_path: Path) -> None:
    codec = SPECS["topk"]
    compressor = Compressor(codec)
    compressor.compress(make_delta(0))
    path = tmp_path / "residual.safetensors"
    compressor.save(path)
    reshaped = {**spec_of(make_delta(0)), "fc.weight": TensorSpec(torch.float32, (11, 37))}
    with pytest.raises(ValueError, match=r"does not fit the model: tensor 'fc.weight': expected"):
        Compressor.load(codec, path, model=reshaped)
    grown = {**spec_of(make_delta(0)), "new": TensorSpec(torch.float32, (3,))}
    with pytest.raises(ValueError, match=r"does not fit the model: missing tensor 'new'"):
        Compressor.load(codec, path, model=grown)


def test_compress_refuses_a_residual_that_does_not_fit() -> None:
    compressor = Compressor(SPECS["topk"])
    compressor.compress(make_delta(0))
    snapshot = compressor.residual
    delta = make_delta(1)
    delta["fc.weight"] = delta["fc.weight"][:, :5]
    with pytest.raises(ValueError, match=r"residual does not match this delta: tensor 'fc.weight'"):
        compressor.compress(delta)
    assert_equal(compressor.residual, snapshot)  # unchanged by the refused call


def test_residual_only_for_topk_and_only_finite() -> None:
    with pytest.raises(ValueError, match=r"codec.name: 'int8' keeps no residual"):
        Compressor(SPECS["int8"], residual={"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"residual tensor 'w' must be floating-point and finite"):
        Compressor(SPECS["topk"], residual={"w": torch.tensor([float("nan")])})
    with pytest.raises(ValueError, match=r"delta tensor 'w' has non-finite values"):
        Compressor(SPECS["topk"]).compress({"w": torch.tensor([1.0, float("inf")])})


# --- streaming -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_streaming_equals_decompress(name: str, chunk: int) -> None:
    codec, compressor = SPECS[name], Compressor(SPECS[name])
    compressor.compress(make_delta(4))  # topk: a non-zero residual feeds into the next step
    delta = make_delta(5)
    model = spec_of(delta)
    compressed = compressor.compress(delta)
    assert_equal(stream(compressed, model, codec, chunk), decompress(compressed, model, codec))


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8"])
def test_dense_codecs_fold_into_weighted_sum_unchanged(name: str) -> None:
    codec, delta = SPECS[name], make_delta(6)
    model = spec_of(delta)
    compressed = Compressor(codec).compress(delta)
    acc = WeightedSum(model)
    decoder = StreamDecoder(expected=compressed_specs(model, codec))
    decompressor = StreamingDecompressor(model, codec)
    for data in encode_chunks(compressed, 64):
        acc.add_pieces(decompressor.feed(decoder.feed(data)), 4.0)  # type: ignore[arg-type]
    decompressor.finish()
    acc.finish_update(4.0)
    assert_equal(acc.mean(), decompress(compressed, model, codec))


def test_truncated_stream_is_refused_by_finish() -> None:
    codec, delta = SPECS["int8"], make_delta(0)
    decompressor = StreamingDecompressor(spec_of(delta), codec)
    decoder = StreamDecoder()
    payload = encode(Compressor(codec).compress(delta))
    list(decompressor.feed(decoder.feed(payload[:-10])))
    with pytest.raises(CodecError, match=r"'w/1_q' incomplete"):
        decompressor.finish()


def _payload_in_order(tensors: Mapping[str, torch.Tensor], order: list[str]) -> bytes:
    """A valid safetensors payload whose data is laid out in ``order``, not sorted by name."""
    codes = {torch.float32: "F32", torch.int8: "I8", torch.int32: "I32"}
    header, data = {}, b""
    for name in order:
        raw = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        offsets = [len(data), len(data) + len(raw)]
        header[name] = {"dtype": codes[tensors[name].dtype], "shape": [tensors[name].numel()]}
        header[name]["data_offsets"] = offsets
        data += raw
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_values_before_metadata_are_refused(name: str) -> None:
    codec, delta = SPECS[name], {"w": torch.randn(40)}
    compressed = Compressor(codec).compress(delta)
    meta, values = SUFFIXES[name]
    payload = _payload_in_order(compressed, ["w" + values, "w" + meta])
    decoder = StreamDecoder(expected=compressed_specs(spec_of(delta), codec))  # names fit
    decompressor = StreamingDecompressor(spec_of(delta), codec)
    with pytest.raises(CodecError, match=r"arrived before 'w/0_.*' was complete"):
        list(decompressor.feed(decoder.feed(payload)))


@pytest.mark.parametrize(
    ("tensor", "bad", "message"),
    [
        ("w/0_index", torch.tensor([1, 40], dtype=torch.int32), r"indices must lie in \[0, 40\)"),
        ("w/0_index", torch.tensor([-1, 3], dtype=torch.int32), r"indices must lie in"),
        ("w/0_index", torch.tensor([3, 3], dtype=torch.int32), r"indices must be distinct"),
        ("w/0_scale", torch.tensor([1.0, -1.0, 1.0]), r"scales must be finite and non-negative"),
        ("w/0_scale", torch.tensor([1.0, float("nan"), 1.0]), r"scales must be finite"),
    ],
)
def test_bad_metadata_is_refused(tensor: str, bad: torch.Tensor, message: str) -> None:
    codec = SPECS["int8"] if tensor.endswith("scale") else CodecSpec("topk", fraction=0.05)
    model = {"w": TensorSpec(torch.float32, (40,))}
    compressed = {**Compressor(codec).compress({"w": torch.randn(40)}), tensor: bad}
    with pytest.raises(CodecError, match=message):
        decompress(compressed, model, codec)
    with pytest.raises(CodecError, match=message):
        stream(compressed, model, codec, 3)


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "gzip"}, "codec.name"),
        ({"name": "int8", "block": 0}, "codec.block"),
        ({"name": "int8", "block": 2.5}, "codec.block"),
        ({"name": "int8", "block": True}, "codec.block"),
        ({"name": "topk", "fraction": 0.0}, "codec.fraction"),
        ({"name": "topk", "fraction": 1.5}, "codec.fraction"),
        ({"name": "topk", "fraction": float("nan")}, "codec.fraction"),
        ({"name": "topk", "fraction": "0.1"}, "codec.fraction"),
    ],
)
def test_codec_spec_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        CodecSpec(**kwargs)  # type: ignore[arg-type]


def test_wrong_dtype_or_shape_is_refused_by_the_expected_specs() -> None:
    delta = make_delta(0)
    model = spec_of(delta)
    int8 = Compressor(SPECS["int8"]).compress(delta)
    int8["fc.weight/1_q"] = int8["fc.weight/1_q"].to(torch.int16)
    with pytest.raises(CodecError, match=r"'fc.weight/1_q': dtype expected torch.int8"):
        StreamDecoder(expected=compressed_specs(model, SPECS["int8"])).feed(encode(int8))
    topk = Compressor(CodecSpec("topk", fraction=0.2)).compress(delta)  # site's fraction differs
    with pytest.raises(CodecError, match=r"'bf/0_index': shape expected \(15,\), got \(30,\)"):
        StreamDecoder(expected=compressed_specs(model, SPECS["topk"])).feed(encode(topk))
    with pytest.raises(CodecError, match=r"unexpected tensor 'bf'"):
        decompress(Compressor(SPECS["fp16"]).compress(delta), model, SPECS["int8"])


# --- size ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_compressed_bytes_is_exact(name: str) -> None:
    delta = make_delta(7)
    payload = encode(Compressor(SPECS[name]).compress(delta))
    assert compressed_bytes(spec_of(delta), SPECS[name]) == len(payload)


def test_compression_ratios() -> None:
    n = 1024 * 1024
    model = {"w": TensorSpec(torch.float32, (1024, 1024)), "step": TensorSpec(torch.int64, (1,))}
    dense = compressed_bytes(model, CodecSpec("none"))
    assert 4 * n < dense < 4 * n + 200
    assert 1.9 < dense / compressed_bytes(model, CodecSpec("bf16")) < 2.0
    int8 = compressed_bytes(model, CodecSpec("int8", block=256))
    assert n + 4 * n // 256 < int8 < n + 4 * n // 256 + 200  # one byte each, plus fp32 scales
    assert 3.9 < dense / int8 < 4.0
    topk = compressed_bytes(model, CodecSpec("topk", fraction=0.01))
    k = round(0.01 * n)
    assert k * 8 < topk < k * 8 + 200  # int32 index + fp32 value per kept element
    assert 0.0199 < topk / dense < 0.0201


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk"])
def test_a_compressed_step_rebuilds_the_same_model_on_both_sides(name: str) -> None:
    """What the coordinator commits with [codec] download equals what a site rebuilds from
    the previous model and the step's bytes, bit for bit, including integer buffers."""
    gen = torch.Generator().manual_seed(3)
    base = {
        "w": torch.randn(37, 11, generator=gen),
        "half": torch.randn(50, generator=gen).to(torch.bfloat16),
        "steps": torch.tensor([7]),
    }
    after = {
        k: (v + 0.01 * torch.randn(v.shape, generator=gen).to(v.dtype)) for k, v in base.items()
    }
    after["steps"] = base["steps"].clone()
    codec = CodecSpec(name, block=16, fraction=0.2)
    compressor = Compressor(codec)
    step = compressor.compress({k: after[k] - base[k] for k in ("w", "half")})
    committed = apply_step(base, step, codec)
    rebuilt = apply_step(decode(encode(base)), decode(encode(step)), codec)
    assert encode(rebuilt) == encode(committed)
    assert torch.equal(committed["steps"], base["steps"])
    if name != "topk":  # moved by the lossy step: close to the exact model
        assert_close(committed["w"], after["w"], atol=1e-3, rtol=0)
    else:  # what was not sent stays in the residual for the next step
        sent = committed["w"] - base["w"]
        assert_close(sent + compressor.residual["w"], after["w"] - base["w"], atol=1e-6, rtol=0)
