"""The coordinator's Prometheus metrics, served at ``/metrics`` of ``--http``.

Counters and histograms are fed by the engine's events (``observers``); gauges are read
from the engine at each scrape (``Engine.gauges``, without its lock). Labels are bounded:
a run id, a status or a stage, never a site (per-site figures are in ``fedra run
status``). Each coordinator has a registry of its own, never the process-wide one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from fedra import __version__
from fedra.config import ConfigError
from fedra.coordinator import gctune
from fedra.coordinator.engine import Gauges
from fedra.coordinator.errors import FedraError, NotFound, Unauthenticated, Unavailable
from fedra.coordinator.observers import Observer, RoundEnded, RunEnded
from fedra.coordinator.web import StatusPages
from fedra.httpserve import HttpServer, Replies, parse_address
from fedra.storage.records import RoundState, RunState

log = logging.getLogger("fedra.coordinator")

# Seconds: a round of a tiny model takes well under a second, a large one an hour.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# A refused caller's reply: no certificate or a revoked one, a deny list unreadable now;
# anything else (a site's or another role's certificate) is forbidden.
_HTTP_STATUS: dict[type[FedraError], int] = {Unauthenticated: 401, Unavailable: 503}
# Ended runs whose per-run series (by run label) are still exported; older ones are
# dropped, so that a long-lived daemon's scrape does not grow with every run it ever had.
KEPT_ENDED_RUNS = 16
ROUND_OUTCOMES = (RoundState.COMMITTED, RoundState.RETRIED, RoundState.FAILED)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class Telemetry(Observer):
    """The metrics of one coordinator; ``gauges`` says how it stands at a scrape."""

    def __init__(
        self,
        gauges: Callable[[], Gauges],
        refused_elsewhere: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """``refused_elsewhere``: calls refused by another process of this coordinator
        (the admin port's) since it was last asked, by status; added at each scrape."""
        self.refused_elsewhere = refused_elsewhere
        self._ended: list[str] = []  # the latest ended runs, oldest first
        self._ended_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rounds = Counter(
            "fedra_rounds", "Round attempts closed, by run and outcome "
            "(committed, retried: another attempt follows, failed: the run gave up)",
            ["run", "outcome"], registry=r,
        )  # fmt: skip
        self.round_seconds = Histogram(
            "fedra_round_duration_seconds", "Committed rounds, opening to commit, by run",
            ["run"], buckets=ROUND_BUCKETS, registry=r,
        )  # fmt: skip
        self.stage_seconds = Histogram(
            "fedra_round_stage_seconds", "Each stage of committed rounds (distribute, "
            "compute, transfer, aggregate, checkpoint: the round's ledger)",
            ["stage"], buckets=STAGE_BUCKETS, registry=r,
        )  # fmt: skip
        self.idle_seconds = Histogram(
            "fedra_site_idle_seconds", "Per committed round, the mean time a site whose "
            "update counted sat idle", buckets=STAGE_BUCKETS, registry=r,
        )  # fmt: skip
        self.bytes = Counter(
            "fedra_bytes", "Bytes of closed round attempts' tasks, by run and direction "
            "(down: models to sites, up: updates)", ["run", "direction"], registry=r,
        )  # fmt: skip
        self.lost = Counter(
            "fedra_lost_bytes", "Of those, bytes that could not count (failed or expired "
            "tasks, transfers cut off, attempts that failed), by run", ["run"], registry=r,
        )  # fmt: skip
        self.checkpoints = Counter(
            "fedra_checkpoint_bytes", "Bytes of committed global models written, by run",
            ["run"], registry=r,
        )  # fmt: skip
        self.runs_ended = Counter(
            "fedra_runs_ended", "Runs that ended, by state", ["state"], registry=r
        )
        self.refusals = Counter(
            "fedra_refusals", "Calls refused, by gRPC status", ["status"], registry=r
        )
        self.commit_seconds = Histogram(
            "fedra_db_commit_seconds", "Group commits (one synced transaction each)",
            buckets=COMMIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.commit_writes = Counter("fedra_db_writes", "Writes in group commits", registry=r)
        r.register(_Now(gauges))

    def round_ended(self, event: RoundEnded) -> None:
        self.rounds.labels(event.run_id, event.outcome).inc()
        self.bytes.labels(event.run_id, "down").inc(event.bytes_down)
        self.bytes.labels(event.run_id, "up").inc(event.bytes_up)
        self.lost.labels(event.run_id).inc(event.lost_bytes)
        if event.outcome != RoundState.COMMITTED:
            return
        self.round_seconds.labels(event.run_id).observe(event.duration_s)
        self.checkpoints.labels(event.run_id).inc(event.checkpoint_bytes)
        if event.number > 0:  # the initial model's round has no sites' work to weigh
            self.idle_seconds.observe(event.idle_s)
            for stage, seconds in event.stages.items():
                if stage != "round_s":  # that is the round's duration, above
                    self.stage_seconds.labels(stage.removesuffix("_s")).observe(seconds)

    def run_ended(self, event: RunEnded) -> None:
        self.runs_ended.labels(event.state).inc()
        with self._ended_lock:  # the scrape stays the size of the runs that matter
            if event.run_id in self._ended:
                return
            self._ended.append(event.run_id)
            forgotten = self._ended[:-KEPT_ENDED_RUNS]
            del self._ended[:-KEPT_ENDED_RUNS]
        for run_id in forgotten:
            self._forget(run_id)

    def _forget(self, run_id: str) -> None:
        """Drop an ended run's series (those by run label)."""
        labelled: list[tuple[Any, tuple[str, ...]]] = [
            *((self.rounds, (run_id, o)) for o in ROUND_OUTCOMES),
            *((self.bytes, (run_id, d)) for d in ("down", "up")),
            (self.round_seconds, (run_id,)),
            (self.lost, (run_id,)),
            (self.checkpoints, (run_id,)),
        ]
        for metric, labels in labelled:
            with contextlib.suppress(KeyError):  # a run that never had that series
                metric.remove(*labels)

    def refused(self, status: str) -> None:
        self.refusals.labels(status).inc()

    def committed(self, seconds: float, writes: int) -> None:
        self.commit_seconds.observe(seconds)
        self.commit_writes.inc(writes)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        if self.refused_elsewhere is not None:
            for status, count in self.refused_elsewhere().items():
                self.refusals.labels(status).inc(count)
        return generate_latest(self.registry)


class _Now(Collector):
    """Gauges read from the engine when scraped."""

    def __init__(self, gauges: Callable[[], Gauges]) -> None:
        self.gauges = gauges

    def describe(self) -> list[Metric]:
        return []  # read at each collect: nothing to describe ahead of it

    def collect(self) -> Iterator[Metric]:
        g = self.gauges()
        info = InfoMetricFamily("fedra_coordinator", "This coordinator")
        info.add_metric([], {"version": __version__})
        yield info
        yield GaugeMetricFamily(
            "fedra_sites_registered", "Sites known to this coordinator", g.sites_registered
        )
        yield GaugeMetricFamily(
            "fedra_sites_online", "Of them, online now (revoked ones never)", g.sites_online
        )
        runs = GaugeMetricFamily("fedra_runs", "Runs by state", labels=["state"])
        for state in RunState:
            runs.add_metric([state], g.runs_by_state.get(state, 0))
        yield runs
        transfers = GaugeMetricFamily(
            "fedra_transfers_in_flight", "Downloads and uploads under way", labels=["direction"]
        )
        transfers.add_metric(["down"], g.downloads_in_flight)
        transfers.add_metric(["up"], g.uploads_in_flight)
        yield transfers
        yield GaugeMetricFamily(
            "fedra_waiting_calls",
            "Calls waiting (long polls, held heartbeats, stage calls, watches)",
            g.waiting_calls,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "fedra_hearing_lag_seconds",
            "How long sites' calls now wait in gRPC's queue before the coordinator takes "
            "them (the median over distinct sites; liveness allows it)",
            g.hearing_lag_s,
        )
        # The interpreter's garbage collector: it holds the interpreter's lock while it
        # runs, and at thousands of sites it takes a tenth of the daemon's CPU.
        collected = CounterMetricFamily(
            "fedra_gc_collections", "Garbage collections, by generation", labels=["generation"]
        )
        seconds = CounterMetricFamily(
            "fedra_gc_seconds", "CPU seconds in garbage collections, by generation",
            labels=["generation"],
        )  # fmt: skip
        for generation, (count, took) in gctune.collections().items():
            collected.add_metric([str(generation)], count)
            seconds.add_metric([str(generation)], took)
        yield collected
        yield seconds


class HttpEndpoint:
    """``/metrics`` over HTTP on ``address`` (port 0: a free one), and with ``pages`` the
    status page at ``/`` and its data under ``/api``; on threads of its own: a scrape or
    a page never waits for a round, nor a round for them. Read-only: GET alone.

    On a loopback address it serves plain HTTP to anyone on this machine. Elsewhere it
    needs ``tls`` (the coordinator's own certificate and CA) and ``admit``, which checks
    each caller's client certificate as the admin commands are checked (an admin of the
    project CA, not revoked) and raises a FedraError otherwise."""

    def __init__(
        self,
        address: str,
        telemetry: Telemetry,
        pages: StatusPages | None = None,
        tls: ssl.SSLContext | None = None,
        admit: Callable[[bytes | None], object] | None = None,
    ) -> None:
        check_http_address(address, tls=tls is not None)
        if tls is not None and admit is None:
            raise ValueError("a TLS endpoint needs a check of its callers")
        self._http = HttpServer(address, "--http", _handler(telemetry, pages, admit), tls)
        self.address, self.scheme = self._http.address, self._http.scheme

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()


def check_http_address(address: str, tls: bool = False) -> tuple[str, int, bool]:
    """(host, port, loopback) of ``--http``; ConfigError naming what is wrong. Without
    ``tls`` only a loopback host: plain HTTP is for this machine alone."""
    host, port, loopback = parse_address(address, "--http")
    if not loopback and not tls:
        raise ConfigError(
            f"--http {address!r}: off a loopback address (127.0.0.1, [::1], localhost) the "
            "endpoint serves TLS to admin certificates only: give --tls-dir, not --insecure, "
            "or bind 127.0.0.1"
        )
    return host, port, loopback


def _handler(
    telemetry: Telemetry,
    pages: StatusPages | None,
    admit: Callable[[bytes | None], object] | None,
) -> type[BaseHTTPRequestHandler]:
    page = (Path(__file__).parent / "status_page.html").read_bytes() if pages else b""

    class Handler(Replies):
        server_version = f"fedra/{__version__}"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if admit is not None:
                try:
                    admit(self.peer_pem())
                except FedraError as exc:
                    self._json(_HTTP_STATUS.get(type(exc), 403), {"error": str(exc)})
                    return
            path = urllib.parse.urlsplit(self.path).path
            if path == "/metrics":
                self.reply(200, telemetry.exposition(), CONTENT_TYPE_LATEST)
            elif pages is None:
                self.reply(404, b"not found: this address serves /metrics\n", "text/plain")
            elif path == "/":
                self.reply(200, page, "text/html; charset=utf-8")
            elif path == "/api/runs":
                self._json(200, pages.runs())
            elif path.startswith("/api/runs/"):
                run_id = urllib.parse.unquote(path.removeprefix("/api/runs/"))
                try:
                    self._json(200, pages.run(run_id))
                except NotFound as exc:
                    self._json(404, {"error": str(exc)})
            else:
                self._json(404, {"error": f"no page {path!r}: /, /api/runs, /metrics"})

        def _json(self, code: int, doc: object) -> None:
            self.reply(code, json.dumps(doc).encode(), "application/json")

    return Handler
