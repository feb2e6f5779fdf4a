"""The connection-memory benchmark's smoke run (``bench/conn_memory.py``): a bare grpc.aio
server and the real daemon each get every channel in place (every call waiting in it,
counted by the server), and every figure is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "conn_memory.py"


def test_conn_memory_reports_the_daemon_against_a_bare_server(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    args = [str(BENCH), "--sites", "24", "--procs", "2", "--out", str(out)]
    done = run_python(*args, cwd=tmp_path, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["sites"] == 24
    for kind in ("bare_connection", "bare_waiting_call", "fedra"):
        f = figures[kind]
        assert 0 < f["idle_kb"] <= f["connected_kb"], (kind, f)
        assert f["kb_per_site"] == pytest.approx((f["connected_kb"] - f["idle_kb"]) / 24)
    assert "x the bare waiting call" in done.stdout and "fedra's own" in done.stdout
