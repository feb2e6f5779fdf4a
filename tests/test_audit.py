"""The audit log: every append chained to the one before, and any edit, deletion,
reordering or cut found by ``verify``, naming the first bad entry."""

from __future__ import annotations

import itertools
import json
import multiprocessing
from pathlib import Path

import pytest

from fedra.audit import GENESIS, AuditError, AuditLog, read, verify


def _log(tmp_path: Path, n: int = 5) -> AuditLog:
    log = AuditLog(tmp_path / "audit.jsonl")
    for i in range(n):
        log.append("round.commit", "", run="r1", round=i, model_sha256=f"{i:064x}")
    return log


def _lines(log: AuditLog) -> list[str]:
    return log.path.read_text().splitlines()


def _write(log: AuditLog, lines: list[str]) -> None:
    log.path.write_text("".join(line + "\n" for line in lines))


def test_entries_chain_and_verify(tmp_path: Path) -> None:
    log = _log(tmp_path)
    entries = verify(log.path)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert entries[0].prev == GENESIS
    assert all(b.prev == a.hash for a, b in itertools.pairwise(entries))
    assert entries[3].data == {"run": "r1", "round": 3, "model_sha256": f"{3:064x}"}
    head = json.loads(log.head_path.read_text())
    assert (head["seq"], head["hash"]) == (5, entries[-1].hash)
    assert verify(log.path, head=entries[2].hash) == entries  # a hash kept elsewhere
    assert verify(tmp_path / "none.jsonl") == []  # nothing written yet


def test_an_edited_entry_is_found(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log)
    doc = json.loads(lines[2])
    doc["data"]["model_sha256"] = "f" * 64
    lines[2] = json.dumps(doc, sort_keys=True)
    _write(log, lines)
    with pytest.raises(AuditError, match=r"^line 3 \(seq 3\): edited"):
        verify(log.path)


def test_an_edited_entry_rehashed_breaks_the_chain_after_it(tmp_path: Path) -> None:
    from fedra.audit import _digest

    log = _log(tmp_path)
    lines = _lines(log)
    doc = json.loads(lines[1])
    doc["who"] = "admin mallory"
    doc["hash"] = _digest(doc)  # a forger who rehashes the entry itself
    lines[1] = json.dumps(doc, sort_keys=True)
    _write(log, lines)
    with pytest.raises(AuditError, match=r"^line 3 \(seq 3\): its prev is not the hash"):
        verify(log.path)


def test_a_deleted_entry_is_found(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log)
    del lines[1]
    _write(log, lines)
    with pytest.raises(AuditError, match=r"^line 2 \(seq 3\): expected seq 2: entries missing"):
        verify(log.path)


def test_reordered_entries_are_found(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log)
    lines[1], lines[2] = lines[2], lines[1]
    _write(log, lines)
    with pytest.raises(AuditError, match=r"^line 2 \(seq 3\): expected seq 2"):
        verify(log.path)


def test_entries_cut_off_the_end_are_found(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log)
    kept = verify(log.path)[2].hash
    _write(log, lines[:3])
    with pytest.raises(AuditError, match="ends at seq 3 but its head says 5: entries were cut"):
        verify(log.path)
    with pytest.raises(AuditError, match="head names seq 5: entries were cut off"):
        log.append("after-the-cut")  # nothing is chained onto a cut log
    log.head_path.unlink()  # the head removed too: found missing; one kept elsewhere tells
    with pytest.raises(AuditError, match="is missing beside a log of 3 entries"):
        verify(log.path)
    with pytest.raises(AuditError, match="is missing beside a log of 3 entries"):
        log.append("after-the-cut")
    with pytest.raises(AuditError, match="no entry has the hash"):
        verify(log.path, head=json.loads(lines[4])["hash"])
    assert len(verify(log.path, head=kept)) == 3


def test_a_rewritten_log_is_found_against_its_head(tmp_path: Path) -> None:
    log = _log(tmp_path)
    head = log.head_path.read_text()
    log.path.unlink()
    log.head_path.unlink()
    _log(tmp_path)  # a fresh chain of as many entries: valid on its own
    log.head_path.write_text(head)  # the old head, kept
    with pytest.raises(AuditError, match="seq 5: not the entry the head file names"):
        verify(log.path)


def test_a_write_cut_short_by_a_crash_is_dropped_at_the_next_append(tmp_path: Path) -> None:
    log = _log(tmp_path, 3)
    with log.path.open("a") as f:
        f.write('{"seq": 4, "time": 1.0, "event": "round.co')  # SIGKILL mid-write
    log.append("after", "")
    entries = verify(log.path)
    assert [(e.seq, e.event) for e in entries][-2:] == [(3, "round.commit"), (4, "after")]


def test_a_torn_last_line_is_not_tampering_and_any_text_survives(tmp_path: Path) -> None:
    log = _log(tmp_path, 2)
    log.append("run.submit", "admin ops", name="line\u2028separator\u0085next")
    with log.path.open("a") as f:
        f.write('{"seq": 4, "ti')  # a crash mid-append: never acknowledged
    entries = verify(log.path)
    assert len(entries) == 3 and entries[2].data["name"] == "line\u2028separator\u0085next"


def test_garbage_is_named_by_its_line(tmp_path: Path) -> None:
    log = _log(tmp_path, 2)
    with log.path.open("a") as f:
        f.write('{"seq": 3}\n')
    with pytest.raises(AuditError, match=r"^line 3: not an audit entry"):
        verify(log.path)
    with pytest.raises(AuditError, match="last entry is unreadable"):  # no append onto it
        log.append("x")


def test_an_entry_too_large_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    log = _log(tmp_path, 1)
    with pytest.raises(AuditError, match="too large"):
        log.append("x", note="y" * 100_000)
    assert len(read(log.path)) == 1


def _append_many(path: str, tag: str, n: int) -> None:
    log = AuditLog(Path(path))
    for i in range(n):
        log.append("test", tag, i=i)


def test_appends_from_several_processes_keep_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(path), f"p{k}", 40)) for k in range(3)]
    try:
        for p in procs:
            p.start()
        _append_many(str(path), "main", 40)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode} (None: it hung)"
    finally:  # a writer that hangs is not left behind
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    entries = verify(path)
    assert len(entries) == 160
    assert {e.who for e in entries} == {"p0", "p1", "p2", "main"}
