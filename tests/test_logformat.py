"""Structured logs (``--log-format json``): the formatter, its context, and a real run."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from pathlib import Path

import pytest

from fedra import logformat
from fedra.cli import main
from fedra.client.agent import SiteAgent
from fedra.client.config import SiteConfig
from fedra.client.executor import LocalExecutor
from fedra.local import LocalCluster
from fedra.logformat import JsonLines, about, set_about
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR)")


def _line(msg: str, *args: object, exc: bool = False, **extra: object) -> dict[str, object]:
    record = logging.LogRecord("fedra.coordinator", logging.WARNING, __file__, 1, msg, args, None)
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            record.exc_info = sys.exc_info()
    for key, value in extra.items():
        setattr(record, key, value)
    text = JsonLines().format(record)
    assert "\n" not in text  # one line, whatever the message holds
    doc = json.loads(text)
    assert isinstance(doc, dict)
    return doc


def test_a_json_line_has_the_time_level_component_and_message() -> None:
    doc = _line("run %s round %d: committed", "r1", 3)
    assert doc["level"] == "WARNING" and doc["component"] == "fedra.coordinator"
    assert doc["message"] == "run r1 round 3: committed"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(doc["time"]))
    assert not {"run", "round", "site", "exception"} & doc.keys()  # nothing it is not about


def test_a_json_line_says_what_it_is_about_and_a_call_s_extra_comes_first() -> None:
    with about(run="r1", round=2):
        with about(site="s-1", round=3):
            inner = _line("x")
        outer = _line("x", site="from-extra")
    after = _line("x")
    assert (inner["run"], inner["round"], inner["site"]) == ("r1", 3, "s-1")
    assert (outer["run"], outer["round"], outer["site"]) == ("r1", 2, "from-extra")
    assert "run" not in after  # the block's context ended with it


def test_a_thread_s_context_is_its_own() -> None:
    seen: dict[str, dict[str, object]] = {}

    def site(name: str) -> None:
        set_about(site=name)
        seen[name] = _line("x")

    threads = [threading.Thread(target=site, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"]["site"] == "a" and seen["b"]["site"] == "b"
    assert "site" not in _line("x")  # and none leaked into this thread


def test_a_site_agent_run_on_the_caller_s_thread_gives_its_context_back() -> None:
    """Its lines are about its site while it runs; the caller's afterwards, as they were."""
    config = SiteConfig("s-run", "127.0.0.1:9", ("m:t",), insecure=True)  # never dialled
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={}, data={})
    seen: list[dict[str, object]] = []
    agent._run = lambda: seen.append(_line("x"))  # type: ignore[method-assign]
    with about(run="r-caller"):
        agent.run()
        after = _line("x")
    assert seen[0]["site"] == "s-run" and seen[0]["run"] == "r-caller"
    assert after["run"] == "r-caller" and "site" not in after


def test_a_hostile_message_stays_one_line_and_an_exception_is_kept() -> None:
    doc = _line("site %s: refused", "evil\nFAKE 2026-01-01 INFO forged\x1b[2J", exc=True)
    assert "forged" in str(doc["message"]) and "\n" in str(doc["message"])  # kept, escaped
    assert "ValueError: boom" in str(doc["exception"])


def test_an_unknown_format_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'xml' is not one of text, json"):
        logformat.check_format("xml")
    with pytest.raises(SystemExit) as flag:
        main(["--log-format", "xml", "sites"])
    assert flag.value.code == 2
    monkeypatch.setenv(logformat.ENV, "yaml")
    with pytest.raises(SystemExit) as env:
        main(["sites"])
    assert env.value.code == 2


@pytest.mark.multiprocess
def test_a_run_logged_as_json_lines_says_which_run_round_and_site(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", secure=False, env={logformat.ENV: "json"}) as cluster:
        cluster.start_coordinator(flags=FAST)
        sites = start_synthetic_sites(cluster, n=2)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=2, sites_per_round=2, min_sites=2))
            status = wait_until(admin, run_id, finished)
        cluster.stop()
    assert status.state == "completed", status.reason
    logs = tmp_path / "cluster" / "logs"
    docs: dict[str, list[dict[str, object]]] = {}
    for name in ("coordinator", *sites):
        lines = (logs / f"{name}.log").read_text().splitlines()
        assert not [line for line in lines if TEXT_LINE.match(line)], f"{name}: a text line"
        docs[name] = [json.loads(line) for line in lines if line.startswith("{")]
        assert docs[name], f"{name} logged nothing"
    committed = [
        d for d in docs["coordinator"] if "committed" in str(d["message"]) and "round" in d
    ]
    assert [(d["run"], d["round"]) for d in committed] == [(run_id, 0), (run_id, 1), (run_id, 2)]
    registered = {d.get("site") for d in docs["coordinator"] if "registered" in str(d["message"])}
    assert registered == set(sites)
    for site_id in sites:
        about_site = [d for d in docs[site_id] if d.get("site") == site_id]
        assert about_site, f"no line of {site_id} names it"
        assert {d.get("run") for d in about_site} >= {run_id}
