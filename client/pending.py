"""An update that was sent but is not yet known to count, kept until it is.

Some updates leave state behind that may move on only if they count: top-k error
feedback carries what an update did not send into the next one, and a run that keeps the
inner optimiser state or SCAFFOLD's c_i stages the round's (``optstate.TwoGenerations``)
until its update is accepted. A site killed after the coordinator accepted the update
but before it heard so would otherwise lose that state, or keep state from an update that
never counted. So the update, as sent, is kept here, in one file written atomically before
the first byte is sent. A site that comes back settles it with its next task of the run:
it sends the update once more with the same nonce, and the coordinator answers it as
accepted (it counted, or is counting) or refuses it (its attempt failed, or it never
arrived). A staged state is promoted on an accept; a top-k residual moves on only once
the next task shows the round counted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedra.client.connection import Assignment
from fedra.files import write_atomic
from fedra.protos.codec import decode_chunks, encode_chunks
from fedra.runspec import CodecSpec, TrainSpec

_HEADER = "pending/header"  # the JSON below, as bytes in a uint8 tensor
_WIRE, _RESIDUAL = "wire/", "residual/"
_FILE_CHUNK_BYTES = 1 << 20
log = logging.getLogger("fedra.site")


@dataclass(frozen=True)
class PendingUpdate:
    """An update as sent (``wire``, ``nonce``) and the residual it leaves if it counts."""

    task: Assignment
    nonce: bytes
    num_samples: int
    metrics: dict[str, float]
    wire: dict[str, torch.Tensor]
    residual: dict[str, torch.Tensor]

    def save(self, path: Path) -> None:
        """Write it whole or not at all (temp file, fsync, rename)."""
        header = {
            "task": {k: v for k, v in asdict(self.task).items() if k != "model"},
            "nonce": self.nonce.hex(),
            "num_samples": self.num_samples,
            "metrics": self.metrics,
        }
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        tensors = {_HEADER: raw}
        tensors.update({_WIRE + k: v for k, v in self.wire.items()})
        tensors.update({_RESIDUAL + k: v for k, v in self.residual.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, encode_chunks(tensors))

    @classmethod
    def load(cls, path: Path) -> PendingUpdate:
        """Read one back; ValueError if the file is not one (damaged, or another kind)."""
        with path.open("rb") as file:
            tensors = decode_chunks(iter(lambda: file.read(_FILE_CHUNK_BYTES), b""))
        if _HEADER not in tensors:
            raise ValueError(f"{path} holds no pending update")
        header: dict[str, Any] = json.loads(bytes(tensors.pop(_HEADER).numpy()))
        return cls(
            task=_assignment(header["task"]),
            nonce=bytes.fromhex(header["nonce"]),
            num_samples=int(header["num_samples"]),
            metrics={str(k): float(v) for k, v in header["metrics"].items()},
            wire=dict(_strip(tensors, _WIRE)),
            residual=dict(_strip(tensors, _RESIDUAL)),
        )


class PendingUpdates:
    """A site's pending updates, one per run at most: in memory, and in ``state_dir``
    (when the site has one) so that they outlive the process."""

    def __init__(self, state_dir: Path | None) -> None:
        self.state_dir = state_dir
        self._held: dict[str, PendingUpdate] = {}

    def _path(self, run_id: str) -> Path | None:
        return None if self.state_dir is None else self.state_dir / f"pending-{run_id}.safetensors"

    def hold(self, pending: PendingUpdate) -> None:
        """Keep it, durably, before any of it is sent."""
        path = self._path(pending.task.run_id)
        if path is not None:
            pending.save(path)
        self._held[pending.task.run_id] = pending

    def drop(self, run_id: str) -> None:
        self._held.pop(run_id, None)
        path = self._path(run_id)
        if path is not None:
            path.unlink(missing_ok=True)

    def get(self, run_id: str) -> PendingUpdate | None:
        """The run's pending update: held, or left behind by a site that was killed."""
        found = self._held.get(run_id)
        path = self._path(run_id)
        if found is None and path is not None and path.exists():
            try:
                found = self._held[run_id] = PendingUpdate.load(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping an unreadable pending update %s: %s", path, exc)
                self.drop(run_id)
        return found


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor


def _assignment(raw: dict[str, Any]) -> Assignment:
    if raw.get("secagg") is not None:
        raise ValueError("a masked update is never kept pending")
    return Assignment(
        **{
            **raw,
            "train": TrainSpec(**raw["train"]),
            "codec": CodecSpec(**raw["codec"]),
        }
    )
