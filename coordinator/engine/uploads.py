"""Receiving an update: validate the header, spool and check the payload, then accept it.

Nothing touches the aggregate until the whole payload is on disk with the right
SHA-256, the right tensor names, shapes and dtypes, and only finite values. Only then
is it recorded as accepted (durably) and folded into the running sum, so a crash at
any point either loses nothing or loses an update the site will be asked for again.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedra.coordinator.engine.folding import fold_ready
from fedra.coordinator.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fedra.coordinator.ledger import MAX_ID_CHARS
from fedra.coordinator.promotion import PROMOTED_ROUND, PROMOTION_BEST, UNPROMOTED
from fedra.coordinator.state import ATTEMPT_FAILED, INIT_ROUND, ActiveRun, Assignment, TaskState
from fedra.faults import crash_point
from fedra.protos.codec import (
    Buffer,
    CodecError,
    StreamDecoder,
    TensorSpec,
    all_finite,
    header_limit,
)
from fedra.protos.compression import (
    Piece,
    StreamingDecompressor,
    compressed_specs,
)
from fedra.runspec import WIRE_CODECS, CodecSpec
from fedra.storage.blobs import BlobDigestError, StorageFullError
from fedra.storage.records import ParticipationState, RoundState
from fedra.storage.spool import SmallWriter
from fedra.storage.writes import DuplicateError, WriteOp

if TYPE_CHECKING:
    from fedra.coordinator.engine.core import Engine

log = logging.getLogger("fedra.coordinator")
NONCE_BYTES = 16
# A weight far above any real data set; keeps n * value inside fp32's range and exact in fp64.
MAX_SAMPLES = 2**40
# Header fields a site chooses, bounded: they are stored, logged and sent in statuses.
MAX_METRICS = 256
MAX_METRIC_NAME_CHARS = 128


class AlreadyAccepted(Exception):
    """This exact update (same nonce and digest) was already accepted: answer success."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


@dataclass(frozen=True)
class UpdateHeader:
    site_id: str
    run_id: str
    round: int
    task_id: str
    num_samples: int
    metrics: dict[str, float]
    codec: str
    sha256: str
    nonce: bytes
    payload_bytes: int


@dataclass
class UploadTicket:
    """An upload the engine agreed to receive; holds the task in 'uploading'."""

    header: UpdateHeader
    run: ActiveRun
    assignment: Assignment
    round: int
    attempt: int
    codec: CodecSpec
    # The update's tensors before the codec (the model's, and a SCAFFOLD run's control
    # deltas); None for the initial model.
    model: dict[str, TensorSpec] | None
    started: float = field(default_factory=time.monotonic)
    # A small update, whole and checked: its bytes go into its accept (storage.spool).
    payload: bytes | None = field(default=None, repr=False)
    # A larger one's file, put in place and held in the spool until ``let_go``.
    spooled: str | None = None

    @property
    def expected(self) -> dict[str, TensorSpec] | None:
        """What the payload must hold: the compressed layout of the model."""
        return None if self.model is None else compressed_specs(self.model, self.codec)


def begin_upload(engine: Engine, h: UpdateHeader) -> UploadTicket:
    """Check everything the header says before a payload byte is read."""
    _check_header_fields(h)
    with engine._lock:
        # First: a retry of an update that counted is answered as done whatever the round
        # is doing now (closing, committing, committed, or resumed after a restart).
        _check_already_accepted(engine, h)
        run, a = engine.current_task(h.site_id, h.task_id)
        assert run.open_round is not None  # current_task: the round is open and accepting
        if h.run_id != run.run_id or h.round != a.issued_round:
            raise InvalidArgument(
                f"header names run {h.run_id} round {h.round}, but task {h.task_id} is for "
                f"run {run.run_id} round {a.issued_round}"
            )
        if a.pending:
            _check_staleness(engine, run, a)
        if a.state == TaskState.UPLOADING:
            raise AlreadyExists(f"an upload for task {h.task_id} is already in progress")
        if not a.pending:
            raise AlreadyExists(
                f"task {h.task_id} is already {a.state}: one update per site per round"
            )
        init = run.open_round == INIT_ROUND
        codec = run.upload_codec
        sec = run.secure
        if sec is not None and (sec.stage != "masked" or h.site_id not in sec.shares_from):
            raise FailedPrecondition(
                f"site {h.site_id!r} is not in this round's masked sum: it must complete the "
                f"key exchange first, and uploads are open only after it (stage {sec.stage})"
            )
        if h.codec != codec.name:
            raise InvalidArgument(
                f"codec {h.codec!r} does not match the run's codec {codec.name!r}"
            )
        ticket = UploadTicket(
            h, run, a, run.open_round, run.attempt, codec, None if init else run.update_specs
        )
        limit = _size_limit(engine, ticket.expected)
        if h.payload_bytes > limit:
            raise ResourceExhausted(
                f"payload_bytes {h.payload_bytes} exceeds the {limit} bytes this update can take"
            )
        a.move(TaskState.UPLOADING)
        # Pending from here until its call ends (``DownloadLedger.ended``), in the same
        # hold of the lock: a round the upload is in is never taken as final before its
        # bytes, cut or not, are counted.
        engine.downloads.started(h.task_id)
        return ticket


