"""The status page benchmark's smoke run (``bench/status_page_cost.py``, a few sites): a
refresh of the run view is timed against reading every participation, and both see the
same run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_python

BENCH = Path(__file__).resolve().parents[1] / "bench" / "status_page_cost.py"


def test_status_page_cost_times_a_refresh_against_every_row(tmp_path: Path) -> None:
    out = tmp_path / "page.json"
    args = [str(BENCH), "--sites", "30", "--rounds", "3", "--repeat", "2", "--out", str(out)]
    done = run_python(*args, cwd=tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["sites"] == 30 and figures["rounds"] == 3
    assert figures["refresh_cpu_s"] > 0 and figures["rows_way_cpu_s"] > 0
    assert "one refresh of the run view" in done.stdout
