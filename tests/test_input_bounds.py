"""Bounds on what a remote party sends, checked before the work it would cost: the
safetensors header by its length prefix, the update header's fields, and requests
that do not parse (fedra.protos.wire's tolerant deserializers)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import safetensors.torch
import torch

from fedra.coordinator.engine import uploads
from fedra.coordinator.errors import InvalidArgument
from fedra.protos import wire
from fedra.protos.codec import (
    MAX_HEADER_BYTES,
    MAX_METADATA_BYTES,
    CodecError,
    StreamDecoder,
    decode,
    encode,
    header_limit,
    spec_of,
)
from fedra.protos.v1 import site_pb2

MODEL = {
    "embed.weight": torch.zeros(50, 16),
    "block.0.attn.qkv": torch.zeros(48, 16, dtype=torch.float16),
    "block.0.norm": torch.zeros(16, dtype=torch.bfloat16),
    "head.bias": torch.zeros(0),
    "step": torch.zeros((), dtype=torch.int64),
}


def _empty_entries(count: int) -> bytes:
    entries = {
        f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)
    }
    text = json.dumps(entries, separators=(",", ":")).encode()
    return len(text).to_bytes(8, "little") + text


def test_a_header_longer_than_the_expected_model_needs_is_refused_from_its_prefix() -> None:
    """Before the fix the bound was 16 MiB whatever the model: the JSON was read whole."""
    specs = spec_of(MODEL)
    flood = _empty_entries(10_000)  # 600 KB of entries, each one free to send
    decoder = StreamDecoder(specs)
    with pytest.raises(CodecError, match=r"header length \d+ exceeds \d+ bytes \(what the"):
        decoder.feed(flood[:8])  # the length prefix alone decides
    assert decoder.bytes_consumed == 8
    assert header_limit(specs) < 6000 < len(flood)


def test_the_limit_admits_this_encoder_and_the_reference_writer() -> None:
    specs = spec_of(MODEL)
    for payload in (
        encode(MODEL),
        encode(MODEL, metadata={"note": "n" * 4000}),
        safetensors.torch.save(MODEL, metadata={"format": "pt"}),
    ):
        length = int.from_bytes(payload[:8], "little")
        assert length <= header_limit(specs)
        got = decode(payload, specs)
        assert sorted(got) == sorted(MODEL)


def test_metadata_is_bounded_with_or_without_expected_tensors() -> None:
    payload = encode(MODEL, metadata={"pad": "p" * (MAX_METADATA_BYTES + 1)})
    for expected in (None, spec_of(MODEL)):
        with pytest.raises(CodecError, match=r"__metadata__ holds|header length"):
            decode(payload, expected)
    assert decode(encode(MODEL, metadata={"pad": "p" * 4000}))  # a few KiB still pass


def test_without_expected_tensors_the_constant_bound_holds() -> None:
    decoder = StreamDecoder()
    with pytest.raises(CodecError, match=f"exceeds {MAX_HEADER_BYTES} bytes$"):
        decoder.feed((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
    small = _empty_entries(10)
    StreamDecoder().feed(small)  # an initial model of empty tensors is a valid header


def test_the_size_limit_of_an_update_follows_the_expected_model() -> None:
    specs = spec_of(MODEL)
    engine: Any = SimpleNamespace(settings=SimpleNamespace(max_init_model_bytes=123))
    data = sum(s.nbytes for s in specs.values())
    assert uploads._size_limit(engine, specs) == 8 + header_limit(specs) + data
    assert uploads._size_limit(engine, specs) < data + 2 * MAX_METADATA_BYTES + 8192
    assert uploads._size_limit(engine, None) == 123  # the initial model: the operator's bound


def _header(**fields: Any) -> uploads.UpdateHeader:
    values: dict[str, Any] = {
        "site_id": "site-a", "run_id": "r" * 12, "round": 1, "task_id": "t" * 32,
        "num_samples": 10, "metrics": {"loss": 1.0}, "codec": "none", "sha256": "a" * 64,
        "nonce": b"n" * 16, "payload_bytes": 100,
    }  # fmt: skip
    values.update(fields)
    return uploads.UpdateHeader(**values)


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"task_id": "t" * 2**20}, "task_id must be at most 128 characters"),
        ({"run_id": "r" * 129}, "run_id must be at most 128 characters"),
        ({"metrics": {f"m{i}": 0.0 for i in range(257)}}, "at most 256 metrics"),
        ({"metrics": {"m" * 129: 0.0}}, "at most 128 printable characters"),
        ({"metrics": {"loss\nINFO forged": 0.0}}, "printable characters"),
        ({"metrics": {"loss": float("nan")}}, "not finite"),
    ],
)
def test_update_header_fields_a_site_chooses_are_bounded(fields: dict[str, Any], text: str) -> None:
    with pytest.raises(InvalidArgument, match=text):
        uploads._check_header_fields(_header(**fields))


def test_a_plain_header_passes() -> None:
    metrics = {f"eval_metric_{i}": float(i) for i in range(256)}
    uploads._check_header_fields(_header(metrics=metrics))


def test_tolerant_deserializers_return_malformed_instead_of_raising() -> None:
    parse = wire.tolerant(site_pb2.RegisterRequest.FromString)
    assert parse(site_pb2.RegisterRequest(site_id="a").SerializeToString()).site_id == "a"
    bad = parse(b"\xff\xff")
    assert isinstance(bad, wire.Malformed) and "DecodeError" in bad.reason
    chunks = wire.tolerant(wire.parse_update_chunk)
    data = wire.update_chunk_frame(4) + b"abcd"
    assert bytes(chunks(data)) == b"abcd"  # the fast path is untouched
    for raw in (data[:-1], wire.update_chunk_frame(2**40) + b"x", b"\x0a\x03\x0a\x01\xff"):
        assert isinstance(chunks(raw), wire.Malformed), raw  # truncated, or not UTF-8


class _Aborted(Exception):
    pass


class _Context:
    """A servicer context whose call has ended (``ended``) or is still going."""

    def __init__(self, ended: str) -> None:
        self.ended = ended

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def add_callback(self, callback: Any) -> bool:
        if self.ended == "before":
            return False  # gRPC: the call already terminated
        if self.ended == "now":
            callback()  # it terminates as the stream's end is looked at
        return True


@pytest.mark.parametrize("ended", ["before", "now"])
def test_a_request_stream_cut_by_the_transport_is_not_taken_as_closed(ended: str) -> None:
    """gRPC ends a request stream alike when the caller closes it and when it refuses a
    message (over the size limit): a handler must not act on the end of the latter."""
    handler = wire._stream_request(lambda requests, context: list(requests))
    with pytest.raises(grpc.RpcError):
        handler(iter([b"a", b"b"]), _Context(ended))


def test_a_request_stream_the_caller_closed_reaches_its_end() -> None:
    handler = wire._stream_request(lambda requests, context: list(requests))
    assert handler(iter([b"a", b"b"]), _Context("never")) == [b"a", b"b"]


class _AioContext:
    """A grpc.aio servicer context whose call ends (``done``) when the test says."""

    def __init__(self) -> None:
        self.ended = False

    def cancelled(self) -> bool:
        return False  # grpc.aio says so for a call the transport cut, too

    def done(self) -> bool:
        return self.ended


class _Clock:
    """``wire``'s clock and sleeps: time passes only as the test (or a sleep) says."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []  # type: list[float]

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def _incoming(*messages: bytes) -> Any:
    for m in messages:
        yield m


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(wire, "time", SimpleNamespace(monotonic=c.monotonic))
    monkeypatch.setattr(wire, "asyncio", SimpleNamespace(sleep=c.sleep))
    return c


