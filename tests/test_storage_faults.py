"""Storage faults fail closed: a full disk leaves no partial blob, refuses an upload with
a status the site retries, and makes a commit go back to the last committed round and
try again; a blob whose bytes changed on disk is never served or built on.

A full disk is simulated by making the fsync of a store's temporary files raise
ENOSPC (a real tiny filesystem is not available to tests)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fedra.coordinator.engine.storage_faults import FAULT_EVENT
from fedra.protos.codec import decode
from fedra.protos.v1 import admin_pb2, site_pb2
from fedra.storage import blobs
from fedra.storage.blobs import BlobCorruptError, BlobStore, StorageFullError
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    delta_payload,
    messages,
    model_state,
    round_status,
    start_round_one,
    tasks_of_round,
    upload,
    wait_round,
)


class DiskFull:
    """While ``left`` > 0, each fsync of a temporary file under ``root/tmp`` fails as on a
    full disk, and ``left`` counts down (``None``: for ever)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, left: int | None) -> None:
        self.prefix, self.left, self.hits = str(root / "tmp") + os.sep, left, 0
        self.lock = threading.Lock()
        real = os.fsync

        def fsync(fd: int) -> None:
            if self._fails(os.readlink(f"/proc/self/fd/{fd}")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def _fails(self, path: str) -> bool:
        with self.lock:
            if not path.startswith(self.prefix) or self.left == 0:
                return False
            self.hits += 1
            if self.left is not None:
                self.left -= 1
            return True

    def clear(self) -> None:
        with self.lock:
            self.left = 0


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# -- the blob writer ---------------------------------------------------------------------


class _FullFile:
    """A file on a disk with ``room`` bytes left: past them each write and the flush of
    what is buffered fail with ENOSPC, as close does (after closing, as CPython's)."""

    def __init__(self, f: Any, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return int(self.f.write(data))

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fileno(self) -> int:
        return int(self.f.fileno())

    def close(self) -> None:
        self.f.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("room", [0, 100, 10_000])
def test_a_full_disk_leaves_no_partial_blob_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """Whether the disk fills at a write, at the flush or at the fsync: StorageFullError
    ("disk full"), and neither a blob nor a temporary file is left."""
    store = BlobStore(tmp_path / "blobs")
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FullFile(real_fdopen(fd, mode), room))
    with pytest.raises(StorageFullError, match="disk full") as info:
        store.put_chunks([b"x" * 4000, b"y" * 4000])
    assert info.value.errno == errno.ENOSPC
    assert _files(store.root) == []


def test_a_failed_fsync_leaves_no_partial_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(tmp_path / "blobs")
    full = DiskFull(monkeypatch, store.root, left=1)
    with pytest.raises(StorageFullError, match="disk full"):
        store.put(b"model bytes")
    assert full.hits == 1 and _files(store.root) == []
    digest = store.put(b"model bytes")  # space again: the same write goes through
    assert store.read(digest) == b"model bytes"


def test_a_blob_whose_bytes_changed_is_refused_at_the_end_of_every_read(
    tmp_path: Path,
) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"a" * 1000)
    path = store.path(digest)
    path.write_bytes(b"a" * 999 + b"b")
    with pytest.raises(BlobCorruptError, match=f"blob {digest} is damaged"):
        store.read(digest)
    chunks = store.read_chunks(digest, chunk_bytes=300)
    assert [len(next(chunks)) for _ in range(4)] == [300, 300, 300, 100]
    with pytest.raises(BlobCorruptError):  # instead of the end of the stream
        next(chunks)
    assert b"".join(store.read_chunks(digest, verify=False)) == path.read_bytes()


