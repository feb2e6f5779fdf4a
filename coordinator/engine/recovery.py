"""Rebuilding a run's live state from the database and blob store after a restart.

The global model and optimiser state come from the last committed checkpoint. An
open round resumes where it stopped: the same sampled sites and tasks, accepted
updates folded in again from the spool, a fresh deadline, and sites given one
liveness timeout to reconnect before they count as gone.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

from fedra.accounting import Accountant
from fedra.coordinator.aggregation import ServerOptimizer
from fedra.coordinator.engine.folding import fold_ready
from fedra.coordinator.engine.rounds import (
    ACCOUNTANT_KEY,
    LEGACY_ACCOUNTANT_KEY,
    RESIDUAL_PREFIX,
    publish_controls,
    start_aggregate,
)
from fedra.coordinator.ledger import DECLINED, PROVENANCE_EVENT
from fedra.coordinator.promotion import PromotionState
from fedra.coordinator.state import ATTEMPT_FAILED, INIT_ROUND, ActiveRun, TaskState
from fedra.privacy import PrivacyError
from fedra.protos.codec import CodecError, StreamDecoder, TensorSpec, decode_chunks
from fedra.runspec import RunSpec
from fedra.storage.blobs import BlobCorruptError, BlobNotFoundError
from fedra.storage.records import (
    PENDING_PARTICIPATION_STATES,
    ParticipationState,
    RunRecord,
    RunState,
)

if TYPE_CHECKING:
    import torch

    from fedra.coordinator.engine.core import Engine

log = logging.getLogger("fedra.coordinator")


def restore_run(engine: Engine, record: RunRecord) -> ActiveRun | None:
    """The ActiveRun for a pending or running run, as of its last durable state; None if
    the run cannot safely go on (it is then recorded as failed, with the reason)."""
    spec = RunSpec.from_json(record.spec_json)
    run = ActiveRun(run_id=record.id, spec=spec, optimizer=ServerOptimizer(spec))
    ckpt = engine._store.latest_checkpoint(record.id)
    if ckpt is not None:
        # The model itself stays in its blob (a commit streams it: rounds.stepped_model),
        # but it is read through once here, so a damaged blob ends the run now with the
        # reason instead of failing a commit after the sites trained on it.
        try:
            run.model_specs = verified_specs(engine, ckpt.model_sha256)
        except (CodecError, BlobNotFoundError) as exc:
            reason = f"the checkpoint of round {ckpt.round_number} is damaged: {exc}"
            _fail(engine, record, reason, ckpt.round_number)
            return None
        run.model_sha256, run.model_bytes = ckpt.model_sha256, ckpt.model_bytes
        run.next_round = ckpt.round_number + 1
        # What each site's updates came from, as recorded: a site unchanged since is not
        # recorded again (nor shown as changed from the resume on).
        for e in engine._store.list_events(record.id, (PROVENANCE_EVENT,)):
            run.provenance[str(e.data.get("site", ""))] = str(e.data.get("digest", ""))
        if spec.promotion is not None:  # as the last commit left it, in its metrics
            last = engine._store.get_round(record.id, ckpt.round_number)
            run.promotion = PromotionState.from_metrics(last.metrics if last else {})
        if ckpt.optimizer_sha256:
            state = decode_chunks(engine.models.read_chunks(ckpt.optimizer_sha256))
            try:
                restore_accountant(run, state)
            except PrivacyError as exc:  # never carry on without knowing what was spent
                reason = f"the checkpoint of round {ckpt.round_number}'s privacy accountant: {exc}"
                _fail(engine, record, reason, ckpt.round_number)
                return None
            run.download_residual = {
                k[len(RESIDUAL_PREFIX) :]: state.pop(k)
                for k in list(state)
                if k.startswith(RESIDUAL_PREFIX)
            }
            run.optimizer.load_state_dict(state)
            run.controls_sha256, run.controls_bytes = publish_controls(engine, run)
        if ckpt.delta_sha256:
            previous = engine._store.get_checkpoint(record.id, ckpt.round_number - 1)
            if previous is not None:
                run.base_sha256, run.delta_sha256 = previous.model_sha256, ckpt.delta_sha256
                run.delta_bytes = engine.models.size(ckpt.delta_sha256)
    # Sites whose policy declined the run's task lately stay out of its sampling for what
    # is left of their hold, as they would have without the restart.
    hold_s = engine.settings.decline_hold_s
    run.declined.update(engine._store.failed_since(record.id, DECLINED, engine.clock() - hold_s))
    # Async: tasks a crash left between a commit and the next round's opening are lost.
    reason = "the coordinator restarted before this task joined the next round"
    engine._store.expire_unfinished_before(record.id, run.next_round, reason, engine.clock())
    open_round = engine._store.get_open_round(record.id)
    if open_round is not None:
        if _unmasked_before(engine, run, open_round.number, open_round.attempt):
            return None
        if not _resume_open_round(engine, run, open_round.number, open_round.attempt):
            return None
    return run


def _fail(engine: Engine, record: RunRecord, reason: str, number: int) -> None:
    """Record a run that cannot go on from its checkpoint as failed, with the reason."""
    now = engine.clock()
    open_round = engine._store.get_open_round(record.id)
    if open_round is not None:
        engine._store.expire_attempt(record.id, open_round.number, open_round.attempt, reason, now)
    engine._store.end_run(record.id, RunState.FAILED, reason, now, number)
    log.error("run %s: %s", record.id, reason)


def restore_accountant(run: ActiveRun, state: dict[str, torch.Tensor]) -> None:
    """[privacy]: what the committed rounds spent, from the checkpoint's optimiser state
    (its accountant entries are taken out of ``state``): the dp-accounting state, or a
    checkpoint's from before it (its round count). PrivacyError if it is not the run's."""
    new, legacy = state.pop(ACCOUNTANT_KEY, None), state.pop(LEGACY_ACCOUNTANT_KEY, None)
    privacy = run.spec.privacy
    if privacy is None or (new is None and legacy is None):
        return
    event = privacy.round_event(run.spec.sites_per_round)
    if new is not None:
        run.accountant = Accountant.from_tensor(new, event)
    else:
        assert legacy is not None
        run.accountant = Accountant.from_legacy_tensor(legacy, event)


def verified_specs(engine: Engine, digest: str) -> dict[str, TensorSpec]:
    """The specs of model blob ``digest``, after checking its structure and SHA-256."""
    decoder = StreamDecoder(copy=False)
    hasher = hashlib.sha256()
    for chunk in engine.models.read_chunks(digest, verify=False):  # checked here, with its reason
        hasher.update(chunk)
        decoder.feed(chunk)
    decoder.finish()
    if hasher.hexdigest() != digest:
        raise CodecError(f"its SHA-256 is {hasher.hexdigest()}, not {digest}")
    engine.models.mark_verified(digest)
    return decoder.specs


def _unmasked_before(engine: Engine, run: ActiveRun, number: int, attempt: int) -> bool:
    """An attempt whose aggregate was released but not committed ends the run (a secure
    round's unmasked sum): running it again would unmask a second sum of the same updates
    over another set of sites, and the difference of the two would expose what secure
    aggregation hides."""
    released = run.aggregator.release_event
    if not released:
        return False
    unmasked = any(
        e.kind == released and e.round_number == number and e.data.get("attempt") == attempt
        for e in engine._store.list_events(run.run_id)
    )
    if not unmasked:
        return False
    now = engine.clock()
    reason = (
        f"round {number} was unmasked but not committed when the coordinator stopped; "
        "running it again would release a second sum of the same updates, so the run "
        "ends here (submit it again to go on)"
    )
    engine._store.expire_attempt(run.run_id, number, attempt, reason, now)
    engine._store.end_run(run.run_id, RunState.FAILED, reason, now, number)
    log.error("run %s: %s", run.run_id, reason)
    return True


def _resume_open_round(engine: Engine, run: ActiveRun, number: int, attempt: int) -> bool:
    """Resume the open round; False if the run turns out to have ended (it is recorded)."""
    if number != run.next_round:
        raise RuntimeError(
            f"run {run.run_id}: open round {number} does not follow the last checkpoint "
            f"(next round {run.next_round}); the database is inconsistent"
        )
    parts = engine._store.list_participations(run.run_id, number, attempt)
    now = engine.clock()
    if engine._store.failed_attempt(run.run_id, number, attempt, ATTEMPT_FAILED):
        # It failed (and said so) before the restart: the next attempt opens, nothing of
        # this one is resumed or recorded again; its spooled updates will not be used.
        # At a start, runs not restored yet may hold the same bytes: the start's sweep
        # deletes these files once every run is back (Engine._sweep_spool).
        kept = engine.spool_kept()
        for p in parts:
            if p.update_sha256 and p.update_sha256 not in kept and not engine.restoring:
                engine.updates.delete(p.update_sha256)
            engine.mark_seen_for_recovery(p.site_id, now)
        engine._store.clear_update_data([p.task_id for p in parts if p.update_sha256])
        if attempt >= run.spec.max_round_attempts:  # it was the last: the run had failed
            reason = f"round {number}: gave up after {attempt} attempts"
            engine._store.end_run(run.run_id, RunState.FAILED, reason, now, number)
            log.error("run %s: %s", run.run_id, reason)
            return False
        run.next_attempt = attempt + 1
        log.info("run %s round %d: attempt %d had failed; opening the next", run.run_id,
                 number, attempt)  # fmt: skip
        return True
    if run.aggregator.restart_reason and number != INIT_ROUND:
        # Its aggregate cannot be rebuilt from the spool (a secure round's key exchange
        # lived in memory): the round is retried, with fresh keys.
        reason = f"the coordinator restarted; {run.aggregator.restart_reason}"
        reason = f"round {number} attempt {attempt}: {reason}"
        engine._store.expire_attempt(run.run_id, number, attempt, reason, now, event=ATTEMPT_FAILED)
        run.next_attempt = attempt + 1
        for p in parts:
            engine.mark_seen_for_recovery(p.site_id, now)
        log.info("run %s round %d: %s", run.run_id, number, reason)
        return True
    deadline = now + run.spec.round_deadline_s
    engine._store.extend_deadline(run.run_id, number, deadline)
    run.set_open(number, attempt, {p.site_id: p.task_id for p in parts}, now, deadline)
    run.next_attempt = attempt
    if number != INIT_ROUND:
        start_aggregate(engine, run)
    for p in parts:
        a = run.assignments[p.site_id]
        a.issued_round = number if p.issued_round is None else p.issued_round
        a.base_round = p.base_round
        engine.mark_seen_for_recovery(p.site_id, now)
        accepted = p.state == ParticipationState.ACCEPTED
        damage = _spool_damage(engine, p.update_sha256) if accepted else ""
        if accepted and not damage:
            a.restore(ParticipationState.ACCEPTED)
            a.update_sha256, a.num_samples = p.update_sha256, p.num_samples
            a.nonce = p.nonce or b""  # a retry whose reply the restart lost is answered as done
        elif accepted:  # the round goes on without it (the quorum permitting)
            reason = f"update {damage} across a restart"
            engine._store.fail_participation(p.task_id, reason, now, accepted_too=True)
            log.error("run %s round %d: %s's %s", run.run_id, number, p.site_id, reason)
            a.restore(ParticipationState.FAILED)
        elif p.state in PENDING_PARTICIPATION_STATES:
            a.restore(p.state)
        else:
            a.restore(ParticipationState.FAILED)
            a.declined = p.error.startswith(DECLINED)  # the attempt waits on, as before
    fold_ready(engine, run)  # in the same order as before the restart: the same sum
    log.info(
        "run %s round %d: resumed attempt %d with %d of %d updates already in",
        run.run_id, number, attempt,
        sum(a.state == TaskState.ACCEPTED for a in run.assignments.values()),
        len(parts),
    )  # fmt: skip
    return True


def _spool_damage(engine: Engine, digest: str | None) -> str:
    """'' if the spooled update is whole (read through once, checked against its name),
    else what is wrong with it; a damaged one is deleted."""
    if not digest or not engine.updates.exists(digest):
        return "lost from the spool"
    try:
        for _ in engine.updates.read_chunks(digest):
            pass
    except BlobCorruptError:
        engine.updates.delete(digest)
        return "damaged in the spool"
    return ""
