"""The site agent: register, long-poll, train, upload; reconnect with backoff.

Only rank 0 of a site runs this. It dials out (a site never listens), serves only
the tasks in its allow list, and survives the coordinator going away: every call
that fails transiently is retried under one backoff policy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from fedra import __version__, logformat, pki
from fedra.audit import AUDIT_FILE, AuditLog
from fedra.client import provenance
from fedra.client.config import SiteConfig
from fedra.client.connection import (
    TRANSIENT,
    Assignment,
    Connection,
    Sent,
    Session,
    new_nonce,
)
from fedra.client.executor import Executor, LocalExecutor, WorldBroken
from fedra.client.heartbeat import Heartbeat
from fedra.client.inner import KeepState, Rebase
from fedra.client.metrics import RoundMeasures, SiteMetrics, world_restarts, write_site_file
from fedra.client.optstate import OptimizerStates
from fedra.client.overlap import Ahead, Trained
from fedra.client.pending import PendingUpdate, PendingUpdates
from fedra.client.policy import Policy
from fedra.client.scaffold import ControlStates, ScaffoldRound
from fedra.client.task import FitSettings, ParallelTask, Task, load_task
from fedra.config import ConfigError
from fedra.faults import armed, attack, crash_point
from fedra.privacy import add_secure_gaussian_, clip_factor
from fedra.protos.codec import CodecError, all_finite, digest_and_size, sole_owners
from fedra.protos.compression import (
    MASKED,
    Compressor,
    apply_step,
    flatten_update,
    to_wire_u32,
)
from fedra.retry import Backoff
from fedra.secagg import SiteSecAgg
from fedra.secagg_round import SecAggRound

log = logging.getLogger("fedra.site")
_SECAGG_WAIT_S = 20.0  # one long poll of a secure-aggregation stage
# Identity failures: nothing this site sends will be accepted until an operator acts.
_FATAL = frozenset({grpc.StatusCode.UNAUTHENTICATED})
# The coordinator's answers to a pending update that say it did not count and never will.
_DID_NOT_COUNT = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)
# Failures that mean "this task no longer counts": drop it and poll again.
_TASK_GONE = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class SiteAgent:
    def __init__(
        self,
        config: SiteConfig,
        executor: Executor | None = None,
        tasks: dict[str, Task] | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.stop = threading.Event()
        self.tasks = tasks if tasks is not None else load_tasks(config)
        self._data = data if data is not None else load_data(config, self.tasks)
        self.executor: Executor = executor or LocalExecutor()
        self.current: Assignment | None = None
        self._compressors: dict[str, Compressor] = {}  # by run: top-k error feedback
        self._pending = PendingUpdates(config.state_dir)  # sent, not yet known to count
        # [train] keep_optimizer_state: each run's inner optimiser state; [train] scaffold:
        # each run's c_i. In state_dir; a round's is staged before its update is sent and
        # promoted once the update is accepted (_keep).
        self._optimizer_states = OptimizerStates(config.state_dir)
        self._control_states = ControlStates(config.state_dir)
        # The last global model of each run (its SHA-256, its tensors): with compressed
        # downloads, the next round's model is this plus a compressed step.
        self._globals: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        # The model object a run last trained, reused for its next round: building a model
        # (random init) can cost more than the round's transfers, and load_state_dict sets
        # every parameter and buffer anyway. CPU training in this process only: a local
        # world's plans rebuild the module, and a model left on the GPU would change where
        # the task's evaluate runs.
        self._models: dict[tuple[str, str], torch.nn.Module] = {}
        # [train] overlap: the run's next round, training while this one's update goes.
        self._ahead: Ahead | None = None
        # The next task, when it came with the answer to an upload (then_poll_s).
        self._next: Assignment | None = None
        tls = None
        if config.tls_dir is not None:
            try:
                tls = pki.load_folder(config.tls_dir)
            except (OSError, ValueError) as exc:  # a wrong path, a file for a folder, damage
                raise ConfigError(f"{_in(config)}tls_dir: {exc}") from exc
        self.conn = Connection(
            config.coordinator, config.site_id, tls, reconnect_max_s=config.reconnect_max_s
        )
        self.backoff = Backoff(cap_s=config.reconnect_max_s)
        self.tag = f"site {config.site_id}"
        self.rounds_done = 0
        self.registered = False  # once it has, the coordinator is "lost", not misconfigured
        # Always kept (a registry of its own costs little); served with [metrics] http.
        self.metrics = SiteMetrics(config.site_id, world_restarts())
        self._downloaded = 0  # bytes the current task's global model took to come here
        # What this site accepted, declined and sent, chained (fedra.audit): in state_dir.
        self.audit = AuditLog(config.state_dir / AUDIT_FILE) if config.state_dir else None
        # Its entries are written here, one at a time and in order: a task's accept is
        # written while its model downloads, and waited for before the task's work begins.
        self._auditor = None if self.audit is None else ThreadPoolExecutor(1, "fedra-audit")
        self.policy = Policy(config.policy, config.state_dir)  # what this site agrees to
        # Per task, what its results come from: told to the coordinator at registration.
        self.provenance = [
            provenance.of_task(ep, impl, config.data, config.path)
            for ep, impl in self.tasks.items()
        ]

    def shutdown(self, reason: str = "") -> None:
        """Stop serving: report a task in flight as failed, cancel a long poll.

        Safe from a signal handler.
        """
        self.stop.set()
        # A task that came back with an upload's answer and is not yet served; else the one
        # in hand, unless its upload is held as the next poll: it was (almost always)
        # accepted, and there is nothing to report.
        task = self._next or (None if self.conn.holding() else self.current)
        if task is not None and reason:
            self._report(task, reason)
        self.conn.close()

    def run(self) -> None:
        """Serve until ``stop`` is set; the metrics endpoint, if any, for as long."""
        # What this thread logs meanwhile is about this site; its caller's context after.
        with logformat.about(site=self.config.site_id):
            self._serve_metrics()
            if self.audit is not None:
                path = self.config.path
                self.audit.record(
                    "site.start", f"site {self.config.site_id}", version=__version__,
                    allowed_tasks=sorted(self.config.allowed_tasks),
                    config_sha256=hashlib.sha256(path.read_bytes()).hexdigest() if path else "",
                )  # fmt: skip
            try:
                self._run()
            finally:
                if self._ahead is not None:
                    self._ahead.cancel()
                if self._auditor is not None:  # what was accepted is on record
                    with contextlib.suppress(RuntimeError):  # (its pool already shut down)
                        self._auditor.submit(_nothing).result()
                self.metrics.close()

    def _serve_metrics(self) -> None:
        """Start ``/metrics`` if [metrics] http asks, and say where (port 0: the one bound)."""
        if not self.config.metrics.http:
            return
        try:
            address = self.metrics.serve(self.config.metrics.http)
        except ConfigError as exc:
            raise ConfigError(f"{_in(self.config)}{exc}") from None
        if self.config.state_dir is not None:
            write_site_file(self.config.state_dir, self.config.site_id, address)
        log.info("%s: metrics at http://%s/metrics", self.tag, address)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                session = self.conn.register(
                    list(self.config.allowed_tasks), provenance=self.provenance
                )
                log.info("%s: registered with %s", self.tag, self.config.coordinator)
                self.registered = True
                self.backoff.reset()
                self._serve(session)
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break
                if exc.code() not in TRANSIENT and exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                delay = self.backoff.next_delay_s()
                hint = (
                    "lost it"  # a restart, a network outage: it comes back
                    if self.registered
                    else "check the address, and that tls_dir or insecure matches how the "
                    "coordinator serves"
                )
                log.warning(
                    "%s: coordinator %s unreachable (%s: %s; %s); retrying in %.1f s",
                    self.tag, self.config.coordinator, exc.code().name, _details(exc), hint,
                    delay,
                )  # fmt: skip
                self.conn.wait_reconnected(delay, self.stop)
        self.conn.close()
        log.info("%s: stopped after %d rounds", self.tag, self.rounds_done)

    def _serve(self, session: Session) -> None:
        while not self.stop.is_set():
            task, self._next = self._next, None
            if task is None:
                task = self.conn.poll(session.poll_timeout_s)
            if task is not None:
                self._run_task(task, session)

    def _audit(self, event: str, task: Assignment, **data: Any) -> None:
        self._audit_soon(event, task, **data).result()

    def _audit_soon(self, event: str, task: Assignment, **data: Any) -> Future[None]:
        """Record ``event`` about ``task`` after those under way; its future says when it
        is written (an entry that cannot be is logged, not raised: ``AuditLog.record``)."""
        done: Future[None] = Future()
        if self.audit is None:
            done.set_result(None)
            return done
        record = functools.partial(
            self.audit.record, event, f"site {self.config.site_id}", run=task.run_id,
            round=task.round, task_id=task.task_id, task=task.entry_point, **data,
        )  # fmt: skip
        if self._auditor is not None:
            try:
                return self._auditor.submit(record)
            except RuntimeError:  # the interpreter is shutting its pools down: write here
                pass
        record()
        done.set_result(None)
        return done

    def _run_task(self, task: Assignment, session: Session) -> None:
        tag = f"{self.tag} run {task.run_id} round {task.round}"
        if task.entry_point not in self.tasks:  # the coordinator should never ask; refuse anyway
            why = f"task {task.entry_point!r} is not allowed here"
            self._audit("task.decline", task, reason=why)
            self.metrics.round_failed(task.run_id, "not_allowed")
            self.conn.report_failure(task.task_id, why)
            return
        declined = self.policy.decline_reason(task)
        if declined is not None:  # this site's [policy]: a decline, not a failure
            log.info("%s: declined: %s", tag, declined)
            self._audit("task.decline", task, reason=declined)
            self.metrics.round_failed(task.run_id, "declined")
            self.conn.report_failure(task.task_id, declined, declined=True)
            return
        accepted = self._audit_soon("task.accept", task)  # on record before its work
        beat = Heartbeat(
            self.conn, task.task_id, session.heartbeat_interval_s, session.poll_timeout_s
        )
        self.current = task
        try:
            with beat, logformat.about(run=task.run_id, round=task.round):
                self._train_and_upload(task, session, tag, beat, accepted)
        except grpc.RpcError as exc:
            if exc.code() in _TASK_GONE:
                log.warning("%s: task dropped: %s", tag, exc.details())
                return
            if exc.code() in TRANSIENT or exc.code() in _FATAL:
                raise  # reconnect, or (revoked, not who we say) stop for good
            # The coordinator refused this update (e.g. INVALID_ARGUMENT): say so, keep serving.
            log.error("%s: update refused: %s: %s", tag, exc.code().name, exc.details())
            self.metrics.round_failed(task.run_id, "refused")
            self._report(task, f"update refused: {exc.code().name}: {exc.details()}")
        except WorldBroken:  # a rank failed mid-collective: exit, the local world restarts
            log.exception("%s: the local world failed", tag)
            self.metrics.round_failed(task.run_id, "world")
            self._report(task, "a local rank failed; the site's local world is restarting")
            raise
        except Exception as exc:  # the task's own code failed: say so, keep serving
            log.exception("%s: training failed", tag)
            self.metrics.round_failed(task.run_id, "task")
            self._report(task, f"{type(exc).__name__}: {exc}")
        finally:
            self.current = None

    def _report(self, task: Assignment, reason: str) -> None:
        try:
            self.conn.report_failure(task.task_id, reason)
        except grpc.RpcError as exc:
            log.warning("%s: could not report the failure: %s", self.tag, exc.code().name)

    def _train_and_upload(
        self,
        task: Assignment,
        session: Session,
        tag: str,
        beat: Heartbeat,
        accepted: Future[None],
    ) -> None:
        impl = self.tasks[task.entry_point]
        params = task.train.params
        started = time.monotonic()
        masker = None
        self._downloaded = len(task.model)  # sent with the task; _global_model adds downloads
        if not task.init and self._settle(task):
            return  # this very task's update was sent before a restart, and is in
        if beat.withdrawn.is_set():  # while it waited for the site (its attempt failed)
            log.warning("%s: task withdrawn before its work began; skipped", tag)
            return
        if task.init:
            accepted.result()
            model = impl.create_model(task.seed, params)
            payload = {k: v.detach().clone() for k, v in model.state_dict().items()}
            num_samples, metrics = 1, dict[str, float]()
        else:
            if task.secagg is not None:  # the key exchange comes before the training
                accepted.result()  # and takes part in the task: the accept is on record
                masker = self._secagg_setup(task, task.secagg)
                crash_point("after_secagg_setup", task.round)
                started = time.monotonic()  # waiting for the others' keys is no download
            global_state = self._global_model(impl, task, max(task.deadline_in_s, 1.0))
            # As the site sees it: the coordinator's download_s ends when the last byte
            # leaves it, which buffers on a slow link hide.
            downloaded = time.monotonic()
            accepted.result()  # written while the model came
            crash_point("after_download", task.round)
            if beat.withdrawn.is_set():  # a training ahead stays for the task given next
                log.warning("%s: task withdrawn during its download; not training", tag)
                return
            payload, num_samples, metrics = self._train(impl, task, global_state)
            payload = attack(payload)
            metrics["download_s"] = downloaded - started
            started = downloaded
        # With [train] overlap, the training done before the task arrived counts too.
        metrics["compute_s"] = time.monotonic() - started + metrics.get("overlap_ahead_s", 0.0)
        if beat.withdrawn.is_set():
            log.warning("%s: round closed while training; not uploading", tag)
            return
        for name, tensor in payload.items():  # refuse locally what the coordinator would refuse
            if not all_finite(tensor):
                raise ValueError(f"the update's tensor {name!r} has non-finite values")
        if masker is not None and task.secagg is not None:
            wire = {MASKED: to_wire_u32(_masked(masker, task.secagg, payload))}
            sending = time.monotonic()
            sent = self._upload(task, wire, num_samples, metrics, new_nonce())
            upload_s = time.monotonic() - sending
            crash_point("after_upload", task.round)
            self._secagg_reveal(task, masker)
            self._round_done(task, num_samples, metrics, sent.bytes_received, upload_s)
            log.info("%s: masked update accepted and unmasking shares revealed", tag)
            return
        compressor = self._compressor(task)
        before = compressor.residual  # a snapshot: the residual until the update counts
        wire = compressor.compress(payload)  # once: a retried upload resends the same bytes
        nonce = new_nonce()  # one per update: a retry of the same update reuses it
        topk = task.codec.name == "topk"
        after: dict[str, torch.Tensor] = {}
        if topk:  # the residual moves on only once the update counted
            after = compressor.residual
            self._compressors[task.run_id] = Compressor(task.codec, before or None)
        if topk or (_stages_state(task) and not task.init):  # on disk first; _settle
            self._pending.hold(PendingUpdate(task, nonce, num_samples, dict(metrics), wire, after))
        sending = time.monotonic()
        # Held as the next poll once accepted: the next task comes with the answer. (Not
        # when a crash is injected right after the accept: it must come at once.)
        hold_s = 0.0 if armed("after_upload", task.round) else session.poll_timeout_s
        sent = self._upload(task, wire, num_samples, metrics, nonce, hold_s)
        upload_s = max(0.0, time.monotonic() - sending - sent.held_s)
        crash_point("after_upload", task.round)  # accepted, nothing of it kept here yet
        self._round_done(task, num_samples, metrics, sent.bytes_received, upload_s)
        if not topk:  # accepted is all a staged state waits for; a residual waits on
            self._pending.drop(task.run_id)
        log.info(
            "%s: update accepted (%s)",
            tag,
            ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())),
        )

    def _round_done(
        self,
        task: Assignment,
        num_samples: int,
        metrics: Mapping[str, float],
        upload_bytes: int,
        upload_s: float,
    ) -> None:
        """Count a delivered update, with the timings the coordinator is sent too; keep
        the state its training staged (inner optimiser state, c_i), if the run keeps it."""
        self.rounds_done += 1
        self._keep(task, counted=True)
        self.metrics.round_done(
            RoundMeasures(
                run_id=task.run_id,
                compute_s=metrics.get("compute_s", 0.0),
                samples=0.0 if task.init else metrics.get("samples_seen", float(num_samples)),
                tokens=metrics.get("tokens", 0.0),
                download_bytes=self._downloaded,
                download_s=metrics.get("download_s", 0.0),
                upload_bytes=upload_bytes,
                upload_s=upload_s,
            )
        )

    def _train(
        self, impl: Task, task: Assignment, global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        arrived = time.monotonic()
        ahead = self._take_ahead(task)  # [train] overlap: this round, already training
        try:
            data = self._data[task.entry_point]
            model = self._model(impl, task)
            model.load_state_dict(global_state)
            # Evaluate the global model on local held-out data before training on it.
            metrics = {f"eval_{k}": float(v) for k, v in impl.evaluate(model, data).items()}
        except BaseException:
            # Never leave a training ahead running unowned: the next task's training would
            # run beside it (on a local world, two streams of collectives from rank 0).
            if ahead is not None:
                ahead.cancel()
            raise
        settings = self._fit_settings(task, task.round)
        scaffold = None  # never with overlap (TrainSpec refuses the two together)
        if ahead is not None:
            keep = ahead.keep
            trained, num_samples, fit_metrics = ahead.finish(global_state)
            # Its compute before this task arrived counts too (compute_s adds it).
            metrics["overlap_ahead_s"] = max(0.0, min(ahead.fit_s, arrived - ahead.started_at))
        else:
            keep = self._keep_state(task)
            scaffold = self._scaffold_round(task, global_state)
            trained, num_samples, fit_metrics = self.executor.train(
                impl, task.entry_point, task.round, model, data, settings, keep, scaffold
            )
        metrics.update(fit_metrics)
        if keep is not None and keep.result is not None:  # promoted once accepted: _keep
            self._optimizer_states.stage(task.run_id, keep.result)
        if task.train.overlap:  # from a copy of ``trained``, which delta consumes
            self._start_ahead(impl, task, trained, keep)
        update = delta(trained, global_state)
        if scaffold is not None:  # delta c_i rides with the update; c_i+ kept once it counts
            update.update(scaffold.finish(update))
            metrics["scaffold_from_round"] = float(scaffold.from_round)
            assert scaffold.result is not None
            self._control_states.stage(task.run_id, scaffold.result)
        return update, num_samples, metrics

    def _fit_settings(self, task: Assignment, round_number: int) -> FitSettings:
        return FitSettings(
            local_steps=task.train.local_steps,
            local_epochs=task.train.local_epochs,
            batch_size=task.train.batch_size,
            learning_rate=task.train.learning_rate,
            seed=_fit_seed(task.seed, round_number, self.config.site_id),
            params=task.train.params,
            proximal_mu=task.train.proximal_mu,
        )

    def _take_ahead(self, task: Assignment) -> Ahead | None:
        """The round trained ahead for ``task`` (``[train] overlap``), if it is this
        task's; one that is not is cancelled."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.matches(task):
            return ahead
        log.info("%s: the training ahead for round %d of run %s is not this task's; "
                 "dropped", self.tag, ahead.round_number, ahead.run_id)  # fmt: skip
        error = ahead.cancel()
        if isinstance(error, WorldBroken):  # the local world must restart before training
            raise error
        return None

    def _start_ahead(
        self,
        impl: Task,
        task: Assignment,
        trained: Mapping[str, torch.Tensor],
        keep: KeepState | None,
    ) -> None:
        """[train] overlap: start training the run's next round now, from a copy of
        ``trained`` (the site's model after ``task``); none after the run's last."""
        if task.rounds and task.round >= task.rounds:
            return
        nxt = task.round + 1
        model = impl.create_model(task.seed, task.train.params)
        model.load_state_dict(trained)
        if keep is not None:  # the state this round leaves, as the next round would load it
            fresh = task.train.resets_optimizer(nxt)
            keep = KeepState(None if fresh else keep.result, nxt)
        settings, data = self._fit_settings(task, nxt), self._data[task.entry_point]
        executor, entry_point = self.executor, task.entry_point

        def fit(m: torch.nn.Module, k: KeepState | None, rebase: Rebase) -> Trained:
            return executor.train(impl, entry_point, nxt, m, data, settings, k, None, rebase)

        self._ahead = Ahead.start(task, trained, model, keep, fit)

    def _keep(self, task: Assignment, counted: bool) -> None:
        """Promote the states ``task``'s training staged, or forget them: its update
        was accepted, or will never count."""
        for states in (self._optimizer_states, self._control_states):
            if counted:
                states.promote(task.run_id, task.round)
            else:
                states.discard(task.run_id)

    def _scaffold_round(
        self, task: Assignment, global_state: Mapping[str, torch.Tensor]
    ) -> ScaffoldRound | None:
        """With [train] scaffold: the coordinator's c (downloaded; zero before it has one)
        and the c_i this site's last counted round of the run left (zero at first)."""
        if not task.train.scaffold:
            return None
        server: dict[str, torch.Tensor] = {}
        if task.controls_sha256:
            server = self.conn.download(task, timeout_s=max(task.deadline_in_s, 1.0), controls=True)
            self._downloaded += task.controls_bytes
        kept = self._control_states.load(task.run_id, task.round)
        site, since = (kept.tensors, kept.after_round) if kept is not None else ({}, 0)
        scaffold = ScaffoldRound(server, site, task.train.learning_rate, task.round, since)
        scaffold.check(global_state)
        return scaffold

    def _keep_state(self, task: Assignment) -> KeepState | None:
        """With [train] keep_optimizer_state: the state the run's last round here left,
        unless this round starts afresh (reset_optimizer_every)."""
        train = task.train
        if not train.keep_optimizer_state:
            return None
        if train.resets_optimizer(task.round):
            log.info("%s: inner optimiser state reset for round %d", self.tag, task.round)
            return KeepState(None, task.round)
        return KeepState(self._optimizer_states.load(task.run_id, task.round), task.round)

    def _global_model(
        self, impl: Task, task: Assignment, timeout_s: float
    ) -> dict[str, torch.Tensor]:
        """The task's global model: the held previous model plus the compressed step when
        the coordinator offers one for it; in round 1 the initial model rebuilt from the
        run's seed when its SHA-256 matches; else the whole model, downloaded. A model held
        already (the same round's task given again) is not fetched at all."""
        held = self._globals.get(task.run_id)
        if held is not None and held[0] == task.model_sha256:
            # This round's model is here already: its task came again (after a coordinator
            # restart, say) once the step to it had been applied.
            return held[1]
        try:
            model = self.conn.sent_model(task)  # a small model comes with its task
        except CodecError as exc:
            log.warning("%s: the model sent with the task is not right (%s); downloading it",
                        self.tag, exc)  # fmt: skip
            model = None
        # The initial model, built by a site from the seed:
        if model is None and held is None and task.round == 1:
            built = self._model(impl, task).state_dict()
            rebuilt = {k: v.detach().clone() for k, v in built.items()}
            if digest_and_size(rebuilt)[0] == task.model_sha256:
                model = rebuilt
                log.info("%s: rebuilt the initial model from the run's seed", self.tag)
        if model is None and task.delta_sha256 and held is not None and held[0] == task.base_sha256:
            step = self.conn.download(task, timeout_s=timeout_s, delta=True)
            self._downloaded += task.delta_bytes
            model = apply_step(held[1], step, task.codec)
            if digest_and_size(model)[0] != task.model_sha256:  # never train on a near miss
                log.warning("%s: the rebuilt model does not match; downloading it whole", self.tag)
                model = None
        if model is None:
            # The held model is replaced whatever comes: decoding into its tensors saves
            # allocating (and faulting in) a new model's memory every round.
            self._globals = {}
            reuse = held[1] if held is not None else None
            model = self.conn.download(task, timeout_s=timeout_s, reuse=reuse)
            self._downloaded += task.model_bytes
        self._globals = {task.run_id: (task.model_sha256, model)}  # one run's model at a time
        return model

    def _model(self, impl: Task, task: Assignment) -> torch.nn.Module:
        """The run's model object: the one it trained last round where it can be reused."""
        key = (task.run_id, task.entry_point)
        model = self._models.get(key)
        if model is None:
            model = impl.create_model(task.seed, task.train.params)
            if isinstance(self.executor, LocalExecutor) and self.executor.device.type == "cpu":
                self._models = {key: model}  # one run's model at a time
        return model

    def _secagg_setup(self, task: Assignment, sa: SecAggRound) -> SiteSecAgg:
        """Stages 1 and 2 of secure aggregation: keys out, shares out, our shares in."""
        masker = SiteSecAgg(self.config.site_id, sa.threshold, sa.context)
        keys = self._long_poll(
            lambda first: self.conn.secagg_keys(
                task.task_id, sa.context, masker.public_keys() if first else b"", _SECAGG_WAIT_S
            )
        )
        ciphertexts = masker.share_keys(keys)
        inbox = self._long_poll(
            lambda first: self.conn.secagg_shares(
                task.task_id, ciphertexts if first else {}, _SECAGG_WAIT_S
            )
        )
        masker.receive_shares(inbox)
        log.info("%s: secure aggregation set up with %d neighbours", self.tag, len(inbox))
        return masker

    def _secagg_reveal(self, task: Assignment, masker: SiteSecAgg) -> None:
        """Stage 4: the shares that unmask the sum; never both kinds for one peer.

        The update already counts: if the round is unmasked or closed before this site
        is asked, its shares were not needed.
        """
        try:
            while True:
                ready, survivors, dropped = self.conn.secagg_unmask(task.task_id, _SECAGG_WAIT_S)
                if ready:
                    break
                if self.stop.is_set():
                    return
            if not survivors and not dropped:
                return  # unmasked with the other sites' shares
            self.conn.secagg_reveal(task.task_id, masker.reveal(survivors, dropped))
        except grpc.RpcError as exc:
            if exc.code() not in _TASK_GONE:
                raise
            log.info("%s: round closed before this site's shares were needed", self.tag)
            return
        if dropped:
            log.info("%s: revealed shares; dropped neighbours: %s", self.tag, ", ".join(dropped))

    def _long_poll(self, call: Callable[[bool], tuple[bool, dict[str, bytes]]]) -> dict[str, bytes]:
        first = True
        while True:
            ready, answer = call(first)
            if ready:
                return answer
            first = False
            if self.stop.is_set():
                raise WorldBroken("the site is stopping")

    def _compressor(self, task: Assignment) -> Compressor:
        """This run's compressor, resuming its saved error-feedback residual if any."""
        codec = task.codec
        current = self._compressors.get(task.run_id)
        if current is None or current.codec != codec:
            path = self._residual_path(task)
            if codec.name == "topk" and path is not None and path.exists():
                current = Compressor.load(codec, path)
                log.info("%s: resumed top-k error feedback from %s", self.tag, path)
            else:
                current = Compressor(codec)
            self._compressors[task.run_id] = current
        return current

    def _residual_path(self, task: Assignment) -> Path | None:
        if self.config.state_dir is None:
            return None
        return self.config.state_dir / f"residual-{task.run_id}.safetensors"

    def _save_residual(self, task: Assignment, compressor: Compressor) -> None:
        path = self._residual_path(task)
        if path is not None and task.codec.name == "topk":
            path.parent.mkdir(parents=True, exist_ok=True)
            compressor.save(path)

    def _settle(self, task: Assignment) -> bool:
        """Learn whether the run's pending update counted, by sending it again with its
        nonce; adopt what it left (a top-k residual, staged optimiser state and c_i) if
        so. True if it was ``task``'s own update."""
        pending = self._pending.get(task.run_id)
        if pending is None:
            return False
        p = pending
        same = p.task.task_id == task.task_id  # else its attempt is over: the header suffices
        try:
            self._upload(p.task, p.wire, p.num_samples, p.metrics, p.nonce, header_only=not same)
        except grpc.RpcError as exc:
            if exc.code() not in _DID_NOT_COUNT:  # not an answer (yet): settled next time
                raise
            log.info(
                "%s: the update for round %d did not count (%s); its top-k residual is dropped",
                self.tag, p.task.round, _details(exc),
            )  # fmt: skip
            self._keep(p.task, counted=False)
            self._pending.drop(task.run_id)
            return False
        self._keep(p.task, counted=True)  # accepted: what its training staged is kept
        topk = p.task.codec.name == "topk"
        if same:  # its attempt is still open: a top-k residual stays pending
            log.info("%s: the update sent before a restart is in", self.tag)
            self.rounds_done += 1
            self.metrics.round_done(RoundMeasures(run_id=task.run_id))  # measured before it
            if not topk:
                self._pending.drop(task.run_id)
            return True
        if topk:
            compressor = Compressor(p.task.codec, p.residual or None)
            self._save_residual(p.task, compressor)
            self._compressors[task.run_id] = compressor
        self._pending.drop(task.run_id)
        return False

    def _upload(
        self,
        task: Assignment,
        payload: dict[str, torch.Tensor],
        num_samples: int,
        metrics: dict[str, float],
        nonce: bytes,
        then_poll_s: float = 0.0,
        header_only: bool = False,
    ) -> Sent:
        """Send an update, retrying transient failures; what the coordinator said. What
        left the site is audited: the payload's digest and size. With ``then_poll_s``, a
        next task that came with the answer is the one served next."""
        retry = Backoff(cap_s=self.config.reconnect_max_s)
        while True:
            try:
                sent = self.conn.upload(
                    task, payload, num_samples, metrics, nonce, 600.0, header_only, then_poll_s
                )
                self._audit(
                    "update.sent", task, update_sha256=sent.sha256, num_samples=num_samples,
                    payload_bytes=sent.payload_bytes, bytes_received=sent.bytes_received,
                )  # fmt: skip
                self._next = sent.next_task
                return sent
            except grpc.RpcError as exc:
                if exc.code() not in TRANSIENT or self.stop.is_set():
                    raise
                delay = retry.next_delay_s()
                log.warning(
                    "%s: upload failed (%s); retrying in %.1f s", self.tag, exc.code().name, delay
                )
                self.stop.wait(delay)


