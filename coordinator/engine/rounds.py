"""The round driver: one thread per run that samples sites, waits, and closes rounds.

A round closes when every sampled site has answered or its deadline passes. With at
least the quorum of updates it commits: the new global model and optimiser state are
written as durable blobs first, then one database transaction records the checkpoint
and closes the round. Without the quorum the attempt is retried with a fresh sample,
up to ``max_round_attempts``, and then the run fails with the reason.

A private run that declares its sampling (``privacy.sampling``) is sampled the way its
accountant assumes, from secret randomness (a sample an observer could recompute from the
spec's seed would amplify nothing). ``fixed``: ``sites_per_round`` sites, uniformly, and
only once at least ``privacy.population`` sites are eligible (from fewer, each site's
chance would exceed the one accounted for). ``poisson``: each eligible site independently
with probability ``sites_per_round / population``, once the population is eligible or
``join_timeout_s`` has passed with at least one; such a round has no quorum and commits
whatever its sample delivers, even nothing (then the model moves by the noise alone):
retrying a round until enough sites were sampled would make the released round depend on
who was sampled, which Poisson amplification does not allow for.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedra import logformat
from fedra.accounting import Accountant
from fedra.coordinator import promotion, scaffold
from fedra.coordinator.aggregation import ServerOptimizer
from fedra.coordinator.aggregators import AggregationError, Attempt
from fedra.coordinator.engine.folding import fold_ready, fold_remaining, has_turn
from fedra.coordinator.engine.storage_faults import StorageFaults
from fedra.coordinator.ledger import DECLINED, idle_s
from fedra.coordinator.observers import RoundEnded, RunEnded
from fedra.coordinator.state import ATTEMPT_FAILED, INIT_ROUND, ActiveRun, TaskState
from fedra.faults import crash_point
from fedra.metrics import format_metric, is_count_metric
from fedra.protos.codec import (
    Buffer,
    StreamDecoder,
    TensorSpec,
    all_finite,
    decode_chunks,
    encode_chunks,
    spec_of,
)
from fedra.protos.compression import Compressor, apply_step
from fedra.storage.blobs import BLOCK_BYTES, BlobCorruptError
from fedra.storage.records import (
    CheckpointRecord,
    ParticipationRecord,
    ParticipationState,
    RoundState,
    RunState,
)
from fedra.storage.store import ClaimLostError, transient_fault

if TYPE_CHECKING:
    from fedra.coordinator.engine.core import Engine
    from fedra.runspec import PrivacySpec, RunSpec

log = logging.getLogger("fedra.coordinator")
_RECHECK_S = 1.0  # liveness is re-evaluated at least this often while waiting
_LOOK_GAP_PER_SITE_S, _MAX_LOOK_GAP_S = 5e-6, 0.025  # between two looks of a waiting round
# How often a waiting round looks for sites that went silent: a timeout of seconds needs
# no finer look. A look asks only the sites due (``SilenceWatch``).
_LIVENESS_LOOK_S = 0.25
# The key in the optimiser-state checkpoint blob that holds the privacy accountant, and
# the key its float64 Rényi-DP tensor had before dp-accounting (still read on resume).
ACCOUNTANT_KEY = "privacy.accountant"
LEGACY_ACCOUNTANT_KEY = "privacy.rdp"
_SECRET = random.SystemRandom()  # the sample of a run that claims amplification by it
# ... and the prefix of the server's error-feedback residual for compressed downloads.
RESIDUAL_PREFIX = "download/"


def start_aggregate(engine: Engine, run: ActiveRun) -> None:
    """Give a freshly opened (or resumed) attempt of a training round its aggregate."""
    specs, number = run.model_specs, run.open_round
    assert specs is not None and number is not None
    run.drop_aggregate()
    spill = engine.updates.root / "spill" / f"{run.run_id}-{number}-{run.attempt}"
    sites = tuple(sorted(run.assignments))
    run.aggregator.begin(Attempt(run.run_id, number, run.attempt, sites, specs, spill))


class SilenceWatch:
    """Which of an attempt's pending sites went silent, without asking each one at every
    look: a heap of when each must next be asked (``Engine.silence_due``: its last-heard
    time plus the liveness timeout, for most), and the sites that hung up since the last
    look. At thousands of sites a look then costs what the few sites due cost (lock held).

    Each site has one live entry (``_when``); an entry pushed again earlier leaves its
    older one in the heap, skipped when it comes up. A clock that went back makes every
    site due at once, as a new attempt does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._attempt: tuple[int | None, int] = (None, 0)
        self._tasks: object = None  # the attempt's assignments (the dict itself)
        self._due: list[tuple[float, str]] = []
        self._when: dict[str, float] = {}  # each site's live entry
        self._hangups = -1
        self._looked = -math.inf

    def silent(self, run: ActiveRun, now: float) -> list[str]:
        """The pending sites of ``run``'s open attempt that count as offline now."""
        engine, due, when_of = self.engine, self._due, self._when
        attempt = (run.open_round, run.attempt)
        if attempt != self._attempt or run.assignments is not self._tasks or now < self._looked:
            self._attempt, self._tasks = attempt, run.assignments
            due[:] = [(now, site) for site in run.assignments]  # all equal: a heap
            when_of.clear()
            when_of.update(dict.fromkeys(run.assignments, now))
        self._looked = now
        asked: dict[str, None] = {}  # the sites to ask, in order, each once
        while due and due[0][0] <= now:
            at, site = heapq.heappop(due)
            if when_of.get(site) == at:
                del when_of[site]
                asked[site] = None
        if engine.hangups != self._hangups:  # offline at once, whenever they are due
            self._hangups = engine.hangups
            for site in engine.hung_up_sites():
                if site in run.assignments:
                    asked.setdefault(site)
        silent = []
        for site in asked:
            a = run.assignments.get(site)
            if a is None or a.final:
                when_of.pop(site, None)
                continue
            when = engine.silence_due(site, now)
            if when is None and a.pending:
                silent.append(site)
                when_of.pop(site, None)
                continue
            # Online (a transfer under way, say), or offline while uploading: asked again
            # then, or sooner than its entry says (a hung-up site's transfer may end).
            at = now + _LIVENESS_LOOK_S if when is None else when
            if at < when_of.get(site, math.inf):
                when_of[site] = at
                heapq.heappush(due, (at, site))
        return silent


