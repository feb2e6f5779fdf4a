"""Raw Python gRPC streaming throughput: the baseline fedra's transport is compared with.

``python bench/raw_grpc.py serve`` starts a server on a free localhost port and prints
``PORT <n>``; it serves raw bytes (identity serializers, no protobuf) until SIGTERM, SIGINT
or its stdin closes. ``measure`` streams a pre-built payload through it in chunks, both
directions: a client-streaming upload and a server-streaming download. With ``proto=True``
each chunk travels wrapped in fedra's ``ModelChunk`` message instead (same bytes on the
wire plus a few bytes of framing, but protobuf's copies on both sides): the cost of the
message layer before any fedra logic. With ``checked=True`` both directions also do the
per-byte work fedra's rules ask of any implementation: the sender of an upload hashes its
payload (SHA-256) before sending the digest and the bytes, and the receiver hashes what
arrives and writes it to a spool file (an update is checked whole before it may touch the
aggregate, and memory must stay O(model)); a download is read from a file and its receiver
hashes it against the digest it expects. That is the best a transfer that checks as fedra's
must can reach through Python gRPC. (fedra also fsyncs each spooled update; in a round that
overlaps other sites' work, so it is left out here.)
``python bench/raw_grpc.py client --port N`` runs ``measure`` against a running server.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import os
import random
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from fedra.protos.v1 import common_pb2

SERVICE = "fedra.bench.Raw"
UPLOAD = f"/{SERVICE}/Upload"
DOWNLOAD = f"/{SERVICE}/Download"
CHUNK_BYTES = 4 * 1024 * 1024
MESSAGE_LIMIT = CHUNK_BYTES + 1024 * 1024  # as fedra: a chunk plus its envelope
_REQUEST = struct.Struct("<QQ")  # download request: total bytes, chunk bytes
_COUNT = struct.Struct("<Q")
_BLOCK_BYTES = 1024 * 1024


def _identity(data: bytes) -> bytes:
    return data


def _to_proto(data: bytes) -> bytes:
    return common_pb2.ModelChunk(data=data).SerializeToString()


def _from_proto(raw: bytes) -> bytes:
    return common_pb2.ModelChunk.FromString(raw).data


_SERIALIZERS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    "": (_identity, _identity),
    "Proto": (_to_proto, _from_proto),
}


def _channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ]


def payload(total_bytes: int) -> bytes:
    """``total_bytes`` of incompressible bytes, built once (a 1 MiB random block repeated).

    The block is the same in every process, so a receiver knows a download's digest."""
    block = random.Random(0).randbytes(_BLOCK_BYTES)
    whole, rest = divmod(total_bytes, len(block))
    return block * whole + block[:rest]


def cycled_digest(data: bytes, total_bytes: int) -> bytes:
    """SHA-256 of ``total_bytes`` of ``data`` cycled, as ``_slices`` sends it (no copies)."""
    digest, view, done = hashlib.sha256(), memoryview(data), 0
    while done < total_bytes:
        piece = view[: min(len(view), total_bytes - done)]
        digest.update(piece)
        done += len(piece)
    return digest.digest()


def _slices(data: bytes, chunk_bytes: int, total_bytes: int) -> Iterator[bytes]:
    """``total_bytes`` of ``data`` (cycled) in chunks; each slice is one copy, as fedra's are."""
    sent = 0
    while sent < total_bytes:
        start = sent % len(data)
        size = min(chunk_bytes, total_bytes - sent, len(data) - start)
        yield data[start : start + size]
        sent += size


