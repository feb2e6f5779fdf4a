"""One rank of a site's local world, as started by torchrun (see ``launch``).

    python -m torch.distributed.run --nproc-per-node 2 -m fedra.client.worker --config site.toml

Rank 0 runs the site agent and is the only rank that talks to the coordinator; the
other ranks follow its instructions. Any failure exits non-zero, so the elastic agent
restarts the whole local world and the site rejoins at the next round. On several nodes
rank 0 is node 0's first process; a world that formed without node 0 (an elastic one,
while node 0 is away) waits for it: its agents start the world again when node 0 joins.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import torch
import torch.distributed as dist

from fedra import logformat
from fedra.client.agent import SiteAgent, load_data, load_tasks
from fedra.client.config import SiteConfig
from fedra.client.executor import WorldExecutor, follow
from fedra.client.world import ControlChannel, init_world
from fedra.lifetime import die_with_parent

log = logging.getLogger("fedra.site")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedra.client.worker")
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    # torch's agent starts each worker in a session of its own: without this, a worker
    # whose agent is killed (the OOM killer, kill -9) would go on holding its world.
    die_with_parent(os.getppid(), signal.SIGKILL)
    config = SiteConfig.load(args.config)
    world = init_world(config.parallel.backend, config.parallel.node_rank)
    logformat.setup(  # the site's --log-format, through the environment
        "info",
        os.environ.get(logformat.ENV, "text"),
        text_format=f"%(asctime)s %(levelname)-7s %(name)s[rank {world.rank}]: %(message)s",
        static={"rank": world.rank, "site": config.site_id},
    )
    if config.threads:
        torch.set_num_threads(config.threads)
    control = ControlChannel()
    tasks = load_tasks(config)
    data = load_data(config, tasks)
    try:
        if world.rank == 0 and config.parallel.node_rank != 0:
            log.warning(
                "site %s: the local world formed without node 0 (this is node %d): waiting "
                "for node 0 to join; only node 0 talks to the coordinator",
                config.site_id, config.parallel.node_rank,
            )  # fmt: skip
            while True:  # until the agent stops this world (SIGTERM) to form the next
                signal.pause()
        elif world.rank == 0:
            executor = WorldExecutor(config.parallel, world, control)
            agent = SiteAgent(config, executor=executor, tasks=tasks, data=data)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: agent.shutdown("the site's local world is stopping"))
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
            log.info(
                "site %s: local world of %d ranks on %d node%s, plan %s",
                config.site_id, world.size, nodes, "" if nodes == 1 else "s",
                config.parallel.plan,
            )  # fmt: skip
            agent.run()
            executor.close()
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops us with SIGTERM
            follow(tasks, data, config.parallel, world, control)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
