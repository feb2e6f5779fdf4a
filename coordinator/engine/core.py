"""The round engine: the coordinator's domain logic, free of gRPC.

Servicers call into one ``Engine``. It keeps the live state of every active run in
memory under one lock, writes every change to the ``Store`` before acting on it, and
runs one ``RoundDriver`` thread per run (see ``rounds``).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from fedra import __version__, logsafe
from fedra.config import SITE_ID_RULE, is_valid_site_id
from fedra.coordinator.aggregation import ServerOptimizer
from fedra.coordinator.attention import Attention
from fedra.coordinator.audit import AuditTrail
from fedra.coordinator.commits import GroupCommit
from fedra.coordinator.downloads import Download, DownloadLedger
from fedra.coordinator.engine.recovery import restore_run
from fedra.coordinator.engine.rounds import RoundDriver
from fedra.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from fedra.coordinator.ledger import (
    DECLINED,
    PROVENANCE_EVENT,
    RUN_PROVENANCE_EVENT,
    SITES_PAGE,
    page_limit,
)
from fedra.coordinator.observers import Observers, RunStarted
from fedra.coordinator.promotion import PromotionState
from fedra.coordinator.state import (
    INIT_ROUND,
    ActiveRun,
    Assignment,
    TaskState,
)
from fedra.coordinator.wakeups import Wakeups, opened_key, run_key, site_key, stage_key
from fedra.faults import crash_point
from fedra.protos.codec import DEFAULT_CHUNK_BYTES, all_finite, decode_chunks, encode_chunks
from fedra.provenance import Provenance
from fedra.runspec import MAX_TASK_CHARS, CodecSpec, PrivacySpec, RunSpec, TrainSpec
from fedra.secagg_round import SecAggRound
from fedra.storage import BlobStore, Store
from fedra.storage.blobs import BLOCK_BYTES
from fedra.storage.records import (
    CheckpointRecord,
    ParticipationState,
    ReadsOf,
    RoundState,
    RunReads,
    RunRecord,
    RunState,
    SiteRecord,
)
from fedra.storage.spool import SMALL_UPDATE_BYTES, UpdateSpool

log = logging.getLogger("fedra.coordinator")
T = TypeVar("T")
_CARRY_GRACE_S = 30.0  # beyond join_timeout_s, how long a carried task's call waits
REASON_CHARS = 500  # of a failure reason a site reports, as stored
MAX_SITE_TASKS, MAX_VERSION_CHARS = 64, 64  # what a site may register, as stored
LIVENESS_WRITE_S = 10.0  # how often sites' last-heard times are written, at most
# How soon a site heard from longer ago than the liveness timeout but online (a call under
# way, or this coordinator hears late: ``attention``) is asked again whether it went silent.
SILENCE_RECHECK_S = 0.25


@dataclass(frozen=True)
class EngineSettings:
    heartbeat_interval_s: float = 5.0
    poll_timeout_s: float = 20.0
    # A site not heard from for this long is offline; its unfinished task fails.
    site_timeout_s: float = 20.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_init_model_bytes: int = 16 * 2**30
    # A model of at most this many bytes (and one chunk) goes out with its task in the
    # poll's reply: one call a site and round fewer. 0: every site downloads.
    inline_model_bytes: int = 64 * 1024
    # An update of at most this many bytes is kept in its participation row, durable with
    # its accept's commit, instead of as a file (storage.spool). 0: every update a file.
    small_update_bytes: int = SMALL_UPDATE_BYTES
    # A site whose policy declined a run's task is left out of the run's sampling so long.
    decline_hold_s: float = 60.0


@dataclass(frozen=True)
class TaskView:
    """A task as handed to a site."""

    task_id: str
    run_id: str
    round: int
    kind: str  # init | train
    entry_point: str
    train: TrainSpec
    seed: int
    model_sha256: str
    model_bytes: int
    deadline_in_s: float
    codec: CodecSpec  # how the site compresses its update (none for the initial model)
    secagg: SecAggRound | None = None  # set: the update is masked for secure aggregation
    # Compressed downloads: the model base_sha256 plus the step delta_sha256 is the model.
    base_sha256: str = ""
    delta_sha256: str = ""
    delta_bytes: int = 0
    model: bytes = field(default=b"", repr=False)  # the whole model, when it comes along
    # What a site's policy may hold the run to: its round's cohort, its privacy.
    sites_in_round: int = 0
    privacy: PrivacySpec | None = None
    # [train] scaffold: the server's control variate c to download ('': c is zero).
    controls_sha256: str = ""
    controls_bytes: int = 0
    rounds: int = 0  # the run's rounds: a site trains nothing ahead of the last ([train] overlap)


@dataclass(frozen=True)
class Gauges:
    """The coordinator's state as numbers (``Engine.gauges``)."""

    sites_registered: int
    sites_online: int
    runs_by_state: dict[str, int]
    downloads_in_flight: int
    uploads_in_flight: int
    waiting_calls: int  # long polls, secure aggregation stages, run watches
    hearing_lag_s: float = 0.0  # how long sites' calls now wait in gRPC's queue (attention)


@dataclass(frozen=True)
class RoundOutcome:
    """What a committed round gave: its model, and the updates that counted in it."""

    tensors: dict[str, torch.Tensor]
    num_samples: int  # summed over the counted updates
    sites: int  # how many updates counted
    metrics: dict[str, float]  # weighted by samples, as the round recorded them


@dataclass(frozen=True)
class GivenModel:
    """A model a run starts from instead of one a site builds: taken as the checkpoint
    of round ``after_round``, so the run's first round is the one after it (a region's
    run of an upstream round: fedra.region)."""

    tensors: Mapping[str, torch.Tensor]
    after_round: int = 0


