"""Experiment tracking: each run's spec and every committed round's metrics, written to
TensorBoard and/or MLflow (``fedra coordinator --track``).

A round driver must never wait on a disk or a tracking server, so ``Tracker`` only
queues what it hears; one thread of its own writes it to each ``Sink``. The libraries
are imported on that thread, at first use: fedra imports without the tracking extra.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import posixpath
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fedra.config import ConfigError
from fedra.coordinator.observers import Observer, RoundEnded, RunEnded, RunStarted
from fedra.storage.records import RoundState, RunState

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("fedra.coordinator")

FAILED_ATTEMPTS = "round_attempts_failed"
RUN_TAG = "fedra.run_id"  # the MLflow tag a resumed run is found by
# The most MLflow servers of any version accept: longer keys and values are cut.
MAX_KEY_CHARS = 250
MAX_PARAM_CHARS = 500
MAX_TAG_CHARS = 5000
# MLflow's limits on one log_batch call.
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
_MLFLOW_STATUS: dict[str, str] = {
    RunState.COMPLETED: "FINISHED",
    RunState.FAILED: "FAILED",
    RunState.CANCELLED: "KILLED",
}
_UNSAFE_KEY = re.compile(r"[^\w./\- ]")  # what MLflow allows in a name (and TensorBoard shows)


class Sink(Protocol):
    """A tracking backend. Only the Tracker's thread calls it, so it need not lock."""

    name: str

    def open(self) -> None:
        """Get ready before the first event (import the library, reach the store): the
        writer's first job, run while the coordinator starts, not at a round's commit."""

    def start_run(self, run_id: str, params: Mapping[str, str], resumed: bool) -> None:
        """Open (or, ``resumed``, reopen) the run's record and write its configuration."""

    def log_round(
        self, run_id: str, step: int, scalars: Mapping[str, float], wall_time: float
    ) -> None:
        """Write one round's scalars at ``step`` (the round number)."""

    def end_run(self, run_id: str, state: str, reason: str) -> None:
        """Close the run's record: ``state`` is completed, failed or cancelled."""

    def close(self) -> None:
        """Flush what is held; runs not ended stay open, for a restart to resume."""