def _check_already_accepted(engine: Engine, h: UpdateHeader) -> None:
    """A retry of an update that counted (same site, nonce and digest): answer it as
    done, from the live assignment while its round is open or closing, else from the
    database (the round committed, or the reply was lost in a restart)."""
    found = engine.find_task(h.task_id)
    if found is not None:
        a = found[1]
        counted = a.site_id == h.site_id and a.state == TaskState.ACCEPTED
        if counted and a.nonce == h.nonce and a.update_sha256 == h.sha256:
            raise AlreadyAccepted(h.payload_bytes)
        return
    past = engine._store.get_participation(h.task_id)
    if (
        past is None
        or past.site_id != h.site_id
        or past.state != ParticipationState.ACCEPTED
        or past.nonce != h.nonce
        or past.update_sha256 != h.sha256
    ):
        return  # not this site's accepted update: current_task says why it cannot be sent
    rnd = engine._store.get_round(past.run_id, past.round_number)
    if (
        rnd is not None
        and rnd.attempt == past.attempt
        and rnd.state in (RoundState.OPEN, RoundState.COMMITTED)
    ):
        over = rnd.state == RoundState.OPEN and engine._store.failed_attempt(
            past.run_id, past.round_number, past.attempt, ATTEMPT_FAILED
        )  # failed, the next attempt not yet open
        if not over:
            raise AlreadyAccepted(h.payload_bytes)
    # Accepted by an attempt that failed: the site must know it did not count (top-k
    # error feedback keeps what it did not send only for updates that counted).
    raise FailedPrecondition(
        f"task {h.task_id}'s update did not count: attempt {past.attempt} of round "
        f"{past.round_number} of run {past.run_id} failed; poll for the next task"
    )


def _check_staleness(engine: Engine, run: ActiveRun, a: Assignment) -> None:
    """Async: refuse (for good) an update trained on a model too many versions old."""
    if run.spec.asynchronous is None or run.open_round is None:
        return
    tau, limit = run.staleness(a), run.spec.asynchronous.max_staleness
    if tau <= limit:
        return
    reason = (
        f"the update was trained on the model of round {run.open_round - tau}, {tau} models "
        f"ago; async.max_staleness is {limit}"
    )
    engine._store.fail_participation(a.task_id, reason, engine.clock())
    a.move(TaskState.FAILED)
    a.update_sha256 = None
    engine.notify()
    raise FailedPrecondition(f"{reason}; poll for a task on the newest model")


