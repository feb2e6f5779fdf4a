"""The coordinator's front door: what the servicers call, as coroutines.

The domain (``Engine``, the round drivers, uploads, folding, storage) is plain blocking
code under the engine's lock. This module is the one place where the event-driven
server meets it:

* every step that takes the lock, touches the database or the disk, hashes or folds
  runs in one bounded executor (``workers`` threads), one short step at a time;
* a call that waits (a long poll, a secure-aggregation stage, a watch) parks a
  ``Ticket`` (``wakeups``) and holds no thread while it waits: the engine wakes the
  ticket of exactly who must look again;
* a transfer waits for its peer's next chunk without a thread, and only the chunk's
  hashing and spooling (or reading) runs in the executor.

Nothing here knows gRPC: servicers turn messages into these calls and results back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fedra.coordinator.engine import Engine, EngineSettings, TaskView, secure, uploads
from fedra.coordinator.errors import FedraError
from fedra.coordinator.ledger import SITES_PAGE
from fedra.coordinator.observers import Observers
from fedra.coordinator.steps import LockedSteps
from fedra.coordinator.wakeups import (
    LoopInbox,
    Ticket,
    opened_key,
    run_key,
    site_key,
    stage_key,
)
from fedra.faults import crash_point
from fedra.protos.codec import Buffer, transfer_chunk_bytes
from fedra.provenance import Provenance
from fedra.runspec import RunSpec
from fedra.storage.blobs import BlobCorruptError
from fedra.storage.records import CheckpointRecord, SiteRecord

if TYPE_CHECKING:  # status builds protobuf replies: the front door never loads it
    from fedra.coordinator.status import StatusSource

log = logging.getLogger("fedra.coordinator")
T = TypeVar("T")
DEFAULT_WORKERS = 32  # threads for blocking steps; waiting calls hold none
READERS = 2  # threads for operators' reads
# A step on this many bytes or fewer (a model chunk read, an update's accept and fold)
# runs on the loop when the engine's lock is free: cheaper than handing it to a thread.
INLINE_BYTES = 64 * 1024
SMALL_MODELS_KEPT = 4  # models sent with tasks, kept in memory (the newest rounds')


class CoordinatorAPI:
    """Async access to one engine; every method is a coroutine run on the server's loop."""

    def __init__(self, engine: Engine, workers: int = DEFAULT_WORKERS) -> None:
        self.engine = engine
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="fedra-work")
        # Operators' reads (status, watch, site lists) have threads of their own: they
        # never queue behind a round's thousands of steps, nor hold those up.
        self.readers = ThreadPoolExecutor(READERS, thread_name_prefix="fedra-read")
        # Short steps that found the engine's lock taken (quick, soon).
        self._steps = LockedSteps(self._locked)
        # Small models sent with their tasks, by digest, newest last (on the loop only).
        self._small_models: dict[str, asyncio.Future[bytes]] = {}
        # What each pool's steps hand back to a loop (see call).
        self._inboxes: dict[tuple[asyncio.AbstractEventLoop, object], LoopInbox] = {}

    @property
    def settings(self) -> EngineSettings:
        return self.engine.settings

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        return self.engine.locked(fn, *args)

    def close(self) -> None:
        self._steps.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.readers.shutdown(wait=False, cancel_futures=True)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a read that takes no engine lock, on the readers' threads."""
        return await self.call(fn, *args, executor=self.readers)

    async def quick(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a short step under the engine's lock that neither waits nor does
        I/O: run here on the loop if the lock is free this instant (no thread hand-off),
        else queued for the engine's step thread, which runs the steps queued in one
        turn of the lock (``steps``). The loop never waits for the lock. Once begun the
        step runs to its end, as in ``call``."""
        ran, out = self.engine.if_free(fn, *args)
        if ran:
            return cast(T, out)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        try:
            self._steps.put(fn, args, done, self._inbox(loop, self._steps))
        except RuntimeError:  # closed: the daemon is stopping
            return await self.call(fn, *args)
        return await _outcome(done)

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        """``quick`` not waited for: now if the engine's lock is free, else queued for
        the engine's step thread (a clean-up that must not wait, nor be lost to a
        cancellation)."""
        ran, _ = self.engine.if_free(fn, *args)
        if not ran:
            try:
                self._steps.put(fn, args)
            except RuntimeError:  # closed: the daemon is stopping
                self.later(self.engine.locked, fn, *args)

    async def call(
        self, fn: Callable[..., T], *args: Any, executor: ThreadPoolExecutor | None = None
    ) -> T:
        """``fn(*args)`` in the executor. It runs to its end even if the caller is
        cancelled meanwhile (the cancellation is raised once it has), so that what it
        did is known to the caller's clean-up."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        pool = executor or self.executor
        inbox = self._inbox(loop, pool)
        work = pool.submit(fn, *args)

        def hand_back(finished: Future[T]) -> None:  # its thread, or close()'s if cancelled
            with suppress(RuntimeError):  # the loop closed: nobody waits any more
                inbox.put(functools.partial(_copy_outcome, finished, done))

        # Back with the other outcomes of the moment (LoopInbox), not a hand-over each.
        work.add_done_callback(hand_back)
        return await _outcome(done)

    def later(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` in the executor, not waited for (clean-up of a cancelled call)."""
        with suppress(RuntimeError):  # shut down: the engine is stopping anyway
            self.executor.submit(fn, *args)

    # -- sites -----------------------------------------------------------------

    async def register(
        self, site_id: str, tasks: list[str], version: str, provenance: list[Provenance]
    ) -> None:
        await self.call(self.engine.register, site_id, tasks, version, provenance)

    def touch(self, site_id: str, queued_s: float | None = None) -> None:
        """A call of the site's arrived, after ``queued_s`` in gRPC's queue if it said its
        deadline (liveness, before anything waits: ``Engine.touch``)."""
        self.engine.touch(site_id, queued_s)

    async def heartbeat(
        self,
        site_id: str,
        task_id: str,
        hold_s: float = 0.0,
        hung_up: Callable[[], bool] = lambda: True,
    ) -> bool:
        """Whether the site's task still counts; with ``hold_s`` > 0 and a task that does,
        after holding the call up to ``hold_s`` (at most the poll timeout) or until it stops
        counting. The site is online while the call is held, as in a long poll, and
        offline at once if it hangs up (it stopped). ``hung_up`` says whether a call
        cancelled was hung up by its caller; one that ran out of time (a coordinator too
        late to answer within it) says nothing against the site."""
        engine = self.engine
        current, run_id = await self.quick(engine.heartbeat, site_id, task_id)
        hold_s = min(hold_s, engine.settings.poll_timeout_s)
        if run_id is None or hold_s <= 0:
            return current
        deadline = time.monotonic() + hold_s

        def ticket() -> Ticket:  # woken when a round opens for it, or the run's attempt moves
            return engine.wakeups.ticket(site_key(site_id), stage_key(run_id))

        waiting = ticket()
        try:
            began, current = await self._look(waiting, engine.hold_begin, site_id, task_id)
        except asyncio.CancelledError:  # hold_begin ran to its end (``call``): undo it
            self.soon(engine.poll_end, site_id, -math.inf, True)
            raise
        try:
            while current and not engine.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await waiting.wait(remaining) or engine.stopping:
                    break
                waiting = ticket()
                current = await self._look(waiting, engine.task_run, site_id, task_id) is not None
            waiting.discard()
        except BaseException:  # cancelled: the caller hung up (or the daemon is stopping)
            waiting.discard()
            self.soon(engine.poll_end, site_id, began, hung_up())
            raise
        # Not waited for: a call that ends is not held by the engine's lock (nor cut off
        # waiting for it by a stopping server).
        self.soon(engine.poll_end, site_id, began, False)
        # A coordinator stopping says nothing against the task: it may count still when
        # the coordinator is back, and the site's upload waits for that.
        return current

    async def poll(
        self,
        site_id: str,
        timeout_s: float,
        hung_up: Callable[[], bool] = lambda: True,
        after: tuple[str, str] | None = None,
    ) -> TaskView | None:
        """The site's task, waiting up to ``timeout_s`` for one. A caller that hangs up
        (the call is cancelled, and ``hung_up`` says so) is offline at once, not when its
        poll would have ended; a poll that ran out of time is not a site hanging up.

        ``after`` (run id, task id): the poll follows that task's accepted update, and
        ends without a task as soon as the run opens an attempt without the site, or
        ends (``Engine.task_after``).

        Its engine steps are few: the poll's start and first look are one, each
        wake-up's look one, and the poll's end with a small model's download
        (``_hand_out``) one. At thousands of sites a round each step is a turn of the
        engine's lock, and a hand-off to a thread whenever it is taken."""
        engine = self.engine
        deadline = time.monotonic() + max(0.0, min(timeout_s, engine.settings.poll_timeout_s))
        keys = [site_key(site_id)] if after is None else [site_key(site_id), opened_key(after[0])]

        def begin() -> tuple[float, TaskView | None, bool]:
            began, view = engine.poll_begin(site_id)
            if view is None and after is not None:
                return (began, *engine.task_after(site_id, *after))
            return began, view, True

        def look() -> tuple[TaskView | None, bool]:
            if after is None:
                return engine.task_for(site_id), True
            return engine.task_after(site_id, *after)

        ticket = engine.wakeups.ticket(*keys)
        try:
            began, view, waits = await self._look(ticket, begin)
        except asyncio.CancelledError:  # begin ran to its end (``call``): undo it
            self.soon(engine.poll_end, site_id, -math.inf, True)
            raise
        try:
            while view is None and waits and not engine.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await ticket.wait(remaining):
                    break
                ticket = engine.wakeups.ticket(*keys)
                view, waits = await self._look(ticket, look)
            ticket.discard()
            model = b""
            if view is not None and self._inlined(view):
                model = await self._small_model(view)
        except BaseException:  # cancelled: the caller hung up (or the daemon is stopping)
            ticket.discard()
            self.later(engine.poll_end, site_id, began, hung_up())
            raise
        step = self._step(view.task_id if view is not None else None)
        handed: TaskView | None = await step(self._hand_out, site_id, began, view, model)
        return handed

    def _step(self, task_id: str | None) -> Callable[..., Awaitable[Any]]:
        """How a step on the task ``task_id`` runs: ``quick``, or in the executor for a
        task of an asynchronous run, whose look at it may wait for the run's next round
        (``Engine.await_carried``): never on the loop, nor holding up the steps queued
        behind it on the step thread."""
        if task_id is not None and self.engine.is_async_task(task_id):
            return self.call
        return self.quick

    def _hand_out(
        self, site_id: str, began: float, view: TaskView | None, model: bytes
    ) -> TaskView | None:
        """The poll's end, and the task with ``model`` (its small model, read and checked,
        or b"": the site downloads it) counted as a finished download of it, in one
        step (a site whose reply is lost polls again and gets both again). A model
        that cannot go this way (the round moved on meanwhile) goes the usual one: the
        site's download meets what is wrong."""
        engine = self.engine
        engine.poll_end(site_id, began, False)
        if view is None or not model:
            return view
        try:
            digest, size, base = engine.open_download(site_id, view.task_id, False)
        except FedraError:
            return view
        if digest != view.model_sha256 or size != len(model):
            engine.downloads.abandoned(view.task_id)
            log.warning(
                "the model %s did not go out with task %s (the round's is %s now): the site "
                "downloads it", view.model_sha256, view.task_id, digest,
            )  # fmt: skip
            return view
        engine.record_download(view.task_id, size, 0.0, base)
        return dataclasses.replace(view, model=model)

    def _inlined(self, view: TaskView) -> bool:
        """Whether the task's model goes out with it: a small one (one chunk at most) that
        the site has no cheaper way to: not round 1's (the initial model, which sites
        rebuild from the run's seed), nor one a compressed step leads to."""
        s = self.engine.settings
        limit = min(s.inline_model_bytes, s.chunk_bytes)
        cheaper = view.round <= 1 or bool(view.delta_sha256)
        return view.kind == "train" and 0 < view.model_bytes <= limit and not cheaper

    async def _small_model(self, view: TaskView) -> bytes:
        """The task's small model, whole and checked, or b"" if it cannot be read (the
        site downloads it then, and meets what is wrong)."""
        try:
            return await self._model_bytes(view.model_sha256, view.model_bytes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("the model %s did not go out with task %s (%s): the site downloads it",
                        view.model_sha256, view.task_id, exc)  # fmt: skip
            return b""

    async def _model_bytes(self, digest: str, size: int) -> bytes:
        """A small stored model, whole and checked: read once for all the polls that
        want it (a round's opening wakes them together), kept while it is recent."""
        read = self._small_models.get(digest)
        if read is None:
            read = asyncio.ensure_future(self.call(self.engine.models.read, digest))
            self._small_models[digest] = read
            while len(self._small_models) > SMALL_MODELS_KEPT:
                del self._small_models[next(iter(self._small_models))]
        try:
            data = await asyncio.shield(read)
        except BaseException:
            if self._small_models.get(digest) is read and read.done():
                del self._small_models[digest]  # failed: the next poll tries again
            raise
        if len(data) != size:
            del self._small_models[digest]
            raise ValueError(f"it has {len(data)} bytes, not the recorded {size}")
        return data

    async def _look(self, ticket: Ticket, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self.quick(fn, *args)
        except BaseException:
            ticket.discard()
            raise

    async def download(
        self,
        site_id: str,
        task_id: str,
        delta: bool,
        frame: Callable[[int], bytes],
        controls: bool = False,
    ) -> AsyncIterator[bytes]:
        """The task's model (or compressed step, or SCAFFOLD's c), each chunk led by
        ``frame(len)``."""
        engine = self.engine
        step = self._step(task_id)  # an async run's task may wait for its next round here
        digest, size, base = await step(engine.open_download, site_id, task_id, delta, controls)
        started, sent = time.monotonic(), 0  # sent: handed to gRPC, frames included
        await self.quick(engine.transfer, site_id, True)
        try:
            async for data in self.read_model(digest, size, frame):
                if sent:  # the first chunk has gone out
                    crash_point("mid_download", base)
                sent += len(data)
                yield data
                del data  # not held while the next one is read
        except BaseException:  # cancelled, failed, or closed by gRPC: what went out is cut
            engine.downloads.abandoned(task_id, min(sent, size))
            raise
        finally:
            self.soon(engine.transfer, site_id, False)
        await self.quick(engine.record_download, task_id, size, time.monotonic() - started, base)

    async def read_model(
        self, digest: str, size: int, frame: Callable[[int], bytes]
    ) -> AsyncIterator[bytes]:
        """A stored model in chunks sized to it (codec.transfer_chunk_bytes), so that a
        stream holds a fraction of it, each read in the executor."""
        chunk = transfer_chunk_bytes(size, self.engine.settings.chunk_bytes)
        chunks = self.engine.models.read_chunks(digest, chunk, frame=frame)
        assert isinstance(chunks, Generator)
        count = max(1, -(-size // chunk))  # the last read also checks the digest: one step
        here = chunk <= INLINE_BYTES  # a small read costs less than a thread hand-off
        try:
            for number in range(1, count + 1):
                if here:
                    data = _read_chunk(chunks, number == count, digest)
                else:
                    data = await self.call(_read_chunk, chunks, number == count, digest)
                if data is None:
                    break
                yield data
                del data
        finally:
            self.later(chunks.close)

    async def upload(
        self,
        header: uploads.UpdateHeader,
        chunks: AsyncIterator[Buffer],
        started: Callable[[], None] = lambda: None,
        check: Callable[[], None] = lambda: None,
        closed: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Receive an update: checked, spooled, durably accepted and folded before this
        returns the bytes it counted. ``check`` (its signature, say) runs first, in the
        same step as the header's checks; ``started`` once the round holds the update;
        ``closed``, where given, once the payload is whole, checked and synced, before it
        is put in place in the spool and accepted: it raises if the caller did not end
        ``chunks`` itself (wire.RequestStream.closed), and the update then counts for
        nothing and leaves no file."""
        engine, held = self.engine, _Held()
        # A small update is received in memory (storage.spool): no file, no thread. (Not
        # an async run's: refusing a stale one writes to the database.)
        small = engine.updates.is_small(header.payload_bytes) and not engine.is_async_task(
            header.task_id
        )
        try:
            if small:
                check()  # not under the engine's lock, which quick holds
                await self.quick(held.begin, engine, header, lambda: None)
            else:
                await self.call(held.begin, engine, header, check)  # opens the spool file
        except uploads.AlreadyAccepted as done:
            return done.nbytes
        except BaseException as exc:
            if held.ticket is not None:  # begun, then cancelled
                self.soon(engine.transfer, header.site_id, False)
                engine.downloads.ended(header.task_id)
                await self._undo(held, exc, small)
            raise
        started()  # pending in the downloads ledger until it ends (_receive)
        try:
            return await self._receive(held, chunks, header.payload_bytes, closed)
        finally:
            self.soon(engine.transfer, header.site_id, False)

    async def _receive(
        self,
        held: _Held,
        chunks: AsyncIterator[Buffer],
        size: int,
        closed: Callable[[], Awaitable[None]] | None,
    ) -> int:
        engine, ledger = self.engine, self.engine.downloads
        assert held.ticket is not None
        ticket, task_id, received = held.ticket, held.ticket.header.task_id, 0
        try:
            # One chunk behind: the last is fed with the finish, one executor step (most
            # updates of small models are one chunk: one step for all of it).
            last: Buffer | None = None
            here = engine.updates.is_small(size)  # in memory: each step costs microseconds
            async for data in chunks:
                received += len(data)
                if last is not None:
                    if here:
                        held.feed(last)
                    else:
                        await self.call(held.feed, last)
                last = data
                del data  # not held while the next message is received
            if closed is not None:
                # Whole, checked and synced but not yet in the spool while the stream's end
                # is confirmed (its wait overlaps this work): refused, nothing stays.
                try:
                    if here:
                        held.seal(last)
                    else:
                        await self.call(held.seal, last)
                except Exception:
                    await closed()  # a stream the transport cut looks short: it was cut
                    raise
                last = None
                await closed()
            digest = held.finish(last) if here else await self.call(held.finish, last)
            del last
        except BaseException as exc:  # cut off or refused: it crossed the wire for nothing
            ledger.ended(task_id, received)
            await self._undo(held, exc, here)
            raise
        try:
            # Small, its fold quick too, and never waiting (an async run's accept may wait
            # for the next round): no thread hand-offs.
            if size <= INLINE_BYTES and ticket.run.spec.asynchronous is None:
                loop = asyncio.get_running_loop()
                done: asyncio.Future[None] = loop.create_future()
                await self.quick(self._accept_here, ticket, digest, size, done)
                await _outcome(done)
            else:
                accepted = await self.call(self._accept, ticket, digest, size)
                await _outcome(asyncio.wrap_future(accepted))
        except asyncio.CancelledError:
            raise  # accept ran to its end: the site's retry is answered from what it did
        except BaseException:  # refused whole (too late, say): all of it for nothing
            ledger.ended(task_id, size)
            raise
        ledger.ended(task_id)
        return size

    async def _undo(self, held: _Held, exc: BaseException, small: bool) -> None:
        """Undo an upload that did not complete. A refusal's caller hears of it only once
        the task is the site's again (a retry at once finds it so); a cancelled call's
        clean-up is not waited for (nobody is waiting, and the server may be stopping)."""
        if isinstance(exc, asyncio.CancelledError):
            self.later(_give_back, self.engine, held)
        elif small:  # in memory: nothing to unlink
            await self.quick(_give_back, self.engine, held)
        else:
            await self.call(_give_back, self.engine, held)

    def _accept_begin(
        self, ticket: uploads.UploadTicket, digest: str, size: int
    ) -> tuple[Future[None], Callable[[Future[None]], None]]:
        """``uploads.accept`` without a thread waiting for the group commit: the accepting
        write goes in the next batch; returned, the batch's future and the rest of the
        accept, to call with that future once it is done. Begun, it goes to its end.

        The rest is given the future, not bound to it: a future keeps its callbacks, so a
        callback holding its own future would be a reference cycle, which only the
        collector frees (with the ticket and all it holds), an upload at a time."""
        write = uploads.accept_begin(self.engine, ticket, digest, size)
        durable = self.engine.commits.submit(write)
        return durable, functools.partial(uploads.accept_end, self.engine, ticket, digest, size)

    def _accept(self, ticket: uploads.UploadTicket, digest: str, size: int) -> Future[None]:
        """An accept whose end runs in the executor; the future says when it has."""
        durable, end = self._accept_begin(ticket, digest, size)
        accepted: Future[None] = Future()

        def committed(batch: Future[None]) -> None:
            self._submit(_settle, accepted, functools.partial(end, batch))

        durable.add_done_callback(committed)
        return accepted

    def _accept_here(
        self, ticket: uploads.UploadTicket, digest: str, size: int, done: asyncio.Future[None]
    ) -> None:
        """An accept whose end runs on ``done``'s loop, handed over with the rest of its
        batch (``LoopInbox``: one hand-over a batch, a slice of them a pass), or in the
        executor if the engine's lock is taken then; ``done`` says when it has."""
        durable, end = self._accept_begin(ticket, digest, size)
        inbox = self._inbox(done.get_loop(), self.executor)

        def back(outcome: Future[None]) -> None:  # from the executor: settle on the loop
            with suppress(RuntimeError):  # the loop closed: nobody waits any more
                inbox.put(functools.partial(_copy_outcome, outcome, done))

        def on_loop(finish: Callable[[], None]) -> None:
            # Not run holding the lock: ``finish`` takes it (and a run's fold lock, which
            # is taken before the engine's elsewhere) itself. Free now, it is soon again.
            if self.engine.is_free():
                _settle(done, finish)
            else:
                aside: Future[None] = Future()
                aside.add_done_callback(back)
                self._submit(_settle, aside, finish)

        def hand_over(batch: Future[None]) -> None:  # the group commit's thread, or here
            finish = functools.partial(end, batch)
            try:
                inbox.put(functools.partial(on_loop, finish))
            except RuntimeError:  # the loop has closed (the server stopped): end it anyway
                self._submit(_settle, Future(), finish)

        durable.add_done_callback(hand_over)

    def _inbox(self, loop: asyncio.AbstractEventLoop, pool: object) -> LoopInbox:
        """The inbox of what ``pool``'s steps (an executor's, or the engine's step
        thread's) hand back to ``loop``: one a pool, so that operators' reads never
        queue behind a round's accepts on their way back."""
        inbox = self._inboxes.get((loop, pool))
        if inbox is None:
            inbox = self._inboxes.setdefault((loop, pool), LoopInbox(loop))
        return inbox

    def _submit(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` in the executor, here if that is shut down (the engine is stopping)."""
        try:
            self.executor.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    async def report_failure(
        self, site_id: str, task_id: str, reason: str, declined: bool = False
    ) -> None:
        await self.call(self.engine.report_failure, site_id, task_id, reason, declined)

    # -- secure aggregation: each stage call posts, then waits for the stage to close -----

    async def secagg_keys(
        self,
        site_id: str,
        task_id: str,
        public_keys: bytes,
        signature: bytes,
        verify: Callable[[bytes, bytes], bytes],
        wait_s: float,
    ) -> tuple[bool, dict[str, tuple[bytes, bytes, bytes]]]:
        post = functools.partial(secure.post_keys, self.engine, site_id, task_id)
        await self.call(post, public_keys, signature, verify)
        return await self._stage(site_id, task_id, secure.keys_answer, wait_s)

    async def secagg_shares(
        self, site_id: str, task_id: str, ciphertexts: dict[str, bytes], wait_s: float
    ) -> tuple[bool, dict[str, bytes]]:
        await self.call(secure.post_shares, self.engine, site_id, task_id, ciphertexts)
        return await self._stage(site_id, task_id, secure.shares_answer, wait_s)

    async def secagg_unmask(
        self, site_id: str, task_id: str, wait_s: float
    ) -> tuple[bool, tuple[list[str], list[str]]]:
        await self.call(secure.check_unmask, self.engine, site_id, task_id)
        return await self._stage(site_id, task_id, secure.unmask_answer, wait_s)

    async def secagg_reveal(self, site_id: str, task_id: str, shares: dict[str, bytes]) -> None:
        await self.call(secure.reveal, self.engine, site_id, task_id, shares)

    async def _stage(
        self,
        site_id: str,
        task_id: str,
        answer: Callable[[Engine, str, str], tuple[bool, T]],
        wait_s: float,
    ) -> tuple[bool, T]:
        """``answer`` once it is ready, or not ready after ``wait_s`` (at most
        STAGE_WAIT_CAP_S); woken when the run's attempt or stage moves."""
        engine = self.engine
        deadline = time.monotonic() + max(0.0, min(wait_s, secure.STAGE_WAIT_CAP_S))
        run_id = await self.call(secure.stage_id, engine, site_id, task_id)
        while True:
            ticket = engine.wakeups.ticket(stage_key(run_id))
            ready, found = await self._look(ticket, answer, engine, site_id, task_id)
            remaining = deadline - time.monotonic()
            if ready or remaining <= 0 or engine.stopping:
                ticket.discard()
                return ready, found
            await ticket.wait(remaining)

    # -- admin -----------------------------------------------------------------

    async def submit(self, spec: RunSpec, who: str) -> tuple[str, list[str]]:
        return await self.call(self.engine.submit, spec, who)

    async def cancel(self, run_id: str, who: str) -> str:
        return await self.call(self.engine.cancel, run_id, who)

    async def export_checkpoint(
        self, run_id: str, round_number: int | None, who: str
    ) -> CheckpointRecord:
        """The checkpoint of ``round_number``, or with None the run's result (the latest, or
        the promoted one), its export by ``who`` audited (``Engine.export_checkpoint``)."""
        return await self.call(self.engine.export_checkpoint, run_id, round_number, who)

    # -- operators' reads: the engine's memory, read without its lock ----------------

    @property
    def status_source(self) -> StatusSource:
        """What a run's status is read from (the engine's memory and its stored runs)."""
        return self.engine

    @property
    def observers(self) -> Observers:
        """Who is told of the coordinator's events (a servicer's refusals among them)."""
        return self.engine.observers

    def site_counts(self, offline: Collection[str] = ()) -> tuple[int, int]:
        """(sites registered, of them online now and not in ``offline``)."""
        return self.engine.site_counts(offline)

    def list_sites(
        self, after: str = "", limit: int = SITES_PAGE
    ) -> tuple[list[tuple[SiteRecord, bool, float]], str]:
        """A page of sites in id order after ``after``, each with whether it is online and
        when it was last heard from, and the id to continue after ('' at the end)."""
        return self.engine.list_sites(after, limit)

    async def changes(self, run_id: str, interval_s: float, gap_s: float) -> AsyncIterator[None]:
        """Yields when the run may have changed: at once, then after each change (at most
        once per ``gap_s``, so a burst of changes is one look) or every ``interval_s``."""
        engine = self.engine
        while not engine.stopping:
            ticket = engine.wakeups.ticket(run_key(run_id))
            looked = time.monotonic()
            try:
                yield
            except BaseException:
                ticket.discard()
                raise
            await ticket.wait(interval_s)
            rest = gap_s - (time.monotonic() - looked)
            if rest > 0 and not engine.stopping:
                await asyncio.sleep(rest)


class _Held:
    """An upload's state across its executor steps, so that a cancelled call's clean-up
    knows what each step did even when the step finished after the cancellation."""

    def __init__(self) -> None:
        self.ticket: uploads.UploadTicket | None = None
        self.receiver: uploads.Receiver | None = None

    def begin(
        self, engine: Engine, header: uploads.UpdateHeader, check: Callable[[], None]
    ) -> None:
        check()
        self.ticket = uploads.begin_upload(engine, header)
        # Online while it lasts (the upload's end ends it), in the same step.
        engine.transfer(header.site_id, True)
        self.receiver = uploads.Receiver(engine, self.ticket)

    def feed(self, data: Buffer) -> None:
        assert self.receiver is not None
        self.receiver.feed(data)

    def seal(self, last: Buffer | None) -> None:
        assert self.receiver is not None
        if last is not None:
            self.receiver.feed(last)
        self.receiver.seal()

    def finish(self, last: Buffer | None) -> str:
        self.seal(last)  # once: the receiver's finish seals only what is not sealed
        assert self.receiver is not None
        return self.receiver.finish()


async def _outcome(future: asyncio.Future[T]) -> T:
    """What ``future`` comes to. A cancelled caller waits for it all the same, then is
    cancelled: what the work did is known to the caller's clean-up."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with suppress(BaseException):
            await asyncio.shield(future)
        raise


def _settle(out: Future[T] | asyncio.Future[T], fn: Callable[[], T]) -> None:
    """``fn()``'s outcome into ``out`` (an asyncio future: called on its loop)."""
    try:
        result = fn()
    except BaseException as exc:
        if not out.done():
            out.set_exception(exc)
        return
    if not out.done():
        out.set_result(result)


def _copy_outcome(source: Future[T], out: asyncio.Future[T]) -> None:
    """On ``out``'s loop: ``source``'s outcome (it is done) into ``out``; cancelled if
    it was (a step not begun when the executor shut down)."""
    if out.done():
        return
    if source.cancelled():
        out.cancel()
        return
    exc = source.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(source.result())


def _read_chunk(chunks: Generator[bytes, None, None], last: bool, digest: str) -> bytes | None:
    """The next chunk; with ``last``, the generator is run to its end too (where it
    checks the blob's digest), in the same step."""
    data = next(chunks, None)
    if last and data is not None and next(chunks, None) is not None:
        raise BlobCorruptError(digest, "something else: the file is longer than recorded")
    return data


def _give_back(engine: Engine, held: _Held) -> None:
    """An upload that did not complete: its spool file goes (put in place already, if
    the call was cancelled after its last step), its task is the site's again."""
    if held.receiver is not None:
        held.receiver.discard()
    if held.ticket is not None:
        uploads.give_up(engine, held.ticket)
