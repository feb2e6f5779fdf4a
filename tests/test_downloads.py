"""The download ledger: finished downloads written in the background, many to a
transaction, all of them before a round commits and before the daemon stops."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

from fedra.coordinator.downloads import Download, DownloadLedger
from fedra.storage import Store

RUN = "run-1"
SITES = ("a", "b", "c", "d")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/fedra.db")
    s.create_run(RUN, "demo", "task", "{}", 1.0)
    s.open_round(RUN, 1, 1, {site: f"t-{site}" for site in SITES}, 1.0, 60.0)
    try:
        yield s
    finally:
        s.close()


def _downloads(store: Store) -> dict[str, tuple[str, int, int | None]]:
    return {
        p.site_id: (p.state, p.bytes_down, p.base_round) for p in store.list_participations(RUN, 1)
    }


def test_flush_waits_for_every_download_recorded_before_it(store: Store) -> None:
    ledger = DownloadLedger(store)
    try:
        for i, site in enumerate(SITES):
            ledger.record(Download(f"t-{site}", 100 * (i + 1), 0.5, 1))
        assert ledger.flush(10)
        assert _downloads(store) == {
            site: ("downloaded", 100 * (i + 1), 1) for i, site in enumerate(SITES)
        }
    finally:
        ledger.close()


def test_downloads_that_finish_together_share_a_transaction(store: Store) -> None:
    """While one batch commits, the downloads that finish meanwhile queue for the next."""
    commits: list[int] = []
    first_commit = threading.Event()
    release = threading.Event()

    def _commit(_conn: object) -> None:
        commits.append(1)
        first_commit.set()
        release.wait(10)  # hold the first batch until the others are queued

    event.listen(store.engine, "commit", _commit)
    ledger = DownloadLedger(store)
    try:
        ledger.record(Download("t-a", 1, 0.1, 1))
        assert first_commit.wait(10)
        for site in SITES[1:]:
            ledger.record(Download(f"t-{site}", 1, 0.1, 1))
        release.set()
        assert ledger.flush(10)
        assert len(commits) == 2  # a, then b c d together
        assert all(state == "downloaded" for state, _, _ in _downloads(store).values())
    finally:
        release.set()
        ledger.close()


def test_close_writes_what_is_queued_and_later_downloads_directly(store: Store) -> None:
    ledger = DownloadLedger(store)
    ledger.record(Download("t-a", 10, 0.1, 1))
    ledger.close()
    ledger.record(Download("t-b", 20, 0.1, 1))  # e.g. a call that ends during shutdown
    assert _downloads(store)["a"] == ("downloaded", 10, 1)
    assert _downloads(store)["b"] == ("downloaded", 20, 1)


def test_a_write_that_fails_is_tried_again_then_given_up_and_the_ledger_goes_on(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = DownloadLedger(store, retry_delays_s=(0.01, 0.01))
    try:
        ledger.record(Download("no-such-task", 1, 0.1, 1))
        assert ledger.flush(10)
        assert "no-such-task was not recorded" in caplog.text
        original = store.mark_downloaded_many
        calls: list[int] = []

        def _fail_once(
            rows: list[tuple[str, int, float, int | None]], cuts: list[tuple[str, int]]
        ) -> list[str]:
            calls.append(len(rows))
            if len(calls) == 1:
                raise RuntimeError("database away for a moment")
            return original(rows, cuts)

        store.mark_downloaded_many = _fail_once  # type: ignore[method-assign]
        ledger.record(Download("t-a", 7, 0.1, 1))
        assert ledger.flush(10)
        assert calls == [1, 1] and _downloads(store)["a"] == ("downloaded", 7, 1)

        def _fail(*_args: object) -> list[str]:
            raise RuntimeError("database away")

        store.mark_downloaded_many = _fail  # type: ignore[method-assign]
        ledger.record(Download("t-b", 1, 0.1, 1))
        assert ledger.flush(10)  # given up on after its tries, not waited for forever
        assert "could not record 1 finished downloads after 3 tries" in caplog.text
        store.mark_downloaded_many = original  # type: ignore[method-assign]
        ledger.record(Download("t-c", 5, 0.1, 1))
        assert ledger.flush(10)
        assert _downloads(store)["c"] == ("downloaded", 5, 1)
        assert _downloads(store)["b"] == ("assigned", 0, None)
    finally:
        ledger.close()


def test_a_download_is_pending_from_its_start_until_its_row_is_written(store: Store) -> None:
    """What a run watch asks before it takes a round for final: a download under way, or
    finished but not yet written, may still change the round's rows."""
    written = threading.Event()
    hold = threading.Event()
    original = store.mark_downloaded_many

    def _held(
        rows: list[tuple[str, int, float, int | None]], cuts: list[tuple[str, int]]
    ) -> list[str]:
        hold.wait(10)
        return original(rows, cuts)

    store.mark_downloaded_many = _held  # type: ignore[method-assign]
    ledger = DownloadLedger(store, on_written=written.set)
    try:
        ledger.started("t-a")
        ledger.started("t-b")
        ledger.started("t-b")  # a site may download its task twice
        assert ledger.pending() == {"t-a", "t-b"}
        ledger.abandoned("t-b")  # one call ended early: nothing to write
        ledger.record(Download("t-a", 1, 0.1, 1))
        ledger.record(Download("t-b", 1, 0.1, 1))
        assert ledger.pending() == {"t-a", "t-b"}  # finished, not yet written
        assert not written.is_set()
        hold.set()
        assert ledger.flush(10) and written.wait(10)  # and watchers are told
        assert ledger.pending() == set()
    finally:
        hold.set()
        ledger.close()


def test_cut_transfers_are_written_and_pending_until_then(store: Store) -> None:
    ledger = DownloadLedger(store)
    try:
        ledger.started("t-a")
        ledger.abandoned("t-a", 512)  # cut off after 512 bytes: counted, not a download
        ledger.started("t-b")
        ledger.abandoned("t-b")  # nothing had gone out: nothing to count
        assert "t-b" not in ledger.pending()
        ledger.started("t-c")
        ledger.ended("t-c", 64)  # an upload refused after 64 bytes
        ledger.started("t-d")
        ledger.ended("t-d")  # an upload accepted
        assert ledger.flush(10)
        assert ledger.pending() == set()
        cut = {p.site_id: p.bytes_cut for p in store.list_participations(RUN, 1)}
        assert cut == {"a": 512, "b": 0, "c": 64, "d": 0}
        assert _downloads(store)["a"] == ("assigned", 0, None)
    finally:
        ledger.close()


def test_a_cut_after_close_is_not_written(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """A call the shutdown ended: the store may be closed (and its claim given up)."""
    caplog.set_level(logging.INFO, logger="fedra.coordinator")
    ledger = DownloadLedger(store)
    ledger.started("t-a")
    ledger.close()
    ledger.abandoned("t-a", 100)
    assert ledger.pending() == set()
    assert "cut by the shutdown: not counted" in caplog.text
    assert {p.site_id: p.bytes_cut for p in store.list_participations(RUN, 1)}["a"] == 0
