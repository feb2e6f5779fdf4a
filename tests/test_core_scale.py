"""The event-driven core's parts: waiting without threads, group commit, paged reads
that never wait for the engine's lock."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from fedra.coordinator.commits import GroupCommit
from fedra.coordinator.engine import EngineSettings
from fedra.coordinator.wakeups import Wakeups, site_key
from fedra.protos.v1 import admin_pb2, site_pb2
from fedra.runspec import RunSpec
from fedra.storage import Store
from fedra.storage.records import ParticipationState
from fedra.storage.store import DuplicateError
from tests.conftest import InProcessCoordinator

if TYPE_CHECKING:
    from fedra.coordinator.engine import Engine

TASK = "fedra.examples.synthetic:task"


# -- wakeups -----------------------------------------------------------------------


def test_a_wake_between_the_look_and_the_wait_is_not_lost() -> None:
    board = Wakeups()

    async def main() -> tuple[bool, bool, float]:
        ticket = board.ticket(site_key("a"))  # taken before looking
        board.wake([site_key("a")])  # what it waits for happens before it waits
        started = time.monotonic()
        woken = await ticket.wait(5.0)
        other = await board.ticket(site_key("b")).wait(0.05)  # nobody wakes b
        return woken, other, time.monotonic() - started

    woken, other, took = asyncio.run(main())
    assert woken and not other and took < 1.0
    assert board.waiting() == 0  # spent tickets are gone


def test_a_wake_from_another_thread_wakes_only_its_key() -> None:
    board = Wakeups()

    async def main() -> list[bool]:
        tickets = [board.ticket(site_key(s)) for s in ("a", "b", "c")]
        assert board.waiting() == 3
        threading.Timer(0.05, lambda: board.wake([site_key("b")])).start()
        return list(await asyncio.gather(*(t.wait(0.5) for t in tickets)))

    assert asyncio.run(main()) == [False, True, False]


def test_a_wake_of_many_sets_them_a_slice_a_pass_so_other_calls_get_in_between() -> None:
    from fedra.coordinator.wakeups import WAKE_SLICE

    board, many = Wakeups(), 3 * WAKE_SLICE + 5

    async def main() -> tuple[int, list[bool]]:
        loop = asyncio.get_running_loop()
        tickets = [board.ticket(site_key(f"s{i}")) for i in range(many)]
        seen: list[int] = []
        probe = asyncio.Event()

        def look() -> None:  # a call that arrived just after the wake
            seen.append(sum(t._future.done() for t in tickets))
            probe.set()

        # The wake, then a call that arrives at once: both reach the loop's queue together.
        assert board.wake([site_key(f"s{i}") for i in range(many)]) == many
        loop.call_soon(look)
        await asyncio.wait_for(probe.wait(), 5)
        return seen[0], list(await asyncio.gather(*(t.wait(5) for t in tickets)))

    first_look, woken = asyncio.run(main())
    assert first_look == WAKE_SLICE  # served after one slice, not after all of them
    assert all(woken) and board.waiting() == 0


def test_a_loop_inbox_hands_over_once_and_runs_a_slice_a_pass() -> None:
    from fedra.coordinator.wakeups import INBOX_SLICE, LoopInbox

    many = 3 * INBOX_SLICE + 5

    async def main() -> tuple[list[int], int, list[int]]:
        loop = asyncio.get_running_loop()
        inbox, ran, handovers = LoopInbox(loop), [], []
        plain = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            handovers.append(1)
            return plain(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        finished = asyncio.Event()
        seen: list[int] = []

        def put_all() -> None:  # a group commit's thread completing a batch
            for i in range(many):
                inbox.put(functools.partial(ran.append, i))
            inbox.put(lambda: loop.call_soon(finished.set))

        # While the loop is busy (here: blocked until the thread is done), as in a burst.
        thread = threading.Thread(target=put_all)
        thread.start()
        thread.join()
        loop.call_soon_threadsafe = plain  # type: ignore[method-assign]
        loop.call_soon(lambda: seen.append(len(ran)))  # a call arriving meanwhile
        await asyncio.wait_for(finished.wait(), 5)
        return ran, len(handovers), seen

    ran, handovers, seen = asyncio.run(main())
    assert ran == list(range(many))  # all of them, in order
    assert handovers == 1  # one hand-over for the whole batch
    assert seen[0] <= INBOX_SLICE  # served after a slice at most, not after all of them


def test_a_loop_inbox_step_that_fails_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedra.coordinator.wakeups import LoopInbox

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        inbox, ran = LoopInbox(loop), []
        first, second = asyncio.Event(), asyncio.Event()
        inbox.put(lambda: ran.append("first"))
        inbox.put(lambda: 1 / 0)
        inbox.put(lambda: ran.append("after"))
        inbox.put(first.set)
        await asyncio.wait_for(first.wait(), 5)
        inbox.put(lambda: ran.append("again"))  # the inbox still hands over
        inbox.put(second.set)
        await asyncio.wait_for(second.wait(), 5)
        return ran

    assert asyncio.run(main()) == ["first", "after", "again"]
    assert "a step handed to the event loop failed" in caplog.text


def test_an_inbox_of_a_closed_loop_refuses_each_step() -> None:
    from fedra.coordinator.wakeups import LoopInbox

    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        inbox.put(lambda: None)
    with pytest.raises(RuntimeError):  # not left "scheduled": it tries again, and says so
        inbox.put(lambda: None)


def test_an_inbox_whose_loop_closed_with_a_drain_due_still_refuses() -> None:
    from fedra.coordinator.wakeups import LoopInbox

    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    inbox.put(lambda: None)  # a drain is due, and never runs: the loop closes first
    loop.close()
    with pytest.raises(RuntimeError):  # not queued behind a drain that will never come
        inbox.put(lambda: None)


def test_a_call_still_queued_when_the_front_door_closes_ends_at_once() -> None:
    from fedra.coordinator.api import CoordinatorAPI

    api = CoordinatorAPI(None, workers=1)  # type: ignore[arg-type]  # call() needs no engine
    began, release = threading.Event(), threading.Event()

    def busy() -> str:
        began.set()
        release.wait(10)
        return "done"

    async def main() -> tuple[str, bool]:
        first = asyncio.ensure_future(api.call(busy))
        await asyncio.to_thread(began.wait, 10)
        queued = asyncio.ensure_future(api.call(lambda: "never begun"))
        await asyncio.sleep(0)  # it is submitted, behind the busy one
        api.close()  # the daemon stopping: what has not begun is cancelled
        release.set()
        try:
            await asyncio.wait_for(queued, 5)
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        return await asyncio.wait_for(first, 5), cancelled

    assert asyncio.run(main()) == ("done", True)


def test_closing_wakes_everyone_now_and_later() -> None:
    board = Wakeups()

    async def main() -> tuple[bool, bool]:
        ticket = board.ticket(site_key("a"))
        board.close()
        return await ticket.wait(5.0), await board.ticket(site_key("z")).wait(5.0)

    assert asyncio.run(main()) == (True, True)


# -- group commit --------------------------------------------------------------------


def _store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'fedra.db'}")


def _timed_engine(tmp_path: Path, now: list[float], site_timeout_s: float) -> Engine:
    """An engine (not started) on ``tmp_path`` whose clock reads ``now[0]``."""
    from fedra.coordinator.engine import Engine
    from fedra.storage import BlobStore

    settings = EngineSettings(site_timeout_s=site_timeout_s)
    m, u = BlobStore(tmp_path / "m"), BlobStore(tmp_path / "u")
    return Engine(_store(tmp_path), m, u, settings, lambda: now[0])


def test_concurrent_writes_share_commits_and_each_is_durable_when_it_returns(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    commits = GroupCommit(store)
    try:
        sites = [f"site-{i:03d}" for i in range(200)]

        def register(site: str) -> bool:
            commits.write(store.upsert_site_op(site, ["t"], "1", 1.0))
            return any(s.id == site for s in store.list_sites(after=site[:-1], limit=20))

        with ThreadPoolExecutor(32) as pool:
            durable = list(pool.map(register, sites))
        assert all(durable)  # each was in the database when its write returned
        assert commits.writes == 200
        assert commits.batches < 200  # writes waiting together went in one transaction
    finally:
        commits.close()
        store.close()


def test_a_write_after_a_quiet_spell_commits_at_once_and_a_stream_shares_commits(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    commits = GroupCommit(store, min_interval_s=0.3)
    try:
        started = time.monotonic()
        commits.write(store.upsert_site_op("site-first", ["t"], "1", 1.0))
        assert time.monotonic() - started < 0.25  # nothing before it: not held back
        # A stream right behind it: one write every 10 ms, none waited for in between.
        stream = []
        for i in range(10):
            stream.append(commits.submit(store.upsert_site_op(f"site-{i}", ["t"], "1", 1.0)))
            time.sleep(0.01)
        for done in stream:
            done.result(5)
        assert commits.writes == 11
        assert commits.batches <= 3  # the first, the one behind it, then the rest together
        assert len(store.list_sites()) == 11
    finally:
        commits.close()
        store.close()


def test_a_refused_write_is_undone_alone_and_its_batch_commits(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        fine = store.upsert_site_op("site-a", ["t"], "1", 1.0)

        def refused(_: object) -> None:
            raise DuplicateError("no")

        errors = store.write_batch([refused, fine])
        assert isinstance(errors[0], DuplicateError) and errors[1] is None
        assert [s.id for s in store.list_sites()] == ["site-a"]
    finally:
        store.close()


def test_a_failed_batch_fails_every_write_in_it_and_writes_none(tmp_path: Path) -> None:
    store = _store(tmp_path)
    commits = GroupCommit(store)
    try:
        gate = threading.Event()

        def slow(_: object) -> None:  # holds the writer while the next two queue up
            gate.wait(5)

        def broken(_: object) -> None:
            raise RuntimeError("disk on fire")

        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(commits.write, slow)
            time.sleep(0.1)
            second = pool.submit(commits.write, store.upsert_site_op("site-b", ["t"], "1", 1.0))
            third = pool.submit(commits.write, broken)
            time.sleep(0.1)
            gate.set()
            first.result(5)
            with pytest.raises(RuntimeError, match="disk on fire"):
                third.result(5)
            with pytest.raises(RuntimeError, match="disk on fire"):
                second.result(5)  # in the same batch: not written either
        assert store.list_sites() == []
    finally:
        commits.close()
        store.close()


# -- reads -----------------------------------------------------------------------------


@pytest.fixture
def coordinator(tmp_path: Path) -> InProcessCoordinator:
    c = InProcessCoordinator(tmp_path / "state", EngineSettings(site_timeout_s=60.0))
    yield c  # type: ignore[misc]
    c.close()


def _register(c: InProcessCoordinator, *sites: str) -> None:
    for site in sites:
        c.site.Register(site_pb2.RegisterRequest(site_id=site, tasks=[TASK], version="1"))


def test_the_site_list_pages_and_counts(coordinator: InProcessCoordinator) -> None:
    from fedra.admin import AdminClient

    sites = [f"site-{i}" for i in range(7)]
    _register(coordinator, *sites)
    pages = []
    token = ""
    while True:
        page = coordinator.admin.ListSites(
            admin_pb2.ListSitesRequest(page_size=3, page_token=token), timeout=10
        )
        pages.append([s.site_id for s in page.sites])
        assert (page.total, page.online) == (7, 7)
        token = page.next_page_token
        if not token:
            break
    assert pages == [sites[:3], sites[3:6], sites[6:]]
    summary = coordinator.admin.ListSites(admin_pb2.ListSitesRequest(summary_only=True))
    assert (len(summary.sites), summary.total, summary.online) == (0, 7, 7)
    admin = AdminClient(coordinator.address)
    try:
        assert [s.site_id for s in admin.sites(page_size=2)] == sites
        assert admin.site_counts() == (7, 7)
    finally:
        admin.close()
    with pytest.raises(grpc.RpcError) as info:
        coordinator.admin.ListSites(admin_pb2.ListSitesRequest(page_token="x" * 500))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in (info.value.details() or "")


def test_status_and_site_list_answer_while_the_engine_lock_is_held(
    coordinator: InProcessCoordinator,
) -> None:
    """Reads go to the database and to liveness in memory: a round holding the engine's
    lock (a long commit, say) does not hold up an operator's status or site list."""
    _register(coordinator, "site-a", "site-b")
    spec = RunSpec(name="r", task=TASK, rounds=1, sites_per_round=5, min_sites=5).validate()
    run_id, _ = coordinator.engine.submit(spec)  # waits for sites it will not get
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with coordinator.engine._lock:
            held.set()
            release.wait(20)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        listed = coordinator.admin.ListSites(admin_pb2.ListSitesRequest(), timeout=5)
        status = coordinator.admin.GetRun(admin_pb2.GetRunRequest(run_id=run_id), timeout=5)
        runs = coordinator.admin.ListRuns(admin_pb2.ListRunsRequest(), timeout=5)
        assert time.monotonic() - started < 3
        assert [s.site_id for s in listed.sites] == ["site-a", "site-b"]
        assert status.run_id == run_id and [r.run_id for r in runs.runs] == [run_id]
    finally:
        release.set()
        holder.join(10)


