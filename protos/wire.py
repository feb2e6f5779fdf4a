"""Model chunks on the wire without protobuf's copies.

``ModelChunk`` (``bytes data = 1``) and the data arm of ``UpdateChunk`` (``bytes data = 2``)
carry nearly every byte fedra moves. Through the generated classes each chunk is copied
into a message, serialized into a second buffer, and parsed back out into a third; here
the sender writes the field's tag and length in front of the chunk as it builds it
(``encode_chunks(frame=...)``, one copy), and the receiver takes a view of the payload
inside the bytes gRPC hands it (no copy). The bytes on the wire are exactly the protobuf
encoding, so either side may be the generated code; anything but a lone data field (an
empty chunk, unknown fields, a header) goes through the generated parser as before.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from fedra.protos.v1 import common_pb2, site_pb2

_LEN = 2  # protobuf wire type of bytes fields
MODEL_CHUNK_TAG = (1 << 3) | _LEN  # ModelChunk.data
UPDATE_CHUNK_DATA_TAG = (2 << 3) | _LEN  # UpdateChunk.data (the header is field 1)
_MAX_VARINT_BYTES = 10

SITE_SERVICE = "fedra.v1.SiteService"
ADMIN_SERVICE = "fedra.v1.AdminService"
DOWNLOAD_MODEL = f"/{SITE_SERVICE}/DownloadModel"
UPLOAD_UPDATE = f"/{SITE_SERVICE}/UploadUpdate"
EXPORT_MODEL = f"/{ADMIN_SERVICE}/ExportModel"
# The largest message the coordinator sends, and the admin client accepts: an unpaged
# GetRun answers with a whole run, about 220 bytes per participation, so 64 MiB holds
# some 300,000 (paged GetRun and WatchRun messages stay near 1 MiB however long the run).
MAX_STATUS_BYTES = 64 * 2**20


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def model_chunk_frame(size: int) -> bytes:
    """What goes in front of ``size`` payload bytes to make them a ``ModelChunk``."""
    return bytes([MODEL_CHUNK_TAG]) + _varint(size)


def update_chunk_frame(size: int) -> bytes:
    """The same for the data arm of an ``UpdateChunk``."""
    return bytes([UPDATE_CHUNK_DATA_TAG]) + _varint(size)


def lone_field(raw: bytes, tag: int) -> memoryview | None:
    """The payload of ``raw`` when ``raw`` is exactly one length-delimited field ``tag``
    (a view, no copy); None for anything else, which the generated parser must read."""
    if len(raw) < 2 or raw[0] != tag:
        return None
    length, shift, pos = 0, 0, 1
    while True:
        if pos >= len(raw) or pos > _MAX_VARINT_BYTES:
            return None
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            break
        shift += 7
    if pos + length != len(raw):
        return None  # more fields follow (or it is truncated): not the fast path's to judge
    return memoryview(raw)[pos:]


def parse_model_chunk(raw: bytes) -> memoryview:
    """A ``ModelChunk``'s data, as a view into ``raw`` when it is a lone data field."""
    view = lone_field(raw, MODEL_CHUNK_TAG)
    if view is not None:
        return view
    return memoryview(common_pb2.ModelChunk.FromString(raw).data)


def parse_update_chunk(raw: bytes) -> site_pb2.UpdateChunk | memoryview:
    """An ``UpdateChunk``: a view of its data when it is a lone data field, else the message
    (a header, or data framed some other valid way)."""
    view = lone_field(raw, UPDATE_CHUNK_DATA_TAG)
    if view is not None:
        return view
    return site_pb2.UpdateChunk.FromString(raw)


def update_chunk_data(message: site_pb2.UpdateChunk | memoryview) -> memoryview | None:
    """The data of an upload message, or None when it is not a data message."""
    if isinstance(message, memoryview):
        return message
    if message.WhichOneof("part") != "data":
        return None
    return memoryview(message.data)


def serialize(message: bytes | Message) -> bytes:
    """Pre-framed bytes pass through as they are; messages serialize as usual."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


def _with_wire(handler: Any, request: Any = None, response: Any = None) -> Any:
    """``handler`` (an RpcMethodHandler namedtuple) with its (de)serializers replaced."""
    changes = {}
    if request is not None:
        changes["request_deserializer"] = request
    if response is not None:
        changes["response_serializer"] = response
    return handler._replace(**changes)


class _Capture:
    """Stands in for a server to collect a generated ``add_*_to_server``'s handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers = dict(handlers)


def add_service(
    server: grpc.Server,
    add_generated: Any,
    servicer: Any,
    service: str,
    overrides: dict[str, dict[str, Any]],
) -> None:
    """Register ``servicer`` as the generated ``add_generated`` would, with some methods'
    (de)serializers replaced: ``overrides[method] = {"request": f, "response": g}``."""
    capture = _Capture()
    add_generated(servicer, capture)
    if not capture.handlers:
        raise RuntimeError(f"{service}: the generated code registered no handlers")
    handlers = capture.handlers
    for method, change in overrides.items():
        handlers[method] = _with_wire(handlers[method], **change)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
