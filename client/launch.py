"""Starting a site's local world with torch's elastic agent (what torchrun uses).

``fedra site`` with ``[parallel] nproc > 1`` becomes the elastic agent: it starts
``nproc`` workers (``fedra.client.worker``), watches them, and when one dies stops
the others and starts the world again, up to ``max_restarts`` times.
"""

from __future__ import annotations

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
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.parallel.nproc,
        run_id=f"{config.site_id}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port on this host only: a site opens nothing outside
        max_restarts=config.parallel.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    # The entry point is a command, not a Python callable: nothing is pickled.
    elastic_launch(launch, sys.executable)(
        "-m", "fedra.client.worker", "--config", str(config_path)
    )
