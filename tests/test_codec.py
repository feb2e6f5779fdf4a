"""Tests for the safetensors-format tensor codec: round trips, reference compatibility, errors."""

from __future__ import annotations

import hashlib
import json
import random
import tracemalloc
from collections.abc import Iterator

import pytest
import torch

from fedra.protos.codec import (
    DEFAULT_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    CodecError,
    StreamDecoder,
    TensorSpec,
    decode,
    decode_chunks,
    encode,
    encode_chunks,
    encoded_size,
    sha256_hex,
    sole_owners,
    spec_of,
    transfer_chunk_bytes,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def mixed_tensors() -> dict[str, torch.Tensor]:
    tensors = {
        f"{dtype}".removeprefix("torch."): make(dtype, (3, 5), i) for i, dtype in enumerate(DTYPES)
    }
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0)
    tensors["empty_i8"] = torch.zeros(0, 4, dtype=torch.int8)
    tensors["transposed"] = make(torch.float32, (4, 6), 9).t()
    return tensors


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def random_splits(payload: bytes, rng: random.Random, max_piece: int) -> Iterator[bytes]:
    start = 0
    while start < len(payload):
        size = rng.randint(1, max_piece)
        yield payload[start : start + size]
        start += size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    tensors = {
        "matrix": make(dtype, (7, 3)),
        "scalar": make(dtype, ()),
        "empty": make(dtype, (0,)),
        "strided": make(dtype, (8, 6), 1)[::2, 1::2],
    }
    assert not tensors["strided"].is_contiguous()
    assert_same(decode(encode(tensors)), tensors)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 4096])
def test_round_trip_chunked(chunk_bytes: int) -> None:
    tensors = mixed_tensors()
    assert_same(decode_chunks(encode_chunks(tensors, chunk_bytes)), tensors)


@pytest.mark.parametrize("max_piece", [1, 3, 7, 4096])
def test_stream_decoder_pieces_at_random_splits(max_piece: int) -> None:
    tensors = mixed_tensors()
    payload = encode(tensors, metadata={"round": "3"})
    decoder = StreamDecoder(expected=spec_of(tensors))
    flat = {name: torch.full((t.numel(),), 7).to(t.dtype) for name, t in tensors.items()}
    seen = 0
    for chunk in random_splits(payload, random.Random(max_piece), max_piece):
        for piece in decoder.feed(chunk):
            assert piece.values.dim() == 1 and piece.values.dtype == tensors[piece.name].dtype
            flat[piece.name][piece.offset : piece.offset + piece.values.numel()] = piece.values
            seen += piece.values.numel()
    decoder.finish()
    assert seen == sum(t.numel() for t in tensors.values())
    assert decoder.bytes_consumed == decoder.total_bytes == len(payload)
    assert decoder.metadata == {"round": "3"}
    assert decoder.specs == spec_of(tensors)
    assert_same({n: f.reshape(tensors[n].shape) for n, f in flat.items()}, tensors)


def test_pieces_do_not_alias_fed_buffers() -> None:
    payload = bytearray(encode({"x": torch.arange(4, dtype=torch.int32)}))
    pieces = StreamDecoder().feed(payload)
    payload[-16:] = bytes(16)
    assert torch.equal(pieces[0].values, torch.arange(4, dtype=torch.int32))


def test_many_tensors_and_metadata() -> None:
    tensors = {f"layer.{i}.weight": make(torch.float32, (i % 5, 3), i) for i in range(300)}
    decoder = StreamDecoder()
    decoder.feed(encode(tensors, metadata={"codec": "none", "ünï": "cödé"}))
    decoder.finish()
    assert decoder.metadata == {"codec": "none", "ünï": "cödé"}
    assert_same(decode(encode(tensors)), tensors)


def test_encoded_size_and_chunk_lengths() -> None:
    tensors = mixed_tensors()
    metadata = {"k": "v"}
    payload = encode(tensors, metadata)
    assert encoded_size(tensors, metadata) == len(payload)
    assert int.from_bytes(payload[:8], "little") % 8 == 0
    chunks = list(encode_chunks(tensors, 100, metadata))
    assert all(len(c) == 100 for c in chunks[:-1]) and 0 < len(chunks[-1]) <= 100
    assert b"".join(chunks) == payload
    assert sha256_hex(chunks) == hashlib.sha256(payload).hexdigest()


def test_tensor_spec() -> None:
    spec = TensorSpec(torch.bfloat16, (3, 4))
    assert (spec.numel, spec.nbytes) == (12, 24)
    assert TensorSpec(torch.float64, ()).nbytes == 8


