"""The site's local world: process group set-up and the control channel from rank 0.

Rank 0 talks to the coordinator; the other ranks wait for instructions. Instructions
are small JSON messages broadcast over a dedicated gloo group with a long timeout
(ranks may idle for hours between rounds); tensors then move over the main group.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from fedra.client.parallel.plan import World

# Followers block in the control broadcast between rounds: allow a long idle time.
CONTROL_TIMEOUT = timedelta(days=30)
TRAIN_TIMEOUT = timedelta(minutes=10)


def init_world(backend: str = "auto") -> World:
    """Join the process group torchrun set up in the environment."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Training collectives fail after this long rather than hang the site forever.
    dist.init_process_group(
        backend,
        store=_attempt_store(),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=TRAIN_TIMEOUT,
    )
    return World.current()


def _attempt_store() -> Store:
    """The rendezvous store, under a prefix unique to this restart of the local world.

    After a restart, a rank could otherwise read the address the previous attempt's
    rank 0 published and fail to connect to a process that no longer exists.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ["RANK"])
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_hosts_store and rank == 0,
        timeout=timedelta(minutes=5),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"fedra/attempt_{attempt}", store)


class ControlChannel:
    """JSON messages from rank 0 to every other rank."""

    def __init__(self) -> None:
        # Every rank must create the group, in the same order.
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message).encode()
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> dict[str, Any]:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.group)
        message: dict[str, Any] = json.loads(payload.numpy().tobytes())
        return message
