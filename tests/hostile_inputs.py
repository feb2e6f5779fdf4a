"""Hypothesis strategies for the hostile-input suite: raw and mutated messages, mangled
upload streams, and safetensors payloads that are wrong in every way a header can be."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from hypothesis import strategies as st

from fedra.protos import wire
from fedra.protos.codec import MAX_METADATA_BYTES, encode
from fedra.protos.v1 import admin_pb2, site_pb2
from tests.hostile_arena import ATTACKER, CALL_TIMEOUT_S, TASK, Arena, delta


class Rpc:
    """One RPC of the site or admin service, called with raw bytes (no serializers)."""

    def __init__(self, service: str, method: Any) -> None:
        self.service = service
        self.name = method.name
        self.path = f"/{service}/{method.name}"
        self.request = message_factory.GetMessageClass(method.input_type)
        self.streams_in, self.streams_out = method.client_streaming, method.server_streaming
        self.admin = service == wire.ADMIN_SERVICE

    def __repr__(self) -> str:
        return self.path

    def invoke(self, channel: grpc.Channel, raw: bytes | list[bytes]) -> Any:
        if self.streams_in:
            stream = [raw] if isinstance(raw, bytes) else raw
            return channel.stream_unary(self.path)(iter(stream), timeout=CALL_TIMEOUT_S)
        assert isinstance(raw, bytes)
        if self.streams_out:
            return channel.unary_stream(self.path)(raw, timeout=CALL_TIMEOUT_S)
        return channel.unary_unary(self.path)(raw, timeout=CALL_TIMEOUT_S)


RPCS = [
    Rpc(svc.full_name, m)
    for module, name in ((site_pb2, "SiteService"), (admin_pb2, "AdminService"))
    for svc in [module.DESCRIPTOR.services_by_name[name]]
    for m in svc.methods
]
NO_RUN = "0" * 12  # an admin's base messages name no real run: CancelRun must not hit it


def base_messages(arena: Arena, rpc: Rpc) -> list[Message]:
    """Well-formed requests for ``rpc`` that the attacker (or, for admin calls, the admin)
    may send: seeds for mutation. None of them may change the honest run."""
    task_a = arena.tasks["site-a"]
    if rpc.name == "SubmitRun":  # rounds unset: invalid, whatever else a mutation keeps
        spec = admin_pb2.RunSpec(task=TASK, sites_per_round=1, strategy="fedavg")
        return [admin_pb2.SubmitRunRequest(spec=spec)]
    if rpc.name == "UploadUpdate":
        (header, *_) = arena.upload_messages(ATTACKER, task_a, encode(delta(0.5)), key_of=ATTACKER)
        return [header, site_pb2.UpdateChunk(data=b"\x08\x00" * 8)]
    if rpc.name == "UploadSmallUpdate":
        payload = encode(delta(0.5))
        (first, *_) = arena.upload_messages(ATTACKER, task_a, payload, key_of=ATTACKER)
        return [
            site_pb2.UploadSmallUpdateRequest(header=first.header, payload=payload),
            # held as the next poll once accepted: a mutated hold must not outlast the test
            site_pb2.UploadSmallUpdateRequest(
                header=first.header, payload=payload, then_poll_s=1.0
            ),
        ]
    out = []
    for site_id in (ATTACKER, "site-a"):
        message = rpc.request()
        for field in rpc.request.DESCRIPTOR.fields:
            value = {
                "site_id": site_id,
                "task_id": task_a.task_id,
                "run_id": NO_RUN if rpc.admin else arena.run_id,
                "tasks": ["hostile.none:task"],
                "reason": "hostile",
            }.get(field.name)
            if value is None:
                continue
            if isinstance(value, list):
                getattr(message, field.name).extend(value)
            else:
                setattr(message, field.name, value)
        out.append(message)
    return out


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` with a few bytes flipped, inserted, deleted, or the end cut off."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "set"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif data:
            data[at] = draw(st.sampled_from([0x00, 0x08, 0x0A, 0x12, 0x7F, 0x80, 0xFF]))
    return bytes(data)


def hostile_bytes(bases: list[Message]) -> st.SearchStrategy[bytes]:
    """Random bytes, or a mutation of a well-formed request."""
    seeds = [m.SerializeToString() for m in bases]
    return st.one_of(st.binary(max_size=300), st.sampled_from(seeds).flatmap(mutated))


# Text a remote party may choose: line breaks, terminal escapes, bidi overrides, floods.
hostile_text = st.one_of(
    st.sampled_from(["site-a", "site-b", ATTACKER, "", "x" * 100_000 + "\nforged"]),
    st.text(st.sampled_from("ab:-_.\n\r\t\x1b[31m\u202e\u2028\x00é"), max_size=40),
    st.integers(200, 3000).map(lambda n: "A" * n + "\nINFO fedra.coordinator: forged"),
)


# -- upload streams ---------------------------------------------------------------

OVERSIZED = 1_200_000  # over the 64 KiB chunks + 1 MiB envelope the coordinator takes


def frame(data: bytes) -> bytes:
    return wire.update_chunk_frame(len(data)) + data


@st.composite
def mangled_stream(draw: st.DrawFn, messages: list[bytes]) -> list[bytes]:
    """A signed upload's messages (raw) truncated, reordered, duplicated, oversized, or
    with a chunk's framing cut short or its tag wrong; never the stream as it was."""
    out = list(messages)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["cut", "drop", "swap", "dup", "big", "frame", "tag", "header"]))
        i = draw(st.integers(0, len(out) - 1)) if out else 0
        j = draw(st.integers(0, len(out))) if out else 0
        if op == "cut":
            del out[i:]
        elif op == "drop" and out:
            del out[i]
        elif op == "swap" and out:
            k = min(j, len(out) - 1)
            out[i], out[k] = out[k], out[i]
        elif op == "dup" and out:
            out.insert(j, out[i])
        elif op == "big":
            out.insert(j, frame(b"\x00" * OVERSIZED))
        elif op == "frame" and out:  # the length says more than follows
            out[i] = wire.update_chunk_frame(len(out[i]) + 5) + out[i][2:]
        elif op == "tag" and out:
            out[i] = (
                bytes([draw(st.sampled_from([0x10, 0x1A, 0x0A, 0x12, 0x00, 0xFF]))]) + out[i][1:]
            )
        elif op == "header":
            out.insert(j, messages[0])
    return out


