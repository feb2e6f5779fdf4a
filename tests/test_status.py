"""A round's status from its stored rows: the bytes lost to work that did not count, the
time its sites sat idle, and how the CLI shows them."""

from __future__ import annotations

import pytest

from fedra.cli import format_round, format_status, format_totals
from fedra.coordinator.status import round_statuses
from fedra.protos.v1 import admin_pb2
from fedra.storage.records import ParticipationRecord, RoundRecord, RunRecord, RunView

RUN = RunRecord("r1", "demo", "task", "{}", "running", "", 1, 0.0, 0.0)
MB = 1_000_000


def _round(number: int, state: str, attempt: int = 1, duration: float = 10.0) -> RoundRecord:
    closed = None if state == "open" else 100.0 + duration
    return RoundRecord("r1", number, attempt, state, ("a", "b", "c"), 100.0, 200.0, closed)


def _part(
    site: str,
    state: str,
    attempt: int = 1,
    number: int = 1,
    down: int = MB,
    up: int = MB,
    download_s: float = 1.0,
    compute_s: float = 2.0,
    upload_s: float = 3.0,
) -> ParticipationRecord:
    return ParticipationRecord(
        task_id=f"{site}-{number}-{attempt}",
        run_id="r1",
        round_number=number,
        attempt=attempt,
        site_id=site,
        state=state,
        assigned_at=100.0,
        bytes_down=down,
        bytes_up=up if state == "accepted" else 0,
        download_s=0.5,  # the coordinator's measure: the site's own comes first
        upload_s=upload_s,
        metrics={"download_s": download_s, "compute_s": compute_s},
    )


def _status(r: RoundRecord, parts: list[ParticipationRecord]) -> admin_pb2.RoundStatus:
    return round_statuses(RunView(RUN, [r], parts, []))[0][r.number]


def test_a_committed_round_loses_what_it_did_not_use() -> None:
    parts = [
        _part("a", "accepted", attempt=1),  # its attempt failed: dropped with it
        _part("b", "failed", attempt=1, down=MB // 2),
        _part("a", "accepted", attempt=2),
        _part("b", "accepted", attempt=2),
        _part("c", "failed", attempt=2, down=MB),  # crashed after its download
        _part("d", "expired", attempt=2, down=0),  # too late: its round closed first
    ]
    s = _status(_round(1, "committed", attempt=2), parts)
    assert s.lost_bytes == 2 * MB + MB // 2 + MB
    assert s.bytes_down + s.bytes_up == 7 * MB + MB // 2


def test_cut_transfers_are_lost_even_for_a_task_that_counted() -> None:
    retried = ParticipationRecord(**{**_part("a", "accepted").__dict__, "bytes_cut": 300})
    s = _status(_round(1, "committed"), [retried, _part("b", "failed", down=MB)])
    assert s.cut_bytes == 300 and s.lost_bytes == MB + 300
    assert s.participations[0].bytes_cut == 300
    assert format_totals([s]).startswith(f"{(3 * MB + 300) / 1e6:.3f} MB on the wire")


def test_an_async_task_still_training_past_its_round_s_commit_is_not_lost() -> None:
    # Carried on into the next round (open_round moves it there): it may still count.
    parts = [_part("a", "accepted"), _part("b", "downloaded"), _part("c", "assigned", down=0)]
    assert _status(_round(1, "committed"), parts).lost_bytes == 0


def test_an_open_round_loses_only_what_cannot_count_any_more() -> None:
    parts = [
        _part("a", "accepted", attempt=1),  # an earlier attempt: lost
        _part("a", "accepted", attempt=2),  # may still count
        _part("b", "downloaded", attempt=2),  # still working
        _part("c", "failed", attempt=2),
    ]
    assert _status(_round(1, "open", attempt=2), parts).lost_bytes == 2 * MB + MB


@pytest.mark.parametrize("state", ["failed", "cancelled"])
def test_the_round_a_run_ended_in_loses_everything(state: str) -> None:
    parts = [_part("a", "accepted"), _part("b", "accepted"), _part("c", "downloaded")]
    assert _status(_round(1, state), parts).lost_bytes == 5 * MB


def test_idle_is_the_round_less_each_used_site_s_own_work() -> None:
    parts = [
        _part("a", "accepted", download_s=1.0, compute_s=2.0, upload_s=3.0),  # 4 s idle
        _part("b", "accepted", download_s=2.0, compute_s=4.0, upload_s=4.0),  # 0 s idle
        _part("c", "failed", download_s=0.0, compute_s=0.0, upload_s=0.0),  # not counted
        _part("a", "accepted", attempt=0, download_s=0.0, compute_s=0.0, upload_s=0.0),
    ]
    s = _status(_round(1, "committed", duration=10.0), parts)
    assert s.site_idle_s == pytest.approx(2.0)
    assert "idle  20%" in format_round(s)


def test_a_site_that_measured_more_than_the_round_is_never_negative_idle() -> None:
    parts = [_part("a", "accepted", compute_s=50.0), _part("b", "accepted", compute_s=0.0)]
    s = _status(_round(1, "committed", duration=10.0), parts)
    assert s.site_idle_s == pytest.approx((0.0 + 6.0) / 2)


def test_an_async_task_carried_in_counts_its_idle_time_from_its_own_assignment() -> None:
    # Assigned 20 s before this round opened (at 100): 30 s to the commit, 6 s of work.
    carried = ParticipationRecord(**{**_part("a", "accepted").__dict__, "assigned_at": 80.0})
    s = _status(_round(1, "committed", duration=10.0), [carried])
    assert s.site_idle_s == pytest.approx(24.0)
    assert "idle 100%" in format_round(s)  # a share of the round: never above all of it


def test_without_its_own_measure_the_coordinator_s_download_time_is_used() -> None:
    p = _part("a", "accepted", compute_s=1.0, upload_s=1.0)
    bare = ParticipationRecord(**{**p.__dict__, "metrics": {"compute_s": 1.0}})
    s = _status(_round(1, "committed", duration=10.0), [bare])
    assert s.site_idle_s == pytest.approx(10.0 - 0.5 - 1.0 - 1.0)


def test_open_and_failed_rounds_have_no_idle_figure() -> None:
    for state in ("open", "failed", "cancelled"):
        s = _status(_round(1, state), [_part("a", "accepted")])
        assert s.site_idle_s == 0.0
        assert "idle" not in format_round(s)


def test_the_cli_shows_lost_bytes_and_sums_the_run_up() -> None:
    def used(number: int) -> ParticipationRecord:
        return _part("a", "accepted", number=number, download_s=1, compute_s=1, upload_s=1)

    r1 = _status(_round(1, "committed", duration=4.0), [used(1), _part("b", "failed")])
    r2 = _status(_round(2, "committed", duration=6.0), [used(2)])
    assert format_round(r1).endswith("lost 1.000 MB")
    small = admin_pb2.RoundStatus(number=3, status="committed", lost_bytes=1234)
    assert format_round(small).endswith("lost 1.2 kB")
    assert "lost" not in format_round(r2)
    # 5 MB moved, 1 of it lost; idle 1 s of 4 and 3 s of 6: 4 of 10 s.
    assert format_totals([r1, r2]) == (
        "5.000 MB on the wire, 1.000 MB (20%) of it for work that did not count; "
        "sites sat idle 40% of their rounds"
    )
    status = admin_pb2.RunStatus(run_id="r1", state="running", rounds=[r1, r2])
    assert format_status(status).splitlines()[-1] == format_totals([r1, r2]) + " (rounds 1 on)"
    assert format_totals([]) == "0 B on the wire"
