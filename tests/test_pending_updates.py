"""A site's pending top-k update: kept whole on disk, read back exactly, dropped cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedra.client.connection import Assignment
from fedra.client.pending import PendingUpdate, PendingUpdates
from fedra.runspec import CodecSpec, TrainSpec


def _pending(run_id: str = "run-1") -> PendingUpdate:
    task = Assignment(
        task_id="t1", run_id=run_id, round=3, init=False, entry_point="pkg.mod:task",
        train=TrainSpec(local_steps=2, params={"dim": "4"}), seed=5, model_sha256="ab" * 32,
        model_bytes=100, deadline_in_s=9.5, codec=CodecSpec("topk", fraction=0.5),
    )  # fmt: skip
    return PendingUpdate(
        task,
        nonce=bytes(range(16)),
        num_samples=12,
        metrics={"train_loss": 0.25},
        wire={"w.values": torch.tensor([1.5, -2.0]), "w.indices": torch.tensor([0, 3])},
        residual={"w": torch.tensor([0.0, 0.1, 0.2, 0.0])},
    )


def test_a_pending_update_survives_the_process(tmp_path: Path) -> None:
    PendingUpdates(tmp_path).hold(_pending())
    back = PendingUpdates(tmp_path).get("run-1")  # a new process: read from disk
    assert back is not None
    original = _pending()
    assert back.task == original.task and back.nonce == original.nonce
    assert back.num_samples == 12 and back.metrics == {"train_loss": 0.25}
    for got, want in ((back.wire, original.wire), (back.residual, original.residual)):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    PendingUpdates(tmp_path).drop("run-1")
    assert PendingUpdates(tmp_path).get("run-1") is None
    assert not list(tmp_path.iterdir())


def test_a_damaged_pending_file_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "pending-run-1.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    assert PendingUpdates(tmp_path).get("run-1") is None
    assert "unreadable pending update" in caplog.text
    assert not (tmp_path / "pending-run-1.safetensors").exists()


def test_without_a_state_dir_it_is_kept_in_memory() -> None:
    pending = PendingUpdates(None)
    pending.hold(_pending())
    assert pending.get("run-1") is not None and pending.get("run-2") is None
