"""The call-cost benchmark's smoke run (``bench/call_cost.py``, a second a kind): the real
daemon and a bare grpc.aio server must both answer, and every figure be reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "call_cost.py"


def test_call_cost_reports_the_daemon_against_a_bare_server(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    args = [str(BENCH), "--sites", "4", "--threads", "2", "--seconds", "1", "--out", str(out)]
    done = run_python(*args, cwd=tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    for name in ("Bare", "BareStream", "Heartbeat", "Bare_registered_all", "Bare_registered_round"):
        assert figures[name] > 0 and figures[f"{name}_per_s"] > 0, figures
    assert "x the bare call" in done.stdout and "x the unary call" in done.stdout
    assert "all 22 registered" in done.stdout and "the 6 of a round registered" in done.stdout
