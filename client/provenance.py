"""What a site's results come from: per task, its code, data and versions, as digests.

Sent with the site's registration, recorded by the coordinator for each run the site
takes part in (``fedra run status --json``'s ``provenance``). Nothing here reveals the
data: the data fingerprint is the task's own (``data_fingerprint(config)``, e.g. a hash
of a manifest) or, by default, a SHA-256 of the ``[data]`` table as configured.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedra import __version__
from fedra.provenance import Provenance


def versions() -> dict[str, str]:
    return {"fedra": __version__, "torch": torch.__version__, "python": platform.python_version()}


def device() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"cpu: {platform.machine()}"


def source_sha256(module_name: str) -> str:
    """SHA-256 over the task module's source: its file, or for a package every ``.py``
    file under it (each file's path relative to it, then its bytes, in path order)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a task given as an object (tests, embedding), not by module
        return ""
    where = getattr(module, "__file__", None)
    if where is None:
        return ""
    root = Path(where).parent
    files = sorted(root.rglob("*.py")) if Path(where).name == "__init__.py" else [Path(where)]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Top-level modules to the installed distributions that provide them: a scan of every
    installed package's metadata (tenths of a second), done once a process."""
    return importlib.metadata.packages_distributions()


def distribution_version(module_name: str) -> str:
    top = module_name.split(".", maxsplit=1)[0]
    for dist in _distributions().get(top, []):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def data_fingerprint(task: Any, config: Mapping[str, Any]) -> str:
    """The task's own fingerprint of its data (``data_fingerprint(config)``), or a SHA-256
    of the data table as configured: which data, never the data."""
    own = getattr(task, "data_fingerprint", None)
    if callable(own):
        return str(own(dict(config)))[:128]
    canonical = json.dumps(dict(config), sort_keys=True, default=str).encode()
    return "config:" + hashlib.sha256(canonical).hexdigest()


def of_task(
    entry_point: str, task: Any, data: Mapping[str, Any], config_path: Path | None
) -> Provenance:
    module = entry_point.partition(":")[0]
    config = hashlib.sha256(config_path.read_bytes()).hexdigest() if config_path else ""
    return Provenance(
        entry_point=entry_point,
        task_version=distribution_version(module),
        task_source_sha256=source_sha256(module),
        data_fingerprint=data_fingerprint(task, data),
        config_sha256=config,
        versions=versions(),
        device=device(),
    )