class Engine:
    """Runs, rounds and sites; every public method is safe to call from any thread."""

    def __init__(
        self,
        store: Store,
        models: BlobStore,
        updates: BlobStore,
        settings: EngineSettings | None = None,
        clock: Callable[[], float] = time.time,
        audit: AuditTrail | None = None,
    ) -> None:
        self._store, self.models = store, models
        self._records = ReadsOf(store)  # what status reads get: no write to reach for
        self.settings = settings or EngineSettings()
        self.updates = UpdateSpool(updates, store, self.settings.small_update_bytes)
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.runs: dict[str, ActiveRun] = {}
        self.version = 0  # bumped on every change watchers may care about
        self.stopping = False
        self.restoring = False  # start() is bringing back unfinished runs
        self._drivers: dict[str, threading.Thread] = {}
        self._site_tasks: dict[str, tuple[str, ...]] = {}
        self._provenance: dict[str, dict[str, Provenance]] = {}  # by site, by task, as told
        self._last_seen: dict[str, float] = {}
        # The registered sites as stored (kept with each registration), how many ids were
        # added, and the ids in order as of that many, for listings.
        self._sites: dict[str, SiteRecord] = {}
        self._sites_added = 0
        self.registrations = 0  # every Register, a new site or not: the registry changed
        self._site_order: tuple[int, list[str]] | None = None
        self.attention = Attention(clock)  # when this coordinator was not listening
        self.attention.lag_cap_s = self.settings.site_timeout_s
        self._polling: Counter[str] = Counter()  # calls held open: long polls, heartbeats
        self._moving: Counter[str] = Counter()  # transfers under way, by site
        self._left: set[str] = set()  # sites that hung up on their poll, not heard from since
        self.hangups = 0  # how many times a site was added to ``_left``
        # The sites the edge refuses (revoked certificates): none until ``bar_sites_by``.
        self._barred: Callable[[], Collection[str]] = frozenset
        # Calls waiting without a thread (long polls, stage calls, watches), by what they
        # wait for; and each run's open (round, attempt) as its sites' polls last saw it.
        self.wakeups = Wakeups()
        self._issued: dict[str, tuple[int | None, int, str]] = {}
        # Times each run was told of a change: the operators' read process wakes its
        # watches of a run when this moves (replica.LiveSnapshot).
        self.run_changes: Counter[str] = Counter()
        self.downloads = DownloadLedger(store, on_written=self._notify_now)
        # Who hears what happened (metrics, tracking): told after the fact, outside the lock.
        self.observers = Observers()
        # Who did what (admin actions, commits, refused identities): audit.AuditTrail.
        self.audit = audit or AuditTrail(None)
        self.observers.add(self.audit)
        self.commits = GroupCommit(store, on_commit=self.observers.committed)  # batched writes
        self._seen_written_at = self.clock()

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Resume every unfinished run from its last committed round."""
        self.restoring = True  # until every unfinished run is back (recovery's deletes)
        self.models.clear_tmp()
        self.updates.clear_tmp()
        shutil.rmtree(self.updates.root / "spill", ignore_errors=True)  # robust rules' spill
        for site in self._store.list_sites():
            self._site_tasks[site.id] = site.tasks
            self._sites[site.id] = site
        for record in self._store.list_runs(states=(RunState.PENDING, RunState.RUNNING)):
            run = restore_run(self, record)
            if run is None:
                continue
            log.info("run %s: resumed at round %d", run.run_id, run.open_round or run.next_round)
            crash_point("during_startup", run.open_round or run.next_round)
            self._launch(run, resumed=True)
        self.restoring = False
        self._sweep_update_data()
        self._sweep_spool()

    def _sweep_update_data(self) -> None:
        """Let go of the small updates' bytes that rows of ended rounds still hold (a
        crash between a round's end and its clean-up leaves them)."""
        holding = self._store.holding_update_data()
        if not holding:
            return
        with self._lock:
            live = {
                a.task_id
                for run in self.runs.values()
                for a in (*run.assignments.values(), *run.carried.values())
            }
        self._store.clear_update_data([t for t in holding if t not in live])

    def _sweep_spool(self) -> None:
        """Delete the spool files no run refers to: an update put in place just before a
        crash, whose accept never became durable, is nobody's (its site sends it again)."""
        with self._lock:  # no accept between what is kept and what goes
            keep = self.spool_kept() | {
                digest
                for run in self.runs.values()
                for digest in (
                    run.init_sha256,
                    *(a.update_sha256 for a in run.carried.values()),
                )
                if digest
            }
            swept = self.updates.sweep(keep)
        if swept:
            log.info("deleted %d spooled update(s) that no round refers to", swept)

    def begin_stop(self) -> None:
        """Mark the engine stopping and wake every waiting call, which returns at once."""
        with self._lock:
            self.stopping = True
            self.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the drivers; open rounds stay open in the database for the next start."""
        self.begin_stop()
        self.wakeups.close()
        for thread in list(self._drivers.values()):
            thread.join(timeout_s)
        self.downloads.close(timeout_s)
        self.commits.close(timeout_s)
        if self._last_seen and not self._store.fenced:  # fenced: the sites are another's now
            self._store.touch_sites(dict(self._last_seen))

    def close(self) -> None:
        """After ``stop``: the observers' files, then the database's connections."""
        self.observers.close()
        self._store.close()

    def holds_claim(self) -> bool:
        """Whether this engine still drives its runs: False once another coordinator has
        taken the database over (this one's connection dropped meanwhile)."""
        return self._store.check_claim()

    @property
    def records(self) -> RunReads:
        """The stored runs, read-only, for status reads (``status.StatusSource``)."""
        return self._records

    def if_free(self, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """``(True, fn(*args))`` holding the lock if it is free this instant, else
        ``(False, None)`` and nothing run: for a caller that must never wait for it (the
        front door's event loop)."""
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            return True, fn(*args)
        finally:
            self._lock.release()

    def is_free(self) -> bool:
        """Whether the lock is free this instant: a hint (it may be taken the next), for
        a step that takes a lock of its own before this one (a run's fold lock)."""
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True

    def locked(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` holding the lock: several engine steps taken as one."""
        with self._lock:
            return fn(*args)

    def _launch(self, run: ActiveRun, resumed: bool = False) -> None:
        spec = json.loads(run.spec.to_json())
        self.commits.write_later(self._store.add_event_op(
            run.run_id, RUN_PROVENANCE_EVENT, f"driven by fedra {__version__}", self.clock(),
            data={"coordinator_version": __version__, "resumed": int(resumed)},
        ))  # fmt: skip
        self.observers.run_started(RunStarted(run.run_id, spec, resumed))
        with self._lock:
            self.runs[run.run_id] = run
            driver = RoundDriver(self, run)
            thread = threading.Thread(target=driver.run, name=f"run-{run.run_id}", daemon=True)
            self._drivers[run.run_id] = thread
        thread.start()

    def spool_in_use(self, digest: str) -> bool:
        """Whether an accepted update of any active run is this blob (lock held).

        The spool is content-addressed: two runs of one task and seed upload the same
        initial model, so one run's clean-up must not delete the other's update.
        """
        return digest in self.spool_kept()

    def spool_kept(self) -> set[str]:
        """The blobs that accepted updates of active runs are (lock held): what a clean-up
        of many updates must keep, looked up once for all of them."""
        return {
            a.update_sha256
            for run in self.runs.values()
            for a in run.assignments.values()
            if a.state == TaskState.ACCEPTED and a.update_sha256
        }

    def _notify_now(self) -> None:
        with self._lock:
            self.notify()

    def notify(self, run_id: str | None = None) -> None:
        """Wake the drivers, the calls waiting on ``run_id`` (every run's if None), and the
        polls of sites a round has just been opened for (call with the lock held)."""
        self.version += 1
        self._changed.notify_all()
        keys: list[tuple[str, str]] = []
        for run in self.runs.values() if run_id is None else filter(None, [self.runs.get(run_id)]):
            keys.append(run_key(run.run_id))
            self.run_changes[run.run_id] += 1
            opened = (run.open_round, run.attempt)
            issued = (*opened, run.secure.stage if run.secure is not None else "")
            last = self._issued.get(run.run_id)
            if last != issued:  # the attempt or its stage moved: who waits on it looks again
                self._issued[run.run_id] = issued
                keys.append(stage_key(run.run_id))
                if last is None or last[:2] != opened:  # a round opened: its sites' tasks
                    keys.extend(site_key(site) for site in run.assignments)
                    if run.open_round is not None:
                        keys.append(opened_key(run.run_id))
        for gone in [r for r in self._issued if r not in self.runs]:  # the run ended
            del self._issued[gone]
            self.run_changes.pop(gone, None)
            keys += [run_key(gone), stage_key(gone), opened_key(gone)]
        if self.stopping:
            self.wakeups.close()
        elif keys:
            self.wakeups.wake(keys)

    # -- sites -----------------------------------------------------------------

    def register(
        self,
        site_id: str,
        tasks: list[str],
        version: str,
        provenance: Sequence[Provenance] = (),
    ) -> None:
        """A site says who it is, the tasks it serves and (per task) what its results
        come from, recorded for each run at its first accepted update (``provenance``)."""
        _check_site_id(site_id)
        told = {p.entry_point: p for p in provenance}
        if len(told) != len(provenance) or not told.keys() <= set(tasks):
            raise InvalidArgument("provenance: at most one per task, each of a task served")
        if not tasks:
            raise InvalidArgument("tasks: a site must serve at least one task")
        if len(tasks) > MAX_SITE_TASKS or any(len(t) > MAX_TASK_CHARS for t in tasks):
            raise InvalidArgument(
                f"tasks: at most {MAX_SITE_TASKS}, each at most {MAX_TASK_CHARS} characters"
            )
        if len(version) > MAX_VERSION_CHARS:
            raise InvalidArgument(f"version: at most {MAX_VERSION_CHARS} characters")
        now = self.clock()
        with self._lock:
            if self._polling[site_id] > 0:
                log.warning(
                    "site %s registered again while another connection of it has a call "
                    "open (a long poll or a held heartbeat): are two processes using the "
                    "same site_id?",
                    site_id,
                )
        self.commits.write(self._store.upsert_site_op(site_id, tasks, version, now))
        with self._lock:
            known = self._sites.get(site_id)
            first = now if known is None else known.registered_at
            self._sites[site_id] = SiteRecord(site_id, tuple(tasks), version, first, now)
            self.registrations += 1
            if known is None:
                self._sites_added += 1  # a new id: the sorted listing is built again
            self._site_tasks[site_id] = tuple(tasks)
            self._provenance[site_id] = told
            self._last_seen[site_id] = now
            self._left.discard(site_id)
            self.notify()
        log.info(
            "site %s: registered, serves %s", site_id, logsafe.safe(", ".join(tasks)),
            extra={"site": site_id},
        )  # fmt: skip

    def seen(self, site_id: str) -> None:
        if site_id not in self._site_tasks:
            raise NotFound(f"site {site_id!r} is not registered; call Register first")
        now = self._last_seen[site_id] = self.clock()
        self._left.discard(site_id)
        if now - self._seen_written_at >= LIVENESS_WRITE_S and not self._store.fenced:
            # Heartbeats are kept in memory and written in one batch every few seconds
            # (nobody waits on them): what `fedra sites` shows survives a crash.
            self._seen_written_at = now
            self.commits.write_later(self._store.touch_sites_op(dict(self._last_seen)))

    def touch(self, site_id: str, queued_s: float | None = None) -> None:
        """A call of the site's arrived: news from it, taken without the lock (a dict
        write) the moment its handler starts, before any of its steps waits its turn on
        a busy coordinator; ``queued_s``, how long it waited in gRPC's queue before that
        (``attention.lag``). Unknown sites are left to the call's own checks."""
        if site_id in self._site_tasks:
            self._last_seen[site_id] = max(self._last_seen.get(site_id, 0.0), self.clock())
            if queued_s is not None:
                self.attention.queued(site_id, queued_s)

    def mark_seen_for_recovery(self, site_id: str, now: float, refresh: bool = False) -> None:
        """Give a site sampled before a restart one liveness timeout to come back; with
        ``refresh``, also one that was heard from (its heartbeats waited out a reload, or
        a round just sampled it between two of its polls)."""
        if refresh:
            self._last_seen[site_id] = max(now, self._last_seen.get(site_id, now))
        else:
            self._last_seen.setdefault(site_id, now)

    def hung_up(self, site_id: str) -> bool:
        """Whether the site hung up on its poll (it stopped) and has not been heard since."""
        return site_id in self._left and not self._polling.get(site_id)

    def is_online(self, site_id: str, now: float) -> bool:
        # .get: a Counter's [] of an absent key runs Python code (__missing__)
        busy = self._polling.get(site_id, 0) > 0 or self._moving.get(site_id, 0) > 0
        return busy or (self._heard_within(site_id, now) and site_id not in self._left)

    def _heard_within(self, site_id: str, now: float) -> bool:
        """Heard from within the liveness timeout, counting only the time this
        coordinator was listening (its own stalls and the time by which it currently
        hears late are not the site's: ``attention``)."""
        last = self._last_seen.get(site_id)
        if last is None:
            return False
        quiet, timeout = now - last, self.settings.site_timeout_s
        if quiet <= timeout:
            return True
        return quiet - self.attention.stalled(last, now) - self.attention.lag() <= timeout

    def silence_due(self, site_id: str, now: float) -> float | None:
        """When the site must next be asked whether it went silent, if nothing more is
        heard from it: None if it is offline now. A round asks each of its sites then,
        not at every look (``RoundDriver``); a hang-up, which makes a site offline at
        once, is counted in ``hangups`` for it to look at ``hung_up_sites``. A site
        heard from longer ago than the timeout but online (a call or a transfer under way,
        or this coordinator hears late) is asked again every ``SILENCE_RECHECK_S``."""
        if not self.is_online(site_id, now):
            return None
        if site_id in self._left:  # hung up, but a transfer under way: offline as it ends
            return now + SILENCE_RECHECK_S
        last = self._last_seen.get(site_id, now)
        return max(last + self.settings.site_timeout_s, now + SILENCE_RECHECK_S)

    def hung_up_sites(self) -> list[str]:
        """The sites that hung up on their poll and were not heard from since (a copy)."""
        return list(self._left)

    def transfer(self, site_id: str, began: bool) -> None:
        """A download or upload of the site's began (or ended): while one is under way the
        site is online, however long a busy coordinator takes to move its bytes. (One
        that stalls is ended by the edge's watchdog, one whose site died by gRPC.)"""
        with self._lock:  # its callers' steps may run on any thread (held already: cheap)
            if began:
                self._moving[site_id] += 1
                return
            self._moving[site_id] -= 1
            if self._moving[site_id] <= 0:
                del self._moving[site_id]
            self._last_seen[site_id] = max(self._last_seen.get(site_id, 0.0), self.clock())

    def site_heard(self, site_id: str) -> bool:
        """Whether the site polled, or was heard from, within its liveness timeout (its
        transfers under way left out: the edge asks this of a stalled one)."""
        recent = self._heard_within(site_id, self.clock())
        return self._polling.get(site_id, 0) > 0 or (recent and site_id not in self._left)

    def site_online(self, site_id: str) -> bool:
        """Whether the site counts as online now (is_online, under the lock)."""
        with self._lock:
            return self.is_online(site_id, self.clock())

    def bar_sites_by(self, barred: Callable[[], Collection[str]]) -> None:
        """From now on, never sample the sites ``barred()`` names into a round (the server's:
        those whose certificates are revoked, ``auth.Guard.revoked_sites``)."""
        self._barred = barred

    def barred(self) -> Collection[str]:
        """The sites never sampled into a round now (``bar_sites_by``; none by default)."""
        return self._barred()

    def eligible_sites(self, run: ActiveRun, now: float) -> list[str]:
        """Online sites serving the run's task and not busy with another run's task."""
        busy = {
            a.site_id
            for other in self.runs.values()
            if other is not run
            for a in (*other.assignments.values(), *other.carried.values())
            if not a.final
        }
        busy.update(run.carried)  # async: still training on an earlier round's task
        busy.update(self.barred())  # revoked: refused at their next call, so never sampled
        hold_s = self.settings.decline_hold_s
        busy.update(s for s, at in run.declined.items() if now - at < hold_s)
        return sorted(
            s
            for s, tasks in self._site_tasks.items()
            if run.spec.task in tasks and s not in busy and self.is_online(s, now)
        )

    def heartbeat(self, site_id: str, task_id: str) -> tuple[bool, str | None]:
        """Record liveness; returns whether ``task_id`` (if any) still counts, and the run
        it is of (None without one that counts)."""
        with self._lock:
            self.seen(site_id)
            if not task_id:
                return True, None
            run_id = self.task_run(site_id, task_id)
            return run_id is not None, run_id

    def task_run(self, site_id: str, task_id: str) -> str | None:
        """The run of the site's task ``task_id`` while it counts (None once it does not)."""
        with self._lock:
            found = self.find_task(task_id)
            if found is None or found[1].site_id != site_id or found[1].final:
                return None
            return found[0].run_id

    def hold_begin(self, site_id: str, task_id: str) -> tuple[float, bool]:
        """A held heartbeat of ``site_id`` begins: it is online while it lasts, as in a long
        poll (``poll_end`` ends it). Returns when it began, and whether the task counts."""
        with self._lock:
            self.seen(site_id)
            self._polling[site_id] += 1
            return self._last_seen[site_id], self.task_run(site_id, task_id) is not None

    def poll_begin(self, site_id: str) -> tuple[float, TaskView | None]:
        """A long poll of ``site_id`` begins: it is online while it lasts. Returns when it
        began, for ``poll_end``, and the site's task if it has one already."""
        with self._lock:
            was_online = self.is_online(site_id, self.clock())
            self.seen(site_id)
            self._polling[site_id] += 1
            if not was_online:  # a site coming online may complete a round's sample
                self.notify()
            return self._last_seen[site_id], self.task_for(site_id)

    def task_for(self, site_id: str) -> TaskView | None:
        """The site's task in an open round, if it has one now."""
        with self._lock:
            return None if self.stopping else self._task_for(site_id)

    def task_after(self, site_id: str, run_id: str, task_id: str) -> tuple[TaskView | None, bool]:
        """For a poll held after the site's update for ``task_id`` of ``run_id`` counted
        (``UploadSmallUpdate``'s then_poll_s): the site's task if it has one now, and
        whether a poll that found none waits on. It does while that update's attempt is
        open, and between its round's close and the next attempt's opening; once the run
        has opened an attempt without the site, or ended, the hold ends, and the site's
        next poll is a call of its own."""
        with self._lock:
            view = self.task_for(site_id)
            if view is not None or self.stopping:
                return view, False
            run = self.runs.get(run_id)
            if run is None:
                return None, False
            return None, run.open_round is None or run.by_task(task_id) is not None

    def poll_end(self, site_id: str, began: float, gone: bool) -> None:
        """The poll ended; ``gone``: its caller hung up (it stopped), and is offline at
        once unless it was heard from since the poll began (by a newer connection, say)."""
        with self._lock:
            self._polling[site_id] -= 1
            if not self._polling[site_id]:
                del self._polling[site_id]
            last = self._last_seen.get(site_id, began)
            if gone and last <= began and not self._polling[site_id]:
                self._left.add(site_id)
                self.hangups += 1
                self.notify()  # the round need not wait for its liveness timeout
            elif not gone:
                self._last_seen[site_id] = self.clock()
                self._left.discard(site_id)

    def waiting_calls(self) -> int:
        """Calls waiting now (long polls, held heartbeats, secure aggregation stages, run
        watches)."""
        return self.wakeups.waiting()

    def _task_for(self, site_id: str) -> TaskView | None:
        for run in self.runs.values():
            a = run.assignments.get(site_id)
            if a is not None and a.pending and run.accepting(run.open_round or 0, run.attempt):
                return self._view(run, a)
        return None

    def _view(self, run: ActiveRun, a: Assignment) -> TaskView:
        assert run.open_round is not None
        init = run.open_round == INIT_ROUND
        return TaskView(
            task_id=a.task_id,
            run_id=run.run_id,
            round=a.issued_round,
            kind="init" if init else "train",
            entry_point=run.spec.task,
            train=run.spec.train,
            seed=run.spec.seed,
            model_sha256="" if init else run.model_sha256,
            model_bytes=0 if init else run.model_bytes,
            deadline_in_s=max(0.0, run.deadline_at - self.clock()),
            codec=run.upload_codec,
            secagg=run.secure.task() if run.secure is not None else None,
            base_sha256="" if init else run.base_sha256,
            delta_sha256="" if init else run.delta_sha256,
            delta_bytes=0 if init else run.delta_bytes,
            sites_in_round=run.cohort_size,
            privacy=run.spec.privacy,
            controls_sha256="" if init else run.controls_sha256,
            controls_bytes=0 if init else run.controls_bytes,
            rounds=run.spec.rounds,
        )

    def is_async_task(self, task_id: str) -> bool:
        """Whether ``task_id`` is a live task of an asynchronous run (a look, no lock)."""
        return any(
            run.spec.asynchronous is not None and run.by_task(task_id) is not None
            for run in list(self.runs.values())
        )

    def find_task(self, task_id: str) -> tuple[ActiveRun, Assignment] | None:
        for run in self.runs.values():
            a = run.by_task(task_id)
            if a is not None:
                return run, a
        return None

    def current_task(self, site_id: str, task_id: str) -> tuple[ActiveRun, Assignment]:
        """The run and assignment for a task the site may act on now (lock held).

        An async task still in training when its round committed is valid in the next
        round: a call made while that round is being committed or opened waits for it.
        """
        self.seen(site_id)
        self.await_carried(task_id)
        found = self.find_task(task_id)
        if found is None:
            past = self._store.get_participation(task_id)
            if past is None:
                raise NotFound(f"no task {task_id!r}")
            if past.site_id != site_id:
                raise PermissionDenied(f"task {task_id!r} was not given to site {site_id!r}")
            raise FailedPrecondition(
                f"task {task_id!r} was for round {past.round_number} (attempt {past.attempt}) "
                f"of run {past.run_id}, which has closed; poll for the next task"
            )
        run, a = found
        if a.site_id != site_id:
            raise PermissionDenied(f"task {task_id!r} was not given to site {site_id!r}")
        if not run.accepting(run.open_round or 0, run.attempt):
            raise FailedPrecondition(f"round {run.open_round} of run {run.run_id} has closed")
        return run, a

    def await_carried(self, task_id: str) -> None:
        """Wait (lock held) while ``task_id`` belongs to an async run between two rounds."""
        limit: float | None = None
        while not self.stopping:
            found = self.find_task(task_id)
            if found is None:
                return
            run, a = found
            between = run.open_round is None or run.closing or a.site_id in run.carried
            if run.spec.asynchronous is None or a.final or not between:
                return
            # As long as the next round may take to open (it waits for sites), and then some.
            limit = limit or time.monotonic() + run.spec.join_timeout_s + _CARRY_GRACE_S
            if time.monotonic() >= limit:
                return
            self._changed.wait(1.0)

    def open_download(
        self, site_id: str, task_id: str, delta: bool = False, controls: bool = False
    ) -> tuple[str, int, int]:
        """Check a site may download its task's model (or the compressed step to it from
        the previous model, or a SCAFFOLD run's control variate c); returns (sha256, size,
        the round whose model it is)."""
        with self._lock:
            run, _ = self.current_task(site_id, task_id)
            if run.open_round == INIT_ROUND:
                raise FailedPrecondition(
                    f"task {task_id!r} builds the initial model: nothing to download"
                )
            if delta:
                if not run.delta_sha256:
                    raise FailedPrecondition(
                        f"round {run.open_round} of run {run.run_id} has no compressed step; "
                        "download the whole model"
                    )
                found = run.delta_sha256, run.delta_bytes, run.open_round or 0
            elif controls:
                if not run.controls_sha256:
                    raise FailedPrecondition(
                        f"round {run.open_round} of run {run.run_id} has no control variate "
                        "to download (a run without train.scaffold, or c still zero)"
                    )
                found = run.controls_sha256, run.controls_bytes, run.open_round or 0
            else:
                found = run.model_sha256, run.model_bytes, run.open_round or 0
            # Under way until record_download, or downloads.abandoned if the call ends early.
            self.downloads.started(task_id)
            return found

    def record_download(self, task_id: str, nbytes: int, seconds: float, base: int) -> None:
        """Count a finished download of the model of round ``base`` (an async update's
        staleness counts from it): at once in memory, in the database in the background."""
        self.downloads.record(Download(task_id, nbytes, seconds, base))
        with self._lock:
            found = self.find_task(task_id)
            if found is not None and found[1].state is TaskState.ASSIGNED:
                found[1].move(TaskState.DOWNLOADED)
            if found is not None:
                found[1].base_round = base
            self.notify()

    def report_failure(
        self, site_id: str, task_id: str, reason: str, declined: bool = False
    ) -> None:
        """The site's task will not count: it failed, or (``declined``) the site's own
        policy refused it, which leaves the site out of the run's sampling for a while."""
        with self._lock:
            run, a = self.current_task(site_id, task_id)
            if not a.pending:
                raise FailedPrecondition(f"task {task_id!r} is {a.state}; nothing to report")
            # Escaped where it enters: the reason reaches the round's and the run's log
            # lines, and the operator's terminal through the status.
            said = logsafe.safe(reason, REASON_CHARS)
            stored = f"{DECLINED}{said}" if declined else f"site reported: {said}"
            now = self.clock()
            self._store.fail_participation(task_id, stored, now)
            a.move(TaskState.FAILED)
            a.declined = declined
            if declined:
                run.declined[site_id] = now
            self.notify()
        what = "declined the task" if declined else "failed its task"
        log.log(
            logging.INFO if declined else logging.WARNING,
            "run %s round %s: site %s %s: %s",
            run.run_id, run.open_round, site_id, what, logsafe.safe(reason),
        )  # fmt: skip

    def note_provenance(self, run: ActiveRun, site_id: str, round_number: int) -> None:
        """An update of ``site_id`` counts for ``run``: record what it comes from, the first
        time and whenever it changes (a site restarted with other code or data), in the
        next group commit. Under the lock."""
        told = self._provenance.get(site_id, {}).get(run.spec.task)
        if told is None:
            return
        digest = told.digest()
        if run.provenance.get(site_id) == digest:
            return
        run.provenance[site_id] = digest
        data: dict[str, float | int | str] = {
            "site": site_id, "digest": digest, **{
                k: v for k, v in dataclasses.asdict(told).items() if isinstance(v, str)
            }, "versions": json.dumps(dict(told.versions), sort_keys=True),
        }  # fmt: skip
        self.commits.write_later(self._store.add_event_op(
            run.run_id, PROVENANCE_EVENT, f"site {site_id}: {told.entry_point}", self.clock(),
            round_number, data,
        ))  # fmt: skip

    # -- admin -----------------------------------------------------------------

    def submit(
        self, spec: RunSpec, who: str = "", start: GivenModel | None = None
    ) -> tuple[str, list[str]]:
        """Validate and persist a run, then start driving it; returns its id and why it
        cannot start yet, if so (``submit_warnings``). ``who``: the admin, audited.
        ``start``: the run starts from that model, as the checkpoint of its round
        ``start.after_round``, instead of having a site build one (a region's run)."""
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        run_id = uuid.uuid4().hex[:12]
        now = self.clock()
        given = None if start is None else self._given_checkpoint(run_id, spec, start, now)
        summary = f"task {spec.task}, {spec.rounds} rounds"
        if given is not None:
            summary += f", from a given model as round {given.round_number}"
        record = self._store.create_run(
            run_id, spec.name or run_id, spec.task, spec.to_json(), now,
            start=given, event=("submitted", summary),
        )  # fmt: skip
        task = logsafe.safe(spec.task)  # the admin's text, free-form after its colon
        log.info("run %s: submitted (%s, %d rounds, %s)", run_id, task, spec.rounds, spec.strategy)
        self.audit.record(
            "run.submit", who, run=run_id, name=spec.name, task=spec.task,
            spec_sha256=hashlib.sha256(spec.to_json().encode()).hexdigest(),
            **({} if given is None else {"start_model_sha256": given.model_sha256}),
        )  # fmt: skip
        warnings = self.submit_warnings(spec)
        for warning in warnings:
            log.warning("run %s: %s", run_id, logsafe.safe(warning, logsafe.MESSAGE_CHARS))
        if given is None:
            run: ActiveRun | None = ActiveRun(
                run_id=run_id, spec=spec, optimizer=ServerOptimizer(spec)
            )
        else:  # as a restart finds it: its checkpoint is the given model
            run = restore_run(self, record)
        if run is not None:
            self._launch(run)
        return run_id, warnings

    def _given_checkpoint(
        self, run_id: str, spec: RunSpec, start: GivenModel, now: float
    ) -> CheckpointRecord:
        """The given model, durable in the model store, as the checkpoint a run starts
        after; InvalidArgument naming what is wrong with it."""
        k = start.after_round
        if not 0 <= k < spec.rounds:
            raise InvalidArgument(
                f"a run given its model starts after a round from 0 to rounds - 1 "
                f"({spec.rounds - 1}), got {k}"
            )
        if not start.tensors:
            raise InvalidArgument("the model a run is given has no tensors")
        for name, tensor in start.tensors.items():
            if not all_finite(tensor):
                raise InvalidArgument(f"the model a run is given has non-finite values in {name!r}")
        tensors = {k: v.detach().cpu().contiguous() for k, v in start.tensors.items()}
        sha = self.models.put_chunks(encode_chunks(tensors, BLOCK_BYTES))
        return CheckpointRecord(run_id, k, sha, self.models.size(sha), None, now, None)

    def submit_warnings(self, spec: RunSpec) -> list[str]:
        """Why a run of ``spec`` cannot start yet, from the sites known now (registered
        at some time, online or not): it is accepted all the same and waits for them."""
        serving = self.sites_serving(spec.task)
        if serving == 0:
            return [
                f"no site known to this coordinator allows task {spec.task}: the run waits "
                f"until sites that do are online ({self._tasks_known()})"
            ]
        if spec.asynchronous is None and serving < spec.quorum:
            return [
                f"only {serving} known site(s) allow task {spec.task}, fewer than the "
                f"{spec.quorum} a round needs (min_sites): the run waits until more that do "
                "are online"
            ]
        return []

    def cancel(self, run_id: str, who: str = "") -> str:
        record = self.get_run_record(run_id)
        with self._lock:
            run = self.runs.get(run_id)
            if run is None or record.finished:
                raise FailedPrecondition(f"run {run_id} is already {record.state}")
            run.cancelled = True
            run.closing = True  # no upload is accepted from here on
            self.notify()
        self.audit.record("run.cancel", who, run=run_id)
        return RunState.CANCELLED

    def get_run_record(self, run_id: str) -> RunRecord:
        record = self._store.get_run(run_id)
        if record is None:
            raise NotFound(f"no run {run_id!r}")
        return record

    def list_sites(
        self, after: str = "", limit: int = SITES_PAGE
    ) -> tuple[list[tuple[SiteRecord, bool, float]], str]:
        """A page of known sites (id order, after ``after``) with whether each is online
        and when it was last heard from, and the id to continue after ('' at the end).

        Read from memory (the sites as registered, what the database holds, and their
        liveness) without the engine's lock: a listing never waits for a round's writes,
        nor holds them up, nor costs a database read per site."""
        limit = page_limit(limit)
        now = self.clock()
        added, cached = self._sites_added, self._site_order
        if cached is not None and cached[0] == added:
            order = cached[1]
        else:  # one atomic copy of the ids (registrations may go on), kept until the next
            order = sorted(list(self._sites))
            self._site_order = (added, order)
        first = bisect.bisect_right(order, after)
        ids = order[first : first + limit + 1]
        page = []
        for site_id in ids[:limit]:
            s = self._sites[site_id]
            page.append((s, self.is_online(site_id, now), self._seen_at(s, now)))
        return page, (ids[limit - 1] if len(ids) > limit else "")

    def presence(self, site_ids: Iterable[str] | None = None) -> dict[str, tuple[bool, float]]:
        """(online now, last heard from) of each known site among ``site_ids`` (None:
        every one), as ``list_sites`` gives them, read from memory without the lock."""
        now = self.clock()
        if site_ids is None:
            site_ids = list(self._sites)  # one atomic copy: registrations may go on
        return {
            site_id: (self.is_online(site_id, now), self._seen_at(s, now))
            for site_id in site_ids
            if (s := self._sites.get(site_id)) is not None
        }

    def presence_ages(self, now: float) -> tuple[dict[str, int], list[str]]:
        """Every known site's milliseconds since it was last heard from at ``now`` (0 while
        connected), and the sites offline: ``presence`` in one pass, in a form that costs
        little to write (the operators' snapshot), without the lock."""
        polling, moving, left = self._polling, self._moving, self._left
        last_seen, timeout = self._last_seen, self.settings.site_timeout_s
        ages: dict[str, int] = {}
        offline: list[str] = []
        # One atomic copy: dict.copy runs no Python code. list(d.items()) allocates a pair
        # per site, which can set off a collection whose callbacks let another thread in
        # to change the dict under the copy (RuntimeError, seen while 5,000 registered).
        for site_id, s in self._sites.copy().items():
            if polling.get(site_id, 0) > 0 or moving.get(site_id, 0) > 0:
                ages[site_id] = 0
                continue
            last = last_seen.get(site_id)
            seen = s.last_seen_at if last is None else last
            ages[site_id] = max(0, round((now - seen) * 1000.0))
            doubt = last is None or now - last > timeout or site_id in left
            if doubt and not self.is_online(site_id, now):  # the rule's own word
                offline.append(site_id)
        return ages, offline

    def _seen_at(self, s: SiteRecord, now: float) -> float:
        if self._polling.get(s.id, 0) > 0 or self._moving.get(s.id, 0) > 0:
            return now  # connected, waiting in a long poll or moving bytes: seen now
        return self._last_seen.get(s.id, s.last_seen_at)

    def site_counts(self, offline: Collection[str] = ()) -> tuple[int, int]:
        """(sites registered, of them online now, those in ``offline`` left out of the
        second), counted in memory, without the lock."""
        now = self.clock()
        known = list(self._site_tasks)  # one atomic copy: registrations may go on
        online = sum(self.is_online(s, now) and s not in offline for s in known)
        return len(known), online

    def gauges(self, offline: Collection[str] = ()) -> Gauges:
        """How the coordinator stands this instant, for its metrics: counted in memory
        (the runs by state from the database), without the lock."""
        registered, online = self.site_counts(offline)
        uploading = sum(
            a.state == TaskState.UPLOADING
            for run in list(self.runs.values())
            for a in list(run.assignments.values())
        )
        moving = sum(list(self._moving.values()))
        return Gauges(
            sites_registered=registered,
            sites_online=online,
            runs_by_state=self._store.count_runs_by_state(),
            downloads_in_flight=max(0, moving - uploading),
            uploads_in_flight=uploading,
            waiting_calls=self.waiting_calls(),
            hearing_lag_s=self.attention.lag(),
        )

    def active_run_ids(self) -> list[str]:
        """The runs this engine drives now (one atomic copy: runs start and end)."""
        return list(self.runs)

    def waiting_reason(self, run_id: str) -> str:
        """Why the driven run ``run_id``, with no round open, waits ('' if it does not),
        read without the lock: a status never waits on a round."""
        live = self.runs.get(run_id)
        if live is None or live.open_round is not None:
            return ""
        return live.waiting_reason or ""

    def settled_before(self) -> float:
        """Now: a round closed before now has no download left to start, so each one of
        it is in ``downloads_pending`` asked after this, or written already."""
        return self.clock()

    def downloads_pending(self) -> set[str]:
        """The tasks with a download under way, or finished but not yet written."""
        return self.downloads.pending()

    def run_phase(self, run_id: str) -> tuple[object, ...]:
        """Where the run stands as a whole: driven (and whether cancelled), or not (not
        yet, or no longer: it has ended). It does not change with its rounds. Read
        without the lock (a torn read is just another phase)."""
        run = self.runs.get(run_id)
        return ("not driven",) if run is None else ("driven", run.cancelled)

    def runs_named_from(self, prefix: str) -> list[RunRecord]:
        """The runs whose name starts with ``prefix``, oldest first (a region's own)."""
        return [r for r in self._store.list_runs() if r.name.startswith(prefix)]

    def _tasks_known(self, shown: int = 5) -> str:
        """The tasks that known sites allow, the most allowed first: a misspelt task shows
        beside the one meant."""
        with self._lock:
            counts = Counter(t for tasks in self._site_tasks.values() for t in tasks)
        if not counts:
            return "no site has registered yet"
        named = ", ".join(task for task, _ in counts.most_common(shown))
        more = f" and {len(counts) - shown} more" if len(counts) > shown else ""
        return f"the tasks known sites allow: {named}{more}"

    def sites_serving(self, task: str) -> int:
        """How many sites known to this coordinator allow ``task``."""
        with self._lock:
            return sum(task in tasks for tasks in self._site_tasks.values())

    def round_outcome(self, run_id: str, number: int) -> RoundOutcome:
        """A committed round's model, the samples and sites its counted updates had, and
        its metrics; NotFound if the round is not committed."""
        rnd = self._store.get_round(run_id, number)
        ckpt = self._store.get_checkpoint(run_id, number)
        if rnd is None or ckpt is None or rnd.state != RoundState.COMMITTED:
            raise NotFound(f"run {run_id} has no committed round {number}")
        parts = self._store.list_participations(run_id, number, rnd.attempt)
        counted = [p for p in parts if p.state == ParticipationState.ACCEPTED]
        tensors = decode_chunks(self.models.read_chunks(ckpt.model_sha256))
        samples = sum(p.num_samples for p in counted)
        return RoundOutcome(tensors, samples, len(counted), dict(rnd.metrics))

    def export_checkpoint(
        self, run_id: str, round_number: int | None, who: str = ""
    ) -> CheckpointRecord:
        """The checkpoint of ``round_number``, or else the run's result: the latest, or
        with ``[promotion]`` the promoted one; with ``who`` (an admin's export), audited."""
        record = self.get_run_record(run_id)
        if round_number is None and RunSpec.from_json(record.spec_json).promotion is not None:
            latest = self._store.latest_checkpoint(run_id)
            last = self._store.get_round(run_id, latest.round_number) if latest else None
            promoted = PromotionState.from_metrics(last.metrics if last else {}).promoted_round
            round_number = promoted if promoted >= 0 else None  # none judged yet: the latest
        if round_number is None:
            ckpt = self._store.latest_checkpoint(run_id)
        else:
            ckpt = self._store.get_checkpoint(run_id, round_number)
        if ckpt is None:
            which = "any round" if round_number is None else f"round {round_number}"
            raise NotFound(f"run {run_id} has no committed checkpoint for {which}")
        if who:
            self.audit.record(
                "model.export",
                who,
                run=run_id,
                round=ckpt.round_number,
                model_sha256=ckpt.model_sha256,
            )
        return ckpt

    def wait_for_stop(self, timeout_s: float) -> None:
        """Sleep ``timeout_s`` (if positive), or less if the engine stops meanwhile."""
        if timeout_s > 0:
            with self._lock:
                self._changed.wait_for(lambda: self.stopping, timeout_s)

    def wait_for_change(self, version: int, timeout_s: float) -> int:
        """Block until the engine's version moves past ``version`` (or timeout); returns it."""
        with self._lock:
            self._changed.wait_for(lambda: self.version != version or self.stopping, timeout_s)
            return self.version


def _check_site_id(site_id: str) -> None:
    if not is_valid_site_id(site_id):
        raise InvalidArgument(f"site_id {site_id!r}: must be {SITE_ID_RULE}")
