"""A site's provenance: what its results for one task come from, as one typed record.

Shared by both sides: the site builds it (``fedra.client.provenance``), the coordinator
records it per run; ``fedra.protos.serde`` converts it to and from ``common.Provenance``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_PROVENANCE_CHARS = 200  # of each string in a site's provenance
MAX_PROVENANCE_VERSIONS = 16


@dataclass(frozen=True)
class Provenance:
    """What a site's results for one task come from (common.Provenance)."""

    entry_point: str
    task_version: str = ""
    task_source_sha256: str = ""
    data_fingerprint: str = ""
    config_sha256: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    device: str = ""

    def digest(self) -> str:
        """One hash of all of it: equal provenances, equal digests. Worked out once (it is
        asked for with every update a site sends) and kept beside the fields."""
        known: str | None = self.__dict__.get("_digest")
        if known is None:
            doc = json.dumps(dataclasses.asdict(self), sort_keys=True, default=dict)
            known = hashlib.sha256(doc.encode()).hexdigest()
            object.__setattr__(self, "_digest", known)  # frozen: not one of its fields
        return known
