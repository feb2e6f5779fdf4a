"""A run's status counted by the database (``GetRunRequest.summary``): every figure the
same as the whole status's, on SQLite and PostgreSQL, with no participation read."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import text

from fedra.admin import AdminClient
from fedra.cli import format_status
from fedra.coordinator import ledger
from fedra.coordinator.ledger import DECLINED, PROVENANCE_EVENT
from fedra.coordinator.status import (
    FinalRounds,
    round_statuses,
    round_summaries,
    run_page,
    run_status,
)
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec
from fedra.storage.records import CheckpointRecord, ReadsOf, SiteTally
from fedra.storage.store import Store
from tests.conftest import InProcessCoordinator, postgres_database

TASK = "fedra.examples.synthetic:task"
T0 = 1_700_000_000.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s = Store(f"sqlite:///{tmp_path}/fedra.db")
        yield s
        s.close()
        return
    with postgres_database("fedra_summary") as url:
        s = Store(url)
        try:
            yield s
        finally:
            s.close()


def _fill(store: Store, run_id: str, seed: int, rounds: int = 9) -> list[str]:
    """A run whose rounds have every kind of participation: downloads, accepts, cut
    transfers, failures, declines, expiries, retried attempts, and a last round left
    open, or ended by the run failing. Returns every task id."""
    rng = random.Random(seed)
    spec = RunSpec(name="mixed", task=TASK, rounds=rounds + 1, sites_per_round=6, min_sites=1)
    store.create_run(run_id, "mixed", TASK, spec.validate().to_json(), T0)
    store.set_run_state(run_id, "running", "", T0)
    tasks: list[str] = []
    now = T0
    for number in range(rounds):
        attempts = rng.choice([1, 1, 2, 3])
        for attempt in range(1, attempts + 1):
            sites = rng.sample([f"site-{i:02d}" for i in range(12)], rng.randint(1, 8))
            assignment = {s: f"{run_id}-{number}-{attempt}-{s}" for s in sites}
            tasks.extend(assignment.values())
            now += 1.0
            store.open_round(run_id, number, attempt, assignment, now, now + 60.0)
            for task in assignment.values():
                what = rng.choice(
                    ["accept", "accept", "accept", "fail", "decline", "idle", "dl", "odd"]
                )
                if what != "idle":
                    store.mark_downloaded(task, rng.randint(1, 10**9), rng.random())
                if rng.random() < 0.3:
                    store.mark_downloaded_many([], cuts=[(task, rng.randint(1, 10**6))])
                if what == "odd" and rng.random() < 0.3:  # an error like a decline's
                    store.fail_participation(task, DECLINED.upper() + "shouted", now)
                elif what == "odd":  # any finite number a site may send
                    store.accept_update(
                        task,
                        nonce=rng.randbytes(16),
                        sha256=f"{rng.getrandbits(256):064x}",
                        num_samples=1,
                        metrics=rng.choice(
                            [{"compute_s": 1e308, "download_s": 1e308}, {"compute_s": -1e200}]
                        ),
                        bytes_up=1,
                        upload_s=rng.choice([0.0, 1e308, -5.0]),
                        now=now,
                    )
                elif what == "accept":
                    store.accept_update(
                        task,
                        nonce=rng.randbytes(16),
                        sha256=f"{rng.getrandbits(256):064x}",
                        num_samples=rng.randint(1, 100),
                        metrics={
                            "compute_s": rng.random() * 3,
                            "loss": rng.random(),
                            **({"download_s": rng.random()} if rng.random() < 0.5 else {}),
                        },
                        bytes_up=rng.randint(1, 10**9),
                        upload_s=rng.random(),
                        now=now + rng.random(),
                    )
                elif what == "fail":
                    store.fail_participation(task, "the update was refused: 50% of it", now)
                elif what == "decline":
                    store.fail_participation(task, DECLINED + "not on weekends", now)
            if attempt < attempts:
                store.expire_attempt(run_id, number, attempt, "attempt failed", now + 2.0)
        last = number == rounds - 1
        if not last:
            ckpt = CheckpointRecord(run_id, number, f"{number:064x}", 1, None, now + 3.0)
            store.commit_round(run_id, number, ckpt, {"loss": rng.random()}, now + 3.0)
        elif rng.random() < 0.5:
            store.set_run_state(run_id, "failed", "too few sites", now + 4.0)
    return tasks


def _without_rows(r: admin_pb2.RoundStatus) -> admin_pb2.RoundStatus:
    out = admin_pb2.RoundStatus()
    out.CopyFrom(r)
    out.ClearField("participations")
    out.ClearField("sampled_sites")
    return out


def _same_but_rows(summary: admin_pb2.RoundStatus, whole: admin_pb2.RoundStatus) -> bool:
    """The summary is the whole round less its lists; its idle time is a mean worked out
    by the database, whose last bits may differ."""
    if summary.site_idle_s != pytest.approx(whole.site_idle_s, rel=1e-9, abs=1e-9):
        return False
    rest = _without_rows(whole)
    rest.site_idle_s = summary.site_idle_s
    return summary == rest


@pytest.mark.parametrize("seed", range(6))
def test_a_summary_has_every_figure_of_the_whole_status_without_its_rows(
    store: Store, seed: int
) -> None:
    """Bytes, lost and cut bytes, updates, idle time and finality, counted by the
    database, equal what the whole status works out from every row; the counts by
    status are the current attempt's participations'."""
    tasks = _fill(store, "mixed", seed)
    rng = random.Random(seed)
    held = set(rng.sample(tasks, 3))
    for since, limit in ((0, None), (3, 2), (5, None)):
        whole = store.read_run("mixed", since=since, limit=limit)
        summed = store.read_run_summary(
            "mixed", since=since, limit=limit, flag_error=DECLINED, tasks=held
        )
        assert whole is not None and summed is not None
        assert summed.more_rounds == whole.more_rounds
        for settled in (float("inf"), T0 + 8.0):
            rounds, final = round_statuses(whole, held, settled)
            summaries, summary_final = round_summaries(summed, settled)
            assert summary_final == final
            assert list(summaries) == list(rounds)
            for number, r in rounds.items():
                s = summaries[number]
                assert _same_but_rows(s, r), number
                assert s.sampled_count == len(r.sampled_sites) > 0
                current = Counter(p.status for p in r.participations if p.attempt == r.attempt)
                assert dict(s.participation_counts) == dict(current)
    every = store.read_run("mixed")
    assert every is not None
    idle = [r.site_idle_s for r in round_statuses(every)[0].values() if r.status == "committed"]
    assert sum(i > 0 for i in idle) >= 3  # the rounds' idle time is being compared
    # To the microsecond, whichever way it was worked out: a mean the database sums in
    # another order has the same figure, and a watch does not send its round again.
    assert all(round(i, 6) == i for i in idle)
    summed = store.read_run_summary("mixed", flag_error=DECLINED)
    assert summed is not None
    assert all(
        round(r.site_idle_s, 6) == r.site_idle_s for r in round_summaries(summed)[0].values()
    )


def test_a_summary_of_a_missing_run_is_none(store: Store) -> None:
    assert store.read_run_summary("nope") is None
    with pytest.raises(ValueError, match="limit must be >= 1"):
        store.read_run_summary("nope", limit=0)


def _sites_from_rows(store: Store, run_id: str, failures: int) -> dict[str, SiteTally]:
    """What ``read_site_tallies`` must give, worked out from every participation's row."""
    view = store.read_run(run_id)
    assert view is not None
    last = {r.number: r for r in view.rounds}
    rows: dict[str, dict[str, Any]] = {}
    order = sorted(view.participations, key=lambda p: (p.round_number, p.attempt, p.assigned_at))
    for p in order:
        row = rows.setdefault(p.site_id, {"failures": ()})
        for name in ("participations", "accepted", "declined", "failed", "bytes"):
            row.setdefault(name, 0)
        for name in ("busy_s", "idle_s", "counted_s"):
            row.setdefault(name, 0.0)
        declined = p.state == "failed" and p.error.startswith(DECLINED)
        row["participations"] += 1
        row["accepted"] += p.state == "accepted"
        row["declined"] += declined
        row["failed"] += p.state in ("failed", "expired") and not declined
        row["bytes"] += p.bytes_down + p.bytes_up + p.bytes_cut
        busy = ledger._busy_s(p)
        row["busy_s"] += busy
        r = last[p.round_number]
        closed = r.closed_at if r.state == "committed" and p.attempt == r.attempt else None
        if p.state == "accepted" and closed:
            span = closed - min(r.opened_at, p.assigned_at)
            row["idle_s"] += max(0.0, span - busy)
            row["counted_s"] += span
        row["latest"] = (p.state, declined)
        if p.state in ("failed", "expired") and p.error and len(row["failures"]) < failures:
            row["failures"] = (*row["failures"], (p.round_number, p.error))
    out = {}
    for site, row in rows.items():
        state, flagged = row.pop("latest")
        fields = {k: row[k] for k in ("participations", "accepted", "failed", "declined")}
        out[site] = SiteTally(
            site_id=site, **fields, bytes=row["bytes"], busy_s=float(row["busy_s"]),
            idle_s=float(row["idle_s"]), counted_s=float(row["counted_s"]),
            latest_state=state, latest_flagged=flagged, failures=row["failures"],
        )  # fmt: skip
    return out


