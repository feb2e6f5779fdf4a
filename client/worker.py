"""One rank of a site's local world, as started by torchrun (see ``launch``).

    python -m torch.distributed.run --nproc-per-node 2 -m fedra.client.worker --config site.toml

Rank 0 runs the site agent and is the only rank that talks to the coordinator; the
other ranks follow its instructions. Any failure exits non-zero, so the elastic agent
restarts the whole local world and the site rejoins at the next round.
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

log = logging.getLogger("fedra.site")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedra.client.worker")
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    config = SiteConfig.load(args.config)
    world = init_world(config.parallel.backend)
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
        if world.rank == 0:
            executor = WorldExecutor(config.parallel, world, control)
            agent = SiteAgent(config, executor=executor, tasks=tasks, data=data)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: agent.shutdown("the site's local world is stopping"))
            log.info(
                "site %s: local world of %d ranks, plan %s",
                config.site_id,
                world.size,
                config.parallel.plan,
            )
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