def _nothing() -> None:
    pass


def _details(exc: grpc.RpcError, limit: int = 300) -> str:
    """gRPC's own words for a failed call (a refused connection, a name that does not
    resolve, a handshake that failed), on one line and cut short."""
    text = " ".join(str(exc.details() or "no details").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_tasks(config: SiteConfig) -> dict[str, Task]:
    """Import every allowed task up front: a broken install fails at start, not mid-round."""
    try:
        tasks = {ep: load_task(ep) for ep in config.allowed_tasks}
    except ConfigError as exc:  # a typo in an entry point, a package not installed
        raise ConfigError(f"{_in(config)}allowed_tasks: {exc}") from exc
    if config.parallel.launches_world:
        for ep, impl in tasks.items():
            if not isinstance(impl, ParallelTask):
                raise ConfigError(
                    f"{_in(config)}parallel.plan: task {ep!r} cannot run with plan "
                    f"{config.parallel.plan!r}: "
                    "it does not implement ParallelTask (batch, loss, optimizer, num_steps, "
                    "num_samples)"
                )
    return tasks


def _in(config: SiteConfig) -> str:
    """'SITE_TOML: ' for errors about the site's configuration file, if it came from one."""
    return f"{config.path}: " if config.path is not None else ""


def load_data(config: SiteConfig, tasks: dict[str, Task]) -> dict[str, Any]:
    """Data too: a bad [data] table is an error at start, and round 1 is not slowed by it."""
    try:
        check_data_keys(config.data, tasks)
        return {ep: impl.load_data(config.data) for ep, impl in tasks.items()}
    except ConfigError as exc:
        if config.path is None:
            raise
        raise ConfigError(f"{config.path}: {exc}") from exc


def check_data_keys(data: Mapping[str, Any], tasks: Mapping[str, Task]) -> None:
    """Refuse a ``[data]`` key no allowed task reads, when every task says what it reads
    (``data_keys``): one table serves all of a site's tasks, so only a key that none of
    them reads is a mistake."""
    declared = [getattr(impl, "data_keys", None) for impl in tasks.values()]
    if not declared or any(keys is None for keys in declared):
        return
    known = set().union(*(set(keys) for keys in declared if keys is not None))
    unknown = sorted(set(data) - known)
    if unknown:
        reads = ", ".join(sorted(known)) or "no [data] keys"
        raise ConfigError(
            f"data.{unknown[0]}: unknown key: no task this site allows reads it (they read {reads})"
        )


def delta(
    local: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """local - global for floating-point tensors; zeros for integer buffers (not averaged).

    Consumes ``local`` (the trained state, which the next round's global model overwrites):
    a tensor of it that matches its global one and whose memory is its own becomes the
    difference in place, so the update costs no second copy of the model. The others
    (tied weights, which share memory; a dtype the task changed) get new tensors.
    """
    own = sole_owners(local)
    out = {}
    for name, g in global_state.items():
        trained = local[name].detach()
        if not g.is_floating_point():
            out[name] = torch.zeros_like(g)
        elif name in own and _same_layout(trained, g):
            out[name] = trained.sub_(g)
        else:
            out[name] = trained - g
    return out


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


def _masked(masker: SiteSecAgg, sa: SecAggRound, delta: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The update as SecAgg+ sends it: flat, L2-clipped and noised under [privacy], masked."""
    vector = flatten_update(delta)
    if sa.l2_clip > 0:
        vector.mul_(clip_factor(float(vector.double().norm()), sa.l2_clip))
    if sa.noise_std > 0:
        add_secure_gaussian_(vector, sa.noise_std)
    return masker.mask(vector, clip=sa.clip, bits=sa.bits)


def _fit_seed(seed: int, round_number: int, site_id: str) -> int:
    # Not keyed by the run id: the same spec on the same data trains the same way.
    key = f"{seed}:{round_number}:{site_id}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def _stages_state(task: Assignment) -> bool:
    """Whether the task's training leaves state that is kept only if its update counts."""
    return task.train.keep_optimizer_state or task.train.scaffold
