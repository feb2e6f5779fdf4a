"""Building RunStatus messages from stored rows: what `fedra run status` shows."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Protocol

from fedra.coordinator.errors import NotFound, ResourceExhausted
from fedra.coordinator.ledger import DECLINED, PROVENANCE_EVENT, RUN_PROVENANCE_EVENT, idle_s
from fedra.protos import wire
from fedra.protos.serde import runspec_to_proto
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec
from fedra.storage.records import (
    ENDED_ROUND_STATES,
    ParticipationRecord,
    ParticipationState,
    ParticipationTally,
    RoundRecord,
    RoundState,
    RunReads,
    RunRecord,
    RunSummaryView,
    RunView,
)

log = logging.getLogger("fedra.coordinator")


class StatusSource(Protocol):
    """What a run's status is read from: the database, and the few facts only the process
    driving the rounds knows. The engine is one (its memory, read without its lock); the
    operators' read process is another (a snapshot the engine writes: ``replica``)."""

    @property
    def records(self) -> RunReads:
        """The stored runs, read-only."""
        ...

    def waiting_reason(self, run_id: str) -> str:
        """Why a driven run with no round open waits ('' if it does not)."""
        ...

    def downloads_pending(self) -> set[str]:
        """The tasks with a download under way, or finished but not yet written."""
        ...

    def run_phase(self, run_id: str) -> tuple[object, ...]:
        """Where the run stands as a whole (``Engine.run_phase``)."""
        ...

    def settled_before(self) -> float:
        """A round closed before this, with none of its tasks in ``downloads_pending()``
        asked after it, is final (the engine: now; a snapshot: when it was written)."""
        ...


def run_status(
    engine: StatusSource,
    run_id: str,
    insecure: bool = False,
    first_round: int = 0,
    summary: bool = False,
) -> admin_pb2.RunStatus:
    """The run, every round numbered ``first_round`` or higher and every participation of
    them, as stored (``summary``: counted, ``round_summaries``); fails with
    RESOURCE_EXHAUSTED if that is more than one reply holds."""
    rounds = _summed_rounds if summary else _whole_rounds
    read = rounds(engine, run_id, first_round, None, (), math.inf)
    status = run_header(engine, read.run, insecure)
    status.provenance.CopyFrom(run_provenance(engine, read.run, changed_only=summary))
    status.rounds.extend(read.fresh.values())
    size = status.ByteSize()
    if size > wire.MAX_STATUS_BYTES:
        raise ResourceExhausted(
            f"the status of run {run_id} is {size / 2**20:.0f} MiB, more than the "
            f"{wire.MAX_STATUS_BYTES / 2**20:.0f} MiB one reply holds: ask for it in pages "
            "(GetRunRequest.page; fedra's admin client and CLI do)"
        )
    return status


def read_run(engine: StatusSource, run_id: str, since: int, limit: int | None = None) -> RunView:
    view = engine.records.read_run(run_id, since=since, limit=limit)
    if view is None:
        raise NotFound(f"no run {run_id!r}")
    return view


# The rounds of one GetRun page, about (a round bigger than this goes alone).
PAGE_BYTES = 1 << 20
_FIRST_READ_ROUNDS = 8  # a page's first read; later reads are sized by what it has seen
_MAX_READ_ROUNDS = 1024