# -- task states -----------------------------------------------------------------------


def test_a_task_moves_only_where_its_state_machine_goes() -> None:
    from fedra.coordinator.state import Assignment, IllegalMove, TaskState

    a = Assignment("t", "site-a")
    assert a.state is TaskState.ASSIGNED and a.state == "assigned" and a.pending
    a.move(TaskState.DOWNLOADED)
    a.move(TaskState.UPLOADING)
    a.move(a.before_upload)  # an upload cut short gives the task back as it was
    assert a.state is TaskState.DOWNLOADED
    a.move(TaskState.UPLOADING)
    a.move(TaskState.ACCEPTED)
    assert a.final and not a.pending
    for to in TaskState:
        with pytest.raises(IllegalMove, match="accepted ->"):
            a.move(to)  # final: nothing moves it again
    b = Assignment("u", "site-b")
    with pytest.raises(IllegalMove):
        b.move(TaskState.ACCEPTED)  # only an update that arrived is accepted
    b.restore(ParticipationState.ACCEPTED)  # as the database has it, after a restart
    assert b.state is TaskState.ACCEPTED
    with pytest.raises(IllegalMove, match="restored twice"):
        b.restore("failed")


def test_heartbeats_are_written_in_batches_every_few_seconds(tmp_path: Path) -> None:
    """Liveness is kept in memory and written (one statement for every site, nobody
    waiting on it) at most every LIVENESS_WRITE_S: it survives a crash that close misses."""
    from fedra.coordinator.engine import LIVENESS_WRITE_S, Engine
    from fedra.storage import BlobStore

    now = [1000.0]
    store = _store(tmp_path)
    engine = Engine(
        store, BlobStore(tmp_path / "m"), BlobStore(tmp_path / "u"), clock=lambda: now[0]
    )
    try:
        engine.register("site-a", [TASK], "1")
        engine.register("site-b", [TASK], "1")
        now[0] += 1.0
        engine.seen("site-a")  # too soon: in memory only
        assert {s.id: s.last_seen_at for s in store.list_sites()} == {
            "site-a": 1000.0,
            "site-b": 1000.0,
        }
        now[0] += LIVENESS_WRITE_S
        engine.seen("site-b")
        deadline = time.monotonic() + 10
        while {s.id: s.last_seen_at for s in store.list_sites()} != {
            "site-a": 1001.0,
            "site-b": now[0],
        }:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.commits.close()
        engine.downloads.close()
        store.close()


