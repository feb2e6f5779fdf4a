"""An append-only, tamper-evident audit log: JSON lines, each chained to the one before.

Each entry is one line of JSON::

    {"seq": 7, "time": 1764755012.31, "event": "run.submit", "who": "admin ops",
     "data": {...}, "prev": "<hash of entry 6>", "hash": "<SHA-256 of this entry>"}

``hash`` is the SHA-256 of the entry's canonical JSON (sorted keys, no spaces) without
its ``hash``; ``prev`` is the previous entry's ``hash`` (64 zeros for the first). An
edited entry no longer matches its hash; a deleted or reordered one breaks the chain of
``seq`` and ``prev``. The last entry's sequence number and hash are also kept in a head
file beside the log (``<log>.head``), written after each append, so that cutting
entries off the end shows too; ``fedra audit --verify`` prints the head, and an
operator who keeps it elsewhere (a ticket, another machine) can check a log against it
long after (``--head HASH``).

Appends are durable (fsync) before ``append`` returns, and serialised across processes
with an advisory lock on the log: the daemon and a CLI command (``fedra revoke``) may
both write to one log.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedra.files import write_atomic

log = logging.getLogger("fedra.audit")

GENESIS = "0" * 64
AUDIT_FILE = "audit.jsonl"  # in a coordinator's or a site's state directory
_KEYS = ("seq", "time", "event", "who", "data", "prev", "hash")
_TAIL_BYTES = 1 << 16  # an entry is far shorter; the tail read finds the last one in it
MAX_ENTRY_BYTES = _TAIL_BYTES // 2


class AuditError(Exception):
    """The log cannot be written, or (from ``verify``) it has been tampered with; the
    message names the first bad entry by its line."""


@dataclass(frozen=True)
class Entry:
    seq: int
    time: float
    event: str
    who: str
    data: Mapping[str, Any]
    prev: str
    hash: str

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KEYS}


def _digest(fields: Mapping[str, Any]) -> str:
    body = {k: fields[k] for k in _KEYS if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class AuditLog:
    """One log file; ``append`` is safe from any thread and from several processes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.head_path = self.path.with_name(self.path.name + ".head")
        self._lock = threading.Lock()

    def append(self, event: str, who: str = "", **data: Any) -> Entry:
        """Write one entry durably and return it; AuditError if it cannot be written."""
        with self._lock, self._locked() as f:
            last = _last_entry(f)
            self._check_head(last)
            seq, prev = (last.seq + 1, last.hash) if last else (1, GENESIS)
            fields: dict[str, Any] = {
                "seq": seq, "time": round(time.time(), 6), "event": event, "who": who,
                "data": data, "prev": prev,
            }  # fmt: skip
            fields["hash"] = _digest(fields)
            line = json.dumps(fields, sort_keys=True, ensure_ascii=False) + "\n"
            if len(line.encode()) > MAX_ENTRY_BYTES:
                raise AuditError(f"audit entry {event!r} is too large ({len(line)} characters)")
            f.seek(0, os.SEEK_END)
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
            entry = Entry(**fields)
            head = {"seq": seq, "hash": entry.hash, "log": self.path.name}
            write_atomic(self.head_path, [json.dumps(head).encode() + b"\n"])
            return entry

    def _check_head(self, last: Entry | None) -> None:
        """Refuse to append after entries cut off the end: the head file, written after
        each append, must name the log's last entry (or, a crash between the append and
        the head's write, the one before it)."""
        try:
            head = json.loads(self.head_path.read_bytes())
            kept_seq, kept_hash = int(head["seq"]), str(head["hash"])
        except FileNotFoundError:
            if last is None:
                return
            raise AuditError(
                f"{self.head_path} is missing beside a log of {last.seq} entries: run "
                "`fedra audit --verify` and keep the log aside before anything is appended"
            ) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise AuditError(f"{self.head_path}: unreadable: {exc}") from None
        at = last.seq if last else 0
        if kept_seq == at and (last is None or kept_hash == last.hash):
            return
        if last is not None and kept_seq == at - 1 and kept_hash == last.prev:
            return  # the last append's head write was cut short by a crash
        raise AuditError(
            f"the audit log ends at seq {at} but its head names seq {kept_seq}: entries were "
            "cut off or rewritten; run `fedra audit --verify` and keep the log aside"
        )

    def record(self, event: str, who: str = "", **data: Any) -> None:
        """``append``, for a record that must not stop what it records: an entry that
        cannot be written is logged as an error instead of raised."""
        try:
            self.append(event, who, **data)
        except (AuditError, OSError) as exc:
            log.error("audit: could not record %s by %s in %s: %s", event, who or "-",
                      self.path, exc)  # fmt: skip

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+b")  # noqa: SIM115 - held under the lock below
        except OSError as exc:
            raise AuditError(f"cannot open the audit log {self.path}: {exc}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            yield f
        finally:
            f.close()  # releases the lock


def _last_entry(f: Any) -> Entry | None:
    """The last complete entry of an open, locked log, read from its tail. A last line
    without its newline is a write a crash cut short (never acknowledged: ``append``
    returns only once the whole line is synced): it is cut off before the next."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return None
    start = max(0, end - _TAIL_BYTES)
    f.seek(start)
    tail = f.read()
    if not tail.endswith(b"\n"):
        cut = tail.rfind(b"\n") + 1  # 0: the torn write is the whole tail read
        if cut == 0 and start > 0:
            raise AuditError("the audit log's last line is too long to be an entry")
        f.truncate(start + cut)
        os.fsync(f.fileno())
        tail = tail[:cut]
    for raw in reversed(tail.splitlines()):
        if raw.strip():
            try:
                return _parse(raw, 0)
            except AuditError:
                raise AuditError(
                    "the audit log's last entry is unreadable; run `fedra audit --verify` "
                    "and keep the log aside before anything is appended"
                ) from None
    return None


def _parse(raw: bytes | str, line_no: int) -> Entry:
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or set(doc) != set(_KEYS):
            raise ValueError(f"keys {sorted(doc) if isinstance(doc, dict) else type(doc)}")
        return Entry(
            seq=int(doc["seq"]), time=float(doc["time"]), event=str(doc["event"]),
            who=str(doc["who"]), data=dict(doc["data"]), prev=str(doc["prev"]),
            hash=str(doc["hash"]),
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise AuditError(f"line {line_no}: not an audit entry: {exc}") from None


def read(path: Path) -> list[Entry]:
    """Every entry of the log, in order (none for a log not yet written)."""
    return [_parse(raw, n) for n, raw in enumerate(_lines(Path(path)), 1) if raw.strip()]


def _lines(path: Path) -> list[bytes]:
    """The log's lines, split at newlines only (an entry's text may hold U+2028 and the
    like, which ``str.splitlines`` would split at). A last line without its newline (a
    write a crash cut short, never acknowledged) is left out."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # not while an append is half done
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    return lines[:-1]  # after the last newline: b"", or a torn write


