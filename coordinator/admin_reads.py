"""The operators' reads (``GetRun``, ``ListRuns``, ``WatchRun``, ``ListSites``) over any
``ReadSide``: the engine's memory and database in the daemon, or a snapshot and the
database in the operators' read process (``replica``). Imports neither torch nor the
engine, so that process starts light."""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from fedra.coordinator.auth import Guard
from fedra.coordinator.edge import mapped, mapped_stream
from fedra.coordinator.errors import InvalidArgument
from fedra.coordinator.ledger import MAX_ID_CHARS
from fedra.coordinator.observers import Observers
from fedra.coordinator.status import (
    PAGE_BYTES,
    FinalRounds,
    RunWatch,
    SharedPages,
    StatusSource,
    run_header,
    run_page,
    run_status,
)
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc
from fedra.storage.records import SiteRecord

T = TypeVar("T")
_LISTINGS_KEPT = 16  # ListSites pages kept for their key (a few callers, a few pages each)
WATCH_GAP_S = 0.2  # a watch looks at most this often, however often its run changes
SiteRow = tuple[SiteRecord, bool, float]  # a site, whether it is online, when last heard


class ReadSide(Protocol):
    """Where the operators' reads come from, and the threads they run on."""

    @property
    def source(self) -> StatusSource: ...

    @property
    def readers(self) -> Executor: ...

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a reader thread (never on the event loop)."""
        ...

    def changes(self, run_id: str, interval_s: float, gap_s: float) -> AsyncIterator[None]:
        """Yields when the run may have changed: at once, then after changes (at most once
        per ``gap_s``) or every ``interval_s``."""
        ...

    def site_counts(self, offline: Collection[str] = ()) -> tuple[int, int]:
        """(sites registered, of them online now and not in ``offline``)."""
        ...

    def list_sites(self, after: str, limit: int) -> tuple[list[SiteRow], str]:
        """A page of sites in id order after ``after`` (at most ``limit``; 0: the
        default) and the id to continue after ('' at the end)."""
        ...

    def listing_key(self) -> object | None:
        """A key for what the listing is built from now, if it changes in steps (the
        same key, the same page: built once for every caller); None: build each time."""
        ...


class AdminReads(admin_pb2_grpc.AdminServiceServicer):
    """The read-only admin calls; the daemon's ``AdminService`` adds the writes to them,
    the read process forwards its writes to the daemon."""

    def __init__(
        self,
        reads: ReadSide,
        guard: Guard,
        observers: Observers | None = None,
        watch_interval_s: float = 10.0,
        watch_gap_s: float = WATCH_GAP_S,
    ) -> None:
        self.reads, self.guard = reads, guard
        self.observers = observers  # told of each refusal (edge.mapped)
        self.watch_interval_s = watch_interval_s  # a watch looks at least this often
        self.watch_gap_s = watch_gap_s  # and at most this often
        self.kept = FinalRounds()  # GetRun pages build only the rounds still moving
        self.kept_summaries = FinalRounds(16 << 20)  # and summaries' pages, theirs
        self.pages = SharedPages()  # a large page is built once for the calls at once
        self._listings: dict[tuple[object, ...], admin_pb2.ListSitesResponse] = {}
        self._listing_lock = threading.Lock()

    def revoked(self) -> frozenset[str]:
        """The sites whose certificates are revoked: listed offline, whatever they did."""
        return self.guard.revoked_sites()

    @mapped
    async def GetRun(self, request: admin_pb2.GetRunRequest, context: Any) -> admin_pb2.RunStatus:
        self.guard.admin(context)
        insecure, first, source = self.guard.insecure, request.first_round, self.reads.source
        if request.page:
            # Shared for a moment within a phase (driven, cancelled, ended), never across one.
            phase = source.run_phase(request.run_id)
            key = (request.run_id, first, insecure, phase, request.summary)
            kept = self.kept_summaries if request.summary else self.kept
            build = functools.partial(
                run_page, source, request.run_id, insecure, first, PAGE_BYTES, kept,
                summary=request.summary,
            )  # fmt: skip
            if (page := self.pages.answer(key, build, self.reads.readers)) is not None:
                return page
            return await self.reads.read(self.pages.get, key, build)
        if request.summary:
            whole = functools.partial(run_status, summary=True)
            return await self.reads.read(whole, source, request.run_id, insecure, first)
        return await self.reads.read(run_status, source, request.run_id, insecure, first)

    @mapped
    async def ListRuns(
        self, request: admin_pb2.ListRunsRequest, context: Any
    ) -> admin_pb2.ListRunsResponse:
        self.guard.admin(context)
        source = self.reads.source

        def read() -> list[admin_pb2.RunStatus]:
            records = source.records.list_runs()
            return [run_header(source, r, self.guard.insecure) for r in records]

        return admin_pb2.ListRunsResponse(runs=await self.reads.read(read))

    @mapped_stream
    async def WatchRun(
        self, request: admin_pb2.WatchRunRequest, context: Any
    ) -> AsyncIterator[admin_pb2.RunStatus]:
        self.guard.admin(context)
        insecure, only_changed = self.guard.insecure, request.changed_rounds_only
        watch = RunWatch(
            self.reads.source, request.run_id, insecure, only_changed, summary=request.summary
        )
        # Woken by a change of the run (a burst of them is one look), or every interval;
        # it waits holding no thread, and a client that hangs up ends it at once.
        changes = self.reads.changes(request.run_id, self.watch_interval_s, self.watch_gap_s)
        async for _ in changes:
            for message in await self.reads.read(watch.look):
                yield message
            if watch.finished:
                return

    @mapped
    async def ListSites(
        self, request: admin_pb2.ListSitesRequest, context: Any
    ) -> admin_pb2.ListSitesResponse:
        self.guard.admin(context)
        if len(request.page_token) > MAX_ID_CHARS:
            raise InvalidArgument(f"page_token: at most {MAX_ID_CHARS} characters")
        reads = self.reads
        if request.summary_only:

            def counts() -> tuple[int, int]:  # O(sites), and reads the deny list: not here
                return reads.site_counts(self.revoked())

            total, online = await reads.read(counts)
            return admin_pb2.ListSitesResponse(total=total, online=online)

        def page() -> admin_pb2.ListSitesResponse:  # built on a reader thread, not the loop
            # Counted in the same step: each hand-off to a thread and back costs the call
            # a pass of the event loop, which is long while a round's calls arrive.
            revoked = self.revoked()  # at once: offline, whatever it did last
            key = reads.listing_key()
            if key is None:
                return build(revoked)
            asked = (key, request.page_token, request.page_size, revoked)
            with self._listing_lock:
                if asked in self._listings:
                    return self._listings[asked]
            reply = build(revoked)
            with self._listing_lock:
                self._listings[asked] = reply
                while len(self._listings) > _LISTINGS_KEPT:  # the oldest go first
                    del self._listings[next(iter(self._listings))]
            return reply

        def build(revoked: frozenset[str]) -> admin_pb2.ListSitesResponse:
            total, online = reads.site_counts(revoked)
            found, next_token = reads.list_sites(request.page_token, request.page_size)
            sites = [
                admin_pb2.Site(
                    site_id=s.id,
                    tasks=list(s.tasks),
                    online=is_online and s.id not in revoked,
                    registered_unix_s=s.registered_at,
                    last_seen_unix_s=last_seen,
                    version=s.version,
                    revoked=s.id in revoked,
                )
                for s, is_online, last_seen in found
            ]
            return admin_pb2.ListSitesResponse(
                sites=sites, next_page_token=next_token, total=total, online=online
            )

        return await reads.read(page)