def test_a_site_with_a_transfer_under_way_is_online_however_long_it_takes(
    tmp_path: Path,
) -> None:
    """A busy coordinator may take longer than the liveness timeout to move a site's
    bytes: the site is not failed as silent meanwhile (a stalled transfer is the edge's
    watchdog's to end, which asks ``site_heard``, leaving transfers out)."""
    from fedra.coordinator.engine import Engine
    from fedra.storage import BlobStore

    now = [1000.0]
    store = _store(tmp_path)
    settings = EngineSettings(site_timeout_s=20.0)
    engine = Engine(
        store, BlobStore(tmp_path / "m"), BlobStore(tmp_path / "u"), settings, lambda: now[0]
    )
    try:
        engine.register("site-a", [TASK], "1")
        engine.transfer("site-a", True)
        now[0] += 60.0
        assert engine.site_online("site-a") and not engine.site_heard("site-a")
        engine.transfer("site-a", False)  # its end is news from the site
        now[0] += 10.0
        assert engine.site_online("site-a")
        now[0] += 11.0
        assert not engine.site_online("site-a")
    finally:
        engine.commits.close()
        engine.downloads.close()
        store.close()


def _numbers(kept: list[bytes]) -> list[int]:
    return [admin_pb2.RoundStatus.FromString(b).number for b in kept]


def test_the_final_rounds_kept_are_bounded_by_bytes() -> None:
    from fedra.coordinator.status import FinalRounds

    kept = FinalRounds(max_bytes=100)
    big = {0: admin_pb2.RoundStatus(number=0, status="x" * 80)}
    kept.keep("run-a", big, {0})
    assert _numbers(kept.from_("run-a", 0)) == [0]
    kept.keep("run-b", big, {0})  # over the bound: the least recently read run goes
    assert kept.from_("run-a", 0) == [] and _numbers(kept.from_("run-b", 0)) == [0]
    kept.keep("run-b", {1: admin_pb2.RoundStatus(number=1)}, set())  # not final: not kept
    assert _numbers(kept.from_("run-b", 0)) == [0]
    assert kept.final_until("run-b", 0) == 1


def test_one_long_run_keeps_no_more_than_the_bound() -> None:
    # A run of thousands of rounds, read page after page: what it keeps stays under the
    # bound (its first rounds), and which rounds are final is still known past it.
    from fedra.coordinator.status import FinalRounds

    kept = FinalRounds(max_bytes=10_000)
    rounds = {
        n: admin_pb2.RoundStatus(
            number=n,
            metrics={"loss": 0.5},
            participations=[admin_pb2.Participation(site_id=f"s{i}") for i in range(4)],
        )
        for n in range(2_000)
    }
    size = rounds[1].ByteSize()
    for first in range(0, 2_000, 100):
        page = {n: rounds[n] for n in range(first, first + 100)}
        kept.keep("run", page, set(page) - {1_999})  # the last round is still open
    held = kept.from_("run", 0)
    assert sum(map(len, held)) <= 10_000 < sum(map(len, held)) + size  # full, not over
    assert _numbers(held) == list(range(len(held)))  # the start of the run, in order
    assert [admin_pb2.RoundStatus.FromString(b) for b in held] == [
        rounds[n] for n in range(len(held))
    ]
    assert kept.from_("run", len(held)) == []
    assert kept.final_until("run", 0) == 1_999
    assert kept.final_until("run", 1_500) == 1_999
    assert kept.final_until("run", 1_999) == 1_999


def test_a_round_that_cannot_fit_lets_no_other_run_go() -> None:
    from fedra.coordinator.status import FinalRounds

    kept = FinalRounds(max_bytes=200)
    kept.keep("b", {0: admin_pb2.RoundStatus(number=0, status="x" * 10)}, {0})
    kept.keep("a", {0: admin_pb2.RoundStatus(number=0, status="x" * 150)}, {0})
    big = {1: admin_pb2.RoundStatus(number=1, status="x" * 100)}
    kept.keep("a", big, {1})  # 150 + 100 > 200 even alone: turned away, and b stays
    assert _numbers(kept.from_("a", 0)) == [0] and _numbers(kept.from_("b", 0)) == [0]
    assert kept.final_until("a", 0) == 2 and kept.final_until("b", 0) == 1
    small = {2: admin_pb2.RoundStatus(number=2, status="x" * 40)}
    kept.keep("a", small, {2})  # fits once b goes: b, the least recently read, goes
    assert _numbers(kept.from_("a", 2)) == [2] and kept.from_("b", 0) == []