def _assert_same_tallies(got: Iterable[SiteTally], want: Iterable[SiteTally]) -> None:
    """The same sites with the same figures (the seconds up to the order of their sum)."""
    by_site = {t.site_id: t for t in want}
    got = list(got)
    assert sorted(t.site_id for t in got) == sorted(by_site)
    for t in got:
        w = by_site[t.site_id]
        for name in ("busy_s", "idle_s", "counted_s"):
            assert getattr(t, name) == pytest.approx(getattr(w, name), rel=1e-9), name
        assert replace(t, busy_s=0, idle_s=0, counted_s=0) == replace(
            w, busy_s=0, idle_s=0, counted_s=0
        )


@pytest.mark.parametrize("seed", range(4))
def test_the_sites_counted_by_the_database_match_their_rows(store: Store, seed: int) -> None:
    """The status page's table of sites: each figure as its participations' rows give it,
    declines told from failures, the latest task's state and the first failures' errors."""
    _fill(store, "r1", seed)
    _fill(store, "r2", seed + 100)  # another run's rows count for nothing here
    for failures in (0, 2, 5):
        got = store.read_site_tallies("r1", flag_error=DECLINED, failures=failures)
        assert [t.site_id for t in got] == sorted(t.site_id for t in got)  # by site id
        _assert_same_tallies(got, _sites_from_rows(store, "r1", failures).values())
    assert any(t.declined for t in got) and any(t.failed for t in got)
    assert any(t.idle_s > 0 for t in got) and any(t.failures for t in got)
    assert store.read_site_tallies("no-such-run") == []


