"""The site's configuration file (site.toml)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedra.client.policy import PolicyConfig
from fedra.config import (
    SITE_ID_RULE,
    ConfigError,
    check_host_port,
    check_keys,
    get,
    is_valid_site_id,
    load_toml,
    require,
)
from fedra.httpserve import parse_address

_KEYS = {
    "site_id", "coordinator", "allowed_tasks", "data", "reconnect_max_s", "threads", "parallel",
    "tls_dir", "insecure", "state_dir", "metrics", "policy",
}  # fmt: skip
_PARALLEL_KEYS = {
    "nproc", "plan", "backend", "tp_size", "pp_size", "pp_schedule", "microbatches", "max_restarts",
}  # fmt: skip
_METRICS_KEYS = {"http"}
PLAN_NAMES = ("none", "dp", "fsdp", "tp", "fsdp+tp", "pp", "pp+dp", "ep")
_TWO_D = {"fsdp+tp": "tp_size", "pp+dp": "pp_size"}


@dataclass(frozen=True)
class ParallelConfig:
    """How the site trains across its own processes: the ``[parallel]`` table."""

    nproc: int = 1
    plan: str = "none"
    backend: str = "auto"  # auto: nccl when CUDA is present, else gloo
    tp_size: int = 0
    pp_size: int = 0
    pp_schedule: str = "1f1b"
    microbatches: int = 4
    max_restarts: int = 100  # local-world restarts after a rank fails

    @staticmethod
    def from_toml(t: dict[str, Any]) -> ParallelConfig:
        check_keys(t, _PARALLEL_KEYS, "parallel")
        c = ParallelConfig(
            nproc=get(t, "nproc", int, "parallel", 1),
            plan=get(t, "plan", str, "parallel", "none"),
            backend=get(t, "backend", str, "parallel", "auto"),
            tp_size=get(t, "tp_size", int, "parallel", 0),
            pp_size=get(t, "pp_size", int, "parallel", 0),
            pp_schedule=get(t, "pp_schedule", str, "parallel", "1f1b"),
            microbatches=get(t, "microbatches", int, "parallel", 4),
            max_restarts=get(t, "max_restarts", int, "parallel", 100),
        )
        c.validate()
        return c

    def validate(self) -> None:
        require(1 <= self.nproc <= 1024, "parallel.nproc", "must be in [1, 1024]", self.nproc)
        require(
            self.plan in PLAN_NAMES,
            "parallel.plan",
            f"must be one of {', '.join(PLAN_NAMES)}",
            self.plan,
        )
        require(
            self.backend in ("auto", "gloo", "nccl"),
            "parallel.backend",
            "must be auto, gloo or nccl",
            self.backend,
        )
        require(
            (self.plan == "none") == (self.nproc == 1),
            "parallel.plan",
            f"'none' is for nproc = 1, the other plans for nproc > 1 (nproc = {self.nproc})",
            self.plan,
        )
        if self.plan in _TWO_D:
            key = _TWO_D[self.plan]
            size = getattr(self, key)
            ok = 1 < size < self.nproc and self.nproc % size == 0
            require(
                ok,
                f"parallel.{key}",
                f"must divide nproc = {self.nproc} and lie in (1, nproc)",
                size,
            )
        require(
            self.pp_schedule in ("gpipe", "1f1b"),
            "parallel.pp_schedule",
            "must be gpipe or 1f1b",
            self.pp_schedule,
        )
        require(self.microbatches >= 1, "parallel.microbatches", "must be >= 1", self.microbatches)
        require(self.max_restarts >= 0, "parallel.max_restarts", "must be >= 0", self.max_restarts)


@dataclass(frozen=True)
class MetricsConfig:
    """The site's own Prometheus endpoint: the ``[metrics]`` table."""

    http: str = ""  # host:port of /metrics (port 0: a free one); "": none

    @staticmethod
    def from_toml(t: dict[str, Any]) -> MetricsConfig:
        check_keys(t, _METRICS_KEYS, "metrics")
        http = get(t, "http", str, "metrics", "")
        if http:
            check_metrics_address(http)
        return MetricsConfig(http=http)


