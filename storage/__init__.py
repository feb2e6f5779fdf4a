"""Persistence: SQLAlchemy models and repository, and the content-addressed blob store.

Nothing here knows about gRPC or torch: rows are plain dataclasses, blobs are bytes.
"""

from fedra.storage.blobs import BlobStore
from fedra.storage.records import (
    CheckpointRecord,
    EventRecord,
    ParticipationRecord,
    RoundRecord,
    RunReads,
    RunRecord,
    SiteRecord,
)
from fedra.storage.store import Store
from fedra.storage.writes import DuplicateError

__all__ = [
    "BlobStore",
    "CheckpointRecord",
    "DuplicateError",
    "EventRecord",
    "ParticipationRecord",
    "RoundRecord",
    "RunReads",
    "RunRecord",
    "SiteRecord",
    "Store",
]