def verify(path: Path, head: str | None = None) -> list[Entry]:
    """The entries, once the chain checks out; AuditError naming the first bad line
    otherwise. The end is checked against the head file beside the log, and against
    ``head`` (a hash kept elsewhere) when given: it must be the hash of some entry."""
    path = Path(path)
    entries: list[Entry] = []
    prev, seq = GENESIS, 0
    head_path = path.with_name(path.name + ".head")
    try:
        with open(path, "rb") as f:  # the log and its head as of one instant
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            data = f.read()
            head_bytes = head_path.read_bytes() if head_path.exists() else None
    except FileNotFoundError:
        data, head_bytes = b"", head_path.read_bytes() if head_path.exists() else None
    lines = data.split(b"\n")[:-1]  # a torn last write (a crash) is not an entry yet
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        e = _parse(raw, n)
        if e.hash != _digest(e.as_dict()):
            raise AuditError(f"line {n} (seq {e.seq}): edited: its hash does not match it")
        if e.seq != seq + 1:
            what = "missing before it" if e.seq > seq + 1 else "out of order"
            raise AuditError(f"line {n} (seq {e.seq}): expected seq {seq + 1}: entries {what}")
        if e.prev != prev:
            raise AuditError(f"line {n} (seq {e.seq}): its prev is not the hash of the one before")
        entries.append(e)
        prev, seq = e.hash, e.seq
    try:
        if head_bytes is None:
            if entries and head is None:  # a head kept elsewhere stands in for it
                raise AuditError(f"{head_path} is missing beside a log of {seq} entries")
            kept_seq, kept_hash = 0, GENESIS
        else:
            kept = json.loads(head_bytes)
            kept_seq, kept_hash = int(kept["seq"]), str(kept["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise AuditError(f"{head_path}: unreadable: {exc}") from None
    if kept_seq > seq:
        raise AuditError(
            f"the log ends at seq {seq} but its head says {kept_seq}: entries were cut off the end"
        )
    # A head behind the log: a crash between the append and the head's write, or the
    # head restored from an earlier copy; either way the entry it names must be there.
    if kept_seq and (kept_seq > len(entries) or entries[kept_seq - 1].hash != kept_hash):
        raise AuditError(
            f"seq {kept_seq}: not the entry the head file names: the log was rewritten"
        )
    if head is not None and head not in {e.hash for e in entries}:
        raise AuditError(f"no entry has the hash {head}: the log was rewritten or cut short")
    return entries


def head_of(entries: list[Entry]) -> tuple[int, str]:
    """(seq, hash) of the last entry; (0, GENESIS) for none."""
    return (entries[-1].seq, entries[-1].hash) if entries else (0, GENESIS)
