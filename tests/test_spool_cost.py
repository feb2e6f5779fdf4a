"""The spool benchmark's smoke run (``bench/spool_cost.py``, a few updates): both ways
of spooling a small update are timed with the real classes, and the ratio reported."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_python

BENCH = Path(__file__).resolve().parents[1] / "bench" / "spool_cost.py"


def test_spool_cost_times_a_file_against_a_row(tmp_path: Path) -> None:
    out = tmp_path / "spool.json"
    args = [str(BENCH), "--updates", "20", "--batch", "8", "--out", str(out)]
    done = run_python(*args, cwd=tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["updates"] == 20 and figures["batch"] == 8
    for key in ("file_cpu_us", "file_wall_us", "row_cpu_us", "row_wall_us"):
        assert figures[key] > 0, figures
    assert "file / row:" in done.stdout
