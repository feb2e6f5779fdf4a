"""The download ledger: finished downloads written in the background, many to a
transaction, all of them before a round commits and before the daemon stops."""

from __future__ import annotations

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


def test_a_failed_write_is_logged_and_the_ledger_goes_on(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = DownloadLedger(store)
    try:
        ledger.record(Download("no-such-task", 1, 0.1, 1))
        assert ledger.flush(10)
        assert "no-such-task was not recorded" in caplog.text
        original = store.mark_downloaded_many

        def _fail(*_args: object) -> list[str]:
            raise RuntimeError("database away")

        store.mark_downloaded_many = _fail  # type: ignore[method-assign]
        ledger.record(Download("t-a", 1, 0.1, 1))
        assert ledger.flush(10)  # given up on, not waited for forever
        assert "could not record 1 finished downloads" in caplog.text
        store.mark_downloaded_many = original  # type: ignore[method-assign]
        ledger.record(Download("t-b", 5, 0.1, 1))
        assert ledger.flush(10)
        assert _downloads(store)["b"] == ("downloaded", 5, 1)
        assert _downloads(store)["a"] == ("assigned", 0, None)
    finally:
        ledger.close()