@pytest.mark.parametrize("seed", range(2))
def test_the_sites_of_two_ranges_of_rounds_add_up_to_those_of_both(store: Store, seed: int) -> None:
    """What the status page keeps of the rounds that can change no more, added to what
    it reads of the others, is what one read of every round gives."""
    _fill(store, "r1", seed)
    whole = store.read_site_tallies("r1", flag_error=DECLINED)
    for cut in range(11):
        added = {
            t.site_id: t for t in store.read_site_tallies("r1", until=cut, flag_error=DECLINED)
        }
        for t in store.read_site_tallies("r1", since=cut, flag_error=DECLINED):
            before = added.get(t.site_id)
            added[t.site_id] = t if before is None else before.then(t, failures=5)
        _assert_same_tallies(sorted(added.values(), key=lambda t: t.site_id), whole)


def test_the_status_page_reads_again_only_the_rounds_that_can_still_change(store: Store) -> None:
    """Its table of sites keeps the tallies of the rounds its summaries kept as final and
    reads the rest at each refresh: the same table as one read of every round."""
    from fedra.coordinator.web import SiteTables

    tasks = _fill(store, "r1", seed=3)
    final = FinalRounds()
    tables = SiteTables(ReadsOf(store), final)

    def table() -> list[SiteTally]:
        return store.read_site_tallies("r1", flag_error=DECLINED, failures=5)

    _assert_same_tallies(tables.tallies("r1"), table())  # nothing final yet: all read
    final.keep("r1", {n: admin_pb2.RoundStatus(number=n) for n in range(4)}, set(range(4)))
    _assert_same_tallies(tables.tallies("r1"), table())  # rounds 0-3 read again, and kept
    # A row of a kept round is not read again (it cannot change: this one is written
    # here, behind the store's back, only to tell a kept tally from one read again); a
    # row of a later round is.
    for kept_round, later_round in ((2, 8), (3, 4)):  # (3, 4): either side of the edge
        early = next(t for t in tasks if t.startswith(f"r1-{kept_round}-"))
        late = next(t for t in tasks if t.startswith(f"r1-{later_round}-"))
        before = {t.site_id: t for t in tables.tallies("r1")}
        with store.engine.begin() as conn:
            for task in (early, late):
                conn.execute(
                    text("UPDATE participations SET bytes_up = bytes_up + 1000 WHERE task_id = :t"),
                    {"t": task},
                )
        now = {t.site_id: t for t in tables.tallies("r1")}
        early_site, late_site = early.split("-", 3)[3], late.split("-", 3)[3]
        moved = 1000 if early_site == late_site else 0
        assert now[early_site].bytes == before[early_site].bytes + moved
        assert now[late_site].bytes == before[late_site].bytes + 1000
        whole = {t.site_id: t for t in table()}
        assert whole[early_site].bytes == before[early_site].bytes + 1000 + moved  # written


