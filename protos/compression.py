"""Update compression for uploads: fp16/bf16 casts, block-wise int8, top-k with error feedback.

Naming rule of a compressed payload. ``none`` sends the plain model; ``fp16``/``bf16`` send each
floating-point tensor under its own name, cast. ``int8`` and ``topk`` send each floating-point
tensor ``X`` as two tensors, ``X/0_<meta>`` (what decoding needs) and ``X/1_<values>``: both start
with ``X/`` and differ first at the digit, so in the codec's sorted layout the metadata always
arrives before the values it applies to, and the mapping is injective whatever the model's names.
Integer buffers are not sent by the lossy codecs: their delta is always zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import torch

from fedra.files import write_atomic
from fedra.protos.codec import (
    CodecError,
    TensorPiece,
    TensorSpec,
    all_finite,
    decode_chunks,
    encode_chunks,
    encoded_size,
    spec_of,
)
from fedra.runspec import CODECS as CODECS  # noqa: PLC0414 - re-exported here
from fedra.runspec import CodecSpec as CodecSpec  # noqa: PLC0414 - re-exported here

# (metadata suffix, values suffix) per codec that splits a tensor in two.
SUFFIXES: dict[str, tuple[str, str]] = {
    "int8": ("/0_scale", "/1_q"),
    "topk": ("/0_index", "/1_value"),
}
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INT8_MAX = 127
_FILE_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SparsePiece:
    """Values to add at flat ``indices`` of model tensor ``name`` (a top-k contribution)."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor


Piece: TypeAlias = TensorPiece | SparsePiece


