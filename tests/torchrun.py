"""Running the parallel-plan equivalence check as a real torchrun world, for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

RUN_TIMEOUT_S = 240


def stop_launcher(proc: subprocess.Popen[str], grace_s: float = 30.0) -> None:
    """Stop a torchrun that is still running, and its workers with it."""
    if proc.poll() is not None:
        return
    # torchrun puts each worker in its own session: only the launcher's SIGTERM handler
    # reaches them (killing the launcher outright would orphan them).
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_check(out: Path, nproc: int, plan: str, *extra: str) -> dict[str, Any]:
    """Run ``fedra.client.parallel.check`` (3 steps) under torchrun; return its JSON report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), "-m", "fedra.client.parallel.check"]
    cmd += ["--plan", plan, "--steps", "3", "--out", str(out), *extra]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    pipe = subprocess.PIPE
    with subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True) as proc:
        try:
            _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            stop_launcher(proc)
    assert proc.returncode == 0, stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def assert_matches_one_process(
    report: dict[str, Any], nproc: int, param_tol: float, loss_tol: float
) -> None:
    """Same names, parameters within ``param_tol``, loss curve within ``loss_tol``."""
    assert report["world"] == nproc
    assert report["mismatched_names"] == []
    assert report["max_abs_diff"] < param_tol, report["worst_param"]
    torch.testing.assert_close(
        torch.tensor(report["losses"]),
        torch.tensor(report["reference_losses"]),
        rtol=0,
        atol=loss_tol,
    )


def moved_at(extra: tuple[str, ...]) -> int:
    """The step a check's ``--move-at`` moves at (-1: no move asked)."""
    return int(extra[extra.index("--move-at") + 1]) if "--move-at" in extra else -1
