"""Loading TOML configuration into typed values, with errors that name the key."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")
# The coordinator's readiness file in its state directory: address, port, pid, insecure.
READY_FILE = "coordinator.json"


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


def load_toml(path: Path | str) -> dict[str, Any]:
    """Read a TOML file; a syntax error names the file and line."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"{p}: no such file") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: {exc}") from exc


def check_keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """Refuse keys a table does not define, so a typo is not silently ignored."""
    unknown = sorted(set(table) - allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key (expected one of {', '.join(sorted(allowed))})"
        )


def get(table: Mapping[str, Any], key: str, kind: type[T], where: str, default: Any = ...) -> T:
    """``table[key]`` checked to be a ``kind``; ints are accepted where floats are asked for."""
    name = f"{where}.{key}" if where else key
    if key not in table:
        if default is ...:
            raise ConfigError(f"{name}: required")
        return default  # type: ignore[no-any-return]
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


_SITE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SITE_ID_RULE = "1-128 ASCII letters, digits, '-', '_' or '.'"


def is_valid_site_id(site_id: str) -> bool:
    """Site ids appear in file names, logs and certificates: keep them plain."""
    return _SITE_ID.fullmatch(site_id) is not None and site_id not in (".", "..")


def require(ok: bool, name: str, reason: str, value: object) -> None:
    """Raise ConfigError('name: reason, got value') unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}: {reason}, got {value!r}")


def check_host_port(value: str, name: str, *, allow_port_zero: bool = False) -> str:
    """``value`` if it is host:port (an IPv6 host in brackets), else ConfigError naming
    ``name``: every coordinator address given to fedra follows it. gRPC would otherwise
    dial port 443 for an address without one."""
    host, sep, port = value.rpartition(":")
    low = 0 if allow_port_zero else 1
    ok = bool(host.strip("[]") and sep and port.isascii() and port.isdigit())
    if not (ok and low <= int(port) <= 65535):
        raise ConfigError(f"{name}: must be host:port with a port in {low}-65535, got {value!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(
            f"{name}: must be host:port with an IPv6 host in brackets "
            f"(e.g. [::1]:50051), got {value!r}"
        )
    return value
