"""Building RunStatus messages from stored rows: what `fedra run status` shows."""

from __future__ import annotations

from fedra.coordinator.engine import Engine
from fedra.protos.serde import runspec_to_proto
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec
from fedra.storage.records import ParticipationRecord, RoundRecord, RunRecord


def run_status(engine: Engine, record: RunRecord, insecure: bool = False) -> admin_pb2.RunStatus:
    """The run, every round and every participation, as stored."""
    store = engine.store
    rounds = store.list_rounds(record.id)
    parts = store.list_participations(record.id)
    ckpts = {c.round_number: c.model_sha256 for c in store.list_checkpoints(record.id)}
    reason = record.reason
    with engine.lock:
        live = engine.runs.get(record.id)
        if live is not None and live.open_round is None and live.waiting_reason:
            reason = live.waiting_reason
    return admin_pb2.RunStatus(
        run_id=record.id,
        spec=runspec_to_proto(RunSpec.from_json(record.spec_json)),
        state=record.state,
        reason=reason,
        rounds_completed=record.rounds_completed,
        rounds=[_round(r, [p for p in parts if p.round_number == r.number], ckpts) for r in rounds],
        created_unix_s=record.created_at,
        updated_unix_s=record.updated_at,
        coordinator_insecure=insecure,
    )


def _round(
    r: RoundRecord, parts: list[ParticipationRecord], ckpts: dict[int, str]
) -> admin_pb2.RoundStatus:
    current = [p for p in parts if p.attempt == r.attempt]
    closed = r.closed_at or 0.0
    return admin_pb2.RoundStatus(
        number=r.number,
        attempt=r.attempt,
        status=r.state,
        sampled_sites=list(r.sampled),
        updates=sum(p.state == "accepted" for p in current),
        opened_unix_s=r.opened_at,
        closed_unix_s=closed,
        duration_s=max(0.0, closed - r.opened_at) if closed else 0.0,
        bytes_down=sum(p.bytes_down for p in parts),
        bytes_up=sum(p.bytes_up for p in parts),
        metrics=r.metrics,
        model_sha256=ckpts.get(r.number, ""),
        stages=r.stages,
        participations=[_participation(p) for p in parts],
    )


def _participation(p: ParticipationRecord) -> admin_pb2.Participation:
    return admin_pb2.Participation(
        site_id=p.site_id,
        attempt=p.attempt,
        status=p.state,
        num_samples=p.num_samples,
        bytes_down=p.bytes_down,
        bytes_up=p.bytes_up,
        download_s=p.download_s,
        upload_s=p.upload_s,
        metrics=p.metrics,
        error=p.error,
    )