@pytest.mark.parametrize("ended", [False, True])
def test_an_event_driven_request_stream_checks_its_end_where_it_ends(
    clock: _Clock, ended: bool
) -> None:
    """Read as it comes (no deferral), a stream the transport cut fails at its end."""
    context = _AioContext()

    async def read() -> list[bytes]:
        stream = wire.RequestStream(_incoming(b"a", b"b"), context)
        context.ended = ended  # the news of the cut comes just after the stream's end
        return [m async for m in stream]

    if ended:
        with pytest.raises(grpc.RpcError):
            asyncio.run(read())
    else:
        assert asyncio.run(read()) == [b"a", b"b"]
    assert clock.slept == [pytest.approx(wire.STREAM_END_CHECK_S)]


@pytest.mark.parametrize("ended", [False, True])
@pytest.mark.parametrize("work_s", [0.0, 0.002, 0.05])
def test_a_deferred_end_check_waits_only_what_the_work_did_not_take(
    clock: _Clock, work_s: float, ended: bool
) -> None:
    """An upload confirms its stream's end after its last checks and sync: the check's
    wait overlaps that work, and a cut stream still fails the check, not the reading."""
    context = _AioContext()

    async def read_then_confirm() -> list[bytes]:
        stream = wire.RequestStream(_incoming(b"a", b"b"), context)
        closed = stream.defer_end_check()
        got = [m async for m in stream]  # no wait at the end, even when cut
        assert clock.slept == []
        context.ended = ended
        clock.now += work_s  # the payload's last checks and its spool's sync
        await closed()
        return got

    if ended:
        with pytest.raises(grpc.RpcError):
            asyncio.run(read_then_confirm())
    else:
        assert asyncio.run(read_then_confirm()) == [b"a", b"b"]
    # What is left of the check's wait, and at least a short one: the loop polls again.
    left = max(wire.STREAM_END_CHECK_S - work_s, wire.STREAM_END_MIN_WAIT_S)
    assert clock.slept == [pytest.approx(left)]


