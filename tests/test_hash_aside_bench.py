"""The blob-write benchmark's smoke run (``bench/hash_aside.py``, small blobs): the three
ways are timed with the real store and the ratios printed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import run_python

BENCH = Path(__file__).resolve().parents[1] / "bench" / "hash_aside.py"


def test_hash_aside_times_each_way_and_prints_ratios(tmp_path: Path) -> None:
    args = [str(BENCH), "--sizes-mb", "0.5,3", "--repeats", "2", "--dir", str(tmp_path)]
    done = run_python(*args, cwd=tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"\s+\d+(\.\d+)? ", line)]
    assert [row[0] for row in rows] == ["0.5", "3.0"], done.stdout  # MB
    for row in rows:
        assert all(float(x) > 0 for x in row[1:]), row
    assert list(tmp_path.iterdir()) == []  # its temporary store is gone