class FinalRounds:
    """The RoundStatus of each run's rounds that can change no more, kept for GetRun.

    A round is final once it has closed with every participation finished and no
    download of it still to be written (``round_statuses``): from then on its status is
    the same at every read. A page of a long run with thousands of sites then reads and
    builds only the rounds still moving. Safe from any thread.

    Rounds are kept serialized: a parsed RoundStatus takes 4-7 times its encoded size
    (each map and message in an arena of its own), and a page copies what it appends
    either way. At most ``max_bytes`` of them are kept: past that, whole runs go, the
    least recently read first, and a run that alone fills them takes no more rounds
    (what it holds is then about its start, which a reader walking its pages in order
    reads first; the rest is read from the database as it would be without this, and
    not encoded for nothing). Which rounds are final is remembered beyond that, as
    ranges of numbers (``final_until``).
    """

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, _KeptRun] = OrderedDict()
        self._bytes = 0  # of every run's kept rounds

    def from_(self, run_id: str, first: int) -> list[bytes]:
        """The kept rounds numbered ``first``, ``first + 1``, ... (up to the first not
        kept), each as RoundStatus bytes."""
        with self._lock:
            kept = self._runs.get(run_id)
            if kept is None:
                return []
            self._runs.move_to_end(run_id)
            out: list[bytes] = []
            while (r := kept.rounds.get(first + len(out))) is not None:
                out.append(r)
            return out

    def final_until(self, run_id: str, first: int) -> int:
        """The first round from ``first`` on not known to be final (``first`` itself if
        it is not), whether or not the final ones are kept."""
        with self._lock:
            kept = self._runs.get(run_id)
            return first if kept is None else kept.final.end_of_run(first)

    def keep(self, run_id: str, fresh: dict[int, admin_pb2.RoundStatus], final: set[int]) -> None:
        with self._lock:
            kept = self._runs.get(run_id)
            if kept is None:
                kept = self._runs[run_id] = _KeptRun()
            self._runs.move_to_end(run_id)
            for number in final:
                kept.final.add(number)
            if kept.nbytes >= self.max_bytes:  # full with its own rounds: none is encoded
                return
            new = {n: fresh[n] for n in final if n not in kept.rounds}
        if not new:
            return
        encoded = {n: r.SerializeToString() for n, r in new.items()}  # not under the lock
        with self._lock:
            kept = self._runs.get(run_id)
            if kept is None:  # let go meanwhile: kept afresh
                kept = self._runs[run_id] = _KeptRun()
                for number in final:
                    kept.final.add(number)
            self._runs.move_to_end(run_id)
            for number in sorted(encoded):
                size = len(encoded[number])
                if number in kept.rounds or kept.nbytes + size > self.max_bytes:
                    continue  # no room even alone: read from the database, nothing let go
                while self._bytes + size > self.max_bytes:  # other runs go, oldest first
                    oldest = next(iter(self._runs))
                    self._bytes -= self._runs.pop(oldest).nbytes
                kept.rounds[number] = encoded[number]
                kept.nbytes += size
                self._bytes += size


class _Ranges:
    """A set of integers as sorted, disjoint half-open ranges (a run's final rounds: in
    order, so one range or a few)."""

    def __init__(self) -> None:
        self._ranges: list[list[int]] = []

    def add(self, n: int) -> None:
        ranges = self._ranges
        for i, (lo, hi) in enumerate(ranges):
            if lo <= n < hi:
                return
            if n == hi:  # extends this range, and may join the next
                ranges[i][1] = n + 1
                if i + 1 < len(ranges) and ranges[i + 1][0] == n + 1:
                    ranges[i][1] = ranges.pop(i + 1)[1]
                return
            if n == lo - 1:
                ranges[i][0] = n
                return
            if n < lo:
                ranges.insert(i, [n, n + 1])
                return
        ranges.append([n, n + 1])

    def end_of_run(self, first: int) -> int:
        """The first number from ``first`` on not in the set."""
        for lo, hi in self._ranges:
            if lo <= first < hi:
                return hi
        return first


@dataclass
class _KeptRun:
    rounds: dict[int, bytes] = field(default_factory=dict)
    nbytes: int = 0
    final: _Ranges = field(default_factory=_Ranges)


_MAX_LARGE_KEYS = 4096  # SharedPages: keys remembered as large, at most


@dataclass(frozen=True)
class _Page:
    status: admin_pb2.RunStatus
    read_at: float  # when its build began: what it shows is at least this recent
    fresh_for: float  # seconds it answers for
    nbytes: int  # encoded (parsed, a page takes about 4.5 times as much)


@dataclass
class _Flight:
    """A build of a page: queued (a background rebuild not yet begun) or claimed by the
    thread running it. Only a claimed one is waited for: a queued one is taken over."""

    future: Future[admin_pb2.RunStatus] = field(default_factory=Future)
    claimed: bool = False


_MAX_PAGES = 64  # SharedPages: pages kept at most (each up to about PAGE_BYTES)
_MAX_PAGES_BYTES = 24 << 20  # ... and their encoded bytes at most (about 100 MB parsed)