class Tracker(Observer):
    """Hands the coordinator's events to ``sinks`` on a thread of its own; never blocks.

    At most ``max_pending`` events wait: beyond that they are dropped and counted in
    ``dropped`` (a slow server costs records, never a round's time)."""

    def __init__(
        self, sinks: Sequence[Sink], *, max_pending: int = 1000, close_timeout_s: float = 30.0
    ) -> None:
        if not sinks:
            raise ValueError("a Tracker needs at least one sink")
        self.sinks = tuple(sinks)
        self.dropped = 0
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(max_pending)
        self._lock = threading.Lock()
        self._closed = False
        self._failing: set[str] = set()  # sinks whose failure was logged with a traceback
        self._thread = threading.Thread(target=self._write, name="fedra-tracking", daemon=True)
        self._thread.start()
        for sink in self.sinks:  # seconds of imports: before the first round, not in it
            self._put(partial(self._guarded, sink, "-", sink.open))

    def run_started(self, event: RunStarted) -> None:
        self._put(partial(self._start, event))

    def round_ended(self, event: RoundEnded) -> None:
        self._put(partial(self._round, event, time.time()))

    def run_ended(self, event: RunEnded) -> None:
        self._put(partial(self._end, event))

    def close(self) -> None:
        """Write out what is queued and close the sinks, waiting ``close_timeout_s`` at most."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + self.close_timeout_s
        with contextlib.suppress(queue.Full):  # the writer is stuck: a daemon, let it go
            self._queue.put(None, timeout=self.close_timeout_s)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning(
                "tracking: writers did not finish within %.0f s; %d events left unwritten",
                self.close_timeout_s, self._queue.qsize(),
            )  # fmt: skip
        if self.dropped:
            log.warning("tracking: %d events were dropped, the writers being behind", self.dropped)

    def _put(self, job: Callable[[], None]) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self.dropped += 1
                first = self.dropped == 1
            if first:
                log.warning(
                    "tracking: %d events wait to be written; dropping new ones (counted) "
                    "until the writers catch up", self._queue.maxsize,
                )  # fmt: skip

    def _write(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception:  # a malformed event costs its record, not the writer
                log.exception("tracking: an event could not be turned into records")
        for sink in self.sinks:
            self._guarded(sink, "-", sink.close)

    def _start(self, event: RunStarted) -> None:
        params = flatten_params(event.spec)
        self._each(event.run_id, lambda s: s.start_run(event.run_id, params, event.resumed))

    def _round(self, event: RoundEnded, wall_time: float) -> None:
        scalars, run_id, step = round_scalars(event), event.run_id, event.number
        self._each(run_id, lambda s: s.log_round(run_id, step, scalars, wall_time))

    def _end(self, event: RunEnded) -> None:
        self._each(event.run_id, lambda s: s.end_run(event.run_id, event.state, event.reason))

    def _each(self, run_id: str, call: Callable[[Sink], None]) -> None:
        for sink in self.sinks:
            self._guarded(sink, run_id, partial(call, sink))

    def _guarded(self, sink: Sink, run_id: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # a backend's failure is its own: the others still write
            first = sink.name not in self._failing
            self._failing.add(sink.name)
            log.warning("tracking %s: run %s: %s", sink.name, run_id, exc, exc_info=first)


def round_scalars(event: RoundEnded) -> dict[str, float]:
    """What a round's attempt records: a committed one its metrics, stages and traffic; a
    failed one only how many attempts of its round have failed so far."""
    if event.outcome != RoundState.COMMITTED:
        return {FAILED_ATTEMPTS: float(event.attempt)}  # attempts count from 1, all failed
    scalars = {safe_key(k): float(v) for k, v in event.metrics.items()}
    scalars.update((safe_key(f"stage/{k}"), float(v)) for k, v in event.stages.items())
    # The round's own figures win over a site metric of the same name.
    scalars.update(
        duration_s=event.duration_s,
        idle_s=event.idle_s,
        updates=float(event.updates),
        bytes_down=float(event.bytes_down),
        bytes_up=float(event.bytes_up),
        lost_bytes=float(event.lost_bytes),
        checkpoint_bytes=float(event.checkpoint_bytes),
    )
    return scalars


def flatten_params(spec: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The run spec as flat ``train.batch_size = "32"`` params; lists and scalars as JSON."""
    params: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(flatten_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            params[safe_key(name)] = text
    return params


def safe_key(name: str) -> str:
    """``name`` as both MLflow and TensorBoard take it: its characters, length and no path
    tricks (MLflow refuses ``a//b``, ``../x``, ``/x``)."""
    key = _UNSAFE_KEY.sub("_", name)[:MAX_KEY_CHARS]
    norm = posixpath.normpath(key) if key else "."
    if norm != key or norm == "." or norm.startswith(("..", "/")):
        key = ("_" + key.replace("/", "_"))[:MAX_KEY_CHARS]
    return key


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    return (items[i : i + size] for i in range(0, len(items), size))


class TensorBoardSink:
    """Event files under ``log_dir/<run id>/``: a scalar per figure and the spec as text."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, flush_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self.flush_s = flush_s
        self._writers: dict[str, SummaryWriter] = {}

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401, PLC0415 - the extra

    def start_run(self, run_id: str, params: Mapping[str, str], resumed: bool) -> None:
        directory = self.run_dir(run_id)
        had_records = directory.is_dir() and any(directory.iterdir())
        writer = self._writer(run_id)
        if not (resumed and had_records):  # a resumed run wrote its config when it began
            lines = "\n".join(f"    {k} = {v}" for k, v in sorted(params.items()))
            writer.add_text("config", lines, global_step=0)
            writer.flush()

    def log_round(
        self, run_id: str, step: int, scalars: Mapping[str, float], wall_time: float
    ) -> None:
        writer = self._writer(run_id)
        for key, value in scalars.items():
            writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        writer.flush()  # rounds are far apart: show each one at once

    def end_run(self, run_id: str, state: str, reason: str) -> None:
        writer = self._writer(run_id)
        writer.add_text("run/state", f"{state}: {reason}" if reason else state)
        writer.close()
        del self._writers[run_id]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def run_dir(self, run_id: str) -> Path:
        """The run's directory: its id, made safe as one path component."""
        return self.log_dir / safe_key(run_id).replace("/", "_")

    def _writer(self, run_id: str) -> SummaryWriter:
        """The run's writer; a new one (a new event file) in the same directory after a
        restart, which TensorBoard reads as one run."""
        writer = self._writers.get(run_id)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - the extra

            writer = SummaryWriter(str(self.run_dir(run_id)), flush_secs=int(self.flush_s))
            self._writers[run_id] = writer
        return writer


class MLflowSink:
    """One MLflow run per fedra run (tagged ``fedra.run_id``) in ``experiment``: the spec
    as params, each figure as a metric at step = round, a status when the run ends."""

    name = "mlflow"

    def __init__(
        self, tracking_uri: str, experiment: str = "fedra", artifact_location: str | None = None
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_location = artifact_location  # None: the tracking server's default
        self._client: MlflowClient | None = None
        self._experiment_id = ""
        self._runs: dict[str, str] = {}  # fedra run id -> MLflow run id

    def open(self) -> None:
        import mlflow  # noqa: F401, PLC0415 - the extra: seconds of imports

        if self.tracking_uri.startswith("sqlite:"):  # a local store: make its tables now
            self._mlflow()  # (a server is not dialled before there is something to send)

    def start_run(self, run_id: str, params: Mapping[str, str], resumed: bool) -> None:
        from mlflow.entities import Param  # noqa: PLC0415 - the extra

        mlflow_id, created = self._open(run_id, look=resumed)
        if not created:
            return  # params are immutable in MLflow, and were written when the run began
        items = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())]
        for batch in _batches(items, PARAMS_PER_BATCH):
            self._mlflow().log_batch(mlflow_id, params=batch)

    def log_round(
        self, run_id: str, step: int, scalars: Mapping[str, float], wall_time: float
    ) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415 - the extra

        mlflow_id, _ = self._open(run_id, look=True)
        at_ms = int(wall_time * 1000)
        items = [Metric(k, v, at_ms, step) for k, v in scalars.items()]
        for batch in _batches(items, METRICS_PER_BATCH):
            self._mlflow().log_batch(mlflow_id, metrics=batch)

    def end_run(self, run_id: str, state: str, reason: str) -> None:
        from mlflow.entities import RunTag  # noqa: PLC0415 - the extra

        mlflow_id, _ = self._open(run_id, look=True)
        client = self._mlflow()
        tags = [RunTag("fedra.state", state), RunTag("fedra.reason", reason[:MAX_TAG_CHARS])]
        client.log_batch(mlflow_id, tags=tags)
        client.set_terminated(mlflow_id, status=_MLFLOW_STATUS.get(state, "FAILED"))
        del self._runs[run_id]

    def close(self) -> None:
        """Nothing is held: each call was written when made."""

    def _mlflow(self) -> MlflowClient:
        if self._client is None:
            from mlflow import MlflowClient  # noqa: PLC0415 - the extra, slow to import

            client = MlflowClient(self.tracking_uri)
            self._experiment_id = self._find_experiment(client)
            self._client = client
        return self._client

    def _find_experiment(self, client: MlflowClient) -> str:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - the extra

        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                return client.create_experiment(
                    self.experiment, artifact_location=self.artifact_location
                )
            except MlflowException:  # another coordinator made it first
                found = client.get_experiment_by_name(self.experiment)
                if found is None:
                    raise
        if found.lifecycle_stage != "active":
            raise RuntimeError(
                f"MLflow experiment {self.experiment!r} is deleted: restore it "
                f"(mlflow experiments restore --experiment-id {found.experiment_id})"
            )
        return str(found.experiment_id)

    def _open(self, run_id: str, look: bool) -> tuple[str, bool]:
        """The MLflow run of ``run_id`` and whether it was made now; ``look``: continue the
        one tagged with it, if any (a run resumed after a restart)."""
        known = self._runs.get(run_id)
        if known is not None:
            return known, False
        client = self._mlflow()
        found = self._find_run(client, run_id) if look else None
        if found is not None:
            mlflow_id, created = found.info.run_id, False
            if found.info.status != "RUNNING":
                client.update_run(mlflow_id, status="RUNNING")
        else:
            made = client.create_run(self._experiment_id, tags={RUN_TAG: run_id}, run_name=run_id)
            mlflow_id, created = made.info.run_id, True
        self._runs[run_id] = mlflow_id
        return mlflow_id, created

    def _find_run(self, client: MlflowClient, run_id: str) -> Run | None:
        if "'" in run_id or "\\" in run_id:
            return None  # not a coordinator's run id: it cannot be quoted in a filter
        runs = client.search_runs(
            [self._experiment_id], f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1,
            order_by=["attributes.start_time DESC"],
        )  # fmt: skip
        return runs[0] if runs else None


