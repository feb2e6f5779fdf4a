"""The call-cost benchmark's smoke run (``bench/call_cost.py``, a second a kind): the real
daemon and a bare grpc.aio server must both answer, and every figure be reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "call_cost.py"


def test_call_cost_reports_the_daemon_against_a_bare_server(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    args = [sys.executable, str(BENCH), "--sites", "4", "--threads", "2", "--seconds", "1"]
    done = subprocess.run(
        [*args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    for name in ("Bare", "Heartbeat"):
        assert figures[name] > 0 and figures[f"{name}_per_s"] > 0, figures
    assert "x the bare call" in done.stdout
