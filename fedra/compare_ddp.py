"""The baseline a team would run instead: PyTorch DDP across the same sites, every step.

``fedra bench compare`` runs it beside the federated configurations: one process per
site (``python -m fedra.compare_ddp``, no pickled arguments), each on its own site's
data, one world over gloo (a ``FileStore``: no port), DDP's gradient all-reduce after
every step, one AdamW per rank, the same model, seed, batch and learning rate as the
other configurations.

**Over the same emulated link.** gloo's ranks connect to each other directly, so the
link is applied to each of DDP's buckets by a communication hook: the bucket is
all-reduced by gloo for real, and its result is handed back to DDP no earlier than the
link would have delivered a ring all-reduce of that many bytes: 2 (n - 1) / n of the
bucket's bytes sent and as many received by every rank, in 2 (n - 1) steps of one-way
latency each, the buckets queued on the rank's link one after another at its bandwidth
(``LinkModel``), while the backward pass goes on (DDP overlaps them, as on a real
network). With one site there is nothing to reduce: no bytes, no delay.

Every ``eval_every`` steps rank 0 keeps a copy of the model, scored after training on
the pooled held-out data (so evaluation costs no training time). A step's compute is
its wall time less the time the backward pass waited for the last bucket's reduction.
"""

# No ``from __future__ import annotations``: DDP checks its hook's annotations as objects.
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fedra.examples import charlm
from fedra.wan import Link

RESULT = "rank{rank}.json"


class LinkModel:
    """When a ring all-reduce of ``nbytes`` started now would have arrived, on a rank's
    link; the link carries one bucket at a time (thread-safe)."""

    def __init__(self, link: Link, world: int) -> None:
        self.link, self.world = link, world
        self._free_at = 0.0
        self._lock = threading.Lock()

    def wire_bytes(self, nbytes: int) -> float:
        """What each rank sends (and receives) for one all-reduce of ``nbytes``."""
        return 2 * (self.world - 1) / self.world * nbytes

    def due(self, nbytes: int, now: float) -> float:
        if self.world == 1:
            return now
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + self.wire_bytes(nbytes) / self.link.bytes_per_s
            return self._free_at + 2 * (self.world - 1) * self.link.latency_ms / 1000


class LinkHook:
    """DDP's communication hook: gloo's all-reduce, delivered when the link would have."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.last_ready = 0.0  # when backward handed over its last bucket
        self.wire_bytes = 0.0  # what this rank sent (and received)
        self._links: list[threading.Thread] = []

    def settle(self) -> None:
        """Wait for every delivery thread to end: none may still run gloo's or DDP's code
        while the process group is torn down, or the interpreter exits."""
        for thread in self._links:
            thread.join()
        self._links.clear()

    def reduce(
        self,
        state: object,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]:
        now = time.monotonic()
        self.last_ready = now
        grads = bucket.buffer()
        grads.div_(self.model.world)
        nbytes = grads.numel() * grads.element_size()
        self.wire_bytes += self.model.wire_bytes(nbytes)
        due = self.model.due(nbytes, now)
        work = dist.all_reduce(grads, async_op=True)
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def deliver() -> None:
            try:
                work.wait()
                time.sleep(max(0.0, due - time.monotonic()))  # the link's delivery time
                out.set_result(grads)
            except Exception as exc:  # a rank gone: DDP raises it in backward
                out.set_exception(exc)  # type: ignore[arg-type]

        thread = threading.Thread(target=deliver, name="link", daemon=True)
        self._links = [t for t in self._links if t.is_alive()]
        self._links.append(thread)
        thread.start()
        return out


def worker(args: argparse.Namespace) -> None:
    """One rank: train on this site's data, write its figures (and rank 0 its curve)."""
    cfg = json.loads(Path(args.spec).read_text())
    rank, world = args.rank, cfg["sites"]
    torch.set_num_threads(1)
    store = dist.FileStore(cfg["store"], world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        _train(cfg, rank, world, Path(args.out))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def _train(cfg: dict[str, Any], rank: int, world: int, out: Path) -> None:
    from fedra.compare import CompareConfig, site_data  # noqa: PLC0415 - no cycle at import

    config = CompareConfig(**cfg["config"])
    task = charlm.task
    data = task.load_data(site_data(config, rank))
    settings = config.settings(config.steps, config.seed + rank)  # each site its own order
    model = task.create_model(config.seed, config.params)
    model.train()
    link = Link(config.bandwidth_mbit, config.latency_ms)
    hook = LinkHook(LinkModel(link, world))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook.reduce)
    opt = task.optimizer(list(ddp.parameters()), settings)
    snapshots: list[tuple[int, float, float, dict[str, torch.Tensor]]] = []
    steps_s: list[float] = []
    compute_s = 0.0
    started = time.monotonic()
    for step in range(config.steps):
        t0 = time.monotonic()
        x, y = task.batch(data, settings, step)
        loss = task.loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        waited = time.monotonic() - hook.last_ready if world > 1 else 0.0
        opt.step()
        took = time.monotonic() - t0
        steps_s.append(took)
        compute_s += max(0.0, took - waited)
        done = step + 1
        if rank == 0 and (done % config.eval_every == 0 or done == config.steps):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            snapshots.append((done, time.monotonic() - started, hook.wire_bytes, state))
    wall = time.monotonic() - started
    hook.settle()
    del ddp  # its reducer lets go of the process group before the group goes
    figures: dict[str, Any] = {
        "wall_s": wall,
        "steps_s": steps_s,
        "compute_s": compute_s,
        "wire_bytes": hook.wire_bytes,
    }
    if rank == 0:
        from fedra.compare import pooled_data  # noqa: PLC0415

        pooled = pooled_data(config)
        initial = task.create_model(config.seed, config.params)
        curve = [{"seconds": 0.0, "bytes_per_site": 0.0, "eval_loss": _loss(initial, pooled)}]
        for done, seconds, wire, state in snapshots:
            model.load_state_dict(state)
            curve.append({"seconds": seconds, "bytes_per_site": 2 * wire,
                          "eval_loss": _loss(model, pooled), "step": done})  # fmt: skip
        figures["curve"] = curve
    (out / RESULT.format(rank=rank)).write_text(json.dumps(figures))