def test_get_run_summary_over_grpc_pages_and_the_cli_prints_from_it(
    coordinator: InProcessCoordinator,
) -> None:
    """Over the admin port: a summary (paged or whole) is the whole status less its rows,
    and far smaller; only the sites whose provenance changed are named; the text of
    `fedra run status` is the same from a summary as from the whole status."""
    engine = coordinator.engine
    _fill(engine._store, "mixed", seed=11, rounds=30)
    for number, (site, digest) in enumerate([("a", "1"), ("b", "1"), ("b", "2"), ("c", "3")]):
        data: dict[str, float | int | str] = {"site": site, "digest": digest, "device": "cpu"}
        engine._store.add_event("mixed", PROVENANCE_EVENT, site, T0 + number, number, data)
    stub, request = coordinator.admin, admin_pb2.GetRunRequest(run_id="mixed")
    whole = stub.GetRun(request, timeout=10)
    summary = stub.GetRun(admin_pb2.GetRunRequest(run_id="mixed", summary=True), timeout=10)
    for r, s in zip(whole.rounds, summary.rounds, strict=True):
        assert _same_but_rows(s, r)
    assert summary.ByteSize() * 3 < whole.ByteSize()
    assert summary.state == whole.state and summary.spec == whole.spec
    assert all(not r.participations and not r.sampled_sites for r in summary.rounds)
    assert [p.site_id for p in whole.provenance.sites] == ["a", "b", "c"]
    assert [(p.site_id, p.since_round) for p in summary.provenance.sites] == [("b", 2)]
    assert summary.provenance.sites[0] == whole.provenance.sites[1]
    assert summary.provenance.spec_sha256 == whole.provenance.spec_sha256
    with AdminClient(coordinator.address) as admin:
        paged = admin.status("mixed", summary=True)
        assert list(paged.rounds) == list(summary.rounds)
        assert list(admin.status("mixed", first_round=7, summary=True).rounds) == list(
            summary.rounds[7:]
        )
        assert format_status(admin.status("mixed")) == format_status(paged)
        # Summaries and rows are kept apart: the pages of rows still hold every row.
        rows = admin.status("mixed")
        assert list(rows.rounds) == list(whole.rounds)
        assert list(admin.status("mixed", summary=True).rounds) == list(summary.rounds)
    small = run_page(engine, "mixed", False, 4, page_bytes=1, summary=True)
    assert [r.number for r in small.rounds] == [4] and small.more_rounds_follow
    assert run_status(engine, "mixed", insecure=True, summary=True) == summary
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetRun(admin_pb2.GetRunRequest(run_id="nope", summary=True, page=True), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no run 'nope'" in str(missing.value.details())


def test_a_summary_watch_sends_what_a_whole_watch_does_without_the_rows(
    coordinator: InProcessCoordinator,
) -> None:
    """A look of WatchRun with summary: every round counted as the whole look has it,
    the same rounds sent again only when they change; over gRPC, the counts that `fedra
    run watch` prints from."""
    from fedra.coordinator.status import RunWatch

    engine = coordinator.engine
    _fill(engine._store, "mixed", seed=3, rounds=12)
    whole = RunWatch(engine, "mixed", True, changed_rounds_only=True)
    counted = RunWatch(engine, "mixed", True, changed_rounds_only=True, summary=True)
    [first_whole], [first_counted] = whole.look(), counted.look()
    assert [r.number for r in first_counted.rounds] == list(range(12))
    for s, r in zip(first_counted.rounds, first_whole.rounds, strict=True):
        assert _same_but_rows(s, r), r.number
    assert counted.look() == whole.look() == []  # nothing changed: nothing sent
    with AdminClient(coordinator.address) as admin:
        stream = admin.watch("mixed", summary=True)
        first = next(stream)
        stream.close()
    assert [r.number for r in first.rounds] == list(range(12))
    assert all(not r.participations and r.sampled_count for r in first.rounds)
    assert [dict(r.participation_counts) for r in first.rounds] == [
        dict(r.participation_counts) for r in first_whole.rounds
    ]


class _Racing:
    """A StatusSource over a store as the engine is one: a round closed before its
    ``settled_before()`` (its clock) is final unless one of its tasks is in
    ``downloads_pending()``. ``race`` runs right after the next pending downloads are
    taken, as another thread of the daemon may."""

    def __init__(self, store: Store) -> None:
        self.records, self.pending, self.now = store, set[str](), T0 + 2.5
        self.race: Callable[[], None] | None = None

    def waiting_reason(self, run_id: str) -> str:
        return ""

    def run_phase(self, run_id: str) -> tuple[object, ...]:
        return ("driven", False)

    def settled_before(self) -> float:
        return self.now

    def downloads_pending(self) -> set[str]:
        out = set(self.pending)
        race, self.race = self.race, None
        if race is not None:
            race()
        return out


@pytest.mark.parametrize("summary", [False, True], ids=["rows", "summary"])
@pytest.mark.parametrize("reader", ["watch", "page"])
def test_a_download_that_begins_as_its_round_commits_is_never_left_out(
    tmp_path: Path, summary: bool, reader: str
) -> None:
    """Between the moment the pending downloads are taken and the read, a site's
    download begins and its round commits: the round must not be taken as final (kept
    by a page's cache, passed over by a watch) before that download's bytes are read."""
    from fedra.coordinator.status import FinalRounds, RunWatch

    store = Store(f"sqlite:///{tmp_path}/fedra.db")
    spec = RunSpec(name="r", task=TASK, rounds=3, sites_per_round=2, min_sites=1)
    store.create_run("r", "r", TASK, spec.validate().to_json(), T0)
    store.set_run_state("r", "running", "", T0)
    store.open_round("r", 0, 1, {"a": "t-a", "b": "t-b"}, T0 + 1, T0 + 60)
    store.mark_downloaded("t-a", 100, 0.1)
    store.accept_update(
        "t-a", nonce=b"n" * 16, sha256="0" * 64, num_samples=1, metrics={},
        bytes_up=10, upload_s=0.1, now=T0 + 2,
    )  # fmt: skip
    source = _Racing(store)
    watch = RunWatch(source, "r", False, changed_rounds_only=True, summary=summary)  # type: ignore[arg-type]
    kept = FinalRounds()
    sent: dict[int, admin_pb2.RoundStatus] = {}

    def read() -> None:
        if reader == "watch":
            for message in watch.look():
                sent.update((r.number, r) for r in message.rounds)
        else:
            page = run_page(source, "r", False, 0, kept=kept, summary=summary)  # type: ignore[arg-type]
            sent.update((r.number, r) for r in page.rounds)

    def commits() -> None:  # site b's download begins, then the round commits
        source.pending.add("t-b")
        ckpt = CheckpointRecord("r", 0, "0" * 64, 1, None, T0 + 3)
        store.commit_round("r", 0, ckpt, {}, T0 + 3)
        store.open_round("r", 1, 1, {"a": "t-a1"}, T0 + 4, T0 + 60)
        source.now = T0 + 5

    read()
    source.race = commits
    read()
    read()
    store.mark_downloaded("t-b", 5000, 1.0)  # b's download ends: written, no longer pending
    source.pending.discard("t-b")
    source.now = T0 + 6
    for _ in range(3):
        read()
    assert sent[0].bytes_down == 5100
    if reader == "watch":
        assert watch.floor == 1  # round 0 is final now, and passed over
    else:
        assert [admin_pb2.RoundStatus.FromString(b).number for b in kept.from_("r", 0)] == [0]
    store.close()


def test_the_engine_settles_only_rounds_closed_before_now(
    coordinator: InProcessCoordinator,
) -> None:
    engine = coordinator.engine
    before = engine.clock()
    assert before <= engine.settled_before() <= engine.clock()