def test_a_good_blob_is_hashed_once_and_a_changed_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model every site downloads every round is not hashed on every download; a file
    that changed since it was checked (a rewrite, a restore from backup) is."""
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"a" * 1000)
    hashed = []
    real = blobs.hashlib.sha256
    monkeypatch.setattr(blobs.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    for _ in range(3):
        assert store.read(digest) == b"a" * 1000
    assert hashed == []  # hashed as it was written
    store.path(digest).write_bytes(b"a" * 999 + b"b")  # same size, new bytes
    with pytest.raises(BlobCorruptError):
        store.read(digest)
    fresh = BlobStore(tmp_path / "blobs")  # a restarted process checks it again
    with pytest.raises(BlobCorruptError):
        fresh.read(digest)


# -- a running coordinator ---------------------------------------------------------------


def _events(c: InProcessCoordinator, run_id: str, kind: str) -> list[str]:
    return [e.message for e in c.engine._store.list_events(run_id) if e.kind == kind]


def test_an_upload_that_finds_the_disk_full_is_unavailable_and_changes_nothing(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator.engine.updates.small_bytes = 0  # spooled as files, however small
    run_id, tasks = start_round_one(coordinator)
    (site, task), (other_site, other_task) = sorted(tasks.items())
    full = DiskFull(monkeypatch, coordinator.engine.updates.root, left=None)
    payload, nonce = delta_payload(), os.urandom(16)
    with pytest.raises(grpc.RpcError) as info:
        upload(coordinator, messages(task, site, payload, nonce=nonce))
    # UNAVAILABLE: the site retries it (client.connection.TRANSIENT), the same update.
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "disk full" in info.value.details()
    assert full.hits == 1
    assert _files(coordinator.engine.updates.root) == []  # nothing spooled, not even half
    r1 = round_status(coordinator, run_id, 1)
    assert r1.status == "open" and r1.updates == 0
    assert {p.status for p in r1.participations} <= {"assigned", "downloaded"}
    full.clear()  # space again: the retry of the same update is accepted
    upload(coordinator, messages(task, site, payload, nonce=nonce))
    upload(coordinator, messages(other_task, other_site, payload))
    assert wait_round(coordinator, run_id, 1, "committed").updates == 2


def test_a_commit_that_finds_the_disk_full_is_retried_and_lands_once(
    coordinator: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1's model blob cannot be written twice over: the driver records the fault,
    goes back to round 0 (the updates are folded again from the spool) and commits when
    there is space; the result is the round's mean, applied once."""
    run_id, tasks = start_round_one(coordinator, rounds=1, strategy="fedavgm")
    initial = model_state()
    full = DiskFull(monkeypatch, coordinator.engine.models.root, left=2)
    for i, (site, task) in enumerate(sorted(tasks.items())):
        upload(coordinator, messages(task, site, delta_payload(0.1 * (i + 1)), num_samples=10))
    status = _finished(coordinator, run_id)
    assert status.state == "completed", status.reason
    assert full.hits == 2
    faults = _events(coordinator, run_id, FAULT_EVENT)
    assert len(faults) == 2 and all("disk full" in f for f in faults), faults
    assert "carried on from round 0, the last committed" in faults[0]
    assert [r.number for r in status.rounds] == [0, 1]
    assert [c.round_number for c in coordinator.engine._store.list_checkpoints(run_id)] == [0, 1]
    export = coordinator.admin.ExportModel(admin_pb2.ExportModelRequest(run_id=run_id, round=1))
    model = decode(b"".join(m.data for m in export))
    for k, v in initial.items():  # server momentum's first step is the mean: (0.1 + 0.2) / 2
        torch.testing.assert_close(model[k], v + 0.15)
    assert not _files(coordinator.engine.models.root / "tmp")  # no partial blob left


def _finished(c: InProcessCoordinator, run_id: str) -> admin_pb2.RunStatus:
    for status in c.admin.WatchRun(admin_pb2.WatchRunRequest(run_id=run_id), timeout=60):
        if status.state in ("completed", "failed", "cancelled"):
            return status
    raise AssertionError(f"run {run_id} did not finish")


def _damage(store: BlobStore, digest: str) -> None:
    path = store.path(digest)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a flipped bit in the last tensor: it still decodes
    path.write_bytes(bytes(data))


def _download(c: InProcessCoordinator, site: str, task: site_pb2.Task) -> Iterator[bytes]:
    request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id)
    for m in c.site.DownloadModel(request, timeout=30):
        yield m.data


def test_a_damaged_model_blob_is_never_served_nor_built_on(
    coordinator: InProcessCoordinator,
) -> None:
    """Round 1's committed model changes on disk while the daemon runs: a download of it
    ends in an error, not in the bytes; the next commit, which reads it, ends the run
    with the reason and commits nothing."""
    run_id, tasks = start_round_one(coordinator, rounds=3)
    for site, task in sorted(tasks.items()):
        upload(coordinator, messages(task, site, delta_payload()))
    model_sha = wait_round(coordinator, run_id, 1, "committed").model_sha256
    _damage(coordinator.engine.models, model_sha)
    round2 = tasks_of_round(coordinator, run_id, 2)
    site, task = sorted(round2.items())[0]
    with pytest.raises(grpc.RpcError) as info:
        b"".join(_download(coordinator, site, task))
    assert info.value.code() != grpc.StatusCode.OK
    for site, task in sorted(round2.items()):  # sites that kept round 1's model need none
        upload(coordinator, messages(task, site, delta_payload()))
    status = _finished(coordinator, run_id)
    assert status.state == "failed"
    assert f"blob {model_sha} is damaged" in status.reason, status.reason
    assert [c.round_number for c in coordinator.engine._store.list_checkpoints(run_id)] == [0, 1]
    assert any("damaged" in m for m in _events(coordinator, run_id, "failed"))


def test_only_faults_that_can_heal_are_waited_out() -> None:
    """A dropped connection or a full disk is ridden out; a broken schema is not."""
    from sqlalchemy.exc import OperationalError

    from fedra.storage.store import transient_fault

    gone = OperationalError("SELECT 1", {}, Exception("server closed the connection"))
    broken = OperationalError("SELECT 1", {}, Exception("no such table: rounds"))
    assert "database is unavailable" in transient_fault(gone)
    assert transient_fault(broken) == ""
    assert transient_fault(OSError(errno.ENOSPC, "No space left on device")).startswith("disk")
    assert transient_fault(ValueError("a bug")) == ""