def _loss(model: torch.nn.Module, data: charlm.CharLMData) -> float:
    return float(charlm.task.evaluate(model, data)["loss"])


def run(config: Any, timeout_s: float) -> dict[str, Any]:
    """Start the ranks, wait for them (at most ``timeout_s``), and gather their figures:
    ``{"state", "reason", "ranks": [...], "curve": [...]}``."""
    with tempfile.TemporaryDirectory(prefix="fedra-ddp-") as tmp:
        folder = Path(tmp)
        spec = folder / "spec.json"
        plain = _fields(config)
        spec.write_text(json.dumps({"sites": config.sites, "store": str(folder / "store"),
                                    "config": plain}))  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [_start_rank(spec, folder, r, env) for r in range(config.sites)]
        deadline = time.monotonic() + timeout_s
        failures: list[str] = []  # every rank's: one rank's error ends the others' too
        try:
            for r, p in enumerate(procs):
                try:
                    output, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failures.append(f"rank {r} not finished within {timeout_s:g} s")
                    continue
                if p.returncode != 0:
                    tail = output.decode(errors="replace")[-800:]
                    failures.append(f"rank {r} exited with {p.returncode}: {tail}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        if failures:
            return {"state": "failed", "reason": "; ".join(failures), "ranks": [], "curve": []}
        ranks = [
            json.loads((folder / RESULT.format(rank=r)).read_text()) for r in range(config.sites)
        ]
        return {"state": "completed", "reason": "", "ranks": ranks, "curve": ranks[0]["curve"]}


def _start_rank(
    spec: Path, folder: Path, rank: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fedra.compare_ddp", "--spec", str(spec), "--rank", str(rank)]
    return subprocess.Popen(
        [*cmd, "--out", str(folder)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _fields(config: Any) -> dict[str, Any]:
    """The CompareConfig's fields that rebuild it in a rank, as JSON."""
    keep = ("steps", "h_values", "overlap_h", "sites", "bandwidth_mbit", "latency_ms",
            "batch_size", "learning_rate", "params", "max_bytes", "seed")  # fmt: skip
    out = {k: getattr(config, k) for k in keep}
    out["params"], out["h_values"] = dict(out["params"]), list(out["h_values"])
    out["overlap_h"] = list(out["overlap_h"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedra.compare_ddp")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    worker(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