def _check_header_fields(h: UpdateHeader) -> None:
    for field_name, text in (("run_id", h.run_id), ("task_id", h.task_id)):
        if len(text) > MAX_ID_CHARS:
            raise InvalidArgument(f"{field_name} must be at most {MAX_ID_CHARS} characters")
    if h.codec not in WIRE_CODECS:
        raise InvalidArgument(
            f"codec {h.codec!r} is not supported (expected one of {', '.join(WIRE_CODECS)})"
        )
    if len(h.nonce) != NONCE_BYTES:
        raise InvalidArgument(f"nonce must be {NONCE_BYTES} bytes, got {len(h.nonce)}")
    if len(h.sha256) != 64 or not all(c in "0123456789abcdef" for c in h.sha256):
        raise InvalidArgument("sha256 must be 64 lower-case hex characters")
    if not 0 < h.num_samples <= MAX_SAMPLES:
        raise InvalidArgument(f"num_samples must be in [1, {MAX_SAMPLES}], got {h.num_samples}")
    # Metrics are stored with the update and sent in every status: bounded like the rest.
    if len(h.metrics) > MAX_METRICS:
        raise InvalidArgument(
            f"an update carries at most {MAX_METRICS} metrics, not {len(h.metrics)}"
        )
    for key, value in h.metrics.items():
        if len(key) > MAX_METRIC_NAME_CHARS or not key.isprintable():
            raise InvalidArgument(
                f"metric name {key[:60]!r}: at most {MAX_METRIC_NAME_CHARS} printable characters"
            )
        if not math.isfinite(value):
            raise InvalidArgument(f"metric {key!r} is not finite: {value}")
        if key in RESERVED_METRICS:
            raise InvalidArgument(
                f"metric name {key!r} is the coordinator's own (a round's {key} is not a "
                "site's to say); name it otherwise"
            )


# What the coordinator writes into a round's metrics itself: never a site's.
RESERVED_METRICS = frozenset(
    {"privacy_epsilon", "staleness", PROMOTED_ROUND, PROMOTION_BEST, UNPROMOTED}
)


def _size_limit(engine: Engine, expected: dict[str, TensorSpec] | None) -> int:
    """The most bytes an update may declare: the expected tensors' data and the header
    they need (``header_limit``); the operator's bound for an initial model."""
    if expected is None:
        return engine.settings.max_init_model_bytes
    return _payload_limit(tuple(expected.items()))


@functools.lru_cache(maxsize=64)
def _payload_limit(expected: tuple[tuple[str, TensorSpec], ...]) -> int:
    """``_size_limit`` of a run's tensors, worked out once (each upload of a round asks,
    and the header's length takes a JSON encoding to know)."""
    specs = dict(expected)
    return 8 + header_limit(specs) + sum(s.nbytes for s in specs.values())


class Receiver:
    """Spools and checks one upload's payload as its chunks arrive (``feed``), then makes
    it durable in the spool (``finish``, which returns its digest). Each step is short and
    blocking: an event-driven server runs them in its executor, one chunk at a time, and
    waits for the next chunk without holding a thread. ``discard`` drops what arrived."""

    def __init__(self, engine: Engine, ticket: UploadTicket) -> None:
        self.ticket = ticket
        self.decoder = StreamDecoder(ticket.expected, copy=False)  # pieces only checked
        # Decompressed as it arrives, so a crafted scale or index is caught before acceptance;
        # masked integers (secagg) have nothing to decompress or check for finiteness.
        self.dense = None
        if ticket.model is not None and ticket.codec.name != "secagg":
            self.dense = StreamingDecompressor(ticket.model, ticket.codec)
        self.spool = engine.updates
        try:
            self.writer = engine.updates.writer(ticket.header.payload_bytes)
        except StorageFullError as exc:  # nothing was spooled: the site retries later
            raise Unavailable("disk full: the coordinator cannot spool updates now") from exc
        self.sealed = False

    def feed(self, chunk: Buffer) -> None:
        declared = self.ticket.header.payload_bytes
        with self._checked():
            if self.writer.bytes_written + len(chunk) > declared:
                raise InvalidArgument(f"payload is longer than the declared {declared} bytes")
            self.writer.write(chunk)
            if self.writer.bytes_written == len(chunk):
                crash_point("mid_upload", self.ticket.round)
            _check_chunk(self.decoder, self.dense, chunk)

    def seal(self) -> None:
        """The payload is whole: check it and sync its bytes, without putting it in place
        in the spool yet (``finish``): until then ``discard`` leaves nothing behind."""
        if self.sealed:
            return
        h = self.ticket.header
        with self._checked():
            if self.writer.bytes_written != h.payload_bytes:
                raise InvalidArgument(
                    f"payload ended after {self.writer.bytes_written} of the declared "
                    f"{h.payload_bytes} bytes"
                )
            self.decoder.finish()
            if self.dense is not None:
                self.dense.finish()
            _check_init_model(self.ticket, self.decoder)
            self.writer.sync(expected_digest=h.sha256)
        self.sealed = True

    def finish(self) -> str:
        """The payload is whole: check it and make it durable; returns its digest. A
        file put in place in the spool is held there (``UpdateSpool.hold``) until the
        upload is accepted or given up (``let_go``)."""
        self.seal()
        with self._checked():
            if isinstance(self.writer, SmallWriter):
                digest = self.writer.commit(expected_digest=self.ticket.header.sha256)
                self.ticket.payload = self.writer.data
                return digest
            held = self.ticket.header.sha256  # sealed: the payload hashes to it
            self.spool.hold(held)
            try:
                digest = self.writer.commit(expected_digest=held)
            except BaseException:
                if self.writer.placed:  # in place, not synced: giving up drops it
                    self.ticket.spooled = held
                else:
                    self.spool.release(held)
                raise
            self.ticket.spooled = digest
            return digest

    def discard(self) -> None:
        self.writer.discard()

    @contextmanager
    def _checked(self) -> Iterator[None]:
        """Domain errors for what the payload got wrong; the spool file goes on any error."""
        try:
            yield
        except CodecError as exc:
            self.discard()
            raise InvalidArgument(f"payload: {exc}") from exc
        except BlobDigestError as exc:
            self.discard()
            raise InvalidArgument(f"checksum mismatch: {exc}") from exc
        except StorageFullError as exc:  # nothing was spooled: the site retries later
            self.discard()
            raise Unavailable("disk full: the coordinator cannot spool updates now") from exc
        except BaseException:
            self.discard()
            raise


