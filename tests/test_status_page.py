"""The status page at ``/`` of ``--http``: its data, and the page in a real headless browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from fedra.config import READY_FILE
from fedra.local import LocalCluster
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def get(address: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
        return json.loads(reply.read())


def chromium() -> str:
    """The browser, or a skip saying why (never under CI: .ci/run installs it)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (.ci/run installs Debian's package)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


class Elements(HTMLParser):
    """Counts of the rendered page's elements by tag and class, and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = [tag] + [f"{tag}.{c}" for k, v in attrs if k == "class" for c in (v or "").split()]
        names += [f"{tag}#{v}" for k, v in attrs if k == "id"]
        for name in names:
            self.count[name] = self.count.get(name, 0) + 1

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A coordinator with --http, two sites, and a finished three-round run."""
    root = tmp_path_factory.mktemp("page")
    with LocalCluster(root / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--http", "127.0.0.1:0"])
        address = json.loads((cluster.state_dir / READY_FILE).read_text())["http_address"]
        sites = start_synthetic_sites(cluster, n=2)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=3, sites_per_round=2, min_sites=2))
            status = wait_until(admin, run_id, finished)
        assert status.state == "completed", status.reason
        yield address, run_id, sites
        cluster.stop()


def test_the_page_s_data_has_the_run_its_rounds_and_sites(federation: Any) -> None:
    address, run_id, sites = federation
    [run] = get(address, "/api/runs")
    assert (run["run_id"], run["state"], run["rounds_completed"]) == (run_id, "completed", 3)
    doc = get(address, f"/api/runs/{run_id}")
    assert [r["number"] for r in doc["rounds"]] == [0, 1, 2, 3]
    trained = doc["rounds"][1:]
    assert all(r["status"] == "committed" and r["updates"] == 2 for r in trained)
    assert all(r["stages"]["compute_s"] > 0 and "train_loss" in r["metrics"] for r in trained)
    assert all(r["bytes_up"] > 0 for r in trained)
    assert {s["site_id"] for s in doc["sites"]} == set(sites)
    assert all(s["accepted"] >= 3 and not s["revoked"] for s in doc["sites"])
    # Still connected, each in a long poll: online, and seen now rather than at its last call.
    assert all(s["online"] and s["last_seen_unix_s"] > time.time() - 5 for s in doc["sites"])
    assert all(0 < s["idle_s"] < s["counted_s"] for s in doc["sites"])
    prov = doc["provenance"]
    assert len(prov["spec_sha256"]) == 64 and {p["site_id"] for p in prov["sites"]} == set(sites)
    assert all(len(p["task_source_sha256"]) == 64 and not p["changed"] for p in prov["sites"])
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(address, "/api/runs/no-such-run")
    assert missing.value.code == 404
    assert "no run 'no-such-run'" in json.loads(missing.value.read())["error"]
    request = urllib.request.Request(f"http://{address}/api/runs", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:  # read-only
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 501


def test_the_page_shows_the_run_in_a_real_browser(federation: Any, tmp_path: Path) -> None:
    address, run_id, sites = federation
    browser = chromium()
    url = f"http://{address}/?run={run_id}"
    flags = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
        "--window-size=1280,1600",
    ]  # fmt: skip
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    page = Elements()
    page.feed(dom)
    assert page.count.get("tr.round") == 4, dom[-2000:]  # rounds 0 to 3
    assert page.count.get("tr.site") == len(sites)
    assert page.count.get("td.seen") == len(sites)
    assert page.count.get("tr.prov") == len(sites) and not page.count.get("tr.changed")
    assert page.count.get("svg#timeline") == 1
    assert page.count.get("rect.stage", 0) == 3 * 5  # three trained rounds, five stages each
    assert page.count.get("polyline", 0) >= 2  # the loss and the bytes at least
    text = " ".join(page.text)
    assert f"Run {run_id}" in text and "completed, 3 of 3 rounds" in text
    assert text.count("online") >= len(sites) and "s ago" in text
    artefacts = Path(os.environ.get("FEDRA_TEST_ARTEFACTS", tmp_path))
    artefacts.mkdir(parents=True, exist_ok=True)
    shot = artefacts / "status-page.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120,
                   check=True)  # fmt: skip
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