def check_metrics_address(address: str) -> tuple[str, int]:
    """(host, port) of ``[metrics] http``, or ConfigError naming it. A loopback host only:
    the endpoint has no TLS, and a site opens no port that others can reach."""
    host, port, loopback = parse_address(address, "metrics.http")
    require(
        loopback,
        "metrics.http",
        "must be a loopback address (127.0.0.1, [::1] or localhost): the endpoint has no "
        "TLS; scrape it from this machine or through a TLS proxy",
        address,
    )
    return host, port


@dataclass(frozen=True)
class SiteConfig:
    site_id: str
    coordinator: str  # host:port
    allowed_tasks: tuple[str, ...]
    data: dict[str, Any] = field(default_factory=dict)  # handed to the task's load_data
    reconnect_max_s: float = 30.0
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tls_dir: Path | None = None  # this site's folder from `fedra provision`
    insecure: bool = False  # plaintext to an --insecure coordinator: development only
    state_dir: Path | None = None  # keeps top-k error feedback across restarts
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # what this site agrees to
    path: Path | None = None  # the site.toml it was read from, for errors found later

    @staticmethod
    def from_toml(doc: dict[str, Any]) -> SiteConfig:
        """Validate a parsed site.toml; errors name the key."""
        check_keys(doc, _KEYS, "")
        site_id = get(doc, "site_id", str, "")
        require(is_valid_site_id(site_id), "site_id", f"must be {SITE_ID_RULE}", site_id)
        coordinator = check_host_port(get(doc, "coordinator", str, ""), "coordinator")
        tasks = get(doc, "allowed_tasks", list, "")
        require(len(tasks) > 0, "allowed_tasks", "must list at least one task entry point", tasks)
        for i, t in enumerate(tasks):
            ok = isinstance(t, str) and ":" in t and all(t.partition(":")[::2])
            require(ok, f"allowed_tasks[{i}]", "must look like 'package.module:attr'", t)
        reconnect = get(doc, "reconnect_max_s", float, "", 30.0)
        require(
            math.isfinite(reconnect) and reconnect > 0,
            "reconnect_max_s",
            "must be a finite number > 0",
            reconnect,
        )
        threads = get(doc, "threads", int, "", 0)
        require(threads >= 0, "threads", "must be >= 0", threads)
        state_dir = get(doc, "state_dir", str, "", "")
        tls_dir = get(doc, "tls_dir", str, "", "")
        insecure = get(doc, "insecure", bool, "", False)
        require(
            bool(tls_dir) != insecure,
            "tls_dir",
            "give this site's folder from `fedra provision`, or insecure = true for an "
            "--insecure coordinator (not both)",
            tls_dir,
        )
        policy = PolicyConfig.from_toml(get(doc, "policy", dict, "", {}))
        require(
            policy.approve != "manual" or bool(state_dir), "policy.approve",
            '"manual" needs a state_dir, where the runs to approve are kept', policy.approve,
        )  # fmt: skip
        return SiteConfig(
            site_id=site_id,
            coordinator=coordinator,
            allowed_tasks=tuple(tasks),
            data=dict(get(doc, "data", dict, "", {})),
            reconnect_max_s=reconnect,
            threads=threads,
            parallel=ParallelConfig.from_toml(get(doc, "parallel", dict, "", {})),
            tls_dir=Path(tls_dir) if tls_dir else None,
            insecure=insecure,
            state_dir=Path(state_dir) if state_dir else None,
            metrics=MetricsConfig.from_toml(get(doc, "metrics", dict, "", {})),
            policy=policy,
        )

    @staticmethod
    def load(path: Path | str) -> SiteConfig:
        doc = load_toml(path)
        try:
            return replace(SiteConfig.from_toml(doc), path=Path(path))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