def test_final_ranges_join_out_of_order() -> None:
    from fedra.coordinator.status import FinalRounds

    kept = FinalRounds(max_bytes=0)  # keeps no round, only which are final
    for n in (5, 7, 0, 1, 6, 3, 2):
        kept.keep("run", {n: admin_pb2.RoundStatus(number=n, status="committed")}, {n})
    assert kept.from_("run", 0) == []
    assert [kept.final_until("run", f) for f in range(9)] == [4, 4, 4, 4, 4, 8, 8, 8, 8]
    kept.keep("run", {4: admin_pb2.RoundStatus(number=4)}, {4})
    assert kept.final_until("run", 0) == 8
    assert kept.final_until("other", 3) == 3


def _page(participations: int) -> admin_pb2.RunStatus:
    parts = [admin_pb2.Participation(site_id=f"s{i}") for i in range(participations)]
    return admin_pb2.RunStatus(run_id="r", rounds=[admin_pb2.RoundStatus(participations=parts)])


class _HeldExecutor(Executor):
    """Holds what is submitted until the test runs it."""

    def __init__(self) -> None:
        self.held: list[Callable[[], object]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.held.append(lambda: fn(*args, **kwargs))
        return Future()

    def run_all(self) -> None:
        held, self.held = self.held, []
        for call in held:
            call()


def test_shared_pages_keep_a_large_page_for_its_cost_and_build_a_small_one_each_time() -> None:
    from fedra.coordinator.status import SharedPages

    now = [0.0]
    pages = SharedPages(
        share=0.1, max_age_s=1.0, min_participations=10, clock=lambda: now[0], max_share=0.5
    )
    built: list[int] = []
    later = _HeldExecutor()

    def build(parts: int, cost: float) -> Callable[[], admin_pb2.RunStatus]:
        def run() -> admin_pb2.RunStatus:
            built.append(parts)
            now[0] += cost
            return _page(parts)

        return run

    small = ("small", 0, False)
    pages.get(small, build(3, 0.05))
    pages.get(small, build(3, 0.05))  # small: never kept, whatever it cost
    assert built == [3, 3] and pages.answer(small, build(3, 0.0), later) is None

    large = ("large", 0, False)
    first = pages.get(large, build(20, 0.02))  # kept for 0.02 / 0.1 = 0.2 s
    now[0] += 0.1
    assert pages.answer(large, build(20, 0.02), later) is first
    assert pages.get(large, build(20, 0.02)) is first
    assert built == [3, 3, 20] and later.held == []
    now[0] += 0.15  # 0.25 s since: past its moment, within as long again
    assert pages.answer(large, build(20, 0.03), later) is first  # and its rebuild starts
    assert pages.answer(large, build(20, 0.03), later) is first and len(later.held) == 1
    later.run_all()  # the rebuild, kept for 0.3 s from now
    second = pages.answer(large, build(20, 0.0), later)
    assert second is not None and second is not first and built == [3, 3, 20, 20]
    now[0] += 0.7  # 0.7 s since: not even as long again
    assert pages.answer(large, build(20, 0.0), later) is None and later.held == []
    third = pages.get(large, build(20, 0.5))  # 5 s by its cost, but max_age_s (0.5 / 0.5)
    now[0] += 0.4  # 0.9 s since its build began: what it shows is that old
    assert pages.get(large, build(20, 0.0)) is third
    now[0] += 0.2
    assert pages.get(large, build(20, 0.0)) is not third
    assert pages.get(("large", 1, False), build(20, 0.0)) is not third  # another page
    assert len(built) == 7

    # A rebuild queued behind busy readers is taken over by the next call, not waited for.
    now[0] += 1.5  # past the moment of the last page (fresh for 0 s: it cost nothing)
    pages.get(large, build(20, 0.1))  # fresh for 1 s
    now[0] += 1.05
    assert pages.answer(large, build(20, 0.0), later) is not None and len(later.held) == 1
    now[0] += 1.0  # past as long again: the next call must build, and does not wait
    taken = pages.get(large, build(21, 0.0))
    assert len(taken.rounds[0].participations) == 21
    later.run_all()  # the queued rebuild finds it taken over: builds nothing
    assert built[-1] == 21 and len(built) == 9


def test_shared_pages_keep_a_summary_of_a_large_round_as_a_large_page() -> None:
    """A summary holds no participations, but its build counted a round's worth of
    them: it is kept as the page of rows would be, and a small one is not."""
    from fedra.coordinator.status import SharedPages

    now = [0.0]
    pages = SharedPages(share=0.1, max_age_s=1.0, min_participations=10, clock=lambda: now[0])
    built: list[int] = []

    def summary(sampled: int) -> Callable[[], admin_pb2.RunStatus]:
        def run() -> admin_pb2.RunStatus:
            built.append(sampled)
            now[0] += 0.02
            return admin_pb2.RunStatus(rounds=[admin_pb2.RoundStatus(sampled_count=sampled)])

        return run

    first = pages.get(("large", 0, True), summary(5000))
    assert pages.get(("large", 0, True), summary(5000)) is first and built == [5000]
    pages.get(("small", 0, True), summary(3))
    pages.get(("small", 0, True), summary(3))
    assert built == [5000, 3, 3]


def test_shared_pages_keep_no_more_than_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages kept at once stay under ``_MAX_PAGES_BYTES`` (encoded): the oldest go first,
    however many keys are asked for within a page's moment."""
    from fedra.coordinator import status

    size = _page(100).ByteSize()
    monkeypatch.setattr(status, "_MAX_PAGES_BYTES", 3 * size)
    now = [0.0]
    pages = status.SharedPages(
        share=0.01, max_age_s=10.0, min_participations=10, clock=lambda: now[0]
    )
    built: list[int] = []

    def build(key: int) -> Callable[[], admin_pb2.RunStatus]:
        def run() -> admin_pb2.RunStatus:
            built.append(key)
            now[0] += 0.01  # kept for 1 s
            return _page(100)

        return run

    kept = [pages.get(("run", k, False), build(k)) for k in range(5)]
    assert built == [0, 1, 2, 3, 4]
    for k in (2, 3, 4):  # the last three fit: answered as kept
        assert pages.get(("run", k, False), build(k)) is kept[k]
    for k in (0, 1):  # the first two went: built again
        assert pages.get(("run", k, False), build(k)) is not kept[k]
    assert built == [0, 1, 2, 3, 4, 0, 1]


def test_shared_pages_build_a_costly_page_at_most_max_share_of_the_time() -> None:
    from fedra.coordinator.status import SharedPages

    pages = SharedPages(share=0.05, max_age_s=0.5, max_share=0.25)
    assert pages.fresh_for(0.01) == pytest.approx(0.2)  # cost / share
    assert pages.fresh_for(0.1) == pytest.approx(0.5)  # at most max_age_s
    assert pages.fresh_for(0.3) == pytest.approx(1.2)  # costlier: cost / max_share
    assert pages.fresh_for(10.0) == pytest.approx(5.0)  # never past max_stale_s
    # Asked for without pause, a key's page is built at most once a moment: the share of
    # a thread its builds take is cost / fresh_for(cost).
    for cost in (0.001, 0.02, 0.125, 0.3, 1.25):
        assert cost / pages.fresh_for(cost) <= 0.25 + 1e-12
    for bad in ({"max_share": 0.0}, {"share": 0.5}, {"max_share": 1.5}):
        with pytest.raises(ValueError, match="max_share"):
            SharedPages(**bad)  # type: ignore[arg-type]

    now = [0.0]
    pages = SharedPages(share=0.05, max_age_s=0.5, min_participations=1, clock=lambda: now[0])
    built: list[int] = []

    def build() -> admin_pb2.RunStatus:
        built.append(1)
        now[0] += 0.3  # a round of thousands of sites: 0.3 s to build its page
        return _page(5)

    key = ("run", 0, False)
    page = pages.get(key, build)
    now[0] += 0.8  # 1.1 s since its build began: it still answers
    assert pages.get(key, build) is page and built == [1]
    now[0] += 0.2  # 1.3 s: past its 1.2 s
    assert pages.get(key, build) is not page and built == [1, 1]


def test_shared_pages_share_one_build_between_calls_at_once_and_pass_on_its_error() -> None:
    from fedra.coordinator.errors import NotFound
    from fedra.coordinator.status import SharedPages

    pages = SharedPages(share=1.0, max_age_s=0.0, min_participations=1, max_share=1.0)
    key = ("run", 0, False)
    pages.get(key, lambda: _page(5))  # large: the next builds are shared, none kept
    started, release = threading.Event(), threading.Event()
    builds: list[str] = []

    def slow() -> admin_pb2.RunStatus:
        builds.append("slow")
        started.set()
        assert release.wait(10)
        return _page(5)

    got: list[admin_pb2.RunStatus] = []
    first = threading.Thread(target=lambda: got.append(pages.get(key, slow)))
    first.start()
    assert started.wait(10)
    waiters = [
        threading.Thread(target=lambda: got.append(pages.get(key, lambda: _page(9))))
        for _ in range(3)
    ]
    for t in waiters:
        t.start()
    flight = pages._building[key].future  # the build under way; its waiters block on it
    deadline = time.monotonic() + 10
    while len(flight._condition._waiters) < 3:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the calls did not wait for the build"
        time.sleep(0.001)
    release.set()
    for t in (first, *waiters):
        t.join(10)
    assert builds == ["slow"] and len(got) == 4 and all(g is got[0] for g in got)

    small, inside, out = ("small", 0, False), threading.Barrier(2, timeout=10), []

    def overlapping() -> admin_pb2.RunStatus:  # two builds of a small page at once
        inside.wait()
        return _page(1)

    pair = [
        threading.Thread(target=lambda: out.append(pages.get(small, overlapping))) for _ in range(2)
    ]
    for t in pair:
        t.start()
    for t in pair:
        t.join(10)
    assert len(out) == 2 and out[0] is not out[1]  # each built its own, neither failed

    def missing() -> admin_pb2.RunStatus:
        raise NotFound("no run 'run'")

    with pytest.raises(NotFound):
        pages.get(key, missing)
    assert pages.get(key, lambda: _page(2)).rounds[0].participations[1].site_id == "s1"


# -- attention: the coordinator's own stalls are not the sites' -------------------------


def test_attention_counts_the_stalls_within_a_stretch_only() -> None:
    from fedra.coordinator.attention import SLACK_S, TICK_S, Attention

    now = [100.0]
    att = Attention(lambda: now[0])
    att.tick(0.0)  # on time: no stall
    assert att.stalled(0.0, now[0]) == 0.0
    now[0] = 110.0
    att.tick(5.0 + SLACK_S)  # the loop ran 5 s late: 105..110 it was not listening
    assert att.stalled(0.0, 110.0) == pytest.approx(5.0)
    assert att.stalled(107.0, 110.0) == pytest.approx(3.0)  # the part within the stretch
    assert att.stalled(110.0, 110.0 + TICK_S) == 0.0  # the next tick is not late yet
    # No tick since 110: the loop is stalled right now, from when the next tick was due.
    due = 110.0 + TICK_S + SLACK_S
    assert att.stalled(110.0, 113.0) == pytest.approx(113.0 - due)
    assert att.stalled(0.0, 113.0) == pytest.approx(5.0 + 113.0 - due)
    att.stop()  # not watched any more: nothing ongoing
    assert att.stalled(110.0, 113.0) == 0.0


def test_attention_agrees_with_adding_up_the_stalls_and_keeps_a_bounded_number() -> None:
    """Thousands of stalls: each window's figure is the overlap summed one by one (what
    is let go, past KEEP, is only ever counted short: a site is then never kept longer)."""
    import random

    from fedra.coordinator import attention
    from fedra.coordinator.attention import SLACK_S, Attention

    rng = random.Random(7)
    now = [0.0]
    att = Attention(lambda: now[0])
    stalls: list[tuple[float, float]] = []
    for _ in range(attention.KEEP + 500):
        late = rng.choice([0.0, 0.0, rng.uniform(0.0, 1.5)])
        now[0] += attention.TICK_S + late  # a tick comes TICK_S after the last, and late
        att.tick(late)
        if late > SLACK_S:
            stalls.append((now[0] - (late - SLACK_S), now[0]))
    att.stop()
    assert len(att._ends) <= attention.KEEP

    def truth(a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in stalls)

    kept_from = att._starts[0]
    for _ in range(300):
        a = rng.uniform(0.0, now[0])
        b = rng.uniform(a, now[0])
        got = att.stalled(a, b)
        if a >= kept_from:
            assert got == pytest.approx(truth(a, b), abs=1e-6)
        else:
            assert got <= truth(a, b) + 1e-6


def test_a_site_is_not_failed_as_silent_for_the_coordinators_own_stall(tmp_path: Path) -> None:
    """The server's event loop stops for longer than the liveness timeout (a burst of
    calls, a pause): a site heard just before is still online after it, and goes offline
    only once the coordinator has listened for a whole timeout without hearing it."""
    timeout_s = 2.0
    c = InProcessCoordinator(tmp_path / "state", EngineSettings(site_timeout_s=timeout_s))
    try:
        _register(c, "site-a")
        frozen = threading.Event()

        def freeze() -> None:  # runs on the server's loop: nothing else runs there meanwhile
            frozen.set()
            time.sleep(2 * timeout_s)

        c.server._loop.call_soon_threadsafe(freeze)
        assert frozen.wait(10.0)
        started = time.monotonic()
        # The loop answers again once the freeze is over (a health check goes through it).
        c.admin.ListSites(admin_pb2.ListSitesRequest(summary_only=True), timeout=30.0)
        assert time.monotonic() - started >= timeout_s  # it did wait for the loop
        engine = c.engine
        quiet = engine.clock() - engine._last_seen["site-a"]
        assert quiet > timeout_s  # by the wall clock alone, the site would be gone
        assert engine.site_online("site-a")
        assert engine.attention.stalled_s >= timeout_s
        deadline = time.monotonic() + 10 * timeout_s
        while engine.site_online("site-a"):  # listening now: a whole timeout, then offline
            assert time.monotonic() < deadline, "the site never went offline"
            time.sleep(0.05)
        assert engine.clock() - engine._last_seen["site-a"] >= 2 * timeout_s
    finally:
        c.close()


class _Context:
    """What ``wire.queued_s`` reads of a call: its metadata and what is left of its deadline."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], remaining: float | None) -> None:
        self.metadata, self.remaining = metadata, remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return self.remaining


def test_a_calls_wait_in_the_queue_is_read_from_the_deadline_it_declared() -> None:
    from fedra.protos import wire

    said = wire.declared_timeout(10.0)
    assert said == ((wire.TIMEOUT_KEY, "10000"),)
    assert wire.queued_s(_Context(said, 7.5)) == pytest.approx(2.5)
    assert wire.queued_s(_Context(said, 10.2)) == 0.0  # never less than nothing
    assert wire.queued_s(_Context(said, -3.0)) == 10.0  # never more than it declared
    assert wire.queued_s(_Context((), 7.5)) is None  # declared none
    assert wire.queued_s(_Context(said, None)) is None  # no deadline at all
    for bad in ("ten", "", "0", "-5", str(10**12)):  # unreadable, nothing, or unbelievable
        assert wire.queued_s(_Context(((wire.TIMEOUT_KEY, bad),), 7.5)) is None


def test_the_hearing_lag_is_a_median_over_distinct_sites_that_no_minority_moves() -> None:
    from fedra.coordinator import attention

    now = [1000.0]
    att = attention.Attention(clock=lambda: now[0])
    att.queued("a", 4.0)
    att.queued("b", 4.0)
    assert att.lag() == 0.0  # too few sites to say
    now[0] += attention.LAG_CACHE_S
    att.queued("c", 6.0)
    assert att.lag() == 4.0
    # A site's later calls replace its earlier ones: one site cannot stand for many.
    for _ in range(50):
        att.queued("liar", 3000.0)
    now[0] += attention.LAG_CACHE_S
    assert att.lag() == 5.0  # the median of 4, 4, 6 and the liar's one figure
    for i in range(3):  # liars in a minority: the median stays among the honest figures
        att.queued(f"liar-{i}", 3000.0)
    for i in range(5):
        att.queued(f"honest-{i}", 4.0)
    now[0] += attention.LAG_CACHE_S
    assert att.lag() == 4.0
    att.lag_cap_s = 2.0  # never more than one liveness timeout
    now[0] += attention.LAG_CACHE_S
    assert att.lag() == 2.0
    assert att.lag_longest_s == 5.0
    # A queue that grows under a burst: the latest calls taken say how long one waits now.
    now[0] += attention.LAG_CACHE_S
    for i in range(200):
        att.queued(f"early-{i}", 0.5)
    for i in range(attention.LAG_RECENT):
        att.queued(f"late-{i}", 1.5)
    assert att.lag() == 1.5
    now[0] += attention.LAG_WINDOW_S + 1  # nothing heard lately: no lag
    assert att.lag() == 0.0
    assert not att._waits  # and the old figures are let go


def test_a_site_is_not_failed_as_silent_while_the_coordinator_hears_late(tmp_path: Path) -> None:
    """Calls that waited in gRPC's queue before their handlers tell the coordinator it
    hears late: a site quiet for a little longer than the liveness timeout is still
    online while the lag covers it, and offline once the lag is gone."""
    from fedra.coordinator import attention

    now = [5000.0]
    timeout_s = 10.0
    engine = _timed_engine(tmp_path, now, timeout_s)
    try:
        for site in ("quiet", "a", "b", "c"):
            engine.register(site, [TASK], "1")
        now[0] += timeout_s + 3.0  # "quiet" says nothing for longer than the timeout
        assert not engine.site_online("quiet")
        for site in ("a", "b", "c"):  # the others' calls come in after 5 s in the queue
            engine.touch(site, queued_s=5.0)
        now[0] += attention.LAG_CACHE_S
        assert engine.attention.lag() == 5.0
        assert engine.site_online("quiet")
        assert engine.gauges().hearing_lag_s == 5.0
        now[0] += 3.0  # quiet for timeout + lag and more: gone, lag or not
        assert not engine.site_online("quiet")
    finally:
        engine.close()


def test_calls_that_waited_in_grpcs_queue_say_so_through_a_real_server(tmp_path: Path) -> None:
    """Heartbeats of three sites sent while the server's loop is held wait in gRPC's
    queue; their handlers read how long from the deadlines the sites' connections declared,
    and the coordinator's hearing lag says it."""
    from fedra.client.connection import Connection

    c = InProcessCoordinator(tmp_path / "state", EngineSettings(site_timeout_s=60.0))
    connections = [Connection(c.address, f"site-{i}") for i in range(3)]
    try:
        for conn in connections:
            conn.register([TASK])
        held_s = 1.0
        frozen = threading.Event()

        def freeze() -> None:  # on the server's loop: no call reaches its handler meanwhile
            frozen.set()
            time.sleep(held_s)

        c.server._loop.call_soon_threadsafe(freeze)
        assert frozen.wait(10.0)
        with ThreadPoolExecutor(3) as pool:
            beats = [pool.submit(conn.heartbeat, "no-task") for conn in connections]
            for beat in beats:
                beat.result(timeout=30.0)
        waits = [w for _, w in c.engine.attention._waits.values()]
        assert len(waits) == 3
        assert all(0.5 * held_s <= w <= 10.0 for w in waits), waits
        lag = c.engine.attention.lag()
        assert 0.5 * held_s <= lag <= 10.0
    finally:
        for conn in connections:
            conn.close()
        c.close()


def test_the_site_list_is_served_from_memory_as_stored_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    """Listings read the sites kept in memory with each registration: the same as the
    database's rows, loaded again by a restarted engine, in id order, paged."""
    from fedra.coordinator.engine import Engine
    from fedra.storage import BlobStore

    def engine_on(store: Store) -> Engine:
        e = Engine(store, BlobStore(tmp_path / "m"), BlobStore(tmp_path / "u"), EngineSettings())
        e.start()
        return e

    def listing(e: Engine) -> list[tuple[str, tuple[str, ...], str, float]]:
        out, after = [], ""
        while True:
            page, after = e.list_sites(after, 2)
            out += [(s.id, s.tasks, s.version, s.registered_at) for s, _, _ in page]
            if not after:
                return out

    store = _store(tmp_path)
    first = engine_on(store)
    try:
        for site in ("site-c", "site-a", "site-b"):
            first.register(site, [TASK], "1")
        first.register("site-a", [TASK, "other:task"], "2")  # again: same registration time
        before = listing(first)
        assert [s[0] for s in before] == ["site-a", "site-b", "site-c"]
        assert before[0][1:3] == ((TASK, "other:task"), "2")
        stored = {s.id: (s.id, s.tasks, s.version, s.registered_at) for s in store.list_sites()}
        assert before == [stored[s[0]] for s in before]
        first.register("site-0", [TASK], "1")  # a new id is listed at once, in order
        assert [s[0] for s in listing(first)] == ["site-0", "site-a", "site-b", "site-c"]
    finally:
        first.stop()
    second = engine_on(store)
    try:
        assert listing(second) == [
            (s.id, s.tasks, s.version, s.registered_at) for s in store.list_sites()
        ]
        assert len(listing(second)) == 4
    finally:
        second.stop()
        store.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_round_asks_only_the_sites_due_and_misses_none_that_went_silent(
    tmp_path: Path, seed: int
) -> None:
    """Sites poll, hang up, move bytes and fall silent at random while a round waits:
    each look reports only sites offline then (``is_online``), every pending site
    offline at one look is reported by the first look ``SILENCE_RECHECK_S`` later at the
    latest, and the operators' snapshot says of each site what ``presence`` does."""
    import random
    from types import SimpleNamespace

    from fedra.coordinator.engine.core import SILENCE_RECHECK_S
    from fedra.coordinator.engine.rounds import SilenceWatch
    from fedra.coordinator.state import Assignment, TaskState

    rng = random.Random(seed)
    now = [1000.0]
    timeout = 10.0
    engine = _timed_engine(tmp_path, now, timeout)
    sites = [f"site-{i:02d}" for i in range(30)]
    try:
        for site in sites:
            engine.register(site, [TASK], "1")
        run = SimpleNamespace(
            open_round=1, attempt=1, assignments={s: Assignment(f"t-{s}", s) for s in sites}
        )
        watch = SilenceWatch(engine)
        polls: dict[str, float] = {}  # the site's poll under way: when it began
        moving: set[str] = set()
        owed: dict[str, float] = {}  # offline at a look, not yet reported: since when
        reported = 0
        for _ in range(400):
            now[0] += rng.choice((0.05, 0.3, 1.0, 2.5, 4.0))
            for site in rng.sample(sites, 6):
                a, act = run.assignments[site], rng.random()
                if act < 0.3:
                    engine.touch(site)
                elif act < 0.45 and site not in polls:
                    polls[site] = engine.poll_begin(site)[0]
                elif act < 0.6 and site in polls:
                    engine.poll_end(site, polls.pop(site), gone=rng.random() < 0.5)
                elif act < 0.7 and site not in moving:
                    moving.add(site)
                    engine.transfer(site, True)
                    if a.pending:
                        a.move(TaskState.UPLOADING)
                elif act < 0.8 and site in moving:
                    moving.discard(site)
                    engine.transfer(site, False)
                    if a.state is TaskState.UPLOADING:
                        a.move(rng.choice((TaskState.ASSIGNED, TaskState.ACCEPTED)))
                elif act < 0.81:  # the attempt fails: a new one, with a task for each
                    run.attempt += 1
                    run.assignments = {s: Assignment(f"t-{s}-{now[0]}", s) for s in sites}
                    owed.clear()
            offline = {s for s, a in run.assignments.items()
                       if a.pending and not engine.is_online(s, now[0])}  # fmt: skip
            silent = watch.silent(run, now[0])
            assert set(silent) <= offline, "a site reported silent while online"
            assert len(silent) == len(set(silent))
            for site in silent:
                run.assignments[site].move(TaskState.FAILED)
                reported += 1
            owed = {s: owed.get(s, now[0]) for s in offline - set(silent)}
            late = [s for s, since in owed.items() if now[0] - since >= SILENCE_RECHECK_S]
            assert not late, f"silent sites not reported: {late}"
            ages, off = engine.presence_ages(now[0])
            presence = engine.presence()
            assert set(off) == {s for s, (online, _) in presence.items() if not online}
            assert ages == {s: round((now[0] - seen) * 1000) for s, (_, seen) in
                            presence.items()}  # fmt: skip
        assert reported > 20  # the walk did find silent sites
    finally:
        engine.close()


def test_a_waiting_round_does_not_ask_sites_heard_from_within_the_timeout(
    tmp_path: Path,
) -> None:
    """At thousands of sites a look must not cost a question per site: once each was
    asked, a site is asked again only when its liveness timeout could have run out."""
    from types import SimpleNamespace

    from fedra.coordinator.engine.rounds import SilenceWatch
    from fedra.coordinator.state import Assignment

    now = [1000.0]
    engine = _timed_engine(tmp_path, now, 10.0)
    sites = [f"site-{i:03d}" for i in range(200)]
    try:
        for site in sites:
            engine.register(site, [TASK], "1")
        asked: list[str] = []
        ask = engine.silence_due
        engine.silence_due = lambda site, t: asked.append(site) or ask(site, t)  # type: ignore[method-assign]
        run = SimpleNamespace(
            open_round=1, attempt=1, assignments={s: Assignment(f"t-{s}", s) for s in sites}
        )
        watch = SilenceWatch(engine)
        assert watch.silent(run, now[0]) == [] and len(asked) == 200  # a new attempt: all
        for _ in range(30):  # 9 s of looks: nobody's timeout can have run out
            asked.clear()
            now[0] += 0.3
            for site in sites[:100]:
                engine.touch(site)  # half of them keep talking
            assert watch.silent(run, now[0]) == [] and asked == []
        now[0] += 1.5  # their timeouts as of the first look ran out: each is asked once
        assert sorted(watch.silent(run, now[0])) == sites[100:]  # the quiet half is gone
        assert sorted(asked) == sites
        for _ in range(25):  # the talking half is due again only a timeout after it spoke
            asked.clear()
            now[0] += 0.3
            assert watch.silent(run, now[0]) == [] and asked == []
        run.attempt = 2  # a new attempt asks each of its sites at once
        asked.clear()
        assert sorted(watch.silent(run, now[0])) == sites[100:]
        assert len(asked) == 200
        asked.clear()
        watch.silent(run, now[0] + 0.1)
        assert asked == []
        now[0] -= 5.0  # the wall clock stepped back: its deadlines say nothing, ask all
        watch.silent(run, now[0])
        assert len(asked) == 200
    finally:
        engine.close()


def test_a_site_that_hung_up_during_a_transfer_is_reported_once_the_transfer_ends(
    tmp_path: Path,
) -> None:
    """A site hangs up its poll while one of its transfers still runs: online until the
    transfer ends, offline from then, and reported at the next look a quarter of a second
    on, not a liveness timeout later. The same for a site whose upload was cut off when
    its hang-up was looked at, once its task goes back to pending."""
    from types import SimpleNamespace

    from fedra.coordinator.engine.core import SILENCE_RECHECK_S
    from fedra.coordinator.engine.rounds import SilenceWatch
    from fedra.coordinator.state import Assignment, TaskState

    now = [1000.0]
    engine = _timed_engine(tmp_path, now, 20.0)
    try:
        for site in ("down", "up"):
            engine.register(site, [TASK], "1")
        run = SimpleNamespace(
            open_round=1,
            attempt=1,
            assignments={s: Assignment(f"t-{s}", s) for s in ("down", "up")},
        )
        watch = SilenceWatch(engine)
        assert watch.silent(run, now[0]) == []  # each asked once: due a timeout on
        for site in ("down", "up"):
            engine.transfer(site, True)  # a download, an upload
        run.assignments["up"].move(TaskState.UPLOADING)
        now[0] += 1.0
        engine.transfer("up", False)  # the upload's stream is cut; its task not yet given back
        for site in ("down", "up"):  # each hangs up a poll of another connection
            began = engine.poll_begin(site)[0]
            engine.poll_end(site, began, gone=True)
        # The hang-ups are looked at: "down" is online (its download runs), "up" offline
        # but uploading (not pending): neither is reported yet.
        assert watch.silent(run, now[0]) == []
        engine.transfer("down", False)  # the download ends: offline, it hung up
        run.assignments["up"].move(TaskState.ASSIGNED)  # the upload's task given back
        assert not engine.is_online("down", now[0]) and not engine.is_online("up", now[0])
        now[0] += SILENCE_RECHECK_S
        assert sorted(watch.silent(run, now[0])) == ["down", "up"]  # not 20 s later
    finally:
        engine.close()


def test_the_operators_presence_reads_while_sites_register_under_collections(
    tmp_path: Path,
) -> None:
    """``presence_ages`` reads the sites without the engine's lock while registrations go
    on. A copy that allocates as it goes (``list(d.items())``) can set off a collection,
    whose callbacks run Python code and so let another thread in: the dictionary then
    changes under the copy (seen at 5,000 sites: the snapshot lost a write)."""
    import gc

    now = [1000.0]
    engine = _timed_engine(tmp_path, now, 20.0)
    # More than the interpreter keeps free pairs for (2,000): the copy's pairs are new
    # objects, so the collector counts them.
    many = 2500
    with ThreadPoolExecutor(32) as pool:  # registrations share group commits
        list(pool.map(lambda i: engine.register(f"site-{i:04d}", [TASK], "1"), range(many)))

    def let_others_in(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            time.sleep(0.0005)  # releases the interpreter's lock, as a slow callback may

    stop, errors = threading.Event(), []

    def register_more() -> None:
        i = many
        while not stop.is_set():
            engine.register(f"site-{i:04d}", [TASK], "1")
            i += 1

    thread = threading.Thread(target=register_more)
    threshold = gc.get_threshold()
    gc.callbacks.append(let_others_in)
    gc.set_threshold(20)
    thread.start()
    try:
        deadline = time.monotonic() + 3.0
        reads = 0
        while time.monotonic() < deadline and reads < 200:
            try:
                ages, _ = engine.presence_ages(now[0])
            except RuntimeError as exc:
                errors.append(exc)
                break
            reads += 1
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(let_others_in)
        stop.set()
        thread.join(10)
        engine.close()
    assert not errors, errors
    assert reads > 0 and len(ages) >= many


def test_a_look_that_finds_a_thousand_sites_silent_fails_them_in_one_transaction(
    tmp_path: Path,
) -> None:
    """A round of thousands opens at one instant, so their liveness runs out at one look
    when they fall silent together. Failing each in a transaction of its own held the
    engine's lock for seconds (a synced commit each), stalling every call that needed it;
    now the look writes them all in one, and each is failed in the database and in memory
    with its reason."""
    from sqlalchemy import event

    from fedra.coordinator.aggregation import ServerOptimizer
    from fedra.coordinator.engine.rounds import RoundDriver
    from fedra.coordinator.state import ActiveRun, TaskState

    now = [1000.0]
    engine = _timed_engine(tmp_path, now, 20.0)
    sites = [f"site-{i:04d}" for i in range(1000)]
    try:
        for site in sites:
            engine.register(site, [TASK], "1")
        spec = RunSpec(TASK, 1, sites_per_round=len(sites), min_sites=len(sites)).validate()
        store = engine._store
        store.create_run("r", "scale", TASK, "{}", now[0])
        tasks = {s: f"t-{s}" for s in sites}
        store.open_round("r", 1, 1, tasks, now[0], now[0] + 300.0)
        run = ActiveRun(run_id="r", spec=spec, optimizer=ServerOptimizer(spec))
        run.set_open(1, 1, tasks, now[0], now[0] + 300.0)
        for site in sites:
            engine.mark_seen_for_recovery(site, now[0], refresh=True)
        driver = RoundDriver(engine, run)
        now[0] += 21.0
        engine.touch(sites[0])  # heard from just now: not silent
        commits: list[None] = []
        event.listen(store.engine, "commit", lambda _: commits.append(None))
        with engine._lock:
            driver._fail_silent_sites(now[0])
        assert len(commits) == 1
        failed = {a.site_id for a in run.assignments.values() if a.state is TaskState.FAILED}
        assert failed == set(sites[1:])
        rows = {p.site_id: p for p in store.list_participations("r", 1, 1)}
        assert rows[sites[0]].state == "assigned"
        assert {(rows[s].state, rows[s].error) for s in sites[1:]} == {
            ("failed", "site went silent for more than 20 s")
        }
    finally:
        engine.close()
