"""Experiment tracking: what a Tracker hears is what TensorBoard and MLflow read back,
a restart continues the same records, and no sink can hold a round up."""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
    EventAccumulator,
)

from fedra.config import ConfigError
from fedra.coordinator.observers import RoundEnded, RunEnded, RunStarted
from fedra.coordinator.tracking import (
    FAILED_ATTEMPTS,
    MAX_PARAM_CHARS,
    RUN_TAG,
    MLflowSink,
    TensorBoardSink,
    Tracker,
    flatten_params,
    parse_track,
    round_scalars,
    safe_key,
)
from fedra.local import ClusterError, LocalCluster
from tests.test_cluster import FAST, finished, start_synthetic_sites, synthetic_spec, wait_until

# mlflow's SQL store trips SQLAlchemy 2.1's deprecation of its own loader option.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SPEC: dict[str, Any] = {
    "name": "digits",
    "task": "digits-mlp",
    "rounds": 3,
    "train": {"batch_size": 32, "learning_rate": 0.05, "params": {}},
    "privacy": None,
    "notes": "x" * 2000,
}


def committed(run_id: str, number: int, attempt: int = 1) -> RoundEnded:
    return RoundEnded(
        run_id, number, attempt, "committed", duration_s=1.5 * number, updates=number + 2,
        bytes_down=1000 * number, bytes_up=700 * number, lost_bytes=10 * number,
        checkpoint_bytes=4096, idle_s=0.25 * number,
        stages={"download_s": 0.1 * number, "compute_s": 0.5 * number},
        metrics={"loss": 1.0 / number, "accuracy": 0.3 * number},
    )  # fmt: skip


def retried(run_id: str, number: int, attempt: int = 1) -> RoundEnded:
    return RoundEnded(
        run_id, number, attempt, "retried", duration_s=9.0, updates=1, lost_bytes=500,
        metrics={"loss": 99.0}, reason="below quorum",
    )  # fmt: skip


def three_rounds(run_id: str) -> list[RoundEnded]:
    """Rounds 1 to 3; round 2's first attempt fails and its second commits."""
    return [
        committed(run_id, 1),
        retried(run_id, 2),
        committed(run_id, 2, attempt=2),
        committed(run_id, 3),
    ]


Scalars = dict[str, dict[int, list[float]]]  # tag -> step -> values, in the order written


def expected_scalars(rounds: list[RoundEnded]) -> Scalars:
    """What the rounds should read back as."""
    out: Scalars = {}
    for r in rounds:
        if r.outcome == "committed":
            figures: Mapping[str, float] = {
                **r.metrics,
                **{f"stage/{k}": v for k, v in r.stages.items()},
                "duration_s": r.duration_s, "idle_s": r.idle_s, "updates": r.updates,
                "bytes_down": r.bytes_down, "bytes_up": r.bytes_up,
                "lost_bytes": r.lost_bytes, "checkpoint_bytes": r.checkpoint_bytes,
            }  # fmt: skip
        else:
            figures = {FAILED_ATTEMPTS: r.attempt}
        for tag, value in figures.items():
            out.setdefault(tag, {}).setdefault(r.number, []).append(float(value))
    return out


def tensorboard_scalars(run_dir: Path) -> Scalars:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: Scalars = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(tag, {}).setdefault(e.step, []).append(e.value)
    return out


def tensorboard_texts(run_dir: Path, tag: str) -> list[str]:
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    if tag not in acc.Tags()["tensors"]:
        return []
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)]


def mlflow_scalars(client: MlflowClient, mlflow_id: str) -> Scalars:
    out: Scalars = {}
    for key in client.get_run(mlflow_id).data.metrics:
        for m in sorted(
            client.get_metric_history(mlflow_id, key), key=lambda m: (m.timestamp, m.value)
        ):
            out.setdefault(key, {}).setdefault(m.step, []).append(m.value)
    return out


def assert_close_scalars(got: Scalars, want: Scalars) -> None:
    """Equal tags, steps and values (TensorBoard keeps float32)."""
    assert sorted(got) == sorted(want)
    for tag, steps in want.items():
        assert sorted(got[tag]) == sorted(steps), tag
        for step, values in steps.items():
            assert got[tag][step] == pytest.approx(values, rel=1e-6), (tag, step)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module: creating its tables takes mlflow seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlruns') / 'mlflow.db'}"


