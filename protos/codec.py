"""Tensor codec: named tensors as safetensors-format bytes, encoded and decoded in bounded chunks.

Own implementation, not the ``safetensors`` package: that one needs the whole payload in memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import torch

# Small enough that a stream's buffers stay a few MiB, large enough that per-message costs
# vanish (about 1 ms of copying per chunk).
DEFAULT_CHUNK_BYTES = 1024 * 1024
# A transfer is cut into at least this many chunks, while chunks stay >= MIN_CHUNK_BYTES
# (a 4 MB model's 256 KiB chunks measured no slower per round than 1 MiB ones).
MIN_CHUNKS_PER_TRANSFER = 16
MIN_CHUNK_BYTES = 64 * 1024
# The largest chunk a receiver must accept (earlier versions sent 4 MiB chunks).
MAX_CHUNK_BYTES = 16 * 1024 * 1024
# The largest header of a payload whose tensors are not known in advance (an initial
# model); one whose tensors are known may carry only what they need (``header_limit``).
MAX_HEADER_BYTES = 16 * 1024 * 1024
# The most bytes of JSON ``__metadata__`` a header may carry (fedra writes none).
MAX_METADATA_BYTES = 4096
# Per tensor, beyond what this encoder writes: other writers' data order (offsets of other
# lengths, up to 19 digits each), spacing after separators, and \u-escaped names.
_ENTRY_SLACK_BYTES = 64

_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
# fmt: off
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
# fmt: on
_DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in _DTYPES.items()}

# Raw bytes are copied to and from tensor memory as-is; the format is little-endian.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("fedra.protos.codec needs a little-endian host")

Buffer: TypeAlias = bytes | bytearray | memoryview
# A prefix for each chunk of n payload bytes: the wire framing, written in the same copy.
Framing: TypeAlias = Callable[[int], bytes]

# Views of received bytes are read-only by contract (see StreamDecoder ``copy``); torch warns
# about any tensor over a read-only buffer, so that warning is silenced for this module only.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)


class CodecError(ValueError):
    """A payload, header or tensor set that does not fit the format or the expected specs."""


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of one tensor, as announced by a header."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorPiece:
    """A run of whole elements of one tensor, starting at element ``offset`` of its flat view."""

    name: str
    offset: int
    values: torch.Tensor


class _Entry(NamedTuple):
    name: str
    spec: TensorSpec
    begin: int
    end: int


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The spec of each tensor; CodecError for a dtype or name the format cannot carry."""
    specs: dict[str, TensorSpec] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == _METADATA_KEY:
            raise CodecError(f"tensor name {name!r} is not allowed")
        if tensor.dtype not in _DTYPE_CODES or tensor.layout != torch.strided:
            raise CodecError(f"tensor {name!r}: unsupported {tensor.dtype} / {tensor.layout}")
        specs[name] = TensorSpec(tensor.dtype, tuple(tensor.shape))
    return specs