def _check_chunk(
    decoder: StreamDecoder, dense: StreamingDecompressor | None, chunk: Buffer
) -> None:
    """Parse a chunk and check its values (the views of it die with this frame)."""
    raw = decoder.feed(chunk)
    pieces: Iterable[Piece] = raw if dense is None else dense.feed(raw)
    for piece in pieces:
        if not all_finite(piece.values):
            raise InvalidArgument(f"tensor {piece.name!r} has non-finite values")


def _check_init_model(ticket: UploadTicket, decoder: StreamDecoder) -> None:
    if ticket.expected is None and not any(
        s.dtype.is_floating_point for s in decoder.specs.values()
    ):
        raise InvalidArgument("the initial model has no floating-point tensors to train")


def let_go(engine: Engine, ticket: UploadTicket) -> None:
    """The upload's file is its round's now, or nobody's: the spool's hold on it ends."""
    if ticket.spooled is not None:
        engine.updates.release(ticket.spooled)
        ticket.spooled = None


def give_up(engine: Engine, ticket: UploadTicket) -> None:
    """An upload that will not be accepted: its file, if it put one in place, goes unless
    an accepted update of any run is the same bytes; its task is the site's again."""
    digest = ticket.spooled
    with engine._lock:
        let_go(engine, ticket)
        if digest is not None:
            _drop_spooled(engine, ticket.run, digest)
    abort_upload(engine, ticket)


def abort_upload(engine: Engine, ticket: UploadTicket) -> None:
    """Give the task back to the site: nothing about it changed."""
    with engine._lock:
        a = ticket.assignment
        if a.state == TaskState.UPLOADING:
            a.move(a.before_upload)
            engine.notify()


def accept(engine: Engine, ticket: UploadTicket, digest: str, nbytes: int) -> None:
    """Record the update as accepted (durably), then fold it into the round's sum: the
    three steps below in a row, this thread waiting for the group commit."""
    write = accept_begin(engine, ticket, digest, nbytes)
    durable: Future[None] = Future()
    try:
        engine.commits.write(write)
        durable.set_result(None)
    except BaseException as exc:
        durable.set_exception(exc)
    accept_end(engine, ticket, digest, nbytes, durable)


