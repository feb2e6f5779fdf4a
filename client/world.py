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


def init_world(backend: str = "auto", node_rank: int = 0) -> World:
    """Join the process group torchrun set up in the environment; on several nodes, with
    the ranks in the order of the nodes' ``node_rank`` (``[parallel]``)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = _attempt_store()
    # Training collectives fail after this long rather than hang the site forever.
    dist.init_process_group(
        backend,
        store=store,
        rank=node_ordered_rank(store, node_rank),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=TRAIN_TIMEOUT,
    )
    return World.current()


def node_ordered_rank(store: Store, node_rank: int) -> int:
    """This process's rank with the nodes in ``node_rank`` order: node 0's processes first.

    The rendezvous numbers nodes in the order they joined (``GROUP_RANK``); each node's
    first process publishes its configured ``node_rank`` under its group rank, and every
    process ranks the nodes present by it. Rank 0 is then node 0's first process whenever
    node 0 is in the world."""
    groups = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if groups == 1:
        return int(os.environ["RANK"])
    group, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    if local == 0:
        store.set(f"fedra/node_rank/{group}", str(node_rank))
    said = [int(store.get(f"fedra/node_rank/{g}")) for g in range(groups)]
    twice = sorted({r for r in said if said.count(r) > 1})
    if twice:
        raise RuntimeError(
            f"two nodes of this site say [parallel] node_rank {twice[0]}: give each node "
            "its own node_rank"
        )
    order = sorted(range(groups), key=said.__getitem__)
    return order.index(group) * int(os.environ["LOCAL_WORLD_SIZE"]) + local


def _attempt_store() -> Store:
    """The rendezvous store, under a prefix unique to this restart of the local world.

    After a restart, a rank could otherwise read the address the previous attempt's
    rank 0 published and fail to connect to a process that no longer exists. (A site on
    several nodes gets a fresh store for each world instead: its nodes' restart counts
    differ, so none needs a prefix, and none may have one.)
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
    if not agent_hosts_store:  # a store of this world's own
        return PrefixStore("fedra/world", store)
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