@dataclass(frozen=True)
class _Backend:
    module: str  # the package the extra installs, checked for when the flag is read
    make: Callable[[str, Path], Sink]  # (the flag's location or "", state dir) -> sink


def _tensorboard(location: str, state_dir: Path) -> Sink:
    return TensorBoardSink(Path(location).expanduser() if location else state_dir / "tensorboard")


def _mlflow(location: str, state_dir: Path) -> Sink:
    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fedra"
    if location:
        return MLflowSink(location, experiment)
    # mlflow 3 refuses a file store (./mlruns) unless MLFLOW_ALLOW_FILE_STORE is set:
    # a SQLite database is its local store.
    root = state_dir.resolve() / "mlruns"
    root.mkdir(parents=True, exist_ok=True)
    return MLflowSink(f"sqlite:///{root / 'mlflow.db'}", experiment, (root / "artifacts").as_uri())


BACKENDS: dict[str, _Backend] = {
    "tensorboard": _Backend("tensorboard", _tensorboard),
    "mlflow": _Backend("mlflow", _mlflow),
}
ACCEPTED = "tensorboard[=DIR] or mlflow[=URI]"


def check_track(values: Sequence[str]) -> list[tuple[str, str]]:
    """(backend, location) for each ``--track`` value, location "" for the default; a
    ConfigError naming the value for an unknown or repeated backend, an empty location,
    or a backend whose package is not installed. Builds nothing."""
    wanted: dict[str, str] = {}
    for value in values:
        kind, has_location, location = value.partition("=")
        backend = BACKENDS.get(kind)
        if backend is None:
            raise ConfigError(f"--track {value!r}: unknown backend (expected {ACCEPTED})")
        if has_location and not location.strip():
            raise ConfigError(f"--track {value!r}: empty location (expected {ACCEPTED})")
        if kind in wanted:
            raise ConfigError(f"--track {value!r}: {kind} given twice (each backend once)")
        if importlib.util.find_spec(backend.module) is None:
            raise ConfigError(
                f"--track {kind}: the {backend.module} package is not installed: "
                "pip install 'fedra[tracking]'"
            )
        wanted[kind] = location.strip()
    return list(wanted.items())


def parse_track(values: Sequence[str], state_dir: Path) -> Tracker | None:
    """The Tracker the repeated ``--track`` flag asks for (None if it was not given)."""
    sinks = [BACKENDS[kind].make(location, state_dir) for kind, location in check_track(values)]
    return Tracker(sinks) if sinks else None