class _Handlers:
    def __init__(self, data: bytes, spool: str) -> None:
        # Receivers of checked downloads expect the 1 MiB block cycled (``cycled_digest``).
        if len(data) % _BLOCK_BYTES:
            raise ValueError(f"the payload must be whole {_BLOCK_BYTES}-byte blocks")
        self.data = data
        self.spool = spool  # checked uploads are written here; the payload is stored here
        self.stored = os.path.join(spool, "payload")
        with open(self.stored, "wb") as f:
            f.write(data)

    def upload(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        received = 0
        for chunk in chunks:
            received += len(chunk)
        return _COUNT.pack(received)

    def download(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        total, chunk_bytes = _REQUEST.unpack(request)
        yield from _slices(self.data, chunk_bytes, total)

    def upload_checked(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """The digest first, then the bytes: hashed and spooled, then compared."""
        declared = next(chunks)
        digest, received = hashlib.sha256(), 0
        fd, path = tempfile.mkstemp(dir=self.spool)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
        finally:
            os.unlink(path)
        if digest.digest() != declared:
            context.abort(grpc.StatusCode.DATA_LOSS, "upload SHA-256 differs from the declared")
        return _COUNT.pack(received)

    def download_checked(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The stored payload, cycled, read from its file chunk by chunk."""
        total, chunk_bytes = _REQUEST.unpack(request)
        sent = 0
        with open(self.stored, "rb") as f:
            while sent < total:
                chunk = f.read(min(chunk_bytes, total - sent))
                if not chunk:
                    f.seek(0)
                    continue
                sent += len(chunk)
                yield chunk


def create_server(address: str, data: bytes, spool: str) -> tuple[grpc.Server, int]:
    """A server with the raw-bytes Upload (stream-unary) and Download (unary-stream) methods,
    each also wrapped in protobuf (``*Proto``) and with fedra's checks (``*Checked``)."""
    handlers = _Handlers(data, spool)
    methods: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {}
    for suffix, (serialize, deserialize) in _SERIALIZERS.items():
        methods[f"Upload{suffix}"] = grpc.stream_unary_rpc_method_handler(
            handlers.upload, request_deserializer=deserialize, response_serializer=_identity
        )
        methods[f"Download{suffix}"] = grpc.unary_stream_rpc_method_handler(
            handlers.download, request_deserializer=_identity, response_serializer=serialize
        )
    methods["UploadChecked"] = grpc.stream_unary_rpc_method_handler(
        handlers.upload_checked, request_deserializer=_identity, response_serializer=_identity
    )
    methods["DownloadChecked"] = grpc.unary_stream_rpc_method_handler(
        handlers.download_checked, request_deserializer=_identity, response_serializer=_identity
    )
    generic = grpc.method_handlers_generic_handler(SERVICE, methods)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=4, thread_name_prefix="raw"), options=_channel_options()
    )
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port


def serve(payload_bytes: int) -> None:
    """Serve until SIGTERM, SIGINT or stdin closing; the port goes to stdout first."""
    with tempfile.TemporaryDirectory(prefix="raw-grpc-") as spool:
        _serve(payload_bytes, spool)


def _serve(payload_bytes: int, spool: str) -> None:
    server, port = create_server("127.0.0.1:0", payload(payload_bytes), spool)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def watch_stdin() -> None:  # the parent dying closes our stdin: do not outlive it
        # os.read, not sys.stdin: a buffered reader's lock aborts interpreter shutdown.
        while os.read(sys.stdin.fileno(), 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"PORT {port}", flush=True)
    stop.wait()
    server.stop(grace=1.0).wait()


@dataclass(frozen=True)
class RawResult:
    """Median throughput of each direction over the repeats, in bytes per second."""

    total_bytes: int
    chunk_bytes: int
    repeats: int
    proto: bool
    upload_bps: float
    download_bps: float
    upload_runs_s: list[float]
    download_runs_s: list[float]
    checked: bool = False
    # CPU seconds both ends used a byte moved in the timed runs (``measure``'s ``cpu``);
    # NaN where not measured.
    cpu_s_per_byte: float = float("nan")

    @property
    def mixed_bps(self) -> float:
        """Rate for equal bytes down and up, moved one after the other (harmonic mean)."""
        return 2.0 / (1.0 / self.upload_bps + 1.0 / self.download_bps)


def _timed(action: Callable[[], int], expected: int) -> float:
    started = time.perf_counter()
    moved = action()
    elapsed = time.perf_counter() - started
    if moved != expected:
        raise RuntimeError(f"moved {moved} bytes, expected {expected}")
    return elapsed


def measure(
    address: str,
    total_bytes: int,
    chunk_bytes: int = CHUNK_BYTES,
    repeats: int = 3,
    timeout_s: float = 120.0,
    proto: bool = False,
    checked: bool = False,
    cpu: Callable[[], float] | None = None,
) -> RawResult:
    """Stream ``total_bytes`` up and down ``repeats`` times each (after a warm-up).
    ``cpu``: the CPU seconds both ends have used so far, read around the timed runs."""
    if proto and checked:
        raise ValueError("proto and checked are separate measurements")
    data = payload(total_bytes)
    suffix = "Proto" if proto else "Checked" if checked else ""
    serialize, deserialize = _SERIALIZERS["Proto" if proto else ""]
    # A download's digest is known to its receiver beforehand, as a model's is to a site.
    sizes = (total_bytes, min(total_bytes, 8 * chunk_bytes)) if checked else ()
    expected = {n: cycled_digest(data[:_BLOCK_BYTES], n) for n in sizes}
    with grpc.insecure_channel(address, options=_channel_options()) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        upload = channel.stream_unary(
            UPLOAD + suffix, request_serializer=serialize, response_deserializer=_identity
        )
        download = channel.unary_stream(
            DOWNLOAD + suffix, request_serializer=_identity, response_deserializer=deserialize
        )

        def up(size: int) -> int:
            chunks = _slices(data, chunk_bytes, size)
            if checked:  # the digest goes first, so the whole payload is hashed first
                chunks = itertools.chain([cycled_digest(data, size)], chunks)
            reply = upload(chunks, timeout=timeout_s)
            return int(_COUNT.unpack(reply)[0])

        def down(size: int) -> int:
            stream = download(_REQUEST.pack(size, chunk_bytes), timeout=timeout_s)
            if not checked:
                return sum(len(chunk) for chunk in stream)
            digest, received = hashlib.sha256(), 0
            for chunk in stream:
                digest.update(chunk)
                received += len(chunk)
            if digest.digest() != expected[size]:
                raise RuntimeError("download SHA-256 differs from the expected")
            return received

        warm = min(total_bytes, 8 * chunk_bytes)
        _timed(lambda: up(warm), warm)
        _timed(lambda: down(warm), warm)
        cpu_before = cpu() if cpu is not None else math.nan
        up_s = [_timed(lambda: up(total_bytes), total_bytes) for _ in range(repeats)]
        down_s = [_timed(lambda: down(total_bytes), total_bytes) for _ in range(repeats)]
        cpu_used = cpu() - cpu_before if cpu is not None else math.nan
    return RawResult(
        total_bytes=total_bytes,
        chunk_bytes=chunk_bytes,
        repeats=repeats,
        proto=proto,
        checked=checked,
        upload_bps=total_bytes / statistics.median(up_s),
        download_bps=total_bytes / statistics.median(down_s),
        upload_runs_s=up_s,
        download_runs_s=down_s,
        cpu_s_per_byte=cpu_used / (2 * repeats * total_bytes),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve raw bytes; prints PORT <n>")
    s.add_argument("--payload-mib", type=int, default=64, help="server-side payload to cycle")
    c = sub.add_parser("client", help="measure against a running server")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--total-mib", type=int, default=512)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--proto", action="store_true", help="wrap chunks in ModelChunk messages")
    c.add_argument("--checked", action="store_true", help="hash and spool as fedra does")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.payload_mib * 1024 * 1024)
        return
    result = measure(
        f"127.0.0.1:{args.port}",
        args.total_mib * 2**20,
        repeats=args.repeats,
        proto=args.proto,
        checked=args.checked,
    )
    print(
        f"upload {result.upload_bps / 1e6:.0f} MB/s, download {result.download_bps / 1e6:.0f} MB/s"
    )


if __name__ == "__main__":
    main()