# -- safetensors payloads -----------------------------------------------------------


def good_header() -> dict[str, Any]:
    """The header a correct encoder writes for the synthetic model's update."""
    payload = encode(delta(0.01))
    length = struct.unpack("<Q", payload[:8])[0]
    return json.loads(payload[8 : 8 + length])  # type: ignore[no-any-return]


def body_of(header: Any) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def assemble(header_text: bytes, data: bytes, length: int | None = None) -> bytes:
    prefix = (len(header_text) if length is None else length).to_bytes(8, "little")
    return prefix + header_text + data


BAD_VALUES: dict[str, list[Any]] = {
    "dtype": ["F16", "I32", "BOOL", "F8", "", 5, None, ["F32"], "f32"],
    "shape": [[], [8, 1], [1, 9], [-1, 8], [2**62, 2**62], [2**40], [1.5], ["1"], None, 8],
    "data_offsets": [[0, 4], [0, 2**64], [32, 0], [0], [0, 16, 32], [-4, 0], [3, 7], None, "0"],
}


@st.composite
def bad_payload(draw: st.DrawFn) -> bytes:
    """Safetensors bytes for the synthetic model's update that no correct update could be."""
    header = good_header()
    data = encode(delta(0.01))[-36:]  # nine float32 values
    names = sorted(k for k in header if k != "__metadata__")
    kind = draw(st.sampled_from(list(_KINDS)))
    return _KINDS[kind](draw, header, names, data)


def _entry(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    name, key = draw(st.sampled_from(names)), draw(st.sampled_from(sorted(BAD_VALUES)))
    value = draw(st.sampled_from([v for v in BAD_VALUES[key] if v != header[name][key]]))
    header[name][key] = value
    return assemble(body_of(header), data)


def _keys(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    name = draw(st.sampled_from(names))
    change = draw(st.sampled_from(["drop_tensor", "extra_tensor", "rename", "extra_key", "no_key"]))
    if change == "drop_tensor":
        del header[name]
    elif change == "extra_tensor":
        header["sneaky"] = {"dtype": "F32", "shape": [0], "data_offsets": [36, 36]}
    elif change == "rename":
        header[name + "\n"] = header.pop(name)
    elif change == "extra_key":
        header[name]["extra"] = 1
    else:
        del header[name][draw(st.sampled_from(sorted(BAD_VALUES)))]
    return assemble(body_of(header), data)


def _metadata(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    padding = st.integers(MAX_METADATA_BYTES + 1, 200_000).map(lambda n: {"pad": "p" * n})
    value = draw(st.one_of(padding, st.sampled_from([[], "x", {"k": 1}, {"k": None}])))
    header["__metadata__"] = value
    return assemble(body_of(header), data)


def _length(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    body = body_of(header)
    length = draw(
        st.one_of(
            st.integers(0, len(body) - 1),
            st.integers(len(body) + 1, len(body) + 2**20),
            st.sampled_from([2**63, 2**64 - 1, 10**9, 16 * 2**20]),
        )
    )
    return assemble(body, data, length)[: draw(st.sampled_from([None, 7, 8, 20]))]


def _text(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    body = draw(
        st.one_of(
            st.binary(min_size=1, max_size=200),
            st.sampled_from([b"[]", b"1", b'"x"', b"null", b"{", b"\xff\xfe{}", b"{}"]),
            st.just(body_of(header).replace(b"{", b'{"linear.bias":0,', 1)),  # a key twice
            st.just(b"[" * 100_000),
        )
    )
    return assemble(body, data)


def _values(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    values = list(struct.unpack("<9f", data))
    for _ in range(draw(st.integers(1, 3))):
        values[draw(st.integers(0, 8))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return assemble(body_of(header), struct.pack("<9f", *values))


def _data_size(draw: st.DrawFn, header: dict[str, Any], names: list[str], data: bytes) -> bytes:
    cut = draw(st.integers(-36, 64).filter(lambda n: n != 0))
    data = data[:cut] if cut < 0 else data + b"\x00" * cut
    return assemble(body_of(header), data)


_KINDS: dict[str, Callable[[st.DrawFn, dict[str, Any], list[str], bytes], bytes]] = {
    "entry": _entry,
    "keys": _keys,
    "metadata": _metadata,
    "length": _length,
    "text": _text,
    "values": _values,
    "data_size": _data_size,
}
