"""The site's configuration file (site.toml)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedra.config import (
    SITE_ID_RULE,
    ConfigError,
    check_keys,
    get,
    is_valid_site_id,
    load_toml,
    require,
)

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
        require(is_valid_site_id(site_id), "site_id", f"must be {SITE_ID_RULE}", site_id)
        coordinator = get(doc, "coordinator", str, "")
        host, sep, port = coordinator.rpartition(":")
        ok = bool(host and sep and port.isdigit()) and 0 < int(port or 0) < 65536
        require(ok, "coordinator", "must be host:port with a port in 1-65535", coordinator)
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
