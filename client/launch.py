"""Starting a site's local world with torch's elastic agent (what torchrun uses).

``fedra site`` with ``[parallel] nproc > 1`` becomes the elastic agent: it starts
``nproc`` workers (``fedra.client.worker``), watches them, and when one dies stops
the others and starts the world again, up to ``max_restarts`` times.

A site on several machines runs ``fedra site`` on each (``[parallel] nnodes``, its own
``node_rank``): the agents meet at ``rdzv_endpoint`` (c10d rendezvous, hosted by node
0's agent) and form one world, node after node in ``node_rank`` order, so rank 0, the
one that talks to the coordinator, is on node 0. With an elastic ``nnodes = "MIN:MAX"``
the world forms again with the nodes that remain when one fails, and again when it
comes back; with a fixed count it waits for the missing node.
"""

from __future__ import annotations

import math
import os
import sys
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fedra.client.config import SiteConfig
from fedra.httpserve import HttpServer, Replies


def launch_world(config: SiteConfig, config_path: Path) -> None:
    """Run the local world until it stops (returns) or exhausts its restarts (raises)."""
    if config.metrics.http:
        # Rank 0 serves it; a port in use would fail every restart of the world in turn.
        # Said once, here, before any worker starts (ConfigError naming the key).
        HttpServer(config.metrics.http, "metrics.http", Replies).stop()
    p = config.parallel
    if p.multi_node:
        # A store of its own for each rendezvous round (on the node that gets rank 0)
        # rather than the agents' shared one: a node that joins later counts its
        # restarts from 0, so the restart count cannot name a round across nodes.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        run_id, endpoint = p.rdzv_id or config.site_id, p.rdzv_endpoint
    else:
        # A free port on this host only: a site on one node opens nothing outside.
        run_id, endpoint = f"{config.site_id}-{uuid.uuid4().hex[:8]}", "127.0.0.1:0"
    launch = LaunchConfig(
        min_nodes=p.min_nodes,
        max_nodes=p.max_nodes,
        nproc_per_node=p.nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        # Node 0 hosts the rendezvous at its endpoint; the others join it there.
        rdzv_configs={  # whole seconds: torch's rendezvous reads them as ints
            "join_timeout": math.ceil(p.rdzv_timeout_s),
            "last_call_timeout": math.ceil(p.rdzv_last_call_s),
            "is_host": p.node_rank == 0,
        },
        max_restarts=p.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    # The entry point is a command, not a Python callable: nothing is pickled.
    elastic_launch(launch, sys.executable)(
        "-m", "fedra.client.worker", "--config", str(config_path)
    )
