"""Parallel plans at world size 2 against one process, and the cost of moving the model.

    python bench/plans_bench.py [--steps 20] [--d-model 128] [--json out.json]

For each plan, torchrun starts a local world of 2 (gloo on CPU, NCCL on GPUs) that
runs exactly what a site runs each round (``train_in_world``), once to warm up and
once measured: the global model is broadcast from rank 0 and the plan applied
(scatter), the local steps run, and the full update is gathered back on rank 0
(gather). Rank 0 then trains the same steps alone. Printed per plan: tokens/s of the
plan and of one process, their ratio, and scatter + gather as a share of the round's
local work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PLANS: list[tuple[str, list[str]]] = [
    ("dp", []),
    ("fsdp", []),
    ("tp", []),
    ("pp", ["--schedule", "1f1b", "--microbatches", "4"]),
    ("ep", ["--experts", "4"]),
]


def run_plan(plan: str, extra: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "fedra.client.parallel.check", "--plan", plan, "--steps", str(args.steps),
        "--d-model", str(args.d_model), "--seq-len", str(args.seq_len), "--layers", "4",
        "--batch-size", str(args.batch_size), "--out", str(out), "--warmup", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"plan {plan} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for plan, extra in PLANS:
            r = run_plan(plan, extra, args, Path(tmp) / f"{plan}.json")
            local = r["scatter_s"] + r["train_s"] + r["gather_s"]
            r["speed_ratio"] = r["tokens_per_s"] / r["reference_tokens_per_s"]
            r["move_share"] = (r["scatter_s"] + r["gather_s"]) / local
            rows.append(r)
    print(f"model: d_model {args.d_model}, 4 layers, seq {args.seq_len}, batch {args.batch_size}, "
          f"{args.steps} steps; world size 2 on {os.cpu_count()} CPU cores")  # fmt: skip
    print(f"{'plan':<6} {'tokens/s':>10} {'1 process':>10} {'ratio':>6} {'scatter s':>9} "
          f"{'gather s':>8} {'move share':>10} {'max |diff|':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['plan']:<6} {r['tokens_per_s']:>10.0f} {r['reference_tokens_per_s']:>10.0f} "
            f"{r['speed_ratio']:>6.2f} {r['scatter_s']:>9.3f} {r['gather_s']:>8.3f} "
            f"{r['move_share']:>10.1%} {r['max_abs_diff']:>10.1e}"
        )
    print(
        "\nratio: tokens/s of the plan over one process on the same cores (2 processes: at\n"
        "most 2x). TP and FSDP communicate per layer, so a model this small gains little.\n"
        "move share: scatter (broadcast + plan set-up) and gather (full update to rank 0)\n"
        "over the local round, measured after a warm-up round as a site runs every round."
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
