"""GPU check: one site round on CUDA through a real coordinator, and update extraction.

    python bench/gpu_site_round.py [--out gpu_check.json]

1. Extraction: device-to-host copy of ~1 GB of fresh fp32 tensors, plain ``.cpu()``
   against fedra's reused pinned buffer (``HostStager``), in GB/s.
2. NCCL: a process group of one initialises and all-reduces (one GPU here: a site's
   NCCL world needs one GPU per rank).
3. A federated run on localhost: coordinator + one site training the reference GPT
   on CUDA with bf16 autocast; reports tokens/s, extraction GB/s inside the site, and
   where the round's time went.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedra.client.parallel.extract import HostStager
from fedra.local import LocalCluster
from fedra.runspec import RunSpec, TrainSpec

TASK = "fedra.examples.charlm:task"
MODEL = {
    "d_model": "1024", "n_layers": "8", "n_heads": "16", "d_ff": "4096", "seq_len": "256",
    "autocast": "bf16",
}  # fmt: skip


def extraction(total_floats: int = 256 * 2**20) -> dict[str, float]:
    """GB/s of a plain .cpu() of fresh tensors versus the pinned, reused buffer."""
    state = {f"w{i}": torch.randn(total_floats // 8, device="cuda") for i in range(8)}
    nbytes = sum(t.nbytes for t in state.values())
    torch.cuda.synchronize()
    started = time.perf_counter()
    plain = {k: v.cpu() for k, v in state.items()}
    plain_gbps = nbytes / (time.perf_counter() - started) / 1e9
    stager = HostStager()
    started = time.perf_counter()
    stager.to_host(state)  # first call also pins the buffer
    first_gbps = nbytes / (time.perf_counter() - started) / 1e9
    stager.to_host(state)
    pinned_gbps = stager.last_gbps
    staged = stager.to_host(state)
    assert all(torch.equal(staged[k], plain[k]) for k in state)
    return {
        "bytes": float(nbytes),
        "plain_cpu_gbps": plain_gbps,
        "pinned_first_call_gbps": first_gbps,
        "pinned_gbps": pinned_gbps,
        "speedup": pinned_gbps / plain_gbps,
    }


def nccl_check() -> dict[str, Any]:
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    ok = bool(torch.equal(t, torch.ones(4, device="cuda")))
    dist.destroy_process_group()
    version = torch.cuda.nccl.version()
    shown = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"nccl_all_reduce_ok": ok, "nccl_version": shown}


def site_round(rounds: int = 2, steps: int = 50) -> dict[str, Any]:
    spec = RunSpec(
        task=TASK,
        rounds=rounds,
        sites_per_round=1,
        round_deadline_s=600.0,
        seed=0,
        train=TrainSpec(local_steps=steps, batch_size=32, learning_rate=3e-4, params=MODEL),
    ).validate()
    with LocalCluster(Path(tempfile.mkdtemp(prefix="fedra-gpu-"))) as cluster:
        cluster.start_coordinator()
        cluster.start_site(
            "gpu-site", [TASK], {"part": 0, "num_parts": 1, "max_bytes": 2_000_000}, threads=4
        )
        cluster.wait_for_sites(["gpu-site"], timeout_s=180)
        with cluster.admin() as admin:
            run_id = admin.submit(spec)
            status = None
            for status in admin.watch(run_id, timeout_s=900):
                if status.state in ("completed", "failed", "cancelled"):
                    break
        assert status is not None and status.state == "completed", status
        log_tail = cluster.sites["gpu-site"].log_tail(5)
    out: dict[str, Any] = {"rounds": [], "site_log_tail": log_tail}
    for r in status.rounds:
        if r.number == 0:
            continue
        (p,) = r.participations
        out["rounds"].append(
            {
                "round": r.number,
                "round_s": r.duration_s,
                "update_bytes": p.bytes_up,
                "download_s": p.download_s,
                "upload_s": p.upload_s,
                **{k: p.metrics[k] for k in sorted(p.metrics)},
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    args = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["extraction"] = extraction()
    report.update(nccl_check())
    report["site"] = site_round()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    e = report["extraction"]
    print(
        f"\nextraction: plain .cpu() {e['plain_cpu_gbps']:.2f} GB/s, "
        f"pinned {e['pinned_gbps']:.1f} GB/s ({e['speedup']:.0f}x)"
    )
    for r in report["site"]["rounds"]:
        print(
            f"round {r['round']}: {r['tokens_per_s']:.0f} tokens/s (bf16 autocast), "
            f"site extraction {r.get('extract_gbps', 0):.1f} GB/s, round {r['round_s']:.2f} s, "
            f"compute {r['compute_s']:.2f} s, upload {r['upload_s']:.2f} s "
            f"for {r['update_bytes'] / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