class RoundDriver:
    def __init__(self, engine: Engine, run: ActiveRun) -> None:
        self.engine, self.run_state = engine, run
        self.tag = f"run {run.run_id}"
        self._liveness_looked = -float("inf")
        self._silence = SilenceWatch(engine)
        self._short = ""  # why the open attempt ended early (``short_of_quorum``), if it did
        self._declined: dict[tuple[int, int], bool] = {}  # failed attempts: declines only?
        # Closed rounds' spooled updates, dropped once the next round is open (``_tidy_up``).
        self._leftovers: list[Callable[[], None]] = []

    def run(self) -> None:
        """Drive rounds until the run ends or the engine stops. A storage fault (a full
        disk, dropped database connections) does not end the run: after a backoff it
        goes back to its last committed state and carries on (``storage_faults``)."""
        logformat.set_about(run=self.run_state.run_id)  # this thread drives this run alone
        faults = StorageFaults(self.engine, self.run_state, self.tag, self._drop_round_updates)
        try:
            while True:
                try:
                    while self._step():
                        faults.carried_on()
                    return
                except Exception as exc:
                    why = transient_fault(exc)
                    if not why:
                        raise
                    if not faults.ride_out(why):
                        if not self.engine.stopping:
                            self._forget()
                        return
        except ClaimLostError:  # the run is the other coordinator's to drive now
            log.warning("%s: stopped driving it: another coordinator took the database", self.tag)
            self._forget()
        except Exception as exc:  # a bug must fail the run visibly, not hang it
            reason = f"internal error: {type(exc).__name__}: {exc}"
            if isinstance(exc, BlobCorruptError):  # never build on a model that changed
                reason = f"stored data is damaged, so the run stops here: {exc}"
                log.error("%s: %s", self.tag, reason)
            else:
                log.exception("%s: driver crashed", self.tag)
            try:
                self._finish(RunState.FAILED, reason)
            except Exception:  # e.g. the database is down too: it stays running there
                log.exception("%s: could not record the failure", self.tag)
            finally:
                self._forget()  # never leave a run whose rounds nobody drives

    def _step(self) -> bool:
        run, engine = self.run_state, self.engine
        with engine._lock:
            if engine.stopping:
                return False
            if run.cancelled:
                self._finish(RunState.CANCELLED, "cancelled by an operator")
                return False
        if run.open_round is None and self._budget_spent():
            return False
        if run.open_round is None and not self._open_next():
            return True  # stopping or cancelled: the next step handles it
        outcome = self._wait()
        if outcome == "closed":
            return self._close()
        if outcome == "fold":  # a site before them failed: fold the updates that waited
            try:
                fold_ready(engine, run)
            except Exception as exc:
                log.exception("%s round %s: folding accepted updates failed", self.tag,
                              run.open_round)  # fmt: skip
                with engine._lock:
                    run.broken = f"folding accepted updates failed: {type(exc).__name__}"
        return True

    # -- opening -----------------------------------------------------------------

    def _budget_spent(self) -> bool:
        """With [privacy]: end the run rather than open a round past its budget."""
        run, privacy = self.run_state, self.run_state.spec.privacy
        if privacy is None or run.next_round == INIT_ROUND:
            return False
        spent = run.privacy_spent()
        after = spent.after().epsilon(privacy.delta)
        if after <= privacy.epsilon:
            return False
        done = run.next_round - 1
        self._finish(
            RunState.COMPLETED,
            f"privacy budget reached: round {run.next_round} would take epsilon to {after:.4g} "
            f"> {privacy.epsilon:g} (delta {privacy.delta:g}); stopped after round {done} of "
            f"{run.spec.rounds} with epsilon {spent.epsilon(privacy.delta):.4g}",
        )
        return True

    def _open_next(self) -> bool:
        run, engine, spec = self.run_state, self.engine, self.run_state.spec
        number, attempt = run.next_round, run.next_attempt
        init = number == INIT_ROUND
        privacy = spec.privacy
        carried = len(run.carried)  # async: sites still training on an earlier task
        wanted = 1 if init else spec.sites_per_round - carried
        quorum = 1 if init else spec.quorum
        started = time.monotonic()
        with engine._lock:
            while True:
                if engine.stopping or run.cancelled:
                    return False
                eligible = engine.eligible_sites(run, engine.clock())
                waited = time.monotonic() - started
                if init or privacy is None or privacy.sampling == "none":
                    enough = len(eligible) + carried >= quorum
                    if len(eligible) >= wanted or (enough and waited >= spec.join_timeout_s):
                        break
                    if enough and spec.asynchronous is not None and not init:
                        break  # async: a new model needs only the buffer; never make sites wait
                    want = f"want {wanted} (quorum {quorum})"
                else:
                    if _may_sample(privacy, len(eligible), waited >= spec.join_timeout_s):
                        break
                    want = f"[privacy] sampling {privacy.sampling} wants {privacy.population}"
                run.waiting_reason = (
                    f"round {number}: waiting for online sites serving {spec.task}: "
                    f"{len(eligible)} eligible, {want}, for {waited:.0f} s so far"
                )
                if self._leftovers:  # the sites keep it waiting: tidy up meanwhile
                    engine._lock.release()  # held once: _step does not hold it
                    try:
                        self._tidy_up()
                    finally:
                        engine._lock.acquire()
                    continue
                engine._changed.wait(_RECHECK_S)
                self._gather(len(eligible))
            sampled = draw(spec, number, attempt, eligible, wanted)
            assignments = {site: uuid.uuid4().hex for site in sampled}
            now = engine.clock()
            deadline = now + spec.round_deadline_s
            carry = [a.task_id for a in run.carried.values()]
            opened = ("round_opened", f"attempt {attempt}: {', '.join(sampled)}")
            engine._store.open_round(
                run.run_id, number, attempt, assignments, now, deadline, carry=carry, event=opened
            )
            if number == INIT_ROUND and attempt == 1:
                engine._store.set_run_state(run.run_id, RunState.RUNNING, "", now)
            run.set_open(number, attempt, assignments, now, deadline)
            logformat.set_about(round=number)
            for site in sampled:  # online when sampled: one liveness timeout to pick it up
                engine.mark_seen_for_recovery(site, now, refresh=True)
            if not init:
                start_aggregate(engine, run)
            engine.notify()
        self._tidy_up()  # the sites are on their way: what the last round left goes now
        log.info(
            "%s round %d: opened (attempt %d) with %s%s",
            self.tag,
            number,
            attempt,
            ", ".join(sampled) or "no new site",
            f" and {carried} still training" if carried else "",
        )
        return True

    # -- waiting -----------------------------------------------------------------

    def _wait(self) -> str:
        run, engine = self.run_state, self.engine
        with engine._lock:
            while True:
                if engine.stopping:
                    return "stopping"
                if run.cancelled:
                    while run.folding and not engine.stopping:  # let accepted updates land
                        engine._changed.wait(_RECHECK_S)
                    return "cancelled"
                now = engine.clock()
                if not 0.0 <= now - self._liveness_looked < _LIVENESS_LOOK_S:
                    self._liveness_looked = now
                    self._fail_silent_sites(now)
                    if not run.broken and (short := short_of_quorum(run)):
                        run.broken = self._short = short
                if not run.broken:
                    self._advance_stages(now)
                tasks = run.assignments.values()
                done = all(a.final for a in tasks)  # stops at the first pending: few looked at
                if spec_async := run.spec.asynchronous:  # FedBuff: the buffer is full
                    accepted = sum(a.state is TaskState.ACCEPTED for a in tasks)
                    done = done or accepted >= spec_async.buffer
                if not done and not run.broken and has_turn(run):
                    return "fold"
                if done or now >= run.deadline_at or run.broken:
                    run.closing = True  # from here on, uploads are late
                    engine.notify()
                    while run.folding and not engine.stopping:  # let accepted updates land
                        engine._changed.wait(_RECHECK_S)
                    if not run.broken and not engine.stopping:
                        self._after_uploads()
                    return "stopping" if engine.stopping else "closed"
                engine._changed.wait(min(run.deadline_at - now, _RECHECK_S))
                self._gather(len(run.assignments))

    def _gather(self, sites: int) -> None:
        """A look costs time in proportion to the sites, and thousands of sites bring
        thousands of changes: after a wake-up, let a burst of them gather before the next
        look (lock held; a few ms at most, nothing at a handful of sites)."""
        engine, run = self.engine, self.run_state
        gap = min(_MAX_LOOK_GAP_S, _LOOK_GAP_PER_SITE_S * sites)
        if gap > 0.0005:
            engine._changed.wait_for(lambda: engine.stopping or run.cancelled, gap)

    def _advance_stages(self, now: float) -> None:
        """Close a stage before the uploads (a key exchange) that is complete or overdue
        (lock held)."""
        run = self.run_state
        change = run.aggregator.advance(run.assignments, run.required_updates)
        self._fail(change.dropped, change.dropped_why, now)
        if change.broken:
            run.broken = change.broken
        if change.changed:  # wake the sites waiting on the stage
            self.engine.notify()

    def _after_uploads(self) -> None:
        """Uploads are closed: run the stage that follows them, if the aggregator has one
        (the survivors reveal their shares), to its end (lock held)."""
        run, engine = self.run_state, self.engine
        accepted = sum(a.state == TaskState.ACCEPTED for a in run.assignments.values())
        if accepted < run.required_updates:
            return  # the attempt fails anyway: ask nobody for anything
        why = run.aggregator.close_uploads()
        if why is None:
            return
        run.broken = why
        engine.notify()
        while not run.broken and run.aggregator.collecting() and not engine.stopping:
            engine._changed.wait(_RECHECK_S)

    def _fail_silent_sites(self, now: float) -> None:
        """A sampled site that went silent will not answer: stop waiting for it."""
        engine = self.engine
        silent: list[str] = []
        hung_up: list[str] = []
        for site in self._silence.silent(self.run_state, now):
            (hung_up if engine.hung_up(site) else silent).append(site)
        self._fail(hung_up, "site hung up on its poll (it stopped) and has not come back", now)
        timeout = engine.settings.site_timeout_s
        self._fail(silent, f"site went silent for more than {timeout:g} s", now)

    def _fail(self, sites: Collection[str], reason: str, now: float) -> None:
        """Fail the tasks of the open attempt's ``sites``, all for ``reason``, in one
        transaction (lock held): a round of thousands can find thousands of them silent at
        one look, and a transaction each held the engine's lock for seconds."""
        if not sites:
            return
        run = self.run_state
        tasks = [run.assignments[site] for site in sites]
        self.engine._store.fail_participations([a.task_id for a in tasks], reason, now)
        for a in tasks:
            a.move(TaskState.FAILED)
            log.warning(
                "%s round %s: %s: %s", self.tag, run.open_round, a.site_id, reason,
                extra={"site": a.site_id},
            )  # fmt: skip

    # -- closing -----------------------------------------------------------------

    def _close(self) -> bool:
        run = self.run_state
        if not run.broken:
            try:  # updates that waited for a site that never delivered
                fold_remaining(self.engine, run)
            except Exception as exc:
                log.exception("%s round %s: folding accepted updates failed", self.tag,
                              run.open_round)  # fmt: skip
                run.broken = f"folding accepted updates failed: {type(exc).__name__}"
        accepted = [a for a in run.assignments.values() if a.state == TaskState.ACCEPTED]
        short, self._short = self._short, ""
        if run.broken:  # ended short of its quorum: which tasks failed, as a short round says
            return self._retry_or_fail(len(accepted), run.broken, listed=run.broken == short)
        if len(accepted) >= run.required_updates:
            return self._commit()
        return self._retry_or_fail(len(accepted))

    def _commit(self) -> bool:
        run, engine, spec = self.run_state, self.engine, self.run_state.spec
        number, attempt, opened = run.open_round, run.attempt, run.opened_at
        assert number is not None
        started = time.perf_counter()
        delta_sha, residual = "", dict[str, torch.Tensor]()
        if number == INIT_ROUND:
            assert run.init_sha256 is not None
            model = decode_chunks(engine.updates.read_chunks(run.init_sha256))
        else:
            try:
                mean, count = self._mean_update()
            except AggregationError as exc:
                return self._retry_or_fail(0, str(exc))
            bad = _first_non_finite(mean)
            if bad:  # finite updates can still overflow in the sum: never commit that
                return self._retry_or_fail(count, f"the mean update's {bad} is not finite")
            mean, mean_delta_c = scaffold.split(mean)
            if mean_delta_c:  # SCAFFOLD: c moves beside the model, in the optimiser's state
                population = spec.scaffold_population()
                scaffold.absorb(run.optimizer.state, mean_delta_c, count, population)
                del mean_delta_c
            if spec.codec.download:  # the step is compressed from the whole old and new models
                model = self._committed_model()
                before: dict[str, torch.Tensor] | None = {k: v.clone() for k, v in model.items()}
                run.optimizer.step(model, mean)
            else:
                model, before = self._stepped_model(mean), None
            del mean  # its memory may now hold the new model
            bad = _first_non_finite(model)
            if bad:  # the outer step diverged: the run cannot go on from here
                self._finish(
                    RunState.FAILED, f"round {number}: the new global model's {bad} is not finite"
                )
                return False
            if before is not None:
                try:
                    step, residual = self._compress_step(before, model)
                except ValueError as exc:  # e.g. an outer step too large for fp16
                    self._finish(
                        RunState.FAILED, f"round {number}: compressing the download: {exc}"
                    )
                    return False
                delta_sha = engine.models.put_chunks(encode_chunks(step))
        model_sha = engine.models.put_chunks(encode_chunks(model, BLOCK_BYTES))
        opt_state = run.optimizer.state_dict()
        if delta_sha:  # the server's error feedback is part of the checkpoint too
            opt_state.update({RESIDUAL_PREFIX + k: v for k, v in residual.items()})
        accountant = None
        if spec.privacy is not None and number != INIT_ROUND:
            # Spent by this round, and committed with it: the checkpoint holds the budget.
            accountant = run.privacy_spent().after()
            opt_state[ACCOUNTANT_KEY] = accountant.to_tensor()
        opt_sha = engine.models.put_chunks(encode_chunks(opt_state)) if opt_state else None
        now = engine.clock()
        if not engine.downloads.flush():  # a committed round's ledger holds all its downloads
            why = "committing before its downloads are counted (the database is slow)"
            log.warning("%s round %d: %s", self.tag, number, why)
        parts = engine._store.list_participations(run.run_id, number, run.attempt)
        accepted = [p for p in parts if p.state == ParticipationState.ACCEPTED]
        metrics = weighted_metrics(accepted)
        if accountant is not None and spec.privacy is not None:
            metrics["privacy_epsilon"] = accountant.epsilon(spec.privacy.delta)
        stop, pending_promotion = "", run.promotion
        if spec.promotion is not None and number != INIT_ROUND:
            decision = promotion.decide(spec.promotion, run.promotion, number, metrics)
            metrics.update(decision.state.as_metrics())
            stop = decision.stop
            if decision.rollback:  # this round's model is the promoted one's, and its state
                model_sha, opt_sha = self._rolled_back(decision.state.promoted_round, accountant)
                delta_sha, residual = "", {}
                log.warning("%s round %d: rolled back to round %d's model: %s", self.tag,
                            number, decision.state.promoted_round, decision.why)  # fmt: skip
            pending_promotion = decision.state
        controls_sha, controls_bytes = publish_controls(engine, run)
        ckpt = CheckpointRecord(
            run.run_id, number, model_sha, engine.models.size(model_sha), opt_sha, now,
            delta_sha or None,
        )  # fmt: skip
        stages = ledger(accepted, run.aggregate_s)
        stages["checkpoint_s"] = time.perf_counter() - started
        # Folding left once the last update was in (site order can leave several).
        tail = run.folded_at - run.last_accept_at if run.last_accept_at else 0.0  # 0: resumed
        stages["fold_tail_s"] = max(0.0, tail)
        stages["round_s"] = now - run.opened_at
        crash_point("before_commit", number)
        final = RunState.COMPLETED if number == spec.rounds or stop else None
        carried = [] if final else self._carry_on()
        engine._store.commit_round(
            run.run_id, number, ckpt, metrics, now, final, stages,
            keep=carried,
            event=("round_committed", _summary(parts, metrics)), final_reason=stop,
        )  # fmt: skip
        if spec.promotion is not None and number != INIT_ROUND:
            run.promotion = pending_promotion
        crash_point("after_commit", number)
        stale = out_of_use(
            (run.model_sha256, run.delta_sha256, run.controls_sha256),
            (model_sha, delta_sha, controls_sha),
            opt_sha,
        )
        with engine._lock:
            run.model_specs = spec_of(model)
            run.base_sha256 = run.model_sha256 if delta_sha else ""
            run.delta_sha256 = delta_sha
            run.delta_bytes = engine.models.size(delta_sha) if delta_sha else 0
            run.download_residual = residual
            run.controls_sha256, run.controls_bytes = controls_sha, controls_bytes
            run.model_sha256, run.model_bytes = model_sha, ckpt.model_bytes
            run.accountant = accountant or run.accountant
            run.set_closed(next_round=number + 1)
            engine.notify()
        self._leftovers.append(partial(self._drop_round_updates, number))
        self._leftovers.append(partial(_evict, engine, stale))
        log.info("%s round %d: committed, %s", self.tag, number, _summary(parts, metrics))
        engine.observers.round_ended(_ended(
            run.run_id, number, attempt, RoundState.COMMITTED, opened, now, parts, carried,
            checkpoint_bytes=ckpt.model_bytes, idle_s=idle_s(opened, now, accepted),
            stages=stages, metrics=metrics, model_sha256=model_sha,
        ))  # fmt: skip
        if final:
            log.info("%s: completed after %d rounds%s", self.tag, number, f" ({stop})" * bool(stop))
            engine.observers.run_ended(RunEnded(run.run_id, RunState.COMPLETED, stop))
            self._forget()
            self._tidy_up()
            return False
        return True

    def _rolled_back(self, promoted: int, accountant: Accountant | None) -> tuple[str, str | None]:
        """(model, optimiser state) blobs for a round rolled back to round ``promoted``:
        its model and its server optimiser's state, with the privacy spent so far (never
        rolled back); the in-memory optimiser is set back too."""
        run, engine = self.run_state, self.engine
        ckpt = engine._store.get_checkpoint(run.run_id, promoted)
        assert ckpt is not None, f"promoted round {promoted} has no checkpoint"
        state: dict[str, torch.Tensor] = {}
        if ckpt.optimizer_sha256:
            state = decode_chunks(engine.models.read_chunks(ckpt.optimizer_sha256))
        state = {k: v for k, v in state.items() if not k.startswith(RESIDUAL_PREFIX)}
        state.pop(ACCOUNTANT_KEY, None)
        state.pop(LEGACY_ACCOUNTANT_KEY, None)
        run.optimizer.load_state_dict(dict(state))
        if accountant is not None:
            state[ACCOUNTANT_KEY] = accountant.to_tensor()
        opt_sha = engine.models.put_chunks(encode_chunks(state)) if state else None
        return ckpt.model_sha256, opt_sha

    def _committed_model(self) -> dict[str, torch.Tensor]:
        """The last committed global model, read back from its blob."""
        run, engine = self.run_state, self.engine
        chunks = engine.models.read_chunks(run.model_sha256)
        return decode_chunks(chunks, run.model_specs)

    def _stepped_model(self, mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        run, engine = self.run_state, self.engine
        assert run.model_specs is not None
        chunks = engine.models.read_chunks(run.model_sha256)
        return stepped_model(chunks, run.model_specs, run.optimizer, mean)

    def _carry_on(self) -> list[str]:
        """Async: the tasks still being trained, which move on to the next round."""
        run = self.run_state
        if run.spec.asynchronous is None or run.open_round == INIT_ROUND:
            return []
        return [a.task_id for a in run.assignments.values() if not a.final]

    def _compress_step(
        self, before: dict[str, torch.Tensor], model: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """[codec] download: compress the outer step and move ``model`` by exactly the
        compressed step (in place), so a site holding ``before`` can rebuild it bit for bit.
        Returns the compressed step and the new error-feedback residual (topk)."""
        run = self.run_state
        codec = run.spec.codec
        compressor = Compressor(codec, run.download_residual or None)
        step = compressor.compress(
            {k: model[k] - before[k] for k in model if model[k].is_floating_point()}
        )
        model.update(apply_step(before, step, codec))
        return step, compressor.residual

    def _mean_update(self) -> tuple[dict[str, torch.Tensor], int]:
        """The attempt's aggregate update, shaped like the model, and how many it combines."""
        run, engine = self.run_state, self.engine
        aggregator = run.aggregator
        with engine._lock:
            aggregator.seal()
        if aggregator.release_event:
            # Durably first: a restart must not release a second sum of the same updates.
            engine._store.add_event(
                run.run_id, aggregator.release_event, f"attempt {run.attempt}", engine.clock(),
                run.open_round, {"attempt": run.attempt},
            )  # fmt: skip
        return aggregator.finish()

    def _retry_or_fail(self, accepted: int, why: str = "", *, listed: bool = False) -> bool:
        """End the open attempt without a commit: retry the round, or fail the run after
        ``max_round_attempts``. ``why`` (else the count of updates that arrived), with its
        failed tasks listed when it is the count or ``listed`` asks for them."""
        run, engine, spec = self.run_state, self.engine, self.run_state.spec
        number, attempt = run.open_round, run.attempt
        assert number is not None
        now = engine.clock()
        # One read of the attempt's tasks (thousands of them) for its failures, whether
        # only declines lost it, and its bytes; what the expiry below changes (pending
        # tasks' state and error) none of those three looks at.
        parts = engine._store.list_participations(run.run_id, number, attempt)
        if not why:
            failed = [a for a in run.assignments.values() if a.state == TaskState.FAILED]
            if now < run.deadline_at and len(failed) == len(run.assignments) - accepted:
                why = (
                    f"{accepted} of the {run.required_updates} required updates arrived, "
                    "and the other sampled sites failed"
                )
            else:
                why = (
                    f"{accepted} of the {run.required_updates} required updates arrived "
                    f"within the {spec.round_deadline_s:g} s deadline"
                )
            listed = True
        if listed:
            why += _failures(parts)
        reason = f"round {number} attempt {attempt}: {why}"
        carried = self._carry_on()
        engine._store.expire_attempt(
            run.run_id, number, attempt, reason, now, carried, event=ATTEMPT_FAILED
        )
        crash_point("after_attempt_failed", number)
        log.warning("%s: %s", self.tag, reason)
        # An attempt lost only to sites whose policy declined it does not count: the run
        # waits for sites that take it (an approval, a site's hours) instead of failing.
        self._declined[(number, attempt)] = _declined_only(parts)
        spared = sum(self._spared(number, k) for k in range(1, attempt + 1))
        gives_up = attempt - spared >= spec.max_round_attempts
        engine.observers.round_ended(_ended(
            run.run_id, number, attempt,
            RoundState.FAILED if gives_up else RoundState.RETRIED,
            run.opened_at, now, parts, carried, reason=reason,
        ))  # fmt: skip
        if gives_up:
            self._finish(RunState.FAILED, f"{reason}; gave up after {attempt} attempts")
            return False
        with engine._lock:
            run.set_closed(next_round=number, next_attempt=attempt + 1)
            engine.notify()
        # After set_closed: nothing of ours refers to them. The attempts before dropped
        # theirs when they failed (what a crash left, the round's end drops).
        self._leftovers.append(partial(self._drop_round_updates, number, parts))
        return True

    def _spared(self, number: int, attempt: int) -> bool:
        """Whether only declines lost that failed attempt, which then does not count
        towards ``max_round_attempts`` (kept: a failed attempt's tasks change no more)."""
        if (number, attempt) not in self._declined:
            parts = self.engine._store.list_participations(self.run_state.run_id, number, attempt)
            self._declined[(number, attempt)] = _declined_only(parts)
        return self._declined[(number, attempt)]

    def _tidy_up(self) -> None:
        """Drop what closed rounds left in the spool. Off the path between two rounds: it
        runs once the next round is open (its sites downloading), while the driver waits
        for sites to open it, or as the run ends. Safe meanwhile: the spool keeps a blob
        while any upload holds it or any accepted update of a run is it, and a start
        sweeps what a crash left. A storage fault here leaves them to that sweep."""
        while self._leftovers:
            drop = self._leftovers.pop(0)
            try:
                drop()
            except Exception as exc:
                why = transient_fault(exc)
                if not why:
                    raise
                log.warning("%s: %s; a closed round's spooled updates stay until the "
                            "daemon's next start", self.tag, why)  # fmt: skip

    def _drop_round_updates(
        self, number: int, parts: list[ParticipationRecord] | None = None
    ) -> None:
        """Drop the spooled updates of the round's tasks (of ``parts`` alone, if given)."""
        if parts is None:
            parts = self.engine._store.list_participations(self.run_state.run_id, number)
        taken_out: list[Path] = []
        with self.engine._lock:  # this run's round is closed: only other runs can still hold one
            kept = self.engine.spool_kept()
            for p in parts:
                if p.update_sha256 and p.update_sha256 not in kept:
                    self.engine.updates.delete(p.update_sha256, taken_out)
        # Unlinked with the lock free: freeing eight 40 MB files' pages took 70 ms, and
        # the next round's polls waited for the lock to hand out their tasks.
        for path in taken_out:
            path.unlink(missing_ok=True)
        self.engine._store.clear_update_data([p.task_id for p in parts if p.update_sha256])

    def _finish(self, state: RunState, reason: str) -> None:
        run, engine = self.run_state, self.engine
        self._tidy_up()
        now = engine.clock()
        if run.open_round is not None:
            engine._store.expire_attempt(run.run_id, run.open_round, run.attempt, reason, now)
        if run.carried:  # async, between rounds: tasks still training will not count
            engine._store.expire_unfinished_before(run.run_id, run.next_round + 1, reason, now)
        engine._store.end_run(run.run_id, state, reason, now, run.open_round)
        log.info("%s: %s: %s", self.tag, state, reason)
        engine.observers.run_ended(RunEnded(run.run_id, state, reason))
        self._forget()
        with engine._lock:
            run.drop_aggregate()  # spill files of a robust round, if any
        if run.open_round is not None:  # forgotten: nothing of ours refers to them now
            self._drop_round_updates(run.open_round)

    def _forget(self) -> None:
        with self.engine._lock:
            self.engine.runs.pop(self.run_state.run_id, None)
            self.engine.notify()


def _may_sample(privacy: PrivacySpec, eligible: int, join_timed_out: bool) -> bool:
    """Whether a round of a run with declared sampling may draw from ``eligible`` sites."""
    if privacy.sampling == "fixed":  # never from fewer than the accountant's population
        return eligible >= privacy.population
    return eligible >= privacy.population or (eligible > 0 and join_timed_out)


def draw(spec: RunSpec, number: int, attempt: int, eligible: list[str], wanted: int) -> list[str]:
    """The sites of a round's attempt, sorted. Without declared sampling, ``wanted`` of the
    ``eligible`` drawn by a generator keyed by the spec's seed alone (the same spec samples
    the same sites); with it, from secret randomness: ``poisson`` takes each eligible site
    with probability ``sites_per_round / population``, ``fixed`` takes ``wanted``."""
    privacy = spec.privacy
    if number == INIT_ROUND or privacy is None or privacy.sampling == "none":
        rng: random.Random = random.Random(f"{spec.seed}:{number}:{attempt}")
    else:
        rng = _SECRET
    if privacy is not None and privacy.sampling == "poisson" and number != INIT_ROUND:
        q = spec.sites_per_round / privacy.population
        return sorted(s for s in eligible if rng.random() < q)
    return sorted(rng.sample(eligible, max(0, min(wanted, len(eligible)))))


def publish_controls(engine: Engine, run: ActiveRun) -> tuple[str, int]:
    """SCAFFOLD: the server's c (as the optimiser's state holds it) as a blob the sites
    download, and its size; ('', 0) while there is none (c is zero)."""
    controls = scaffold.controls_of(run.optimizer.state)
    if not controls:
        return "", 0
    digest = engine.models.put_chunks(encode_chunks(controls))
    return digest, engine.models.size(digest)


def stepped_model(
    chunks: Iterable[Buffer],
    specs: dict[str, TensorSpec],
    optimizer: ServerOptimizer,
    mean: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The next global model: the committed one (its encoded ``chunks``) moved by the
    server optimiser piece by piece as it streams in.

    A tensor's new values go into the memory of its mean update where the dtypes match
    (each run of the update is read before its new values overwrite it), so a commit holds
    the aggregate and a chunk, never a second copy of the model. For fp32 and fp64 models
    the result is bit for bit ``optimizer.step`` on whole tensors; half-precision ones may
    differ in the last bit at a few elements where a piece ends (torch's CPU kernels round
    short runs differently)."""
    optimizer.begin_step()
    new: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}  # each mean update, flat (a copy only if not contiguous)
    for name, spec in specs.items():
        delta = mean.get(name)
        if delta is not None:
            flat[name] = delta.reshape(-1)
        if delta is not None and delta.dtype == spec.dtype and delta.is_contiguous():
            new[name] = flat[name]
        else:
            new[name] = torch.empty(spec.numel, dtype=spec.dtype)
        if delta is not None and spec.numel == 0:  # no pieces come: its state starts here
            optimizer.step_piece(name, spec.shape, 0, new[name], flat[name])
    decoder = StreamDecoder(specs)  # copying: each piece is the new values' scratch
    for chunk in chunks:
        for piece in decoder.feed(chunk):
            end = piece.offset + piece.values.numel()
            if piece.name in flat:  # integer buffers keep the global value
                optimizer.step_piece(
                    piece.name,
                    specs[piece.name].shape,
                    piece.offset,
                    piece.values,
                    flat[piece.name][piece.offset : end],
                )
            new[piece.name][piece.offset : end] = piece.values
    decoder.finish()
    return {name: t.view(specs[name].shape) for name, t in new.items()}


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the first tensor with a NaN or infinity, or ''."""
    for name, t in tensors.items():
        if not all_finite(t):
            return f"tensor {name!r}"
    return ""


def out_of_use(served: Iterable[str], serving: Iterable[str], state: str | None) -> set[str]:
    """The blobs a commit leaves unread until a restart, a rollback or an export: what the
    last checkpoint's downloads read (``served``: model, step, controls) and this one's
    (``serving``) do not, and the new optimiser ``state``. Durable, they need not stay in
    the OS's page cache, where a checkpoint a round would pile up."""
    return ({*served, state or ""} - {*serving}) - {""}


def _evict(engine: Engine, digests: Collection[str]) -> None:
    for digest in digests:
        engine.models.evict(digest)


def ledger(accepted: list[ParticipationRecord], aggregate_s: float) -> dict[str, float]:
    """Seconds per stage of a round: the slowest site's download, compute and upload
    (they decide when the round can close), and the coordinator's aggregation."""
    return {
        # The site's own measure when it sent one: on a slow link the coordinator's
        # download_s ends when its last byte is buffered, long before it arrives.
        "distribute_s": max(
            (p.metrics.get("download_s", p.download_s) for p in accepted), default=0.0
        ),
        "compute_s": max((p.metrics.get("compute_s", 0.0) for p in accepted), default=0.0),
        "transfer_s": max((p.upload_s for p in accepted), default=0.0),
        "aggregate_s": aggregate_s,
    }


def short_of_quorum(run: ActiveRun) -> str | None:
    """Why the open attempt can no longer commit: its failed tasks leave fewer than the
    required updates to come (None while they can still arrive). The attempt then ends at
    once instead of at its deadline or its last site's answer: the sites still at work
    would train for an attempt that fails, and its retry would wait for them. Not for an
    asynchronous run (its tasks carry on to the next round), nor while every failure is a
    site's policy declining (``Assignment.declined``; ``_declined_only``: such an attempt
    waits for the others and does not count)."""
    need = run.required_updates
    if run.spec.asynchronous is not None or need <= 0:
        return None
    failed = declined = pending = 0
    for a in run.assignments.values():
        if a.state is TaskState.FAILED:
            failed += 1
            declined += a.declined
        else:
            pending += a.state is not TaskState.ACCEPTED
    could = len(run.assignments) - failed
    if could >= need or not pending or declined == failed:
        return None  # (with none pending, the attempt ends now anyway, saying so)
    return (
        f"{failed} of the {len(run.assignments)} sampled sites failed, so at most "
        f"{could} of the {need} required updates could arrive: ended early"
    )


def _failures(parts: list[ParticipationRecord], shown: int = 3) -> str:
    """'; failed: site: error, ...' for the failed tasks among an attempt's ``parts``, the
    first few of them, each error cut short: why a round came up short, in its reason."""
    failed = [p for p in parts if p.state == ParticipationState.FAILED]
    if not failed:
        return ""
    listed = "; ".join(f"{p.site_id}: {_shorten(p.error)}" for p in failed[:shown])
    more = f" (and {len(failed) - shown} more)" if len(failed) > shown else ""
    return f"; failed: {listed}{more}"


def _declined_only(parts: list[ParticipationRecord]) -> bool:
    """Whether an attempt's tasks that did not count were all declined by the sites'
    policies (and at least one was)."""
    lost = [p for p in parts if p.state != ParticipationState.ACCEPTED]
    return bool(lost) and all(p.error.startswith(DECLINED) for p in lost)


def _ended(
    run_id: str, number: int, attempt: int, outcome: RoundState, opened_at: float, closed_at: float,
    parts: list[ParticipationRecord], carried: Collection[str] = (), **more: Any,
) -> RoundEnded:  # fmt: skip
    """The event of an attempt's close, its bytes counted from its tasks. Tasks
    ``carried`` on to the next round (async: still training) are neither counted nor
    lost here: they are in the round they end in."""
    parts = [p for p in parts if p.task_id not in carried]
    counts = outcome == RoundState.COMMITTED
    lost = [p for p in parts if not counts or p.state != ParticipationState.ACCEPTED]
    return RoundEnded(
        run_id, number, attempt, outcome, max(0.0, closed_at - opened_at),
        updates=sum(p.state == ParticipationState.ACCEPTED for p in parts) if counts else 0,
        bytes_down=sum(p.bytes_down for p in parts),
        bytes_up=sum(p.bytes_up for p in parts),
        lost_bytes=sum(p.bytes_cut for p in parts) + sum(
            p.bytes_down + p.bytes_up for p in lost
        ),
        **more,
    )  # fmt: skip


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split()) or "no reason given"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def weighted_metrics(parts: list[ParticipationRecord]) -> dict[str, float]:
    """Each metric over the sites that reported it: counts (``is_count_metric``) summed,
    the rest (losses, accuracies, timings) as the sample-weighted mean."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    totals: dict[str, float] = {}
    for p in parts:
        for key, value in p.metrics.items():
            if is_count_metric(key):
                totals[key] = totals.get(key, 0.0) + value
                continue
            sums[key] = sums.get(key, 0.0) + value * p.num_samples
            weights[key] = weights.get(key, 0.0) + p.num_samples
    means = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
    return dict(sorted({**means, **totals}.items()))


def _summary(parts: list[ParticipationRecord], metrics: dict[str, float]) -> str:
    accepted = sum(p.state == ParticipationState.ACCEPTED for p in parts)
    shown = ", ".join(f"{k} {format_metric(k, v)}" for k, v in metrics.items())
    return f"{accepted}/{len(parts)} updates" + (f", {shown}" if shown else "")