def test_a_deferred_end_check_before_the_end_is_a_mistake(clock: _Clock) -> None:
    async def confirm_early() -> None:
        stream = wire.RequestStream(_incoming(b"a"), _AioContext())
        closed = stream.defer_end_check()
        await anext(stream)
        await closed()

    with pytest.raises(RuntimeError, match="not read to its end"):
        asyncio.run(confirm_early())


@pytest.mark.parametrize(
    ("wrap", "incoming"),
    [
        (wire._unary_request, wire.Malformed("DecodeError: bad")),
        (wire._stream_request, iter([b"ok", wire.Malformed("DecodeError: bad")])),
        (wire._stream_both, iter([b"ok", wire.Malformed("DecodeError: bad")])),
    ],
)
def test_a_malformed_request_is_refused_before_the_handler_acts_on_it(
    wrap: Any, incoming: Any
) -> None:
    seen: list[Any] = []

    def handler(requests: Any, context: Any) -> Any:
        if isinstance(requests, wire.Malformed):
            seen.append(requests)  # a unary handler must never get here
            return None
        for message in requests:
            seen.append(message)
        return [b"reply"]

    with pytest.raises(_Aborted) as info:
        result = wrap(handler)(incoming, _Context("never"))
        list(result)  # a response stream runs as it is read
    code, details = info.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "DecodeError: bad" in details
    assert all(m == b"ok" for m in seen)


@pytest.mark.parametrize(
    ("tasks", "version", "text"),
    [
        (["pkg.mod:task"] * 65, "1", "tasks: at most 64"),
        (["pkg.mod:" + "t" * 300], "1", "each at most 300 characters"),
        (["pkg.mod:task"], "v" * 65, "version: at most 64"),
    ],
)
def test_what_a_site_registers_is_bounded_as_it_is_stored(
    coordinator: Any, tasks: list[str], version: str, text: str
) -> None:
    """PostgreSQL would refuse longer values (INTERNAL); the site is told what is wrong."""
    request = site_pb2.RegisterRequest(site_id="site-a", tasks=tasks, version=version)
    with pytest.raises(grpc.RpcError) as info:
        coordinator.site.Register(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in (info.value.details() or "")
    assert coordinator.engine._store.list_sites() == []


@pytest.mark.parametrize(("key", "value"), [("name", "n" * 201), ("task", "p.m:" + "t" * 297)])
def test_a_run_s_name_and_task_are_bounded_as_they_are_stored(key: str, value: str) -> None:
    from fedra.config import ConfigError
    from fedra.runspec import RunSpec

    spec = RunSpec(task="pkg.mod:task", rounds=1)
    with pytest.raises(ConfigError, match=f"^{key}: at most"):
        dataclasses.replace(spec, **{key: value}).validate()
