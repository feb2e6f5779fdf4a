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
    "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_timeout_s", "rdzv_last_call_s",
}  # fmt: skip
MAX_NODES = 1024
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
    # Several machines (torch's elastic agent and c10d rendezvous, as torchrun): the
    # number of nodes, fixed or "MIN:MAX"; this node's place (0: the node that talks to
    # the coordinator); node 0's address for the rendezvous, inside the site's network.
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = ""  # the site's id where empty
    rdzv_timeout_s: float = 600.0  # how long a node waits for the others to join
    # Elastic: once MIN nodes are in, how long the world waits for more before it forms.
    rdzv_last_call_s: float = 30.0

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def launches_world(self) -> bool:
        """Whether ``fedra site`` becomes an elastic agent (else it trains in-process)."""
        return self.nproc > 1 or self.multi_node

    @staticmethod
    def from_toml(t: dict[str, Any]) -> ParallelConfig:
        check_keys(t, _PARALLEL_KEYS, "parallel")
        min_nodes, max_nodes = _node_range(t.get("nnodes", 1))
        c = ParallelConfig(
            nproc=get(t, "nproc", int, "parallel", 1),
            plan=get(t, "plan", str, "parallel", "none"),
            backend=get(t, "backend", str, "parallel", "auto"),
            tp_size=get(t, "tp_size", int, "parallel", 0),
            pp_size=get(t, "pp_size", int, "parallel", 0),
            pp_schedule=get(t, "pp_schedule", str, "parallel", "1f1b"),
            microbatches=get(t, "microbatches", int, "parallel", 4),
            max_restarts=get(t, "max_restarts", int, "parallel", 100),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            node_rank=get(t, "node_rank", int, "parallel", 0),
            rdzv_endpoint=get(t, "rdzv_endpoint", str, "parallel", ""),
            rdzv_id=get(t, "rdzv_id", str, "parallel", ""),
            rdzv_timeout_s=get(t, "rdzv_timeout_s", float, "parallel", 600.0),
            rdzv_last_call_s=get(t, "rdzv_last_call_s", float, "parallel", 30.0),
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
        self._validate_nodes()
        single = not self.launches_world
        require(
            (self.plan == "none") == single,
            "parallel.plan",
            "'none' is for one process (nproc = 1 on one node), the other plans for more "
            f"(nproc = {self.nproc}, nnodes = {self.nnodes})",
            self.plan,
        )
        if self.plan in _TWO_D:
            key = _TWO_D[self.plan]
            size = getattr(self, key)
            for world in self.world_sizes:
                require(
                    1 < size < world and world % size == 0,
                    f"parallel.{key}",
                    f"must divide the world's {world} processes (nproc {self.nproc} x "
                    f"nnodes {self.nnodes}) and lie in (1, {world})",
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

    @property
    def nnodes(self) -> str:
        """As written in site.toml: "2", or "1:2" for an elastic range."""
        same = self.min_nodes == self.max_nodes
        return str(self.max_nodes) if same else f"{self.min_nodes}:{self.max_nodes}"

    @property
    def world_sizes(self) -> range:
        """The number of processes the world may have: nproc on each node present."""
        return range(self.nproc * self.min_nodes, self.nproc * self.max_nodes + 1, self.nproc)

    def _validate_nodes(self) -> None:
        require(
            0 <= self.node_rank < self.max_nodes,
            "parallel.node_rank",
            f"must be in [0, {self.max_nodes}) (nnodes = {self.nnodes}): 0 is the node that "
            "talks to the coordinator",
            self.node_rank,
        )
        require(
            math.isfinite(self.rdzv_timeout_s) and 1 <= self.rdzv_timeout_s <= 86_400,
            "parallel.rdzv_timeout_s",
            "must be in [1, 86400] seconds",
            self.rdzv_timeout_s,
        )
        require(
            math.isfinite(self.rdzv_last_call_s) and 0 <= self.rdzv_last_call_s <= 3600,
            "parallel.rdzv_last_call_s",
            "must be in [0, 3600] seconds",
            self.rdzv_last_call_s,
        )
        if self.rdzv_id:
            require(
                is_valid_site_id(self.rdzv_id),
                "parallel.rdzv_id",
                f"must follow the rule for site ids: {SITE_ID_RULE}",
                self.rdzv_id,
            )
        if not self.multi_node:
            require(
                not self.rdzv_endpoint,
                "parallel.rdzv_endpoint",
                "is for a site on several nodes (nnodes > 1): one node needs none",
                self.rdzv_endpoint,
            )
            return
        require(
            bool(self.rdzv_endpoint),
            "parallel.rdzv_endpoint",
            "required with nnodes > 1: node 0's host:port inside the site's network, where "
            "the nodes meet",
            self.rdzv_endpoint,
        )
        check_host_port(self.rdzv_endpoint, "parallel.rdzv_endpoint")  # a fixed port


def _node_range(value: object) -> tuple[int, int]:
    """``[parallel] nnodes``: N, or "N", or "MIN:MAX"; ConfigError naming the key."""
    text = str(value) if isinstance(value, int | str) and not isinstance(value, bool) else ""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(
            f'parallel.nnodes: must be a number of nodes or MIN:MAX (e.g. 2 or "1:2"), '
            f"got {value!r}"
        ) from None
    require(
        1 <= lo <= hi <= MAX_NODES,
        "parallel.nnodes",
        f"must satisfy 1 <= MIN <= MAX <= {MAX_NODES}",
        value,
    )
    return lo, hi


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
