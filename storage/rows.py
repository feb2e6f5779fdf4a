"""Converting ORM rows into the plain records the rest of fedra sees."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from fedra.storage import models as m
from fedra.storage.records import (
    CheckpointRecord,
    EventRecord,
    ParticipationRecord,
    ParticipationState,
    RoundRecord,
    RoundState,
    RunRecord,
    RunState,
    SiteRecord,
)

# A stored state's member by its stored value: a plain dict's lookup, for the thousands of
# participations a status reads at once.
PARTICIPATION_STATE = {str(s): s for s in ParticipationState}


def run_record(r: m.Run) -> RunRecord:
    return RunRecord(
        id=r.id,
        name=r.name,
        task=r.task,
        spec_json=r.spec_json,
        state=RunState(r.state),
        reason=r.reason,
        rounds_completed=r.rounds_completed,
        created_at=r.created_at,
        updated_at=r.updated_at,
    )


def site_record(r: m.Site) -> SiteRecord:
    return SiteRecord(
        id=r.id,
        tasks=tuple(json.loads(r.tasks_json)),
        version=r.version,
        registered_at=r.registered_at,
        last_seen_at=r.last_seen_at,
    )


def round_record(r: m.Round) -> RoundRecord:
    return RoundRecord(
        run_id=r.run_id,
        number=r.number,
        attempt=r.attempt,
        state=RoundState(r.state),
        sampled=tuple(json.loads(r.sampled_json)),
        opened_at=r.opened_at,
        deadline_at=r.deadline_at,
        closed_at=r.closed_at,
        metrics=json.loads(r.metrics_json),
        stages=json.loads(r.stages_json or "{}"),
    )


# ParticipationRecord's fields in order, as the participations table's columns (the
# metrics are stored as JSON): a status of thousands of sites reads them positionally.
PARTICIPATION_COLUMNS = tuple(
    "metrics_json" if f.name == "metrics" else f.name for f in fields(ParticipationRecord)
)
_METRICS_AT = PARTICIPATION_COLUMNS.index("metrics_json")
_STATE_AT = PARTICIPATION_COLUMNS.index("state")


def participation_from_values(values: Sequence[Any]) -> ParticipationRecord:
    """A record from a row of ``PARTICIPATION_COLUMNS``, in that order."""
    row = list(values)
    row[_METRICS_AT] = json.loads(row[_METRICS_AT])
    row[_STATE_AT] = PARTICIPATION_STATE[row[_STATE_AT]]
    return ParticipationRecord(*row)


def participation_record(r: m.Participation) -> ParticipationRecord:
    return ParticipationRecord(
        task_id=r.task_id,
        run_id=r.run_id,
        round_number=r.round_number,
        attempt=r.attempt,
        site_id=r.site_id,
        state=PARTICIPATION_STATE[r.state],
        assigned_at=r.assigned_at,
        update_sha256=r.update_sha256,
        num_samples=r.num_samples,
        bytes_down=r.bytes_down,
        bytes_up=r.bytes_up,
        bytes_cut=r.bytes_cut,
        download_s=r.download_s,
        upload_s=r.upload_s,
        metrics=json.loads(r.metrics_json),
        error=r.error,
        finished_at=r.finished_at,
        nonce=r.nonce,
        issued_round=r.issued_round,
        base_round=r.base_round,
    )


def checkpoint_record(r: m.Checkpoint) -> CheckpointRecord:
    return CheckpointRecord(
        run_id=r.run_id,
        round_number=r.round_number,
        model_sha256=r.model_sha256,
        model_bytes=r.model_bytes,
        optimizer_sha256=r.optimizer_sha256,
        created_at=r.created_at,
        delta_sha256=r.delta_sha256,
    )


def event_record(r: m.Event) -> EventRecord:
    return EventRecord(
        id=r.id,
        run_id=r.run_id,
        round_number=r.round_number,
        kind=r.kind,
        message=r.message,
        data=json.loads(r.data_json),
        created_at=r.created_at,
    )
