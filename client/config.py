"""The site's configuration file (site.toml)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedra.config import ConfigError, check_keys, get, load_toml, require

_KEYS = {"site_id", "coordinator", "allowed_tasks", "data", "reconnect_max_s", "threads"}


@dataclass(frozen=True)
class SiteConfig:
    site_id: str
    coordinator: str  # host:port
    allowed_tasks: tuple[str, ...]
    data: dict[str, Any] = field(default_factory=dict)  # handed to the task's load_data
    reconnect_max_s: float = 30.0
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default

    @staticmethod
    def from_toml(doc: dict[str, Any]) -> SiteConfig:
        """Validate a parsed site.toml; errors name the key."""
        check_keys(doc, _KEYS, "")
        site_id = get(doc, "site_id", str, "")
        require(
            bool(site_id)
            and all(c.isalnum() or c in "-_." for c in site_id)
            and len(site_id) <= 128,
            "site_id",
            "must be 1-128 letters, digits, '-', '_' or '.'",
            site_id,
        )
        coordinator = get(doc, "coordinator", str, "")
        host, sep, port = coordinator.rpartition(":")
        require(
            bool(host and sep and port.isdigit()), "coordinator", "must be host:port", coordinator
        )
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
        return SiteConfig(
            site_id=site_id,
            coordinator=coordinator,
            allowed_tasks=tuple(tasks),
            data=dict(get(doc, "data", dict, "", {})),
            reconnect_max_s=reconnect,
            threads=threads,
        )

    @staticmethod
    def load(path: Path | str) -> SiteConfig:
        doc = load_toml(path)
        try:
            return SiteConfig.from_toml(doc)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