class SharedPages:
    """GetRun pages of a large run, shared by the calls that ask for one at about the
    same time.

    A page of a round that thousands of sites are in reads and builds thousands of
    participations (tens of ms): with operators, dashboards or scrapers asking a few
    times a second, that alone took a tenth of a core or more. A page that read at least
    ``min_participations`` is kept for a moment after it is built (``fresh_for``): for
    ``cost / share`` (its build time over ``share``) up to ``max_age_s``, for
    ``cost / max_share`` where that is longer, and never for more than ``max_stale_s``.
    So building pages takes at most about ``share`` of one thread however often they are
    asked for, ``max_share`` for a round so large that its page costs more than
    ``max_age_s * share`` (a round of 5,000 sites in its third attempt, 15,000
    participations, took 0.3 s to build here, and rebuilt every ``max_age_s`` those
    builds took most of a core), and more only for a build that took longer than
    ``max_stale_s * max_share`` (a pause of the process). Once a key's page was that
    large, the calls that ask while one is being built wait for that build. For as long
    again it still answers (``answer``) while its rebuild runs in the background, so that
    a caller seldom waits for a build. What a page shows is at most ``2 * max_age_s`` old
    (a second) from the start of its build, ``2 * cost / max_share`` for a costlier one
    (2.4 s for that 0.3 s page), and never more than ``2 * max_stale_s`` (10 s); a
    smaller page is built afresh for each call. The caller puts in ``key`` what a page
    must not be kept across (GetRun: the run's phase, so that a cancel and the run's end
    are not hidden by a page of before). Safe from any thread.
    """

    def __init__(
        self,
        share: float = 0.05,
        max_age_s: float = 0.5,
        min_participations: int = 256,
        clock: Callable[[], float] = time.monotonic,
        max_share: float = 0.25,
        max_stale_s: float = 5.0,
    ) -> None:
        if not 0.0 < share <= max_share <= 1.0:
            raise ValueError(f"need 0 < share <= max_share <= 1, got {share} and {max_share}")
        self.share, self.max_age_s, self.max_share = share, max_age_s, max_share
        self.max_stale_s = max(max_age_s, max_stale_s)
        self.min_participations, self.clock = min_participations, clock
        self._lock = threading.Lock()
        self._pages: dict[tuple[object, ...], _Page] = {}
        self._building: dict[tuple[object, ...], _Flight] = {}
        self._large: set[tuple[object, ...]] = set()  # keys whose last page was large

    def fresh_for(self, cost: float) -> float:
        """How long a large page that took ``cost`` seconds to build is kept: never more
        than ``max_stale_s``, however long one build took (a pause of the process)."""
        kept = min(cost / self.share, max(self.max_age_s, cost / self.max_share))
        return min(kept, self.max_stale_s)

    def answer(
        self,
        key: tuple[object, ...],
        build: Callable[[], admin_pb2.RunStatus],
        executor: Executor,
    ) -> admin_pb2.RunStatus | None:
        """The page kept for ``key`` if it may answer now, else None; no wait, no build
        here: for the event loop to answer with, without a hand-off to a reader thread.
        A page past its moment but within as long again answers too, and its rebuild is
        queued on ``executor`` (one at a time), so that the callers that follow get a
        fresh page without waiting for its build."""
        with self._lock:
            page = self._pages.get(key)
            if page is None:
                return None
            age = self.clock() - page.read_at
            if age < page.fresh_for:
                return page.status
            if age >= 2 * page.fresh_for:
                del self._pages[key]
                return None
            if key in self._building:  # its rebuild is under way, or queued
                return page.status
            flight = self._building[key] = _Flight()
        try:
            executor.submit(self._rebuild, key, build, flight)
        except RuntimeError:  # the executor has shut down: the server is stopping
            with self._lock:
                if self._building.get(key) is flight:
                    del self._building[key]
        return page.status

    def get(
        self, key: tuple[object, ...], build: Callable[[], admin_pb2.RunStatus]
    ) -> admin_pb2.RunStatus:
        """The page for ``key``: a kept one that still answers, the one a thread is
        building for a key whose last page was large (waited for), or ``build()``'s
        (which takes over a queued rebuild, so that nobody waits for one not begun)."""
        with self._lock:
            page = self._pages.get(key)
            if page is not None and self.clock() - page.read_at < page.fresh_for:
                return page.status
            flight = self._building.get(key)
            if flight is not None and flight.claimed and key in self._large:
                wait = flight
            else:
                wait = None
                if flight is None or flight.claimed:  # a small page's builds run side by side
                    flight = self._building[key] = _Flight()
                flight.claimed = True
        if wait is not None:
            return wait.future.result()
        return self._build(key, build, flight)

    def _rebuild(
        self, key: tuple[object, ...], build: Callable[[], admin_pb2.RunStatus], flight: _Flight
    ) -> None:
        """A queued rebuild, on the executor: unless a caller took it over meanwhile."""
        with self._lock:
            if flight.claimed:
                return
            flight.claimed = True
        try:
            self._build(key, build, flight)
        except Exception:  # nobody waits for it: the next call builds and sees the error
            log.exception("a background rebuild of a status page of run %s failed", key[0])

    def _build(
        self, key: tuple[object, ...], build: Callable[[], admin_pb2.RunStatus], flight: _Flight
    ) -> admin_pb2.RunStatus:
        try:
            started = self.clock()
            status = build()
            cost = self.clock() - started
            # What its build read: each round's participations, or counted (a summary).
            read = sum(max(len(r.participations), r.sampled_count) for r in status.rounds)
            large = read >= self.min_participations
            nbytes = status.ByteSize() if large else 0  # not under the lock
            with self._lock:
                self._keep(key, _Page(status, started, self.fresh_for(cost), nbytes), large)
            flight.future.set_result(status)
            return status
        except BaseException as exc:
            flight.future.set_exception(exc)
            raise
        finally:
            with self._lock:
                if self._building.get(key) is flight:
                    del self._building[key]

    def _keep(self, key: tuple[object, ...], page: _Page, large: bool) -> None:
        now = self.clock()  # lock held
        for old in [k for k, p in self._pages.items() if now - p.read_at >= 2 * p.fresh_for]:
            del self._pages[old]
        if not large:
            self._large.discard(key)
            self._pages.pop(key, None)
            return
        if len(self._large) >= _MAX_LARGE_KEYS:
            self._large.clear()
        self._large.add(key)
        self._pages[key] = page
        while len(self._pages) > 1 and (
            len(self._pages) > _MAX_PAGES
            or sum(p.nbytes for p in self._pages.values()) > _MAX_PAGES_BYTES
        ):  # the oldest go first
            del self._pages[min(self._pages, key=lambda k: self._pages[k].read_at)]


