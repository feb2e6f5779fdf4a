"""The site's own Prometheus metrics, served at ``/metrics`` of ``[metrics] http``.

What only the site sees: how long its rounds compute, how fast its link moves bytes from
its side of it, how often its local world restarts. Labels are bounded: a run id (the
last ``MAX_RUNS`` runs only) and a failure reason. Each site has a registry of its own,
never the process-wide one, so that many agents can live in one process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fedra import __version__
from fedra.client.config import check_metrics_address
from fedra.files import write_atomic
from fedra.httpserve import HttpServer, Replies

# In the site's state_dir: this process's pid and the address its /metrics is served at.
SITE_FILE = "site.json"
# Runs whose series are kept: a site serving run after run for months keeps a bounded set.
MAX_RUNS = 8
# Why a round failed here: the coordinator refused the update, a local rank died, the
# task's own code raised, the task is not allowed here, or this site's policy declined it.
FAILURE_REASONS = ("refused", "world", "task", "not_allowed", "declined")


@dataclass(frozen=True)
class RoundMeasures:
    """What one round of this site took and moved, as the agent measured it."""

    run_id: str
    compute_s: float = 0.0
    samples: float = 0.0  # trained on: the task's samples_seen, else the update's count
    tokens: float = 0.0  # the task's "tokens" metric; 0 for tasks that count none
    download_bytes: int = 0  # 0: the model was here already, or rebuilt from the seed
    download_s: float = 0.0
    upload_bytes: int = 0
    upload_s: float = 0.0


class SiteMetrics:
    """The metrics of one site agent; ``serve`` puts them on HTTP."""

    def __init__(self, site_id: str, world_restarts: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        run = ["run"]
        self.rounds = Counter(
            "fedra_site_rounds", "Rounds whose update this site delivered", run, registry=r
        )
        self.failed = Counter(
            "fedra_site_rounds_failed", "Rounds this site reported failed, by reason "
            f"({', '.join(FAILURE_REASONS)})", ["run", "reason"], registry=r,
        )  # fmt: skip
        self.compute_s = Counter(
            "fedra_site_compute_seconds", "Local compute: evaluation and training", run, registry=r
        )
        self.samples = Counter("fedra_site_samples", "Samples trained on", run, registry=r)
        self.tokens = Counter("fedra_site_tokens", "Tokens trained on", run, registry=r)
        self.samples_rate = Gauge(
            "fedra_site_samples_per_second", "Samples a second of the last round", run, registry=r
        )
        self.tokens_rate = Gauge(
            "fedra_site_tokens_per_second", "Tokens a second of the last round", run, registry=r
        )
        self.bytes = Counter(
            "fedra_site_bytes", "Bytes moved, by direction (down: models, up: updates)",
            ["run", "direction"], registry=r,
        )  # fmt: skip
        self.transfer_s = Counter(
            "fedra_site_transfer_seconds", "Time spent moving them, by direction",
            ["run", "direction"], registry=r,
        )  # fmt: skip
        self.transfer_rate = Gauge(
            "fedra_site_transfer_bytes_per_second", "The last round's rate, by direction",
            ["run", "direction"], registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "fedra_site_world_restarts", "Restarts of this site's local world (a rank failed)",
            registry=r,
        )  # fmt: skip
        self.restarts.inc(world_restarts)  # this process is a restart's: count those before it
        info = Gauge(
            "fedra_site_info", "This site: always 1", ["site", "version"], registry=r
        )  # fmt: skip
        info.labels(site_id, __version__).set(1)
        self._runs: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._server: HttpServer | None = None
        self.address = ""  # host:port it serves at, once serving (the port bound, for port 0)

    def round_done(self, m: RoundMeasures) -> None:
        """Count a round whose update was delivered, with what it took and moved."""
        with self._lock:
            self._keep(m.run_id)
            self.rounds.labels(m.run_id).inc()
            self.compute_s.labels(m.run_id).inc(max(m.compute_s, 0.0))
            self.samples.labels(m.run_id).inc(max(m.samples, 0.0))
            self.tokens.labels(m.run_id).inc(max(m.tokens, 0.0))
            if m.compute_s > 0 and m.samples > 0:
                self.samples_rate.labels(m.run_id).set(m.samples / m.compute_s)
            if m.compute_s > 0 and m.tokens > 0:
                self.tokens_rate.labels(m.run_id).set(m.tokens / m.compute_s)
            for direction, n, seconds in (
                ("down", m.download_bytes, m.download_s),
                ("up", m.upload_bytes, m.upload_s),
            ):
                self.bytes.labels(m.run_id, direction).inc(max(n, 0))
                self.transfer_s.labels(m.run_id, direction).inc(max(seconds, 0.0))
                if n > 0 and seconds > 0:  # a model held or rebuilt says nothing of the link
                    self.transfer_rate.labels(m.run_id, direction).set(n / seconds)

    def round_failed(self, run_id: str, reason: str) -> None:
        """Count a round this site reported failed; ``reason`` is one of FAILURE_REASONS."""
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r}")
        with self._lock:
            self._keep(run_id)
            self.failed.labels(run_id, reason).inc()

    def _keep(self, run_id: str) -> None:
        """Mark ``run_id`` the newest run; drop the series of the oldest past MAX_RUNS."""
        self._runs[run_id] = None
        self._runs.move_to_end(run_id)
        while len(self._runs) > MAX_RUNS:
            old, _ = self._runs.popitem(last=False)
            for metric in (self.rounds, self.compute_s, self.samples, self.tokens):
                metric.remove(old)
            for rate in (self.samples_rate, self.tokens_rate):
                rate.remove(old)
            for reason in FAILURE_REASONS:
                self.failed.remove(old, reason)
            for direction in ("down", "up"):
                for labelled in (self.bytes, self.transfer_s, self.transfer_rate):
                    labelled.remove(old, direction)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, address: str) -> str:
        """Serve ``/metrics`` on ``address`` (port 0: a free one) on threads of its own, so
        that a scrape never waits for a round; the address bound, also in ``address``."""
        check_metrics_address(address)
        self._server = HttpServer(address, "metrics.http", _handler(self))
        self._server.start()
        self.address = self._server.address
        return self.address

    def close(self) -> None:
        """Stop serving, if serving; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def world_restarts() -> int:
    """How often the elastic agent has restarted this process's local world (0 when it was
    not started by one): it tells each new attempt in the environment."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def write_site_file(state_dir: Path, site_id: str, metrics_address: str) -> Path:
    """Write ``state_dir/site.json`` (this process, and where its metrics are), whole or not
    at all: with port 0 it is how an operator or a test finds the port."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / SITE_FILE
    info = {
        "site_id": site_id,
        "pid": os.getpid(),
        "metrics_address": metrics_address,
        "started_unix_s": time.time(),
    }
    write_atomic(path, [json.dumps(info, indent=2).encode() + b"\n"])
    return path


def _handler(metrics: SiteMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(Replies):
        server_version = f"fedra-site/{__version__}"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.reply(404, b"not found: this address serves /metrics\n", "text/plain")
                return
            self.reply(200, metrics.exposition(), CONTENT_TYPE_LATEST)

    return Handler