def accept_begin(engine: Engine, ticket: UploadTicket, digest: str, nbytes: int) -> WriteOp:
    """The update may count: the write that records it as accepted, for the next group
    commit (``commits``). From here until ``accept_end`` the engine's lock is free but
    the round cannot close (``run.folding`` holds it open, as a fold does), and the task
    is the site's no more (it stays 'uploading')."""
    h, run, a = ticket.header, ticket.run, ticket.assignment
    upload_s = time.monotonic() - ticket.started
    with engine._lock:
        try:
            _may_accept(engine, ticket)
        except BaseException:  # refused (or the database failed): the file counts for nothing
            let_go(engine, ticket)
            _drop_spooled(engine, run, digest)
            abort_upload(engine, ticket)  # not refused for good: the task is the site's again
            raise
        metrics = dict(h.metrics)
        if run.spec.asynchronous is not None:
            metrics["staleness"] = float(run.staleness(a))
        run.folding += 1  # the driver will not close the round under this write and fold
        engine.note_provenance(run, h.site_id, ticket.round)
        return engine._store.accept_op(
            h.task_id, nonce=h.nonce, sha256=digest, num_samples=h.num_samples,
            metrics=metrics, bytes_up=nbytes, upload_s=upload_s, now=engine.clock(),
            data=ticket.payload,
        )  # fmt: skip


def _may_accept(engine: Engine, ticket: UploadTicket) -> None:
    """Raise if the update may not count now (lock held): its round closed before it
    arrived, or an asynchronous run's update came too stale."""
    h, run, a = ticket.header, ticket.run, ticket.assignment
    if run.spec.asynchronous is not None:  # the round may have moved on meanwhile
        engine.await_carried(h.task_id)
        if run.assignments.get(h.site_id) is a and run.open_round is not None:
            ticket.round, ticket.attempt = run.open_round, run.attempt
            _check_staleness(engine, run, a)
    if not run.accepting(ticket.round, ticket.attempt):
        a.move(TaskState.FAILED)
        a.update_sha256 = None
        late = f"round {ticket.round} closed before the update arrived"
        engine._store.fail_participation(a.task_id, late, engine.clock())
        raise FailedPrecondition(
            f"round {ticket.round} of run {run.run_id} closed before your update arrived; "
            "poll for the next task"
        )


def accept_end(
    engine: Engine, ticket: UploadTicket, digest: str, nbytes: int, durable: Future[None]
) -> None:
    """After ``accept_begin``'s write was committed (or refused: ``durable`` holds the
    outcome): the task is accepted and the update folded, or it is the site's again and
    the refusal raised."""
    h, run, a = ticket.header, ticket.run, ticket.assignment
    exc = durable.exception()
    if exc is not None:
        with engine._lock:
            run.folding -= 1
            let_go(engine, ticket)
            _drop_spooled(engine, run, digest)
            abort_upload(engine, ticket)
            engine.notify(run.run_id)
        if isinstance(exc, DuplicateError):
            raise AlreadyExists(str(exc)) from exc
        raise exc
    upload_s = time.monotonic() - ticket.started
    if ticket.payload is not None:  # durable in its row now; at hand for the fold
        engine.updates.accepted(digest, ticket.payload)
    with engine._lock:
        try:
            crash_point("after_accept", ticket.round)  # durable, not folded, no reply
            a.move(TaskState.ACCEPTED)
            a.update_sha256, a.num_samples = digest, h.num_samples
            a.nonce = h.nonce
        finally:
            let_go(engine, ticket)  # the round keeps it now (Engine.spool_kept)
        run.last_accept_at = time.perf_counter()
    # Summing a large update takes a while: polls, heartbeats and other uploads go on.
    broken = ""
    try:
        fold_ready(engine, run)  # this update, and any that waited for its turn
    except Exception as exc:
        # Accepted durably but only partly summed: this attempt's sum cannot be trusted.
        log.exception(
            "run %s round %d: folding an accepted update failed", run.run_id, ticket.round
        )
        broken = f"folding accepted updates failed: {type(exc).__name__}"
    with engine._lock:
        run.folding -= 1
        run.broken = run.broken or broken
        engine.notify(run.run_id)
    log.debug(  # one a site a round: the round's commit line sums them up
        "run %s round %d: accepted update from %s (%d bytes, %.2fs)",
        run.run_id, ticket.round, h.site_id, nbytes, upload_s,
    )  # fmt: skip
    crash_point("before_reply", ticket.round)  # durable and folded, no reply


def _drop_spooled(engine: Engine, run: ActiveRun, digest: str) -> None:
    # Identical updates share a blob; keep it while an accepted one refers to it.
    if not engine.spool_in_use(digest):
        engine.updates.delete(digest)
