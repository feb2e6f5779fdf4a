"""The site's one gRPC channel to the coordinator, and the message conversions."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from fedra import __version__, pki
from fedra.protos import wire
from fedra.protos.codec import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    CodecError,
    decode_chunks,
    digest_and_size,
    encode,
    encode_chunks,
    transfer_chunk_bytes,
)
from fedra.protos.serde import (
    codec_from_proto,
    privacy_from_proto,
    provenance_to_proto,
    secagg_round_from_proto,
    train_from_proto,
)
from fedra.protos.v1 import site_pb2, site_pb2_grpc
from fedra.provenance import Provenance
from fedra.runspec import CodecSpec, PrivacySpec, TrainSpec
from fedra.secagg import SecAggError
from fedra.secagg_round import SecAggRound
from fedra.storage.hashing import AsideHasher

log = logging.getLogger("fedra.site")

# Transient: the coordinator is restarting or the network blinked. Retry with backoff.
TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# The least time one connection attempt may take (TCP and TLS handshakes on a slow link).
MIN_CONNECT_TIMEOUT_S = 2.0
_STOP_CHECK_S = 0.2  # how often a wait for the channel looks at its stop event
# gRPC's connectivity poller, started by ``subscribe``, looks every 0.2 s whether anyone
# still listens; a close waits this long at most for it to see that nobody does.
_POLLER_END_S = 1.0


def reconnect_options(reconnect_max_s: float) -> list[tuple[str, int]]:
    """gRPC's own reconnect backoff, capped like fedra's at ``reconnect_max_s``: its default
    grows to 120 s, and a call on a channel in that backoff fails at once without trying,
    so a site could stay away minutes after the coordinator came back."""
    max_ms = max(1, round(reconnect_max_s * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(1000, max_ms)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
        # Despite its name, the least time gRPC gives one attempt to connect, not a
        # pause between attempts (those follow the backoff above).
        ("grpc.min_reconnect_backoff_ms", max(max_ms, round(MIN_CONNECT_TIMEOUT_S * 1000))),
    ]


@dataclass(frozen=True)
class Sent:
    """An upload's outcome: the bytes the coordinator says it received, and the digest
    and size of the payload that left the site (0 for a header alone); with
    ``then_poll_s``, the next task if one came with the answer, and how long the
    coordinator held the call after accepting the update."""

    bytes_received: int
    sha256: str
    payload_bytes: int
    next_task: Assignment | None = None
    held_s: float = 0.0


@dataclass(frozen=True)
class Assignment:
    """A task the coordinator gave this site."""

    task_id: str
    run_id: str
    round: int
    init: bool  # build the initial model instead of training
    entry_point: str
    train: TrainSpec
    seed: int
    model_sha256: str
    model_bytes: int
    deadline_in_s: float
    codec: CodecSpec
    secagg: SecAggRound | None = None  # set: the update is masked for secure aggregation
    base_sha256: str = ""  # compressed downloads: the model the step applies to
    delta_sha256: str = ""
    delta_bytes: int = 0
    # The whole model, when the coordinator sent it with the task (a small one): no
    # download needed. Never kept on disk with the task.
    model: bytes = field(default=b"", repr=False, compare=False)
    sites_in_round: int = 0  # sampled into this round (0: not said)
    privacy: PrivacySpec | None = None  # the run's differential privacy, if any
    # [train] scaffold: the server's control variate c to download ('': c is zero).
    controls_sha256: str = ""
    controls_bytes: int = 0
    rounds: int = 0  # the run's rounds (0: not said): nothing is trained ahead of the last


@dataclass(frozen=True)
class Session:
    heartbeat_interval_s: float
    poll_timeout_s: float
    chunk_bytes: int


class Connection:
    """Typed calls to the SiteService; raises grpc.RpcError like the stubs do."""

    def __init__(
        self,
        address: str,
        site_id: str,
        tls: pki.TlsFiles | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        reconnect_max_s: float = 30.0,
    ) -> None:
        # Downloads come in the coordinator's chunk size, not ours (which only sizes uploads):
        # accept any chunk up to MAX_CHUNK_BYTES, older coordinators' 4 MiB included.
        options = [
            ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + 1024 * 1024),
            ("grpc.max_send_message_length", chunk_bytes + 1024 * 1024),
            *reconnect_options(reconnect_max_s),
        ]
        if tls is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(
                address, pki.channel_credentials(tls), options=options
            )
        self.tls = tls
        self.stub = site_pb2_grpc.SiteServiceStub(self.channel)
        # The two bulk methods, with model chunks framed and parsed by hand (protos.wire).
        self._download_model = self.channel.unary_stream(
            wire.DOWNLOAD_MODEL,
            request_serializer=site_pb2.DownloadModelRequest.SerializeToString,
            response_deserializer=wire.parse_model_chunk,
        )
        self._upload_update = self.channel.stream_unary(
            wire.UPLOAD_UPDATE,
            request_serializer=wire.serialize,
            response_deserializer=site_pb2.UploadUpdateResponse.FromString,
        )
        self.site_id = site_id
        self.chunk_bytes = chunk_bytes
        self._small_uploads = True  # until a coordinator answers that it has no such call
        self.closed = False
        self._transfers = 0  # downloads and uploads under way
        self._held = 0  # of them, uploads held as the site's next poll (then_poll_s)
        self._transfers_lock = threading.Lock()
        self._moved_at = 0.0  # when one of them last moved a chunk (time.monotonic)

    def close(self) -> None:
        self.closed = True
        self._await_poller_end()
        self.channel.close()

    def _await_poller_end(self) -> None:
        """Let gRPC's connectivity poller (``wait_reconnected`` subscribes to the channel)
        end before the channel closes: it goes on up to 0.2 s after its last subscriber
        left, and a channel closed under it raises in its thread ("Cannot monitor channel
        state: Channel closed!"). gRPC keeps whether it polls in the channel's private
        state; a channel without it (another gRPC) closes at once."""
        state = getattr(self.channel, "_connectivity_state", None)
        end = time.monotonic() + _POLLER_END_S
        while getattr(state, "polling", False) and time.monotonic() < end:
            time.sleep(0.01)

    def moved_within(self, seconds: float) -> bool:
        """Whether a download or upload of this site's is under way and moved a chunk in
        the last ``seconds``, or an upload that the coordinator holds as the site's next
        poll is open: the coordinator hears the site through it, so a heartbeat then
        tells it nothing. (An upload whose next chunk is long in coming, on a slow link,
        still needs them: they keep it from being taken for a silent site's.)"""
        if self.holding():
            return True
        return self._transfers > 0 and time.monotonic() - self._moved_at <= seconds

    def holding(self) -> bool:
        """Whether an upload of this site's is open that the coordinator holds, once its
        update is accepted, as the site's next poll (``upload``'s ``then_poll_s``)."""
        return self._held > 0

    @contextmanager
    def _transfer(self, held: bool = False) -> Iterator[None]:
        with self._transfers_lock:
            self._transfers += 1
            self._held += held
            self._moved_at = time.monotonic()
        try:
            yield
        finally:
            with self._transfers_lock:
                self._transfers -= 1
                self._held -= held

    def wait_reconnected(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait out a backoff delay of ``timeout_s``, ending early (True) once the channel,
        down when the wait began, is connected again, or when ``stop`` is set: a site is
        back as soon as gRPC reaches the coordinator, not at the end of its own delay."""
        if self.closed or stop.is_set():  # gRPC would poll a closed channel, and complain
            return False
        down, ready = threading.Event(), threading.Event()

        def on_change(state: grpc.ChannelConnectivity) -> None:
            if state is not grpc.ChannelConnectivity.READY:
                down.set()
            elif down.is_set():  # a channel that was up all along is no reason to hurry
                ready.set()

        self.channel.subscribe(on_change, try_to_connect=True)
        try:
            end = time.monotonic() + timeout_s
            while not (ready.is_set() or stop.is_set()):
                left = end - time.monotonic()
                if left <= 0:
                    break
                ready.wait(min(left, _STOP_CHECK_S))
        finally:
            self.channel.unsubscribe(on_change)
        return ready.is_set()

    def register(
        self, tasks: list[str], timeout_s: float = 10.0, provenance: Sequence[Provenance] = ()
    ) -> Session:
        """Announce the site, its tasks and (per task) what its results come from."""
        request = site_pb2.RegisterRequest(
            site_id=self.site_id, tasks=tasks, version=__version__,
            provenance=[provenance_to_proto(p) for p in provenance],
        )  # fmt: skip
        r = self.stub.Register(
            request, timeout=timeout_s, metadata=wire.declared_timeout(timeout_s)
        )
        self.chunk_bytes = min(self.chunk_bytes, r.chunk_bytes or self.chunk_bytes)
        return Session(r.heartbeat_interval_s, r.poll_timeout_s, self.chunk_bytes)

    def heartbeat(self, task_id: str, timeout_s: float = 10.0) -> bool:
        """Whether the task still counts (answered at once). A blocking call: a future
        waited for at once costs the caller a hand-off to gRPC's channel thread, which
        halved the calls a second a busy client made (``bench/call_cost.py``)."""
        request = site_pb2.HeartbeatRequest(site_id=self.site_id, task_id=task_id)
        reply = self.stub.Heartbeat(
            request, timeout=timeout_s, metadata=wire.declared_timeout(timeout_s)
        )
        return bool(reply.task_current)

    def heartbeat_future(
        self, task_id: str, timeout_s: float = 10.0, hold_s: float = 0.0
    ) -> grpc.Future[site_pb2.HeartbeatResponse]:
        """A heartbeat sent, its answer to come: held by the coordinator up to ``hold_s``
        while the task counts (one that does not hold answers at once)."""
        request = site_pb2.HeartbeatRequest(site_id=self.site_id, task_id=task_id, hold_s=hold_s)
        future: grpc.Future[site_pb2.HeartbeatResponse] = self.stub.Heartbeat.future(
            request, timeout=timeout_s, metadata=wire.declared_timeout(timeout_s)
        )
        return future

    def poll(self, poll_timeout_s: float) -> Assignment | None:
        request = site_pb2.PollTaskRequest(site_id=self.site_id)
        timeout_s = poll_timeout_s + 10.0
        r = self.stub.PollTask(
            request, timeout=timeout_s, metadata=wire.declared_timeout(timeout_s)
        )
        return _assignment(r.task, r.model) if r.HasField("task") else None

    def sent_model(self, task: Assignment) -> dict[str, torch.Tensor] | None:
        """The model that came with the task, checked like a download (its SHA-256 and
        structure); None if it came without one."""
        if not task.model:
            return None
        digest = hashlib.sha256(task.model).hexdigest()
        if digest != task.model_sha256 or len(task.model) != task.model_bytes:
            raise CodecError(f"model SHA-256 {digest} != announced {task.model_sha256}")
        return decode_chunks([memoryview(task.model)])

    def download(
        self,
        task: Assignment,
        timeout_s: float,
        delta: bool = False,
        reuse: Mapping[str, torch.Tensor] | None = None,
        controls: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Stream the task's global model (or, with ``delta``, its compressed step from the
        previous model; with ``controls``, a SCAFFOLD run's c) in, checking its SHA-256 and
        structure; into ``reuse``'s tensors where they fit (``codec.decode_chunks``), whose
        values are then lost either way."""
        request = site_pb2.DownloadModelRequest(
            site_id=self.site_id, task_id=task.task_id, delta=delta, controls=controls
        )
        expected = task.delta_sha256 if delta else task.model_sha256
        if controls:
            expected = task.controls_sha256
        digest = AsideHasher()  # a large model is hashed beside its receipt and decoding

        def chunks() -> Iterator[memoryview]:
            for data in self._download_model(request, timeout=timeout_s):
                self._moved_at = time.monotonic()
                digest.update(data)
                yield data
                del data  # free it before the next message arrives

        with self._transfer():
            tensors = decode_chunks(chunks(), reuse=reuse)
        if digest.hexdigest() != expected:
            raise CodecError(f"model SHA-256 {digest.hexdigest()} != announced {expected}")
        return tensors

    def upload(
        self,
        task: Assignment,
        tensors: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        nonce: bytes,
        timeout_s: float,
        header_only: bool = False,
        then_poll_s: float = 0.0,
    ) -> Sent:
        """Send an update up: a header with the payload's SHA-256, and the payload, in one
        call if it fits (UploadSmallUpdate) or else streamed in chunks; what the
        coordinator received, and the payload's digest and size.

        ``header_only``: ask whether an update sent before counted; the coordinator
        answers that from the header alone (fedra.client.pending).

        ``then_poll_s`` > 0: a payload that goes in one call asks the coordinator to hold
        it, once the update is accepted, up to that long for the site's next task
        (``Sent.next_task``), the poll the site would make next; ``timeout_s`` is then
        the upload's own, the hold comes on top. The site is heard through the call
        while it is open, so no heartbeat goes meanwhile (``moved_within``)."""
        # The header carries the payload's SHA-256, so hash first (from tensor memory, no
        # copies), then stream.
        sha256, size = digest_and_size(tensors)
        signature = b""
        if self.tls is not None:  # bind the payload's digest to this site, round and nonce
            message = pki.upload_message(
                task.run_id, task.round, self.site_id, task.task_id, nonce, sha256,
                num_samples=num_samples, codec=task.codec.name, payload_bytes=size,
            )  # fmt: skip
            signature = pki.sign(self.tls.key, message)
        header = site_pb2.UpdateHeader(
            site_id=self.site_id,
            run_id=task.run_id,
            round=task.round,
            task_id=task.task_id,
            num_samples=num_samples,
            metrics=dict(metrics),
            codec=task.codec.name,
            sha256=sha256,
            nonce=nonce,
            payload_bytes=size,
            signature=signature,
        )

        if not header_only and size <= wire.SMALL_UPLOAD_MAX_BYTES and self._small_uploads:
            request = site_pb2.UploadSmallUpdateRequest(
                header=header, payload=encode(tensors), then_poll_s=then_poll_s
            )
            try:
                with self._transfer(held=then_poll_s > 0):
                    small = self.stub.UploadSmallUpdate(request, timeout=timeout_s + then_poll_s)
                t = small.next.task if small.next.HasField("task") else None
                return Sent(
                    int(small.bytes_received), sha256, size,
                    next_task=None if t is None else _assignment(t, small.next.model),
                    held_s=max(0.0, small.held_s),
                )  # fmt: skip
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._small_uploads = False  # an older coordinator: stream it, as it takes
                log.info("the coordinator has no UploadSmallUpdate: uploads go as streams")

        def messages() -> Iterator[site_pb2.UpdateChunk | bytes]:
            yield site_pb2.UpdateChunk(header=header)
            if header_only:
                return
            # UpdateChunk data messages, each built in one copy from tensor memory.
            chunk = transfer_chunk_bytes(size, self.chunk_bytes)
            for data in encode_chunks(tensors, chunk, frame=wire.update_chunk_frame):
                self._moved_at = time.monotonic()  # gRPC takes the next one when it can
                yield data
                del data  # not held while the next one is built

        with self._transfer():
            reply = self._upload_update(messages(), timeout=timeout_s)
        return Sent(int(reply.bytes_received), sha256, 0 if header_only else size)

    def report_failure(
        self, task_id: str, reason: str, timeout_s: float = 10.0, declined: bool = False
    ) -> None:
        """The task will not be done: it failed, or (``declined``) this site's policy
        refuses it."""
        request = site_pb2.ReportFailureRequest(
            site_id=self.site_id, task_id=task_id, reason=reason, declined=declined
        )
        self.stub.ReportFailure(request, timeout=timeout_s)

    # -- secure aggregation: long polls that answer ready=False until their stage closes

    def secagg_keys(
        self, task_id: str, context: bytes, public_keys: bytes, wait_s: float
    ) -> tuple[bool, dict[str, bytes]]:
        """Send our keys (signed over mTLS), wait for the neighbours' and check each one
        is signed by that neighbour's certificate from our CA; SecAggError if not."""
        signature = b""
        if public_keys and self.tls is not None:
            message = pki.secagg_keys_message(context, self.site_id, public_keys)
            signature = pki.sign(self.tls.key, message)
        request = site_pb2.SecAggKeysRequest(
            site_id=self.site_id,
            task_id=task_id,
            public_keys=public_keys,
            wait_s=wait_s,
            signature=signature,
        )
        r = self.stub.SecAggKeys(request, timeout=wait_s + 10.0)
        keys = dict(r.neighbour_keys)
        if r.ready and self.tls is not None:
            check_neighbour_keys(
                self.tls.ca, context, keys, dict(r.signatures), dict(r.certificates)
            )
        return r.ready, keys

    def secagg_shares(
        self, task_id: str, ciphertexts: Mapping[str, bytes], wait_s: float
    ) -> tuple[bool, dict[str, bytes]]:
        request = site_pb2.SecAggSharesRequest(
            site_id=self.site_id, task_id=task_id, ciphertexts=dict(ciphertexts), wait_s=wait_s
        )
        r = self.stub.SecAggShares(request, timeout=wait_s + 10.0)
        return r.ready, dict(r.inbox)

    def secagg_unmask(self, task_id: str, wait_s: float) -> tuple[bool, list[str], list[str]]:
        request = site_pb2.SecAggUnmaskRequest(site_id=self.site_id, task_id=task_id, wait_s=wait_s)
        r = self.stub.SecAggUnmask(request, timeout=wait_s + 10.0)
        return r.ready, list(r.survivors), list(r.dropped)

    def secagg_reveal(
        self, task_id: str, shares: Mapping[str, bytes], timeout_s: float = 30.0
    ) -> None:
        request = site_pb2.SecAggRevealRequest(
            site_id=self.site_id, task_id=task_id, shares=dict(shares)
        )
        self.stub.SecAggReveal(request, timeout=timeout_s)


def check_neighbour_keys(
    ca_pem: bytes,
    context: bytes,
    keys: Mapping[str, bytes],
    signatures: Mapping[str, bytes],
    certificates: Mapping[str, bytes],
) -> None:
    """SecAggError unless every neighbour's keys are signed by that neighbour's certificate
    from our CA: a coordinator that swapped in keys of its own is caught here."""
    for peer, peer_keys in keys.items():
        cert = certificates.get(peer, b"")
        why = pki.check_peer_certificate(ca_pem, cert, "site", peer)
        message = pki.secagg_keys_message(context, peer, peer_keys)
        if not why and not pki.verify(cert, signatures.get(peer, b""), message):
            why = "its signature does not match"
        if why:
            raise SecAggError(
                f"the keys the coordinator relayed for neighbour {peer!r} are not its own "
                f"({why}); refusing to take part in this round"
            )


def new_nonce() -> bytes:
    return os.urandom(16)


def _assignment(t: site_pb2.Task, model: bytes = b"") -> Assignment:
    return Assignment(
        task_id=t.task_id,
        run_id=t.run_id,
        round=t.round,
        init=t.kind == site_pb2.TASK_KIND_INIT,
        entry_point=t.entry_point,
        train=train_from_proto(t.settings),
        seed=t.seed,
        model_sha256=t.model_sha256,
        model_bytes=t.model_bytes,
        deadline_in_s=t.deadline_in_s,
        codec=codec_from_proto(t.compression),
        secagg=secagg_round_from_proto(t.secagg) if t.HasField("secagg") else None,
        base_sha256=t.base_sha256,
        delta_sha256=t.delta_sha256,
        delta_bytes=t.delta_bytes,
        model=model if t.kind == site_pb2.TASK_KIND_TRAIN else b"",
        sites_in_round=t.sites_in_round,
        privacy=privacy_from_proto(t.privacy) if t.HasField("privacy") else None,
        controls_sha256=t.controls_sha256,
        controls_bytes=t.controls_bytes,
        rounds=t.rounds,
    )
