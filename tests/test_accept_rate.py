"""The accept-rate benchmark's smoke run (``bench/accept_rate.py``): a bare grpc.aio
server takes fewer new calls a second while its loop has other work ready."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.multiprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "accept_rate.py"


def test_a_busy_loop_takes_fewer_calls_a_second(tmp_path: Path) -> None:
    out = tmp_path / "accept.json"
    args = [str(BENCH), "--busy", "0,200", "--seconds", "1", "--out", str(out)]
    done = run_python(*args, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    idle, busy = json.loads(out.read_text())["results"]
    assert idle["busy"] == 0 and busy["busy"] == 200
    assert idle["calls_per_s"] > 0 and busy["calls_per_s"] > 0, (idle, busy)
    # 200 callbacks of 20 us make a pass of about 4 ms: the server takes calls many times
    # slower (measured here: about 80x), while its client has a process of its own.
    assert busy["pass_ms"] > 5 * idle["pass_ms"], (idle, busy)
    assert idle["failed"] == 0, idle
    assert busy["calls_per_s"] < idle["calls_per_s"] / 3, (idle, busy)
    assert "calls a second taken" in done.stdout


def test_accept_rate_refuses_a_bad_busy_list() -> None:
    done = run_python(str(BENCH), "--busy", "many", timeout_s=60)
    assert done.returncode == 2 and "--busy" in done.stderr, done.stderr


def test_several_servers_share_one_port_and_every_connection_is_answered(tmp_path: Path) -> None:
    out = tmp_path / "accept.json"
    args = [str(BENCH), "--busy", "0", "--seconds", "1", "--out", str(out)]
    args += ["--servers", "3", "--connections", "6", "--window", "12"]
    done = run_python(*args, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["calls_per_s"] > 0 and result["failed"] == 0, result


def test_accept_rate_refuses_no_servers() -> None:
    done = run_python(str(BENCH), "--servers", "0", timeout_s=60)
    assert done.returncode == 2 and "--servers" in done.stderr, done.stderr
