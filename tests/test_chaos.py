"""The bounded crash torture (``bench/chaos.py --quick``): real processes killed at random
instants and at fault points must end on the same bits as an uninterrupted run, with no
committed round lost or run twice. The long version is ``python bench/chaos.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import postgres_database

CHAOS = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"


def _torture(tmp_path: Path, config: str, db: str | None = None) -> dict[str, object]:
    out = tmp_path / "chaos.json"
    args = [sys.executable, str(CHAOS), "--quick", "--configs", config, "--out", str(out)]
    args += ["--workdir", str(tmp_path / "work")] + (["--db", db] if db else [])
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (figures,) = json.loads(out.read_text())["configs"]
    return figures  # type: ignore[no-any-return]


def _check(figures: dict[str, object]) -> None:
    assert figures["ok"] and figures["state"] == "running", figures  # then cancelled
    # Every round up to where the run was compared (the whole plan, then 2 more rounds).
    assert figures["identical_rounds"] == figures["rounds"] >= 4, figures
    assert figures["committed_rounds_lost"] == 0 and figures["duplicate_rounds"] == 0, figures
    assert figures["max_abs_diff"] == 0.0, figures
    assert figures["coordinator_kills"] >= 2 and figures["site_kills"] >= 1, figures  # type: ignore[operator]
    assert figures["fault_points_hit"], figures


@pytest.mark.multiprocess
def test_torture_on_sqlite_ends_bit_identical(tmp_path: Path) -> None:
    """DiLoCo's outer momentum and int8 updates with compressed downloads (server state
    on both sides of the wire)."""
    _check(_torture(tmp_path, "diloco+int8"))


@pytest.mark.multiprocess
@pytest.mark.postgres
def test_torture_on_postgresql_ends_bit_identical(tmp_path: Path) -> None:
    """FedAdam's moments and top-k updates, whose error feedback lives at the sites."""
    with postgres_database("chaos_admin") as url:
        _check(_torture(tmp_path, "fedadam+topk", url))