def mlflow_run(client: MlflowClient, run_id: str) -> Any:
    experiment = client.get_experiment_by_name("fedra")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_TAG}` = '{run_id}'")
    assert len(runs) == 1, f"{len(runs)} MLflow runs for {run_id}"
    return runs[0]


def test_every_committed_round_reaches_tensorboard_and_mlflow(
    tmp_path: Path, mlflow_uri: str
) -> None:
    tracker = parse_track(["tensorboard", f"mlflow={mlflow_uri}"], tmp_path)
    assert tracker is not None
    rounds = three_rounds("run3rounds")
    tracker.run_started(RunStarted("run3rounds", SPEC))
    for event in rounds:
        tracker.round_ended(event)
    tracker.run_ended(RunEnded("run3rounds", "completed"))
    tracker.close()
    assert tracker.dropped == 0

    want = expected_scalars(rounds)
    assert want[FAILED_ATTEMPTS] == {2: [1.0]} and want["loss"][2] == [0.5]  # not the retry's
    run_dir = tmp_path / "tensorboard" / "run3rounds"
    assert_close_scalars(tensorboard_scalars(run_dir), want)
    (config,) = tensorboard_texts(run_dir, "config/text_summary")
    assert "train.batch_size = 32" in config
    assert tensorboard_texts(run_dir, "run/state/text_summary") == ["completed"]

    client = MlflowClient(mlflow_uri)
    run = mlflow_run(client, "run3rounds")
    assert run.info.status == "FINISHED"
    assert run.data.tags["fedra.state"] == "completed"
    assert_close_scalars(mlflow_scalars(client, run.info.run_id), want)
    params = run.data.params
    assert params["train.batch_size"] == "32" and params["train.learning_rate"] == "0.05"
    assert params["privacy"] == "null" and params["train.params"] == "{}"
    assert params["notes"] == "x" * MAX_PARAM_CHARS


def test_a_resumed_run_continues_its_records(tmp_path: Path, mlflow_uri: str) -> None:
    first = parse_track([f"tensorboard={tmp_path / 'tb'}", f"mlflow={mlflow_uri}"], tmp_path)
    assert first is not None
    first.run_started(RunStarted("runresumed", SPEC))
    first.round_ended(committed("runresumed", 1))
    first.close()  # the coordinator stops mid-run: the MLflow run stays RUNNING
    client = MlflowClient(mlflow_uri)
    assert mlflow_run(client, "runresumed").info.status == "RUNNING"

    second = parse_track([f"tensorboard={tmp_path / 'tb'}", f"mlflow={mlflow_uri}"], tmp_path)
    assert second is not None
    second.run_started(RunStarted("runresumed", SPEC, resumed=True))
    second.round_ended(retried("runresumed", 2))
    second.round_ended(RoundEnded("runresumed", 2, 2, "failed", 3.0, 0, reason="no sites"))
    second.run_ended(RunEnded("runresumed", "failed", "round 2: gave up after 2 attempts"))
    second.close()

    run = mlflow_run(client, "runresumed")  # the same run, not a second one
    assert run.info.status == "FAILED"
    assert run.data.tags["fedra.reason"] == "round 2: gave up after 2 attempts"
    want = expected_scalars([committed("runresumed", 1)])
    want[FAILED_ATTEMPTS] = {2: [1.0, 2.0]}  # the retried attempt, then the last one
    assert_close_scalars(mlflow_scalars(client, run.info.run_id), want)

    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["runresumed"]
    run_dir = tmp_path / "tb" / "runresumed"
    assert len(list(run_dir.iterdir())) == 2  # an event file per coordinator life
    assert_close_scalars(tensorboard_scalars(run_dir), want)
    assert len(tensorboard_texts(run_dir, "config/text_summary")) == 1


def test_defaults_live_in_the_state_dir(tmp_path: Path) -> None:
    tracker = parse_track(["tensorboard", "mlflow"], tmp_path)
    assert tracker is not None
    tb, ml = tracker.sinks
    tracker.close()
    assert isinstance(tb, TensorBoardSink) and tb.log_dir == tmp_path / "tensorboard"
    assert isinstance(ml, MLflowSink)
    assert ml.tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlruns/mlflow.db"
    assert ml.artifact_location == (tmp_path.resolve() / "mlruns" / "artifacts").as_uri()
    assert (tmp_path / "mlruns").is_dir()


def test_any_tracking_uri_is_taken_as_given(tmp_path: Path) -> None:
    tracker = parse_track(["mlflow=http://mlflow.example.org:5000"], tmp_path)
    assert tracker is not None
    (sink,) = tracker.sinks
    tracker.close()  # nothing was sent: nothing dialled
    assert isinstance(sink, MLflowSink) and sink.tracking_uri == "http://mlflow.example.org:5000"
    assert parse_track([], tmp_path) is None


@pytest.mark.parametrize(
    ("values", "bad"),
    [
        (["wandb"], "'wandb': unknown backend"),
        (["TensorBoard=/tmp/x"], "'TensorBoard=/tmp/x': unknown backend"),
        (["tensorboard="], "'tensorboard=': empty location"),
        (["mlflow= "], "'mlflow= ': empty location"),
        (["tensorboard", "tensorboard=/tmp/x"], "'tensorboard=/tmp/x': tensorboard given twice"),
    ],
)
def test_bad_track_values_are_named(tmp_path: Path, values: list[str], bad: str) -> None:
    with pytest.raises(ConfigError, match="--track") as info:
        parse_track(values, tmp_path)
    assert bad in str(info.value)
    if "unknown" in bad or "empty" in bad:
        assert "tensorboard[=DIR] or mlflow[=URI]" in str(info.value)


def test_a_missing_extra_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name)
    )
    with pytest.raises(ConfigError, match=r"--track mlflow: .*pip install 'fedra\[tracking\]'"):
        parse_track(["tensorboard", "mlflow"], tmp_path)


class RecordingSink:
    """Records each call; ``log_round`` waits for ``release`` once ``block`` is set."""

    def __init__(self, name: str = "recording", block: bool = False) -> None:
        self.name = name
        self.calls: list[tuple[Any, ...]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.closed = False

    def open(self) -> None:
        self.calls.append(("open",))

    def start_run(self, run_id: str, params: Mapping[str, str], resumed: bool) -> None:
        self.calls.append(("start", run_id, dict(params), resumed))

    def log_round(
        self, run_id: str, step: int, scalars: Mapping[str, float], wall_time: float
    ) -> None:
        self.entered.set()
        self.release.wait()
        self.calls.append(("round", run_id, step))

    def end_run(self, run_id: str, state: str, reason: str) -> None:
        self.calls.append(("end", run_id, state))

    def close(self) -> None:
        self.closed = True


class FailingSink(RecordingSink):
    def log_round(
        self, run_id: str, step: int, scalars: Mapping[str, float], wall_time: float
    ) -> None:
        raise ConnectionError("tracking server unreachable")


@pytest.fixture
def blocked() -> Iterator[RecordingSink]:
    sink = RecordingSink(block=True)
    yield sink
    sink.release.set()  # never leave the writer thread stuck


def test_a_stuck_sink_never_blocks_a_round(
    blocked: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = Tracker([blocked], max_pending=2)
    tracker.round_ended(committed("stuck", 1))
    assert blocked.entered.wait(10), "the writer never took the first round"
    # The writer is inside log_round and stays there until release: every further call
    # must return at once, the first two queued and the rest dropped.
    returned = threading.Event()

    def report_rounds() -> None:
        for number in range(2, 8):
            tracker.round_ended(committed("stuck", number))
        tracker.run_ended(RunEnded("stuck", "completed"))
        returned.set()

    with caplog.at_level(logging.WARNING, logger="fedra.coordinator"):
        threading.Thread(target=report_rounds, daemon=True).start()
        assert returned.wait(10), "round_ended waited on a stuck sink"
    assert not blocked.release.is_set() and blocked.calls == [("open",)]
    assert tracker.dropped == 5
    assert len([r for r in caplog.records if "dropping" in r.message]) == 1

    blocked.release.set()
    tracker.close()
    assert blocked.calls == [
        ("open",), ("round", "stuck", 1), ("round", "stuck", 2), ("round", "stuck", 3)
    ]  # fmt: skip
    assert blocked.closed


def test_close_gives_up_on_a_stuck_sink(
    blocked: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = Tracker([blocked], close_timeout_s=0.05)
    tracker.round_ended(committed("stuck", 1))
    assert blocked.entered.wait(10)
    with caplog.at_level(logging.WARNING, logger="fedra.coordinator"):
        tracker.close()
    assert any("did not finish" in r.message for r in caplog.records)
    tracker.round_ended(committed("stuck", 2))  # after close: ignored, not queued
    blocked.release.set()


def test_a_failing_sink_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    failing, recording = FailingSink("failing"), RecordingSink()
    tracker = Tracker([failing, recording])
    with caplog.at_level(logging.WARNING, logger="fedra.coordinator"):
        tracker.run_started(RunStarted("r", {"rounds": 2}))
        tracker.round_ended(committed("r", 1))
        tracker.round_ended(committed("r", 2))
        tracker.run_ended(RunEnded("r", "cancelled"))
        tracker.close()
    assert recording.calls == [
        ("open",),  # first, before any event: the libraries' imports are not a round's
        ("start", "r", {"rounds": "2"}, False),
        ("round", "r", 1),
        ("round", "r", 2),
        ("end", "r", "cancelled"),
    ]
    warned = [r for r in caplog.records if "tracking failing" in r.getMessage()]
    assert len(warned) == 2 and "unreachable" in warned[0].getMessage()
    assert warned[0].exc_info and not warned[1].exc_info  # one traceback
    assert failing.closed and recording.closed


def test_round_scalars_keep_names_mlflow_accepts() -> None:
    event = RoundEnded(
        "r", 4, 1, "committed", 2.0, 3, metrics={"acc@top1": 0.5, "updates": 99.0},
        stages={"upload_s": 0.2},
    )  # fmt: skip
    scalars = round_scalars(event)
    assert scalars["acc_top1"] == 0.5 and scalars["stage/upload_s"] == 0.2
    assert scalars["updates"] == 3.0  # the round's own figure wins
    assert FAILED_ATTEMPTS not in scalars
    assert round_scalars(retried("r", 4, attempt=3)) == {FAILED_ATTEMPTS: 3.0}


@pytest.mark.parametrize(
    ("name", "key"),
    [("loss", "loss"), ("stage/compute_s", "stage/compute_s"), ("a//b", "_a__b"),
     ("../x", "_.._x"), ("/x", "__x"), ("", "_"), (".", "_."), ("é:ß", "é_ß"),
     ("k" * 300, "k" * 250)],
)  # fmt: skip
def test_safe_key(name: str, key: str) -> None:
    assert safe_key(name) == key


def test_flatten_params() -> None:
    spec = {"a": {"b": {"c": 1}, "d": [1, 2]}, "e": True, "f": "text", "g": {}}
    assert flatten_params(spec) == {
        "a.b.c": "1", "a.d": "[1, 2]", "e": "true", "f": "text", "g": "{}",
    }  # fmt: skip


# -- a real daemon ---------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_daemon_with_track_writes_each_round_of_a_real_run(tmp_path: Path) -> None:
    """``fedra coordinator --track tensorboard --track mlflow``: what run status says of
    each committed round is what TensorBoard and MLflow read back, in the defaults'
    places in the state directory."""
    with LocalCluster(tmp_path / "cluster", secure=False) as cluster:
        cluster.start_coordinator(flags=[*FAST, "--track", "tensorboard", "--track", "mlflow"])
        start_synthetic_sites(cluster, n=2)
        with cluster.admin() as admin:
            run_id = admin.submit(synthetic_spec(rounds=2, sites_per_round=2, min_sites=2))
            status = wait_until(admin, run_id, finished)
        assert status.state == "completed", status.reason
        cluster.stop()  # closes the trackers: everything queued is written
        state = cluster.state_dir
    rounds = {r.number: r for r in status.rounds if r.status == "committed"}
    assert len(rounds) == 3  # the initial model's round and two trained
    scalars = tensorboard_scalars(state / "tensorboard" / run_id)
    assert sorted(scalars["duration_s"]) == sorted(rounds)
    for number, r in rounds.items():
        assert scalars["bytes_up"][number] == [pytest.approx(r.bytes_up)]
        for name, value in r.metrics.items():
            assert scalars[safe_key(name)][number] == [pytest.approx(value, rel=1e-6)], name
    assert "eval_loss" in rounds[2].metrics and "train_loss" in rounds[2].metrics
    client = MlflowClient(f"sqlite:///{state / 'mlruns' / 'mlflow.db'}")
    run = mlflow_run(client, run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["rounds"] == "2"
    assert_close_scalars(mlflow_scalars(client, run.info.run_id), scalars)


@pytest.mark.multiprocess
def test_a_bad_track_value_stops_the_daemon_at_start(tmp_path: Path) -> None:
    with (
        LocalCluster(tmp_path / "cluster", secure=False) as cluster,
        pytest.raises(ClusterError, match=r"--track 'wandb': unknown backend"),
    ):
        cluster.start_coordinator(flags=["--track", "wandb"], timeout_s=30)