def run_page(
    engine: StatusSource,
    run_id: str,
    insecure: bool,
    first_round: int,
    page_bytes: int = PAGE_BYTES,
    kept: FinalRounds | None = None,
    summary: bool = False,
) -> admin_pb2.RunStatus:
    """One page of a run's status: whole rounds from ``first_round`` on, about
    ``page_bytes`` of them (at least one), ``more_rounds_follow`` set if more remain
    (``summary``: rounds counted, not listed, ``round_summaries``).

    Rounds are read in batches sized by the rounds read so far to about fill the page,
    so a page costs about what it holds however long the run and however large its
    rounds, and a walk through every page reads each round about once. With ``kept``,
    the rounds it holds (final ones) are not read again, and those found final are kept;
    keep summaries and whole rounds in two.
    """
    rounds = _summed_rounds if summary else _whole_rounds
    cached = kept.from_(run_id, first_round) if kept is not None else []
    # A download finished but not yet written may change its round: asked before the
    # read, and after the moment before which a closed round may be final (a round
    # closed later may have a download that began after the pending ones were asked).
    settled_before = engine.settled_before() if kept is not None else math.inf
    pending = engine.downloads_pending() if kept is not None else set()
    status: admin_pb2.RunStatus | None = None
    size, since, batch, read = 0, first_round + len(cached), _FIRST_READ_ROUNDS, 0
    while True:
        got = rounds(engine, run_id, since, batch, pending, settled_before)
        if status is None:
            status = run_header(engine, got.run, insecure)
            # Every page says what the run's results come from (a client's first page may
            # start at any round): a few rows of the ledger.
            status.provenance.CopyFrom(run_provenance(engine, got.run, changed_only=summary))
            for encoded in cached:
                if status.rounds and size + len(encoded) > page_bytes:
                    status.more_rounds_follow = True
                    return status
                status.rounds.add().MergeFromString(encoded)
                size += len(encoded)
        if kept is not None:
            kept.keep(run_id, got.fresh, got.final)
        for r in got.fresh.values():
            if status.rounds and size + r.ByteSize() > page_bytes:
                status.more_rounds_follow = True
                return status
            status.rounds.append(r)
            size += r.ByteSize()
        if not got.more or not got.fresh:
            return status
        read += len(got.fresh)
        since = max(got.fresh) + 1
        per_round = max(1, size // read)
        batch = max(1, min((page_bytes - size) // per_round + 1, _MAX_READ_ROUNDS))


@dataclass(frozen=True)
class _Read:
    """Rounds read for a status: by number, and the numbers of the final ones."""

    run: RunRecord
    fresh: dict[int, admin_pb2.RoundStatus]
    final: set[int]
    more: bool  # rounds after these exist


def _whole_rounds(
    engine: StatusSource,
    run_id: str,
    since: int,
    limit: int | None,
    pending: Collection[str],
    settled_before: float,
) -> _Read:
    view = read_run(engine, run_id, since, limit)
    fresh, final = round_statuses(view, pending, settled_before)
    return _Read(view.run, fresh, final, view.more_rounds)


def _summed_rounds(
    engine: StatusSource,
    run_id: str,
    since: int,
    limit: int | None,
    pending: Collection[str],
    settled_before: float,
) -> _Read:
    view = engine.records.read_run_summary(
        run_id, since=since, limit=limit, flag_error=DECLINED, tasks=pending
    )
    if view is None:
        raise NotFound(f"no run {run_id!r}")
    fresh, final = round_summaries(view, settled_before)
    return _Read(view.run, fresh, final, view.more_rounds)


# The rounds of one WatchRun message, at most (one round bigger than this goes alone).
WATCH_MESSAGE_BYTES = 1 << 20


class RunWatch:
    """The successive RunStatus messages of one WatchRun stream.

    Each look reads from the database only the rounds that can still change: those from
    the first round that is not yet final (closed, every participation finished) onwards.
    Rounds below it were sent already and never change again, so a watch's cost per
    change stays flat however long the run. With ``changed_rounds_only`` a look's rounds
    are only those new or changed since the last look (the first look's: all of them),
    spread over messages of about ``message_bytes`` each: a long run with many sites
    never needs one message larger than a client accepts.
    """

    def __init__(
        self,
        engine: StatusSource,
        run_id: str,
        insecure: bool,
        changed_rounds_only: bool,
        message_bytes: int = WATCH_MESSAGE_BYTES,
        summary: bool = False,
    ) -> None:
        self.engine, self.run_id, self.insecure = engine, run_id, insecure
        self.changed_rounds_only = changed_rounds_only
        self.summary = summary  # rounds counted, not listed (``round_summaries``)
        self.message_bytes = message_bytes
        self.sent: dict[int, admin_pb2.RoundStatus] = {}  # by number: the rounds to send whole
        self.floor = 0  # every round numbered below this is final, and was sent as such
        self.settled: set[int] = set()  # final at the last look, with no download pending
        self.header: admin_pb2.RunStatus | None = None  # the last message, without rounds
        self.finished = False  # the run has ended: nothing follows the last message

    def look(self) -> list[admin_pb2.RunStatus]:
        """The next messages: none when nothing changed since the last look."""
        engine = self.engine
        if self.summary:  # the read asks after the pending downloads: asked before it,
            # and after the moment before which a closed round may be final (run_page)
            settled_before = engine.settled_before()
            pending = engine.downloads_pending()
            got = _summed_rounds(engine, self.run_id, self.floor, None, pending, settled_before)
            run, fresh, final = got.run, got.fresh, got.final
        else:
            view = read_run(engine, self.run_id, self.floor)
            # A finished download is written a moment later (DownloadLedger): a round with
            # a download pending may change yet. Asked after the read, so that a round
            # settled now was read after its last write; it is passed over at the next
            # look, once this look has sent it.
            pending, settled_before = engine.downloads_pending(), engine.settled_before()
            run = view.run
            fresh, final = round_statuses(view, pending, settled_before)
        self.finished = run.finished
        header = run_header(engine, run, self.insecure, self.header)
        changed = [r for n, r in fresh.items() if self.sent.get(n) != r]
        out: list[admin_pb2.RunStatus] = []
        if self.header is None or changed or header != self.header:
            first = self.header is None
            self.header = header
            self.sent.update(fresh)
            if self.changed_rounds_only:
                out = self._batches(header, list(self.sent.values()) if first else changed)
            else:
                out = [_with_rounds(header, [self.sent[n] for n in sorted(self.sent)])]
        while self.floor in self.settled:  # sent as final already: never read again
            if self.changed_rounds_only:  # nor sent: no need to keep it
                del self.sent[self.floor]
            self.floor += 1
        self.settled = final
        return out

    def _batches(
        self, header: admin_pb2.RunStatus, rounds: list[admin_pb2.RoundStatus]
    ) -> list[admin_pb2.RunStatus]:
        """``rounds`` in order, over as few messages of about ``message_bytes`` as they fit."""
        out: list[admin_pb2.RunStatus] = []
        batch: list[admin_pb2.RoundStatus] = []
        size = 0
        for r in sorted(rounds, key=lambda r: r.number):
            if batch and size + r.ByteSize() > self.message_bytes:
                out.append(_with_rounds(header, batch, more_rounds_follow=True))
                batch, size = [], 0
            batch.append(r)
            size += r.ByteSize()
        out.append(_with_rounds(header, batch))  # no rounds changed: the header alone
        return out


def _with_rounds(
    header: admin_pb2.RunStatus,
    rounds: list[admin_pb2.RoundStatus],
    more_rounds_follow: bool = False,
) -> admin_pb2.RunStatus:
    status = admin_pb2.RunStatus()
    status.CopyFrom(header)
    status.rounds.extend(rounds)
    status.more_rounds_follow = more_rounds_follow
    return status


_PROVENANCE_KINDS = (PROVENANCE_EVENT, RUN_PROVENANCE_EVENT)
_provenance_lock = threading.Lock()
# By (store, run): the latest provenance event read, and what was built from the events
# (every site's, and only the changed ones').
_provenance: weakref.WeakKeyDictionary[
    RunReads,
    OrderedDict[str, tuple[int, admin_pb2.RunProvenance, admin_pb2.RunProvenance]],
]
_provenance = weakref.WeakKeyDictionary()
_PROVENANCE_KEPT = 64


def run_provenance(
    engine: StatusSource, record: RunRecord, changed_only: bool = False
) -> admin_pb2.RunProvenance:
    """What the run's results come from: its spec's digest, the fedra that drove it, and
    each site's provenance as of its latest accepted update (flagged ``changed`` if it
    differs from the site's earlier ones; ``changed_only``: only those sites), from the
    run's ledger. Built again only once the ledger has a provenance event it was not
    built from (a page of a 1,000-site run otherwise read and parsed a thousand events
    each time). Shared: copy it, never change it."""
    store, key = engine.records, record.id
    last = store.last_event_id(record.id, _PROVENANCE_KINDS)
    with _provenance_lock:
        runs = _provenance.setdefault(store, OrderedDict())
        kept = runs.get(key)
        if kept is not None and kept[0] == last:
            runs.move_to_end(key)
            return kept[2] if changed_only else kept[1]
    whole = _build_provenance(engine, record)
    changed = admin_pb2.RunProvenance(
        spec_sha256=whole.spec_sha256, coordinator_version=whole.coordinator_version
    )
    changed.sites.extend(p for p in whole.sites if p.changed)
    with _provenance_lock:
        runs[key] = (last, whole, changed)
        while len(runs) > _PROVENANCE_KEPT:
            runs.popitem(last=False)
    return changed if changed_only else whole


def _build_provenance(engine: StatusSource, record: RunRecord) -> admin_pb2.RunProvenance:
    out = admin_pb2.RunProvenance(spec_sha256=hashlib.sha256(record.spec_json.encode()).hexdigest())
    sites: dict[str, admin_pb2.SiteProvenance] = {}
    digests: dict[str, set[str]] = {}
    for e in engine.records.list_events(record.id, _PROVENANCE_KINDS):
        d = e.data
        if e.kind == RUN_PROVENANCE_EVENT:
            out.coordinator_version = str(d.get("coordinator_version", ""))
            continue
        site = str(d.get("site", ""))
        seen = digests.setdefault(site, set())
        seen.add(str(d.get("digest", "")))
        p = admin_pb2.SiteProvenance(
            site_id=site, changed=len(seen) > 1, since_round=e.round_number or 0
        )
        for key in ("entry_point", "task_version", "task_source_sha256", "data_fingerprint",
                    "config_sha256", "device"):  # fmt: skip
            setattr(p.provenance, key, str(d.get(key, "")))
        p.provenance.versions.update(json.loads(str(d.get("versions", "{}"))))
        sites[site] = p
    out.sites.extend(sites[s] for s in sorted(sites))
    return out


def run_header(
    engine: StatusSource,
    record: RunRecord,
    insecure: bool,
    previous: admin_pb2.RunStatus | None = None,
) -> admin_pb2.RunStatus:
    """The run's status without its rounds (the spec taken from ``previous`` if given:
    it never changes): what ListRuns sends."""
    reason = engine.waiting_reason(record.id) or record.reason
    if previous is not None:
        spec = previous.spec
    else:
        spec = runspec_to_proto(RunSpec.from_json(record.spec_json))
    return admin_pb2.RunStatus(
        run_id=record.id,
        spec=spec,
        state=record.state,
        reason=reason,
        rounds_completed=record.rounds_completed,
        created_unix_s=record.created_at,
        updated_unix_s=record.updated_at,
        coordinator_insecure=insecure,
    )


def round_statuses(
    view: RunView, pending: Collection[str] = (), settled_before: float = math.inf
) -> tuple[dict[int, admin_pb2.RoundStatus], set[int]]:
    """The view's rounds by number, and the numbers of those that are final: closed, with
    every participation finished (an async run's task still training moves on to the
    next round, so its round is not final until it has) and none of its tasks in
    ``pending`` (a download whose row is still to be written), closed before
    ``settled_before``."""
    ckpts = {c.round_number: c.model_sha256 for c in view.checkpoints}
    by_round: dict[int, list[ParticipationRecord]] = {}
    for p in view.participations:
        by_round.setdefault(p.round_number, []).append(p)
    out, final = {}, set()
    for r in view.rounds:
        mine = by_round.get(r.number, [])
        tallies = tally(mine)
        held = any(p.task_id in pending for p in mine)
        if _final(r, tallies, held, settled_before):
            final.add(r.number)
        status = _round(r, tallies, site_idle_s(r, mine), ckpts)
        status.sampled_sites.extend(r.sampled)
        status.participations.extend(_participation(p) for p in mine)
        out[r.number] = status
    return out, final


def round_summaries(
    view: RunSummaryView, settled_before: float = math.inf
) -> tuple[dict[int, admin_pb2.RoundStatus], set[int]]:
    """``round_statuses`` of a view counted by the database: each round as
    ``round_statuses`` builds it, less its ``participations`` and ``sampled_sites``
    (``sampled_count`` and ``participation_counts`` say how many)."""
    ckpts = {c.round_number: c.model_sha256 for c in view.checkpoints}
    tallies: dict[int, list[ParticipationTally]] = {}
    for t in view.tallies:
        tallies.setdefault(t.round_number, []).append(t)
    out, final = {}, set()
    for r in view.rounds:
        mine = tallies.get(r.number, [])
        if _final(r, mine, r.number in view.held, settled_before):
            final.add(r.number)
        out[r.number] = _round(r, mine, view.idle.get(r.number, 0.0), ckpts)
    return out, final


def tally(parts: list[ParticipationRecord]) -> list[ParticipationTally]:
    """The participations counted and summed per round, attempt, state and whether the
    site declined, as ``Store.read_run_summary`` counts them with ``flag_error=DECLINED``."""
    sums: dict[tuple[int, int, ParticipationState, bool], list[int]] = {}
    for p in parts:
        key = (p.round_number, p.attempt, p.state, p.error.startswith(DECLINED))
        row = sums.setdefault(key, [0, 0, 0, 0])
        row[0] += 1
        row[1] += p.bytes_down
        row[2] += p.bytes_up
        row[3] += p.bytes_cut
    return [ParticipationTally(*key, *row) for key, row in sums.items()]


def _final(
    r: RoundRecord, tallies: list[ParticipationTally], held: bool, settled_before: float
) -> bool:
    settled = r.state != RoundState.OPEN and (r.closed_at or 0.0) < settled_before
    return settled and not held and all(t.finished for t in tallies)


IDLE_DIGITS = 6  # of a round's mean idle seconds shown


def _round(
    r: RoundRecord, tallies: list[ParticipationTally], idle: float, ckpts: dict[int, str]
) -> admin_pb2.RoundStatus:
    """The round's figures from its participations' tallies and its sites' idle time
    (``site_idle_s``): no rows."""
    counts: dict[str, int] = {}
    for t in tallies:
        if t.attempt == r.attempt:
            shown = shown_status(t.state, t.flagged)
            counts[shown] = counts.get(shown, 0) + t.count
    closed = r.closed_at or 0.0
    cut = sum(t.bytes_cut for t in tallies)
    return admin_pb2.RoundStatus(
        number=r.number,
        attempt=r.attempt,
        status=r.state,
        sampled_count=len(r.sampled),
        updates=counts.get(ParticipationState.ACCEPTED, 0),
        opened_unix_s=r.opened_at,
        closed_unix_s=closed,
        duration_s=max(0.0, closed - r.opened_at) if closed else 0.0,
        bytes_down=sum(t.bytes_down for t in tallies),
        bytes_up=sum(t.bytes_up for t in tallies),
        metrics=r.metrics,
        model_sha256=ckpts.get(r.number, ""),
        stages=r.stages,
        lost_bytes=sum(t.bytes_down + t.bytes_up for t in tallies if _lost(r, t)) + cut,
        # To the microsecond: a mean the database works out may differ in its last bits
        # between two reads (the order of its sum), and a watch would send it again.
        site_idle_s=round(idle, IDLE_DIGITS),
        cut_bytes=cut,
        participation_counts=counts,
    )


def shown_status(state: ParticipationState, declined: bool) -> str:
    """A task's state as status shows it: one the site's policy declined is not a failure
    of the site, and is said as such."""
    return "declined" if state == ParticipationState.FAILED and declined else str(state)


def _lost(r: RoundRecord, p: ParticipationTally) -> bool:
    """Whether a participation's work (and the bytes it moved) can no longer count.

    A task still under way (an open round's, or an async task carried on past its
    round's commit) is not lost yet. Between a failed attempt and the next one's opening
    the round still shows the failed attempt, whose accepted updates count as lost only
    once the next attempt opens (or the run ends)."""
    if r.state in ENDED_ROUND_STATES:  # the round its run ended in: nothing counts
        return True
    if p.attempt < r.attempt:  # an attempt that failed: dropped, whatever its state
        return True
    return p.finished and p.state != ParticipationState.ACCEPTED  # failed or expired


def site_idle_s(r: RoundRecord, parts: list[ParticipationRecord]) -> float:
    """A committed round: the mean time a site whose update it accepted sat idle
    (``rounds.idle_s``); 0 for any other round."""
    if r.state != RoundState.COMMITTED or not r.closed_at:
        return 0.0
    accepted = [
        p for p in parts if p.attempt == r.attempt and p.state == ParticipationState.ACCEPTED
    ]
    return idle_s(r.opened_at, r.closed_at, accepted)


def _participation(p: ParticipationRecord) -> admin_pb2.Participation:
    return admin_pb2.Participation(
        site_id=p.site_id,
        attempt=p.attempt,
        status=shown_status(p.state, p.error.startswith(DECLINED)),
        num_samples=p.num_samples,
        bytes_down=p.bytes_down,
        bytes_up=p.bytes_up,
        bytes_cut=p.bytes_cut,
        download_s=p.download_s,
        upload_s=p.upload_s,
        metrics=p.metrics,
        error=p.error,
    )