def dense_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a decompressed delta is given: fp64 for fp64 tensors, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def num_blocks(numel: int, block: int) -> int:
    """int8: the number of blocks (and scales) of a tensor; the last may be partial."""
    return -(-numel // block)


def topk_count(numel: int, fraction: float) -> int:
    """topk: how many elements are sent, ``fraction * numel`` rounded, at least 1 if any."""
    return min(numel, max(1, round(fraction * numel))) if numel else 0


def index_dtype(numel: int) -> torch.dtype:
    """topk: int32 indices where they fit, halving their bytes; int64 beyond."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


# secagg: the payload is one int32 tensor, the masked update modulo 2**32 (bit pattern).
MASKED = "secagg.masked"
_U32 = 0xFFFFFFFF


def floating_layout(model: Mapping[str, TensorSpec]) -> list[tuple[str, TensorSpec]]:
    """The floating-point tensors in the order a flat update vector concatenates them."""
    return [(name, model[name]) for name in sorted(model) if model[name].dtype.is_floating_point]


def flatten_update(delta: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The floating-point tensors of ``delta`` as one flat float32 vector (sorted by name)."""
    parts = [
        delta[name].detach().reshape(-1).float() for name, _ in floating_layout(spec_of(delta))
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten_update(
    vector: torch.Tensor, model: Mapping[str, TensorSpec]
) -> dict[str, torch.Tensor]:
    """The inverse of ``flatten_update``: views of ``vector`` shaped like the model's tensors."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, spec in floating_layout(model):
        out[name] = vector[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel
    if offset != vector.numel():
        raise ValueError(f"a vector of {vector.numel()} elements does not fit {offset}")
    return out


def to_wire_u32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 tensor with the same bits."""
    values = values & _U32
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def from_wire_u32(values: torch.Tensor) -> torch.Tensor:
    """The int32 bit patterns of ``to_wire_u32`` back as int64 values in [0, 2**32)."""
    return values.to(torch.int64) & _U32


def compressed_specs(model: Mapping[str, TensorSpec], codec: CodecSpec) -> dict[str, TensorSpec]:
    """The exact tensors of a payload compressed with ``codec``, for the coordinator to expect."""
    if codec.name == "none":
        return dict(model)
    if codec.name == "secagg":
        return {MASKED: TensorSpec(torch.int32, (sum(s.numel for _, s in floating_layout(model)),))}
    specs: dict[str, TensorSpec] = {}
    for name, spec in model.items():
        if not spec.dtype.is_floating_point:
            continue
        if codec.name in _HALF:
            specs[name] = TensorSpec(_HALF[codec.name], spec.shape)
            continue
        meta, values = SUFFIXES[codec.name]
        if codec.name == "int8":
            specs[name + meta] = TensorSpec(torch.float32, (num_blocks(spec.numel, codec.block),))
            specs[name + values] = TensorSpec(torch.int8, (spec.numel,))
        else:
            k = topk_count(spec.numel, codec.fraction)
            specs[name + meta] = TensorSpec(index_dtype(spec.numel), (k,))
            specs[name + values] = TensorSpec(torch.float32, (k,))
    return specs


def compressed_bytes(model: Mapping[str, TensorSpec], codec: CodecSpec) -> int:
    """The exact size of an encoded payload compressed with ``codec``."""
    # Meta tensors carry dtype and shape without memory, so a large model costs nothing here.
    shells = {
        n: torch.empty(s.shape, dtype=s.dtype, device="meta")
        for n, s in compressed_specs(model, codec).items()
    }
    return encoded_size(shells)


def _mismatch(expected: Mapping[str, TensorSpec], got: Mapping[str, TensorSpec]) -> str:
    """The first difference between two tensor layouts, or "" if there is none."""
    for name in sorted(set(expected) | set(got)):
        if name not in got or name not in expected:
            return f"{'missing' if name not in got else 'unexpected'} tensor {name!r}"
        if expected[name] != got[name]:
            return f"tensor {name!r}: expected {expected[name]}, got {got[name]}"
    return ""


def _check_scales(name: str, scales: torch.Tensor) -> None:
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError(f"tensor {name!r}: scales must be finite and non-negative")


def _check_indices(name: str, indices: torch.Tensor, numel: int) -> None:
    if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < numel:
        raise CodecError(f"tensor {name!r}: indices must lie in [0, {numel})")
    if torch.unique(indices).numel() != indices.numel():
        raise CodecError(f"tensor {name!r}: indices must be distinct")


def _quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    scales = blocks.abs().amax(dim=1) / _INT8_MAX
    # An all-zero block has scale 0; dividing by the smallest normal instead keeps its q at 0.
    divisor = scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    q = torch.round(blocks / divisor).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return scales, q.reshape(-1)[:n]


def _topk_step(
    delta: torch.Tensor, residual: torch.Tensor | None, fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = delta.reshape(-1).to(dense_dtype(delta.dtype))
    # A fresh tensor in both cases, so neither the caller's delta nor the old residual is touched.
    acc = flat + residual.reshape(-1).to(flat.device) if residual is not None else flat.clone()
    k = topk_count(acc.numel(), fraction)
    indices = acc.abs().topk(k, sorted=False).indices.sort().values
    values = acc[indices].float()
    acc[indices] -= values.to(acc.dtype)  # zero for fp32; fp64 keeps its rounding error
    return indices.to(index_dtype(acc.numel())), values, acc.view(delta.shape)


def residual_specs(model: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The specs a topk residual for ``model`` must have."""
    return {
        n: TensorSpec(dense_dtype(s.dtype), s.shape)
        for n, s in model.items()
        if s.dtype.is_floating_point
    }


class Compressor:
    """Site side: compresses each round's delta; keeps the topk error-feedback residual."""

    def __init__(
        self, codec: CodecSpec, residual: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self.codec = codec
        if residual and codec.name != "topk":
            raise ValueError(f"codec.name: {codec.name!r} keeps no residual, but one was given")
        for name, tensor in (residual or {}).items():
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"residual tensor {name!r} must be floating-point and finite")
        self._residual = dict(residual or {})

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The topk residual (empty otherwise); never modified in place, so a copy is a snapshot."""
        return dict(self._residual)

    def compress(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The payload for ``delta`` (every model tensor, integer buffers included)."""
        if self.codec.name == "none":
            return {name: tensor.detach() for name, tensor in delta.items()}
        floats = {n: t.detach() for n, t in delta.items() if t.is_floating_point()}
        for name, tensor in floats.items():  # a non-finite value would poison the residual
            if not all_finite(tensor):
                raise ValueError(f"delta tensor {name!r} has non-finite values")
        if self.codec.name in _HALF:
            return {name: _cast_half(name, t, self.codec.name) for name, t in floats.items()}
        meta, values = SUFFIXES[self.codec.name]
        out: dict[str, torch.Tensor] = {}
        if self.codec.name == "int8":
            for name, tensor in floats.items():
                out[name + meta], out[name + values] = _quantize_int8(tensor, self.codec.block)
            return out
        if self._residual:
            mismatch = _mismatch(residual_specs(spec_of(floats)), spec_of(self._residual))
            if mismatch:
                raise ValueError(f"the residual does not match this delta: {mismatch}")
        residual: dict[str, torch.Tensor] = {}
        for name, tensor in floats.items():
            step = _topk_step(tensor, self._residual.get(name), self.codec.fraction)
            out[name + meta], out[name + values], residual[name] = step
        self._residual = residual  # only once every tensor succeeded
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the residual atomically (temp file, fsync, rename, fsync of the directory)."""
        write_atomic(Path(path), encode_chunks(self._residual))

    @classmethod
    def load(
        cls,
        codec: CodecSpec,
        path: str | os.PathLike[str],
        model: Mapping[str, TensorSpec] | None = None,
    ) -> Compressor:
        """A compressor resuming from a saved residual; checked against ``model`` if given."""
        with open(path, "rb") as file:
            residual = decode_chunks(iter(lambda: file.read(_FILE_CHUNK_BYTES), b""))
        if model is not None:
            mismatch = _mismatch(residual_specs(model), spec_of(residual))
            if mismatch:
                raise ValueError(f"residual {os.fspath(path)!r} does not fit the model: {mismatch}")
        return cls(codec, residual)


def _cast_half(name: str, tensor: torch.Tensor, codec: str) -> torch.Tensor:
    cast = tensor.to(_HALF[codec])
    if not bool(torch.isfinite(cast).all()):  # fp16 overflows above 65504
        raise ValueError(f"delta tensor {name!r} overflows {codec}; use bf16 or int8")
    return cast


def decompress(
    compressed: Mapping[str, torch.Tensor], model: Mapping[str, TensorSpec], codec: CodecSpec
) -> dict[str, torch.Tensor]:
    """Dense deltas of the model's float tensors (see ``dense_dtype``); the reference decoder."""
    mismatch = _mismatch(compressed_specs(model, codec), spec_of(compressed))
    if mismatch:
        raise CodecError(f"compressed update does not fit the {codec.name} layout: {mismatch}")
    out: dict[str, torch.Tensor] = {}
    for name, spec in model.items():
        if not spec.dtype.is_floating_point:
            continue
        dense = dense_dtype(spec.dtype)
        if codec.name not in SUFFIXES:
            out[name] = compressed[name].to(dense, copy=True)
            continue
        meta_name, values_name = (name + s for s in SUFFIXES[codec.name])
        meta, values = compressed[meta_name], compressed[values_name]
        if codec.name == "int8":
            _check_scales(meta_name, meta)
            per_element = meta.to(dense).repeat_interleave(codec.block)[: spec.numel]
            out[name] = (values.to(dense) * per_element).view(spec.shape)
        else:
            _check_indices(meta_name, meta, spec.numel)
            flat = torch.zeros(spec.numel, dtype=dense)
            flat[meta.long()] = values.to(dense)
            out[name] = flat.view(spec.shape)
    return out


def apply_step(
    base: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor], codec: CodecSpec
) -> dict[str, torch.Tensor]:
    """``base`` moved by a compressed step: what the coordinator commits and what a site
    holding ``base`` rebuilds from a compressed download, bit for bit (the same operations
    on the same inputs; the site checks the result's SHA-256 against the model's)."""
    dense = decompress(step, spec_of(base), codec)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        if name in dense:
            out[name] = tensor + dense[name].to(tensor.dtype)
        else:  # integer buffers do not move
            out[name] = tensor.clone()
    return out


def _dequantize_run(
    q: torch.Tensor, offset: int, scales: torch.Tensor, block: int, dense: torch.dtype
) -> torch.Tensor:
    n = q.numel()
    first, last = offset // block, (offset + n - 1) // block
    starts = torch.arange(first, last + 1) * block
    counts = (starts + block).clamp_(max=offset + n) - starts.clamp(min=offset)
    per_element = scales[first : last + 1].to(dense).repeat_interleave(counts, output_size=n)
    return q.to(dense) * per_element


class StreamingDecompressor:
    """Coordinator side: turns pieces of a compressed stream into dense or sparse contributions.

    Holds only the scales or indices of the tensor being read, never a decompressed update.
    """

    def __init__(self, model: Mapping[str, TensorSpec], codec: CodecSpec) -> None:
        self.codec = codec
        self._model = dict(model)
        self._specs = compressed_specs(model, codec)
        self._received = dict.fromkeys(self._specs, 0)
        self._meta: dict[str, torch.Tensor] = {}  # model tensor -> its scales or indices
        self._routes: dict[str, tuple[str, str]] = {}  # compressed name -> (model name, role)
        for name, spec in model.items():
            if codec.name not in SUFFIXES:
                self._routes[name] = (name, "dense" if spec.dtype.is_floating_point else "skip")
            elif spec.dtype.is_floating_point:
                meta, values = SUFFIXES[codec.name]
                self._routes[name + meta] = (name, "meta")
                self._routes[name + values] = (name, "values")

    def feed(self, pieces: Iterable[TensorPiece]) -> Iterator[Piece]:
        """Contributions, in model tensor names and flat element offsets, for ``pieces``.

        Dense fp32 contributions are the pieces themselves, which may be views of received
        bytes (``StreamDecoder(copy=False)``): consumers read them, never write into them."""
        for piece in pieces:
            yield from self._take(piece)

    def _take(self, piece: TensorPiece) -> list[Piece]:
        spec = self._specs.get(piece.name)
        if spec is None or piece.values.dtype != spec.dtype:
            raise CodecError(f"piece of {piece.name!r} does not fit the {self.codec.name} layout")
        end = piece.offset + piece.values.numel()
        if piece.offset != self._received[piece.name] or end > spec.numel:
            raise CodecError(f"piece of {piece.name!r} at element {piece.offset} is out of order")
        self._received[piece.name] = end
        done = end == spec.numel
        tensor, role = self._routes[piece.name]
        dense = dense_dtype(self._model[tensor].dtype)
        if role == "skip":
            return []
        if role == "dense":
            return [TensorPiece(tensor, piece.offset, piece.values.to(dense))]
        if role == "meta":
            self._collect_meta(tensor, piece, spec, done)
            return []
        meta = self._ready_meta(tensor, piece.name)
        if done:
            del self._meta[tensor]  # the largest thing held, so drop it as soon as possible
        if self.codec.name == "int8":
            values = _dequantize_run(piece.values, piece.offset, meta, self.codec.block, dense)
            return [TensorPiece(tensor, piece.offset, values)]
        return [SparsePiece(tensor, meta[piece.offset : end], piece.values.to(dense))]

    def _collect_meta(self, tensor: str, piece: TensorPiece, spec: TensorSpec, done: bool) -> None:
        if piece.offset == 0:
            self._meta[tensor] = torch.empty(spec.numel, dtype=spec.dtype)
        meta = self._meta[tensor]
        meta[piece.offset : piece.offset + piece.values.numel()] = piece.values
        if done and self.codec.name == "int8":
            _check_scales(piece.name, meta)
        elif done:
            _check_indices(piece.name, meta, self._model[tensor].numel)

    def _ready_meta(self, tensor: str, values_name: str) -> torch.Tensor:
        meta_name = tensor + SUFFIXES[self.codec.name][0]
        if self._received[meta_name] < self._specs[meta_name].numel:
            raise CodecError(
                f"tensor {values_name!r} arrived before {meta_name!r} was complete: "
                "the payload must be laid out in sorted name order"
            )
        return self._meta[tensor]

    def finish(self) -> None:
        """CodecError unless every compressed tensor arrived whole."""
        for name, spec in self._specs.items():
            if self._received[name] != spec.numel:
                raise CodecError(
                    f"tensor {name!r} incomplete: {self._received[name]} of {spec.numel} elements"
                )