def test_encode_rejects_unsupported_input() -> None:
    with pytest.raises(CodecError, match=r"'c'.*complex"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(CodecError, match="__metadata__"):
        encode({"__metadata__": torch.zeros(1)})
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_chunks({}, 0)


# --- compatibility with the reference implementation -------------------------------------------

st = pytest.importorskip("safetensors.torch")


def test_reference_bytes_decode_with_ours() -> None:
    tensors = mixed_tensors()
    reference = st.save({n: t.contiguous() for n, t in tensors.items()}, metadata={"a": "b"})
    decoder = StreamDecoder()
    for chunk in random_splits(reference, random.Random(1), 64):
        decoder.feed(chunk)
    decoder.finish()
    assert decoder.metadata == {"a": "b"}
    assert_same(decode_chunks(random_splits(reference, random.Random(2), 33)), tensors)


def test_our_bytes_load_with_reference() -> None:
    tensors = mixed_tensors()
    assert_same(st.load(encode(tensors)), tensors)


def test_byte_identical_to_reference_for_one_dtype() -> None:
    # The reference orders data by dtype, then name; ours by name only. With a single dtype the
    # two orders agree, and padding and JSON formatting match, so the payloads are identical.
    tensors = {"b": make(torch.float32, (4, 3)), "a": make(torch.float32, ()), "é": torch.zeros(0)}
    assert encode(tensors, {"x": "y"}) == st.save(tensors, metadata={"x": "y"})
    assert encode(tensors) == st.save(tensors)


# --- malformed input ---------------------------------------------------------------------------


def frame(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (frame(b"[1, 2]"), "must be a JSON object"),
        (frame(b"{not json"), "not valid JSON"),
        (frame(b'{"a": 1, "a": 2}'), "'a' twice"),
        (frame(b'{"\xff": 1}'), "not valid UTF-8"),
        (frame(b"[" * 100_000), "not valid JSON"),
        (frame({"w": entry("F8", [1], 0, 1)}), "'w': unknown dtype 'F8'"),
        (frame({"w": entry("F32", [-1], 0, 0)}), "'w': shape must be non-negative"),
        (frame({"w": entry("F32", [True], 0, 4)}), "'w': shape must be non-negative"),
        (frame({"w": {"dtype": "F32", "shape": []}}), "'w': entry must have exactly"),
        (frame({"w": entry("F32", [2], 0, 4)}), "'w'.*span 4 bytes, expected 8"),
        (frame({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}), "'b': data gap"),
        (frame({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}), "data overlap"),
        (frame({"w": entry("F32", [1], 4, 8)}), "'w': data gap, begins at 4, expected 0"),
        (frame({"__metadata__": {"k": 1}}), "__metadata__"),
        (frame({"w": entry("I8", [0, 2**64], 0, 0)}), "'w': shape must be non-negative"),
        (frame({"w": entry("BOOL", [2], 0, 2)}, b"\x01\x02"), "'w': BOOL bytes must be 0 or 1"),
    ],
)
def test_malformed_header(payload: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(payload)


def test_header_length_over_limit_fails_before_buffering() -> None:
    decoder = StreamDecoder(max_header_bytes=1024)
    with pytest.raises(CodecError, match="header length 1025 exceeds 1024"):
        decoder.feed((1025).to_bytes(8, "little"))
    with pytest.raises(CodecError, match="exceeds"):
        StreamDecoder().feed(b"\xff" * 8)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "inside the length prefix after 0 bytes"),
        (b"\x10\x00\x00", "inside the length prefix after 3 bytes"),
        (frame(b'{"a":1}')[:-2], "inside the header"),
    ],
)
def test_truncated_prefix_or_header(payload: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(payload)


def test_truncated_data_names_the_tensor() -> None:
    tensors = {"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(0)}
    payload = encode(tensors)
    with pytest.raises(CodecError, match="inside tensor 'b'"):
        decode(payload[:-3])
    decoder = StreamDecoder()
    decoder.feed(payload[:-20])
    with pytest.raises(CodecError, match="inside tensor 'a'"):
        decoder.finish()


def test_trailing_bytes_fail_on_the_feed_that_brings_them() -> None:
    payload = encode({"a": torch.ones(2)})
    decoder = StreamDecoder()
    decoder.feed(payload)
    with pytest.raises(CodecError, match="1 trailing bytes"):
        decoder.feed(b"\x00")
    with pytest.raises(CodecError, match="3 trailing bytes"):
        decode(payload + b"xyz")


def test_specs_before_header_is_an_error() -> None:
    decoder = StreamDecoder()
    assert not decoder.header_ready
    with pytest.raises(RuntimeError, match="header"):
        _ = decoder.specs


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        ({"a": TensorSpec(torch.float32, (2, 3))}, "unexpected tensor 'b'"),
        (
            {n: TensorSpec(torch.float32, (2, 3)) for n in "abc"},
            "missing tensor 'c'",
        ),
        (
            {"a": TensorSpec(torch.float16, (2, 3)), "b": TensorSpec(torch.float32, (2, 3))},
            "'a': dtype expected torch.float16, got torch.float32",
        ),
        (
            {"a": TensorSpec(torch.float32, (2, 3)), "b": TensorSpec(torch.float32, (3, 2))},
            r"'b': shape expected \(3, 2\), got \(2, 3\)",
        ),
    ],
)
def test_expected_spec_mismatch(expected: dict[str, TensorSpec], message: str) -> None:
    payload = encode({"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)})
    with pytest.raises(CodecError, match=message):
        decode(payload, expected)


def test_decode_chunks_never_builds_the_whole_payload() -> None:
    tensor = torch.arange(16 * 1024 * 1024, dtype=torch.float32)  # 64 MiB
    payload_bytes = encoded_size({"w": tensor})
    tracemalloc.start()
    try:
        decoded = decode_chunks(encode_chunks({"w": tensor}, DEFAULT_CHUNK_BYTES))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # torch allocations are not traced, so this bounds the Python-side transport buffers.
    assert peak < 1.5 * DEFAULT_CHUNK_BYTES < payload_bytes // 8
    assert torch.equal(decoded["w"], tensor)


def test_decoding_into_a_held_model_fills_its_tensors_in_place() -> None:
    new = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "n": torch.tensor([5, 6])}
    held = {"w": torch.zeros(3, 4), "n": torch.zeros(2, dtype=torch.int64)}
    before = {k: v.data_ptr() for k, v in held.items()}
    decoded = decode_chunks(encode_chunks(new, 16), reuse=held)
    assert {k: v.data_ptr() for k, v in decoded.items()} == before
    for name, value in new.items():
        assert torch.equal(decoded[name], value), name


def test_decoding_allocates_where_the_held_tensor_does_not_fit() -> None:
    new = {
        "shape": torch.ones(2, 3),
        "dtype": torch.ones(4, dtype=torch.float16),
        "tied_a": torch.full((4,), 2.0),
        "tied_b": torch.full((4,), 3.0),
        "absent": torch.ones(1),
    }
    shared = torch.zeros(4)
    held = {
        "shape": torch.zeros(3, 2),
        "dtype": torch.zeros(4),
        "tied_a": shared,  # one memory under two names: filling one would change the other
        "tied_b": shared,
    }
    decoded = decode_chunks(encode_chunks(new, 16), reuse=held)
    for name, value in new.items():
        assert torch.equal(decoded[name], value), name
        assert all(decoded[name].data_ptr() != t.data_ptr() for t in held.values()), name
    assert torch.equal(shared, torch.zeros(4))


def test_sole_owners_are_the_tensors_no_other_one_overlaps() -> None:
    flat = torch.zeros(10)
    tensors = {
        "own": torch.zeros(3),
        "first_half": flat[:5],  # views of one buffer that do not overlap own their bytes
        "second_half": flat[5:],
        "tied": (tied := torch.zeros(2)),
        "tied_too": tied,
        "strided": torch.zeros(4, 4).t(),  # not contiguous: its bytes are not one span
        "empty": torch.zeros(0),
    }
    overlapping = torch.zeros(6)
    tensors |= {"low": overlapping[:4], "high": overlapping[2:]}
    table = torch.zeros(3, 4)  # its column, a strided view, shares its bytes
    tensors |= {"table": table, "column": table[:, 1]}
    weight = torch.zeros(2, 3)  # and a transposed view all of them
    tensors |= {"weight": weight, "weight_t": weight.t()}
    assert sole_owners(tensors) == {"own", "first_half", "second_half"}


def test_digest_and_size_match_the_encoding() -> None:
    from fedra.protos.codec import digest_and_size

    tensors = {
        "b": torch.arange(10, dtype=torch.bfloat16),
        "a": torch.randn(3, 5).t(),  # non-contiguous
        "c": torch.zeros(0),
    }
    payload = encode(tensors)
    digest, size = digest_and_size(tensors)
    assert size == len(payload)
    assert digest == hashlib.sha256(payload).hexdigest()


def test_transfer_chunks_are_a_sixteenth_of_the_payload_within_bounds() -> None:
    mib = 1 << 20
    assert transfer_chunk_bytes(40_000_000) == DEFAULT_CHUNK_BYTES == mib  # capped
    assert transfer_chunk_bytes(4 * mib) == mib // 4  # 1/16th of a small model
    assert transfer_chunk_bytes(100) == MIN_CHUNK_BYTES  # never tiny messages
    assert transfer_chunk_bytes(4 * mib, limit=100) == 100  # the configured limit wins
    assert transfer_chunk_bytes(64 * mib, limit=4 * mib) == 4 * mib
    with pytest.raises(ValueError, match="positive"):
        transfer_chunk_bytes(mib, limit=0)