def _header_bytes(specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CodecError("metadata keys and values must be str")
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name in sorted(specs):
        spec = specs[name]
        end = offset + spec.nbytes
        code = _DTYPE_CODES[spec.dtype]
        header[name] = {"dtype": code, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    # Compact separators and raw UTF-8 match the reference writer byte for byte.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def header_limit(specs: Mapping[str, TensorSpec]) -> int:
    """The most header bytes (after the 8-byte length) a payload of ``specs`` may carry:
    what this encoder writes, a little slack per tensor, and MAX_METADATA_BYTES."""
    exact = len(_header_bytes(specs, None)) - 8
    slack = sum(_ENTRY_SLACK_BYTES + 2 * len(name.encode("utf-8")) for name in specs)
    return exact + slack + MAX_METADATA_BYTES


def encoded_size(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """The exact number of bytes ``encode_chunks(tensors, metadata=metadata)`` yields."""
    specs = spec_of(tensors)
    return len(_header_bytes(specs, metadata)) + sum(s.nbytes for s in specs.values())


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
        flat = flat.view(torch.int16)
    # The numpy array keeps the tensor alive, so the view stays valid without a copy.
    return flat.numpy().view(np.uint8).data


def transfer_chunk_bytes(payload_bytes: int, limit: int = DEFAULT_CHUNK_BYTES) -> int:
    """The chunk size to send ``payload_bytes`` in: at most ``limit``, and at most
    1/MIN_CHUNKS_PER_TRANSFER of the payload, but not under MIN_CHUNK_BYTES.

    A stream holds about three chunks at a time (the one gRPC is moving, the one being
    processed, the one being built), so its buffers cost a fixed fraction of the payload
    (about 3/16) rather than three times ``limit``: with many concurrent transfers of a small
    model, 1 MiB chunks would hold most of each model per stream.
    """
    if limit <= 0:
        raise ValueError(f"chunk limit must be positive, got {limit}")
    return min(limit, max(MIN_CHUNK_BYTES, payload_bytes // MIN_CHUNKS_PER_TRANSFER))


def encode_chunks(
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    metadata: Mapping[str, str] | None = None,
    frame: Framing | None = None,
) -> Iterator[bytes]:
    """Yield the encoded payload in chunks of exactly ``chunk_bytes`` (the last may be shorter).

    With ``frame``, each chunk comes with ``frame(len(chunk))`` in front, built in the same
    single copy: a wire message around the chunk costs nothing more (``fedra.protos.wire``).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    header = _header_bytes(spec_of(tensors), metadata)  # validates eagerly, before iteration
    ordered = [tensors[name] for name in sorted(tensors)]
    return _chunked(header, ordered, chunk_bytes, frame)


def _chunked(
    header: bytes, ordered: list[torch.Tensor], chunk_bytes: int, frame: Framing | None
) -> Iterator[bytes]:
    # Views into tensor memory are gathered and joined once: each chunk is built with one copy
    # and no staging buffer, so the chunk being yielded is the only transport buffer alive.
    views: list[memoryview | bytes] = [frame(chunk_bytes)] if frame else []
    filled = 0
    # map() is lazy, so at most one tensor's contiguous/CPU copy is made at a time.
    for part in itertools.chain([memoryview(header)], map(_tensor_bytes, ordered)):
        start = 0
        while start < len(part):
            view = part[start : start + chunk_bytes - filled]
            views.append(view)
            filled += len(view)
            start += len(view)
            if filled == chunk_bytes:
                yield b"".join(views)  # not bound to a local, so it is freed with the consumer's
                views.clear()
                if frame:
                    views.append(frame(chunk_bytes))
                filled = 0
    if filled:
        if frame:
            views[0] = frame(filled)
        yield b"".join(views)


def digest_and_size(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """SHA-256 (hex) and length of the encoding, hashed straight from tensor memory (no chunks)."""
    header = _header_bytes(spec_of(tensors), metadata)
    digest = hashlib.sha256(header)
    size = len(header)
    for name in sorted(tensors):
        view = _tensor_bytes(tensors[name])
        digest.update(view)
        size += len(view)
    return digest.hexdigest(), size


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The whole payload as one bytes object; prefer ``encode_chunks`` for large tensors."""
    return b"".join(encode_chunks(tensors, metadata=metadata))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise CodecError(f"header names {key!r} twice")
        result[key] = value
    return result


def _load_header_json(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except CodecError:
        raise
    except UnicodeDecodeError as exc:
        raise CodecError(f"header is not valid UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, oversized ints, deep nesting
        raise CodecError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CodecError(f"header must be a JSON object, got {type(header).__name__}")
    return header


def _is_int(value: Any) -> bool:
    # The int64 bound keeps torch.empty from overflowing on a hostile header.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _parse_entry(name: str, entry: Any) -> _Entry:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise CodecError(f"tensor {name!r}: entry must have exactly {sorted(_ENTRY_KEYS)}")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CodecError(f"tensor {name!r}: unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise CodecError(f"tensor {name!r}: shape must be non-negative ints, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
        raise CodecError(f"tensor {name!r}: data_offsets must be 2 non-negative ints")
    spec = TensorSpec(dtype, tuple(shape))
    if offsets[1] - offsets[0] != spec.nbytes:
        raise CodecError(
            f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
            f"expected {spec.nbytes} for {entry['dtype']} {list(shape)}"
        )
    return _Entry(name, spec, offsets[0], offsets[1])


def _parse_header(raw: bytes) -> tuple[list[_Entry], dict[str, str]]:
    """Entries in data order, and the metadata, from the JSON header bytes."""
    header = _load_header_json(raw)
    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CodecError("__metadata__ must be an object of strings")
    size = sum(len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in metadata.items())
    if size > MAX_METADATA_BYTES:
        raise CodecError(f"__metadata__ holds {size} bytes, more than {MAX_METADATA_BYTES}")
    # The reference writer orders data by dtype then name, so follow offsets, not key order.
    entries = sorted(
        (_parse_entry(n, e) for n, e in header.items()), key=lambda e: (e.begin, e.end)
    )
    position = 0
    for entry in entries:
        if entry.begin != position:
            kind = "gap" if entry.begin > position else "overlap"
            raise CodecError(
                f"tensor {entry.name!r}: data {kind}, begins at {entry.begin}, expected {position}"
            )
        position = entry.end
    return entries, metadata


def _check_expected(expected: Mapping[str, TensorSpec], specs: Mapping[str, TensorSpec]) -> None:
    for name in sorted(set(expected) | set(specs)):
        if name not in specs:
            raise CodecError(f"missing tensor {name!r}")
        if name not in expected:
            raise CodecError(f"unexpected tensor {name!r}")
        want, got = expected[name], specs[name]
        if want.dtype != got.dtype:
            raise CodecError(f"tensor {name!r}: dtype expected {want.dtype}, got {got.dtype}")
        if want.shape != got.shape:
            raise CodecError(f"tensor {name!r}: shape expected {want.shape}, got {got.shape}")


def _piece(entry: _Entry, offset: int, data: Buffer, copy: bool = True) -> TensorPiece:
    raw = None
    if not copy and len(data):
        # A view of the caller's bytes (kept alive by the tensor), where its elements are
        # aligned; an unaligned run is copied like any other.
        view = torch.frombuffer(data, dtype=torch.uint8)
        raw = view if view.data_ptr() % entry.spec.dtype.itemsize == 0 else None
    if raw is None:
        # Copy straight into fresh tensor memory: no Python-side buffer, no aliasing.
        raw = torch.empty(len(data), dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    if entry.spec.dtype == torch.bool and bool((raw > 1).any()):  # other bytes are not valid bools
        raise CodecError(f"tensor {entry.name!r}: BOOL bytes must be 0 or 1")
    return TensorPiece(entry.name, offset, raw.view(entry.spec.dtype))


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite; True for integer tensors.

    One reduction instead of ``isfinite(t).all()``'s mask, many times faster: a NaN or an
    infinity always makes the sum NaN or infinite, so a finite sum proves every element
    finite; only a non-finite sum (which finite values can also reach, by overflow) needs
    the exact elementwise check.
    """
    if not tensor.is_floating_point():
        return True
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    if math.isfinite(float(tensor.sum(dtype=wide))):
        return True
    return bool(torch.isfinite(tensor).all())


class StreamDecoder:
    """Incremental parser: feed arbitrary byte chunks, get whole-element pieces of tensors."""

    def __init__(
        self,
        expected: Mapping[str, TensorSpec] | None = None,
        max_header_bytes: int | None = None,
        copy: bool = True,
    ) -> None:
        """``max_header_bytes`` defaults to what ``expected`` needs (``header_limit``), else
        MAX_HEADER_BYTES; a longer header is refused from its length, before it is read.
        ``copy=False``: pieces are read-only views of the fed bytes where they can be
        (aligned runs), each keeping its chunk alive; for consumers that only read them."""
        if max_header_bytes is None:
            max_header_bytes = MAX_HEADER_BYTES if expected is None else header_limit(expected)
        self._expected = expected
        self._copy = copy
        self._max_header_bytes = max_header_bytes
        self._head = bytearray()  # length prefix, then header JSON; freed once parsed
        self._header_len: int | None = None
        self._entries: list[_Entry] | None = None
        self._metadata: dict[str, str] = {}
        self._data_size = 0
        self._position = 0  # bytes of the data section seen
        self._index = 0  # entry the next data byte belongs to
        self._carry = bytearray()  # bytes of an element split across feeds (< itemsize)
        self._consumed = 0

    @property
    def header_ready(self) -> bool:
        return self._entries is not None

    def _ready_entries(self) -> list[_Entry]:
        if self._entries is None:
            raise RuntimeError("header not complete yet")
        return self._entries

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {e.name: e.spec for e in self._ready_entries()}

    @property
    def metadata(self) -> dict[str, str]:
        self._ready_entries()
        return dict(self._metadata)

    @property
    def total_bytes(self) -> int:
        self._ready_entries()
        assert self._header_len is not None
        return 8 + self._header_len + self._data_size

    @property
    def bytes_consumed(self) -> int:
        return self._consumed

    def feed(self, data: Buffer) -> list[TensorPiece]:
        """Take the next bytes of the stream; returns the whole elements they complete."""
        view = memoryview(data).cast("B")
        self._consumed += len(view)
        if self._entries is None:
            view = self._feed_header(view)
        return self._feed_data(view) if view else []

    def _feed_header(self, view: memoryview) -> memoryview:
        if self._header_len is None:
            need = 8 - len(self._head)
            self._head += view[:need]
            view = view[need:]
            if len(self._head) < 8:
                return view
            length = int.from_bytes(self._head, "little")
            if length > self._max_header_bytes:
                why = " (what the expected tensors need)" if self._expected is not None else ""
                raise CodecError(
                    f"header length {length} exceeds {self._max_header_bytes} bytes{why}"
                )
            self._header_len = length
            self._head.clear()
        need = self._header_len - len(self._head)
        self._head += view[:need]
        view = view[need:]
        if len(self._head) == self._header_len:
            self._install_header(bytes(self._head))
            self._head = bytearray()
        return view

    def _install_header(self, raw: bytes) -> None:
        entries, metadata = _parse_header(raw)
        if self._expected is not None:
            _check_expected(self._expected, {e.name: e.spec for e in entries})
        self._entries, self._metadata = entries, metadata
        self._data_size = entries[-1].end if entries else 0

    def _feed_data(self, view: memoryview) -> list[TensorPiece]:
        entries = self._ready_entries()
        extra = self._position + len(view) - self._data_size
        if extra > 0:
            raise CodecError(
                f"{extra} trailing bytes after the {self._data_size}-byte data section"
            )
        pieces: list[TensorPiece] = []
        while view:
            while entries[self._index].end <= self._position:  # skips empty tensors too
                self._index += 1
            entry = entries[self._index]
            take = min(len(view), entry.end - self._position)
            pieces.extend(self._split_elements(entry, view[:take]))
            self._position += take
            view = view[take:]
        return pieces

    def _split_elements(self, entry: _Entry, part: memoryview) -> list[TensorPiece]:
        itemsize = entry.spec.dtype.itemsize
        start = self._position - entry.begin  # byte offset of part[0] within the tensor
        pieces: list[TensorPiece] = []
        if self._carry:
            need = itemsize - len(self._carry)
            self._carry += part[:need]
            if len(self._carry) < itemsize:
                return pieces
            pieces.append(_piece(entry, (start + need) // itemsize - 1, self._carry))
            self._carry = bytearray()
            part, start = part[need:], start + need
        whole = len(part) // itemsize * itemsize
        if whole:
            pieces.append(_piece(entry, start // itemsize, part[:whole], self._copy))
        self._carry += part[whole:]
        return pieces

    def finish(self) -> None:
        """CodecError unless exactly one whole payload was fed."""
        if self._entries is None:
            where = "length prefix" if self._header_len is None else "header"
            raise CodecError(f"stream ended inside the {where} after {self._consumed} bytes")
        if self._position < self._data_size:
            entry = next(e for e in self._entries if e.end > self._position)
            raise CodecError(
                f"stream ended inside tensor {entry.name!r}: data byte {self._position} "
                f"of {self._data_size}, tensor spans [{entry.begin}, {entry.end})"
            )


def decode_chunks(
    chunks: Iterable[Buffer],
    expected: Mapping[str, TensorSpec] | None = None,
    reuse: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a chunked payload; each tensor is allocated once and filled as its bytes arrive
    (one copy: from the chunks straight into the tensors).

    A tensor of ``reuse`` with the same name, dtype and shape (contiguous, on the CPU, its
    memory its own) is filled in place instead of a new one: a model replacing the one
    before it costs no fresh memory. Whatever happens, those tensors' values are then lost.
    """
    decoder = StreamDecoder(expected, copy=False)
    tensors: dict[str, torch.Tensor] | None = None
    for chunk in chunks:
        if tensors is None:
            pieces = decoder.feed(chunk)
            if decoder.header_ready:
                tensors = _destinations(decoder.specs, reuse or {})
                _fill(tensors, pieces)
            del pieces
        else:
            _fill(tensors, decoder.feed(chunk))
        del chunk  # the pieces (views of it) are gone too: the producer can free it
    decoder.finish()
    assert tensors is not None
    return tensors


def _destinations(
    specs: Mapping[str, TensorSpec], reuse: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Where each tensor of a payload is decoded to: the ``reuse`` tensor that fits, else new."""
    own = sole_owners(reuse)  # filling a tied weight under one name would change another
    out = {}
    for name, spec in specs.items():
        old = reuse.get(name)
        if old is not None and name in own and _fits(old, spec):
            out[name] = old.detach()
        else:
            out[name] = torch.empty(spec.shape, dtype=spec.dtype)
    return out


def _fits(tensor: torch.Tensor, spec: TensorSpec) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.dtype == spec.dtype
        and tuple(tensor.shape) == spec.shape
    )


def sole_owners(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """The names of the contiguous tensors whose bytes no other tensor of ``tensors`` shares
    (tied weights share theirs): each can be written in place without touching another."""
    spans = []
    for name, t in tensors.items():
        if t.numel() == 0:
            continue  # no bytes to share: written in place, it changes nothing
        start = t.data_ptr()
        # A strided view's bytes lie between its first and last elements: it cannot own
        # them (others may sit in its gaps), but it overlaps whatever else lies there.
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        spans.append((start, start + (last + 1) * t.element_size(), name, t.is_contiguous()))
    spans.sort()
    alone = set()
    reach = -1  # the furthest end of the spans before this one
    for i, (start, end, name, contiguous) in enumerate(spans):
        before = start < reach
        after = i + 1 < len(spans) and spans[i + 1][0] < end
        if contiguous and not before and not after:
            alone.add(name)
        reach = max(reach, end)
    return alone


def _fill(tensors: dict[str, torch.Tensor], pieces: list[TensorPiece]) -> None:
    for piece in pieces:
        flat = tensors[piece.name].view(-1)
        flat[piece.offset : piece.offset + piece.values.numel()] = piece.values


def decode(
    payload: Buffer, expected: Mapping[str, TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    """Decode a whole payload held in memory, in chunk-sized slices to bound temporary copies."""
    view = memoryview(payload).cast("B")
    slices = (view[i : i + DEFAULT_CHUNK_BYTES] for i in range(0, len(view), DEFAULT_CHUNK_BYTES))
    return decode_chunks(slices, expected)


def sha256_hex(chunks: Iterable[Buffer]) -> str:
    """Hex SHA-256 of the concatenated chunks, computed without joining them."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()
