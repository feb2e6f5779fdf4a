"""Hand-framed model chunks: the same bytes as protobuf's, parsed without copies."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from google.protobuf.message import DecodeError

from fedra.client.connection import Assignment, Connection
from fedra.config import ConfigError
from fedra.coordinator.server import CoordinatorConfig, server_options
from fedra.protos import wire
from fedra.protos.codec import (
    StreamDecoder,
    all_finite,
    decode_chunks,
    encode,
    encode_chunks,
    transfer_chunk_bytes,
)
from fedra.protos.v1 import common_pb2, site_pb2
from fedra.runspec import CodecSpec, TrainSpec

# Lengths around each varint boundary (1, 2 and 3 length bytes) and a realistic chunk.
SIZES = [1, 127, 128, 300, 16383, 16384, 1 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_frames_are_exactly_protobufs_encoding(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert (
        wire.model_chunk_frame(size) + data == common_pb2.ModelChunk(data=data).SerializeToString()
    )
    assert (
        wire.update_chunk_frame(size) + data == site_pb2.UpdateChunk(data=data).SerializeToString()
    )


@pytest.mark.parametrize("size", SIZES)
def test_a_lone_data_field_parses_to_a_view_without_copying(size: int) -> None:
    data = b"\x5a" * size
    raw = common_pb2.ModelChunk(data=data).SerializeToString()
    view = wire.parse_model_chunk(raw)
    assert isinstance(view, memoryview) and view.obj is raw  # a view into the received bytes
    assert view == data
    raw_up = site_pb2.UpdateChunk(data=data).SerializeToString()
    parsed = wire.parse_update_chunk(raw_up)
    assert isinstance(parsed, memoryview) and parsed.obj is raw_up and parsed == data


def test_anything_else_goes_through_the_generated_parser() -> None:
    assert wire.parse_model_chunk(b"") == b""  # proto3 writes nothing for empty data
    # The data field twice: protobuf keeps the last; the fast path must not take the first.
    twice = common_pb2.ModelChunk(data=b"old").SerializeToString()
    twice += common_pb2.ModelChunk(data=b"new").SerializeToString()
    assert wire.parse_model_chunk(twice) == b"new"
    # An unknown field after the data (a newer sender) is skipped, the data kept.
    unknown = common_pb2.ModelChunk(data=b"abc").SerializeToString() + b"\x10\x07"
    assert wire.parse_model_chunk(unknown) == b"abc"
    header = site_pb2.UpdateChunk(header=site_pb2.UpdateHeader(site_id="s1", round=3))
    parsed = wire.parse_update_chunk(header.SerializeToString())
    assert isinstance(parsed, site_pb2.UpdateChunk) and parsed.header.site_id == "s1"
    assert wire.update_chunk_data(parsed) is None
    assert wire.update_chunk_data(site_pb2.UpdateChunk(data=b"xy")) == b"xy"


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x05abc",  # length says 5, 3 bytes follow
        b"\x0a" + b"\xff" * 11,  # a varint that never ends
        b"\x0a",  # a tag and nothing else
    ],
)
def test_malformed_chunks_are_decode_errors(raw: bytes) -> None:
    assert wire.lone_field(raw, wire.MODEL_CHUNK_TAG) is None
    with pytest.raises(DecodeError):
        wire.parse_model_chunk(raw)


def test_serialize_passes_frames_through_and_serializes_messages() -> None:
    framed = wire.update_chunk_frame(3) + b"abc"
    assert wire.serialize(framed) is framed
    header = site_pb2.UpdateChunk(header=site_pb2.UpdateHeader(site_id="s"))
    assert wire.serialize(header) == header.SerializeToString()


def test_framed_encoding_round_trips_through_parse_and_decode() -> None:
    tensors = {
        "w": torch.randn(1000, 37),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(333).to(torch.bfloat16),
    }
    frames = list(encode_chunks(tensors, 4096, frame=wire.model_chunk_frame))
    views = [wire.parse_model_chunk(f) for f in frames]
    assert all(len(v) == 4096 for v in views[:-1]) and 0 < len(views[-1]) <= 4096
    assert b"".join(views) == encode(tensors)  # the frames hold exactly the payload
    decoded = decode_chunks(views)
    assert all(torch.equal(decoded[k], tensors[k]) for k in tensors)


def test_a_non_copying_decoder_views_aligned_runs_and_copies_the_rest() -> None:
    payload = encode({"w": torch.arange(64, dtype=torch.float32)})
    header_end = len(payload) - 64 * 4
    chunk = bytes(payload)
    pieces = StreamDecoder(copy=False).feed(chunk)
    assert len(pieces) == 1 and torch.equal(pieces[0].values, torch.arange(64.0))
    # Aligned: the piece's memory is inside the fed chunk (no copy).
    start = pieces[0].values.data_ptr()
    view = memoryview(chunk)
    tensor_of_chunk = torch.frombuffer(view, dtype=torch.uint8)
    assert start == tensor_of_chunk.data_ptr() + header_end
    # Fed one byte off alignment, runs are copied and still decode right.
    decoder = StreamDecoder(copy=False)
    odd = bytearray(1) + bytearray(payload)
    values = []
    first, second = memoryview(odd)[1 : 1 + header_end + 6], memoryview(odd)[1 + header_end + 6 :]
    odd_start = torch.frombuffer(odd, dtype=torch.uint8).data_ptr()
    assert (odd_start + 1 + header_end) % 4 != 0  # the float32 data really is misaligned
    for part in (first, second):
        for p in decoder.feed(part):
            assert not odd_start <= p.values.data_ptr() < odd_start + len(odd)  # a copy
            values.append(p.values)
    decoder.finish()
    assert torch.equal(torch.cat(values), torch.arange(64.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    cases = [
        torch.randn(1000).to(dtype),
        torch.zeros(0, dtype=dtype),
        torch.full((4,), big, dtype=dtype),  # finite, but the sum overflows
        torch.tensor([1.0, float("nan")], dtype=dtype),
        torch.tensor([float("inf"), 1.0], dtype=dtype),
        torch.tensor([float("inf"), float("-inf")], dtype=dtype),
        torch.tensor([big, float("-inf")], dtype=dtype),
    ]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    assert all_finite(torch.arange(10))  # integers are always finite


def test_server_options_fix_the_receive_window_or_leave_it_adaptive() -> None:
    fixed = dict(server_options(1 << 20, 2.0))
    assert fixed["grpc.http2.bdp_probe"] == 0
    assert fixed["grpc.http2.lookahead_bytes"] == 2 << 20
    assert fixed["grpc.max_receive_message_length"] == 2 << 20  # a chunk and its envelope
    adaptive = dict(server_options(1 << 20, 0))
    assert "grpc.http2.bdp_probe" not in adaptive and "grpc.http2.lookahead_bytes" not in adaptive


@pytest.mark.parametrize("window", [-1.0, float("nan"), float("inf"), 4096.0])
def test_a_bad_stream_window_is_refused_by_name(window: float, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--stream-window-mb"):
        CoordinatorConfig(state_dir=tmp_path, insecure=True, stream_window_mb=window)


def test_the_cli_refuses_a_bad_window_before_touching_the_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ["coordinator", "--state-dir", str(state), "--insecure", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "fedra", *args, "--stream-window-mb", "-1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2
    assert "--stream-window-mb: must be 0 (adaptive) or a size in MiB" in done.stderr
    assert not state.exists()


def _assignment() -> Assignment:
    """A task to upload for, as a Connection takes it (no coordinator behind it here)."""
    return Assignment(
        task_id="t", run_id="r", round=1, init=False, entry_point="m:t", train=TrainSpec(),
        seed=0, model_sha256="", model_bytes=0, deadline_in_s=60.0, codec=CodecSpec(),
    )  # fmt: skip


def test_a_small_update_goes_up_in_one_call_and_is_not_streamed() -> None:
    update = {"w": torch.arange(10, dtype=torch.float32)}
    payload = encode(update)
    conn = Connection("127.0.0.1:1", "site-a")  # the channel connects lazily: never here
    sent: list[site_pb2.UploadSmallUpdateRequest] = []

    def fake_small(request: site_pb2.UploadSmallUpdateRequest, timeout: float) -> Any:
        sent.append(request)
        return site_pb2.UploadSmallUpdateResponse(bytes_received=len(request.payload))

    def no_stream(messages: Iterator[site_pb2.UpdateChunk | bytes], timeout: float) -> Any:
        raise AssertionError("a small update was streamed")

    conn.stub = SimpleNamespace(UploadSmallUpdate=fake_small)  # type: ignore[assignment]
    conn._upload_update = no_stream  # type: ignore[method-assign]
    task = _assignment()
    try:
        done = conn.upload(task, update, 8, {}, os.urandom(16), timeout_s=5.0)
    finally:
        conn.close()
    [request] = sent
    assert request.payload == payload and request.header.payload_bytes == len(payload)
    assert request.header.sha256 == hashlib.sha256(payload).hexdigest()
    assert done.bytes_received == done.payload_bytes == len(payload)


@pytest.mark.parametrize(
    ("elements", "limit"), [(1 << 20, 1 << 20), (1 << 20, 100_000), (20_000, 1 << 20)]
)
def test_a_site_uploads_in_chunks_sized_to_its_update(elements: int, limit: int) -> None:
    """A 4 MiB update goes up in 1/16ths (a stream then holds a fraction of it), a session's
    smaller agreed chunk size wins, and an update just over what one call takes (80 KB)
    goes in chunks of 64 KiB, the least chunk."""
    update = {"w": torch.arange(elements, dtype=torch.float32)}
    payload = encode(update)
    conn = Connection("127.0.0.1:1", "site-a")  # the channel connects lazily: never here
    conn.chunk_bytes = limit
    sent: list[site_pb2.UpdateChunk | bytes] = []

    def fake_upload(messages: Iterator[site_pb2.UpdateChunk | bytes], timeout: float) -> Any:
        sent.extend(messages)
        return site_pb2.UploadUpdateResponse(bytes_received=len(payload))

    conn._upload_update = fake_upload  # type: ignore[method-assign]
    task = _assignment()
    try:
        conn.upload(task, update, 8, {}, os.urandom(16), timeout_s=5.0)
    finally:
        conn.close()
    header, *data = sent
    assert isinstance(header, site_pb2.UpdateChunk) and header.header.payload_bytes == len(payload)
    sizes = [len(wire.parse_update_chunk(m)) for m in data]  # type: ignore[arg-type]
    chunk = transfer_chunk_bytes(len(payload), limit)
    assert sizes[:-1] == [chunk] * (len(sizes) - 1) and sum(sizes) == len(payload)
    if elements == 20_000:
        assert sizes == [64 * 1024, len(payload) - 64 * 1024]
    else:
        assert chunk == (len(payload) // 16 if limit == 1 << 20 else limit)


class _Recorder:
    """Records what a service registers with a server (gRPC's server API)."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, list[str]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered[service] = sorted(handlers)


def _site_service(registered: Any) -> _Recorder:
    from fedra.protos.v1 import site_pb2_grpc

    server = _Recorder()
    servicer = site_pb2_grpc.SiteServiceServicer()
    add = site_pb2_grpc.add_SiteServiceServicer_to_server
    wire.add_service(server, add, servicer, wire.SITE_SERVICE, {}, registered=registered)
    return server


def test_only_the_methods_named_are_registered_and_every_method_is_served() -> None:
    from fedra.coordinator.server import ROUND_METHODS

    everything = _site_service(None)
    methods = everything.registered[wire.SITE_SERVICE]
    assert "ReportFailure" in methods and set(ROUND_METHODS) < set(methods)
    hot = _site_service(ROUND_METHODS)
    assert hot.registered == {wire.SITE_SERVICE: sorted(ROUND_METHODS)}
    assert _site_service(()).registered == {}
    for server in (everything, hot):
        [generic] = server.generic  # found by name: the methods not registered too
        call = SimpleNamespace(method=f"/{wire.SITE_SERVICE}/ReportFailure")
        assert generic.service(call) is not None


def test_registering_a_method_the_service_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no method Upload$"):
        _site_service(("PollTask", "Upload"))
