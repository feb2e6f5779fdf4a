"""SCAFFOLD (``[train] scaffold``, Karimireddy et al. 2020, option II): fedra's site hook
and coordinator update against SCAFFOLD written out in plain torch over several rounds,
the run.toml keys and refusals, the wire, and a run across real processes with a site
SIGKILLed between its update's accept and its own bookkeeping, and restarted."""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedra.client.agent import delta
from fedra.client.config import ParallelConfig
from fedra.client.executor import LocalExecutor, WorldExecutor
from fedra.client.inner import InnerOptimizerError
from fedra.client.parallel.plan import World
from fedra.client.scaffold import CONTROL_PREFIX, ControlStates, ScaffoldRound, load_file
from fedra.client.task import FitResult, FitSettings
from fedra.config import ConfigError
from fedra.coordinator import scaffold
from fedra.coordinator.aggregation import ServerOptimizer
from fedra.coordinator.aggregators import Attempt, ScaffoldMean, make_aggregator
from fedra.coordinator.engine import EngineSettings
from fedra.coordinator.errors import InvalidArgument
from fedra.examples import charlm
from fedra.local import LocalCluster
from fedra.protos.codec import StreamDecoder, decode, decode_chunks, encode, encode_chunks, spec_of
from fedra.protos.compression import Compressor, Piece, StreamingDecompressor, compressed_specs
from fedra.protos.serde import train_from_proto, train_to_proto
from fedra.protos.v1 import common_pb2, site_pb2
from fedra.runspec import CodecSpec, RunSpec, TrainSpec, runspec_from_toml
from fedra.storage import BlobStore, Store
from tests.conftest import InProcessCoordinator
from tests.test_site_service import (
    messages,
    model_state,
    refused,
    start_round_one,
    submit,
    tasks_of_round,
    upload,
    wait_round,
)

STEPS, BATCH, LR = 5, 8, 0.1
SAMPLES = (64, 40, 24)  # unequal: the model mean is weighted, the control mean is not
XY = tuple[torch.Tensor, torch.Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _data(site: int) -> XY:
    g = torch.Generator().manual_seed(10 + site)
    x = torch.randn(SAMPLES[site], 4, generator=g)
    # Each site's targets differ (heterogeneous data): the drift SCAFFOLD corrects.
    return x, (site - 1.0) * x[:, :2] + torch.randn(SAMPLES[site], 2, generator=g)


def _rows(step: int, n: int) -> slice:
    start = (step * BATCH) % n
    return slice(start, start + BATCH)


def _loss(model: nn.Module, data: XY, step: int) -> torch.Tensor:
    x, y = data
    rows = _rows(step, len(y))
    return nn.functional.mse_loss(model(x[rows]), y[rows])


class _SgdTask:
    """A task whose own ``fit`` steps torch.optim.SGD, as a task would."""

    def __init__(self, optimizer: str = "sgd") -> None:
        self.optimizer = optimizer

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        return _model()

    def load_data(self, config: Mapping[str, Any]) -> XY:
        raise NotImplementedError

    def fit(self, model: nn.Module, data: XY, settings: FitSettings) -> FitResult:
        params = list(model.parameters())
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=settings.learning_rate)
        if self.optimizer == "momentum":
            opt = torch.optim.SGD(params, lr=settings.learning_rate, momentum=0.9)
        elif self.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=settings.learning_rate)
        for step in range(settings.local_steps):
            opt.zero_grad()
            _loss(model, data, step).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return FitResult(num_samples=len(data[1]))

    def evaluate(self, model: nn.Module, data: XY) -> dict[str, float]:
        return {}


def _reference(rounds: int, population: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """SCAFFOLD, Algorithm 1 option II, by hand: SGD with the correction, c_i and c."""
    model = _model()
    x = [p.detach().clone() for p in model.parameters()]
    c = [torch.zeros_like(p) for p in x]
    c_i = [[torch.zeros_like(p) for p in x] for _ in SAMPLES]
    for _ in range(rounds):
        deltas_y, deltas_c = [], []
        for site in range(len(SAMPLES)):
            with torch.no_grad():
                for p, xp in zip(model.parameters(), x, strict=True):
                    p.copy_(xp)
            for step in range(STEPS):
                model.zero_grad()
                _loss(model, _data(site), step).backward()  # type: ignore[no-untyped-call]
                with torch.no_grad():
                    for p, cp, cip in zip(model.parameters(), c, c_i[site], strict=True):
                        p.sub_(LR * (p.grad + cp - cip))
            y = [p.detach().clone() for p in model.parameters()]
            new_c_i = [
                cip - cp + (xp - yp) / (STEPS * LR)
                for cip, cp, xp, yp in zip(c_i[site], c, x, y, strict=True)
            ]
            deltas_y.append([yp - xp for yp, xp in zip(y, x, strict=True)])
            deltas_c.append([n - o for n, o in zip(new_c_i, c_i[site], strict=True)])
            c_i[site] = new_c_i
        total = float(sum(SAMPLES))
        for j in range(len(x)):  # FedAvg (server_lr 1) and c += |S|/N mean(delta c_i)
            x[j] = x[j] + sum(n * d[j] for n, d in zip(SAMPLES, deltas_y, strict=True)) / total
            mean_c = sum(d[j] for d in deltas_c) / len(SAMPLES)
            c[j] = c[j] + len(SAMPLES) / population * mean_c
    names = [n for n, _ in _model().named_parameters()]
    return dict(zip(names, x, strict=True)), [dict(zip(names, ci, strict=True)) for ci in c_i]


class _Spooled:
    """An update as the coordinator reads it back: compressed, encoded, decoded against
    the run's update layout (the upload checks' layout), decompressed."""

    def __init__(self, update: Mapping[str, torch.Tensor], specs: Any, codec: CodecSpec) -> None:
        self.wire = encode_chunks(Compressor(codec).compress(update))
        self.specs, self.codec = specs, codec

    def dense(self) -> Iterator[Piece]:
        decoder = StreamDecoder(compressed_specs(self.specs, self.codec))
        dense = StreamingDecompressor(self.specs, self.codec)
        for chunk in self.wire:
            yield from dense.feed(decoder.feed(memoryview(chunk)))
        decoder.finish()
        dense.finish()

    def masked(self) -> Iterator[tuple[int, torch.Tensor]]:
        raise NotImplementedError


@pytest.mark.parametrize("population", [3, 5])
def test_fedra_s_hook_and_update_equal_scaffold_by_hand(tmp_path: Path, population: int) -> None:
    """Three sites, four rounds: the global model and every site's c_i to 1e-6."""
    rounds = 4
    spec = RunSpec(task="m:t", rounds=rounds, sites_per_round=3,
                   train=TrainSpec(local_steps=STEPS, batch_size=BATCH, learning_rate=LR,
                                   scaffold=True, scaffold_population=population),
                   ).validate()  # fmt: skip
    optimizer = ServerOptimizer(spec)
    aggregator = make_aggregator(spec)
    assert isinstance(aggregator, ScaffoldMean)
    stores = [ControlStates(tmp_path / f"site-{i}") for i in range(len(SAMPLES))]
    executor = LocalExecutor(torch.device("cpu"))
    settings = FitSettings(STEPS, 0, BATCH, LR, seed=0)
    model = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    for number in range(1, rounds + 1):
        specs = spec_of(model)
        # c as the sites receive it: the published blob, decoded
        published = scaffold.controls_of(optimizer.state)
        c = decode_chunks(encode_chunks(published)) if published else {}
        aggregator.begin(Attempt("r", number, 1, ("0", "1", "2"), specs, tmp_path / "spill"))
        for site, store in enumerate(stores):
            kept = store.load("r", number)
            round_ = ScaffoldRound(c, kept.tensors if kept else {}, LR, number)
            net = _model()
            net.load_state_dict(model)
            trained, samples, metrics = executor.train(
                _SgdTask(), "m:t", number, net, _data(site), settings, None, round_
            )
            assert metrics["scaffold_steps"] == STEPS
            update = delta(trained, model)
            update.update(round_.finish(update))
            assert round_.result is not None
            store.save("r", round_.result)
            spooled = _Spooled(update, aggregator.update_specs(specs), spec.codec)
            aggregator.fold(str(site), spooled, samples, 0)
        mean, count = aggregator.finish()
        mean, mean_delta_c = scaffold.split(mean)
        assert sorted(mean_delta_c) == sorted(k for k in model)  # every float tensor
        scaffold.absorb(optimizer.state, mean_delta_c, count, spec.scaffold_population())
        optimizer.step(model, mean)
    want_x, want_c_i = _reference(rounds, population)
    for name, x in want_x.items():
        assert_close(model[name], x, atol=1e-6, rtol=1e-6)
    for store, want in zip(stores, want_c_i, strict=True):
        kept = store.load("r", rounds + 1)
        assert kept is not None and kept.after_round == rounds
        for name, c_i in want.items():
            assert_close(kept.tensors[name], c_i, atol=1e-6, rtol=1e-6)
    assert any(float(v.abs().max()) > 1e-3 for v in scaffold.controls_of(optimizer.state).values())


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk"])
def test_delta_c_travels_compressed_by_every_codec(tmp_path: Path, codec: str) -> None:
    """The controls are part of the compressed payload's layout and come out of the
    aggregate as the codec gave them (top-k: the largest entries only)."""
    codec_spec = CodecSpec(codec, fraction=1.0) if codec == "topk" else CodecSpec(codec)
    spec = RunSpec(task="m:t", rounds=1, codec=codec_spec, train=TrainSpec(scaffold=True))
    aggregator = make_aggregator(spec.validate())
    model = _model().state_dict()
    specs = spec_of(model)
    aggregator.begin(Attempt("r", 1, 1, ("a",), specs, tmp_path))
    update = {k: torch.full_like(v, 0.5) for k, v in model.items()}
    update.update({CONTROL_PREFIX + k: torch.full_like(v, -2.0) for k, v in model.items()})
    layout = aggregator.update_specs(specs)
    assert sorted(compressed_specs(layout, codec_spec)) != sorted(
        compressed_specs(specs, codec_spec)
    )
    aggregator.fold("a", _Spooled(update, layout, codec_spec), 7, 0)
    mean, _ = aggregator.finish()
    model_mean, controls = scaffold.split(mean)
    for k, v in model.items():
        assert_close(model_mean[k], torch.full_like(v, 0.5), atol=1e-2, rtol=1e-2)
        assert_close(controls[k], torch.full_like(v, -2.0), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_an_inner_optimiser_other_than_plain_sgd_is_refused(kind: str) -> None:
    round_ = ScaffoldRound({}, {}, LR, 1)
    with pytest.raises(InnerOptimizerError, match=r"^train\.scaffold: option II"):
        LocalExecutor(torch.device("cpu")).train(
            _SgdTask(kind), "m:t", 1, _model(), _data(0), FitSettings(2, 0, BATCH, LR, 0),
            None, round_,
        )  # fmt: skip


def test_another_learning_rate_is_refused() -> None:
    round_ = ScaffoldRound({}, {}, LR * 2, 1)  # the run says 2 LR; the task steps at LR
    with pytest.raises(InnerOptimizerError, match=r"^train\.scaffold: .* steps at lr 0\.1"):
        LocalExecutor(torch.device("cpu")).train(
            _SgdTask(), "m:t", 1, _model(), _data(0), FitSettings(2, 0, BATCH, LR, 0),
            None, round_,
        )  # fmt: skip


def test_a_control_variate_that_does_not_fit_the_model_is_refused() -> None:
    model = _model().state_dict()
    ScaffoldRound({"0.weight": torch.zeros(3, 4)}, {}, LR, 1).check(model)
    with pytest.raises(ValueError, match=r"^train\.scaffold: .*'0\.weight'"):
        ScaffoldRound({"0.weight": torch.zeros(4, 3)}, {}, LR, 1).check(model)
    with pytest.raises(ValueError, match=r"^train\.scaffold: .*'evil'"):
        ScaffoldRound({"evil": torch.zeros(1)}, {}, LR, 1).check(model)


def test_the_update_layout_names_exactly_the_model_and_its_controls() -> None:
    """The upload check's layout: a tensor under the prefix that is not a model's
    floating tensor has no place in it, and a model may not use the prefix."""
    specs = spec_of({"w": torch.zeros(2, 3), "n": torch.zeros(1, dtype=torch.int64)})
    layout = scaffold.update_specs(specs)
    assert sorted(layout) == ["n", CONTROL_PREFIX + "w", "w"]
    assert layout[CONTROL_PREFIX + "w"] == specs["w"]
    with pytest.raises(InvalidArgument, match=r"^train\.scaffold: .*prefix"):
        scaffold.update_specs(spec_of({CONTROL_PREFIX + "x": torch.zeros(1)}))


def _toml(**train: Any) -> dict[str, Any]:
    return {"task": "m:t", "rounds": 2, "train": {"local_steps": 3, "scaffold": True, **train}}


def test_run_toml_keys_and_the_wire() -> None:
    spec = runspec_from_toml(_toml(scaffold_population=10))
    assert spec.train.scaffold and spec.scaffold_population() == 10
    assert train_from_proto(train_to_proto(spec.train)) == spec.train
    assert runspec_from_toml(_toml()).scaffold_population() == 2  # sites_per_round
    assert not runspec_from_toml({"task": "m:t", "rounds": 2}).train.scaffold
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match=r"^train\.scaffold: expected bool"):
        runspec_from_toml(_toml(scaffold="yes"))
    with pytest.raises(ConfigError, match=r"^train\.scaffold_population: must be at least"):
        runspec_from_toml(_toml(scaffold_population=1))
    with pytest.raises(ConfigError, match=r"^train\.scaffold_population: only a SCAFFOLD"):
        runspec_from_toml(_toml(scaffold=False, scaffold_population=4))
    with pytest.raises(ConfigError, match=r"^train\.scaffold_popultion|unknown key"):
        runspec_from_toml(_toml(scaffold_popultion=4))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"secagg": {}}, r"^train\.scaffold: cannot be combined with \[secagg\]"),
        ({"privacy": {"epsilon": 50.0, "noise_multiplier": 5.0}},
         r"^train\.scaffold: cannot be combined with \[privacy\]"),
        ({"async": {"buffer": 2}}, r"^train\.scaffold: cannot be combined with \[async\]"),
        ({"aggregation": {"rule": "median"}}, r"^train\.scaffold: .*aggregation\.rule 'median'"),
        ({"aggregation": {"norm_bound": 1.0}}, r"^train\.scaffold: .*aggregation\.norm_bound"),
        ({"promotion": {}}, r"^train\.scaffold: .*promotion\.on_patience 'rollback'"),
        ({"train": {"local_steps": 3, "scaffold": True, "proximal_mu": 0.1}},
         r"^train\.proximal_mu: cannot be combined with train\.scaffold"),
        ({"train": {"local_steps": 3, "scaffold": True, "keep_optimizer_state": True}},
         r"^train\.keep_optimizer_state: cannot be combined with train\.scaffold"),
    ],
)  # fmt: skip
def test_combinations_refused_at_submit(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        runspec_from_toml({**_toml(), **extra})


def test_promotion_that_stops_instead_of_rolling_back_is_allowed() -> None:
    spec = runspec_from_toml({**_toml(), "promotion": {"on_patience": "stop"}})
    assert spec.train.scaffold and spec.promotion is not None


def _scaffold_settings() -> common_pb2.TrainSettings:
    return common_pb2.TrainSettings(local_steps=1, batch_size=8, learning_rate=0.1, scaffold=True)


def test_submit_refuses_a_bad_combination_with_invalid_argument(
    coordinator: InProcessCoordinator,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        submit(coordinator, train=_scaffold_settings(),
               aggregation=common_pb2.Aggregation(rule="median"))  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "train.scaffold" in (info.value.details() or "")


SETTINGS = EngineSettings(
    heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0, inline_model_bytes=0
)


def _download_c(c: InProcessCoordinator, site: str, task: site_pb2.Task) -> dict[str, torch.Tensor]:
    request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id, controls=True)
    payload = b"".join(m.data for m in c.site.DownloadModel(request))
    assert hashlib.sha256(payload).hexdigest() == task.controls_sha256
    return decode(payload)


def test_the_edge_takes_exactly_the_model_and_its_controls_and_publishes_c(
    tmp_path: Path,
) -> None:
    """A SCAFFOLD round over the real gRPC edge: an update without its delta c_i, or with
    a tensor smuggled under the prefix, is refused; c = mean delta c_i (N = |S| = 2) is
    what round 2's sites download, before and after a coordinator restart; before round 1
    commits there is nothing to download."""
    coordinator = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:
        run_id, tasks = start_round_one(coordinator, train=_scaffold_settings())
        (site, task), (other_site, other_task) = sorted(tasks.items())
        assert task.settings.scaffold and not task.controls_sha256
        request = site_pb2.DownloadModelRequest(site_id=site, task_id=task.task_id, controls=True)
        with pytest.raises(grpc.RpcError) as info:
            b"".join(m.data for m in coordinator.site.DownloadModel(request))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        state = model_state()
        model = {k: torch.full_like(v, 0.01) for k, v in state.items()}

        def controls(value: float) -> dict[str, torch.Tensor]:
            return {CONTROL_PREFIX + k: torch.full_like(v, value) for k, v in state.items()}

        bad = grpc.StatusCode.INVALID_ARGUMENT
        refused(coordinator, messages(task, site, encode(model)), bad, CONTROL_PREFIX)
        sneaky = {**model, **controls(1.0), CONTROL_PREFIX + "sneaky": torch.zeros(1)}
        refused(coordinator, messages(task, site, encode(sneaky)), bad, "sneaky")
        mine, theirs = {**model, **controls(1.0)}, {**model, **controls(3.0)}
        upload(coordinator, messages(task, site, encode(mine), num_samples=10))
        upload(coordinator, messages(other_task, other_site, encode(theirs), num_samples=30))
        wait_round(coordinator, run_id, 1, "committed")
        tasks = tasks_of_round(coordinator, run_id, 2)
        published = {t.controls_sha256 for t in tasks.values()}
        assert len(published) == 1 and all(t.controls_bytes > 0 for t in tasks.values())
        for site, task in tasks.items():
            c = _download_c(coordinator, site, task)
            assert sorted(c) == sorted(state)
            for k, v in state.items():  # unweighted: (1 + 3) / 2, whatever the sample counts
                assert_close(c[k], torch.full_like(v, 2.0))
    finally:
        coordinator.close()
    again = InProcessCoordinator(tmp_path / "state", SETTINGS)
    try:  # c comes back from the checkpoint, published under the same digest
        tasks = tasks_of_round(again, run_id, 2)
        assert {t.controls_sha256 for t in tasks.values()} == published
        for site, task in tasks.items():
            assert_close(_download_c(again, site, task)[sorted(state)[0]],
                         torch.full_like(state[sorted(state)[0]], 2.0))  # fmt: skip
    finally:
        again.close()


def _controls_file(cluster: LocalCluster, site_id: str, run_id: str) -> Path:
    return cluster.state_dir / "sites" / site_id / f"scaffold-{run_id}.safetensors"


DIGITS = "fedra.examples.digits:task"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_scaffold_run_across_processes_through_a_site_sigkill(cluster: LocalCluster) -> None:
    """Two real sites on digits (plain SGD): the run completes, c is in each checkpoint's
    server state and moves, each site's c_i file moves round by round, and a site killed
    the instant its round-2 update was accepted (before it kept anything of it) carries on
    from the c_i that round left: every counted round starts from the one before."""
    cluster.start_coordinator(
        flags=["--heartbeat-s", "0.5", "--site-timeout-s", "3", "--poll-timeout-s", "5"]
    )
    ids = ["site-0", "site-1"]
    data = [{"partition": i, "num_partitions": 2} for i in range(2)]
    for site_id, d in zip(ids, data, strict=True):
        fault = {"FEDRA_FAULT_CRASH": "after_upload:2"} if site_id == "site-0" else None
        cluster.start_site(site_id, [DIGITS], d, extra_env=fault)
    cluster.wait_for_sites(ids)
    steps = 4
    train = TrainSpec(local_steps=steps, batch_size=16, learning_rate=0.05,
                      params={"momentum": "0"}, scaffold=True)  # fmt: skip
    spec = RunSpec(task=DIGITS, rounds=4, sites_per_round=2, seed=5, round_deadline_s=60.0,
                   join_timeout_s=60.0, train=train, codec=CodecSpec("fp16"),
                   ).validate()  # fmt: skip
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        assert cluster.sites["site-0"].popen.wait(120) == -signal.SIGKILL
        cluster.start_site("site-0", [DIGITS], data[0])
        status = next(s for s in admin.watch(run_id, timeout_s=240)
                      if s.state in ("completed", "failed", "cancelled"))  # fmt: skip
    assert status.state == "completed", status.reason
    for r in (r for r in status.rounds if r.number > 0):
        accepted = [
            p for p in r.participations if p.status == "accepted" and p.attempt == r.attempt
        ]
        assert sorted(p.site_id for p in accepted) == ids
        for p in accepted:  # every round counted at both: each starts from the one before
            assert p.metrics["scaffold_steps"] == steps
            assert p.metrics["scaffold_from_round"] == r.number - 1, (p.site_id, r.number)
    for site_id in ids:
        # Promoted once the site hears its update was accepted: a moment after the commit,
        # and its pending copy dropped a moment after that.
        path = _controls_file(cluster, site_id, run_id)
        pending = path.parent / f"pending-{run_id}.safetensors"
        deadline = time.monotonic() + 30
        while (
            (kept := load_file(path)).after_round < 4 or pending.exists()
        ) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the site's files, with a deadline
        assert kept.after_round == 4, (site_id, kept.after_round)
        prev = load_file(path.with_name(f"scaffold-{run_id}.prev.safetensors"))
        assert prev.after_round == 3
        assert not torch.equal(_first(kept), _first(prev))  # c_i moved in its last round
        assert not path.with_name(f"scaffold-{run_id}.staged.safetensors").exists()
        assert not pending.exists()
    cs = [_server_c(cluster, run_id, n) for n in (1, 4)]
    assert cs[0] and sorted(cs[0]) == sorted(cs[1])
    assert any(not torch.equal(cs[0][k], cs[1][k]) for k in cs[0])


def _first(controls: Any) -> torch.Tensor:
    return controls.tensors[sorted(controls.tensors)[0]]


def _server_c(cluster: LocalCluster, run_id: str, number: int) -> dict[str, torch.Tensor]:
    """c as the checkpoint of round ``number`` holds it, in the server optimiser's state."""
    store = Store(f"sqlite:///{cluster.state_dir / 'fedra.db'}")
    try:
        ckpt = store.get_checkpoint(run_id, number)
    finally:
        store.close()
    assert ckpt is not None and ckpt.optimizer_sha256
    blobs = BlobStore(cluster.state_dir / "blobs")
    return scaffold.controls_of(decode_chunks(blobs.read_chunks(ckpt.optimizer_sha256, 1 << 20)))


def test_an_optimiser_a_local_world_refuses_fails_the_task_not_the_world() -> None:
    """Every rank refuses the same optimiser at its first step, outside any collective:
    rank 0 raises the refusal itself (the agent reports the task failed) and not
    ``WorldBroken``, which would restart the site's whole local world."""
    sent: list[dict[str, Any]] = []

    class _Ranks:  # the other ranks' channel: what they are told
        def send(self, message: dict[str, Any]) -> None:
            sent.append(message)

    world = World(0, 1, "gloo", torch.device("cpu"))
    executor = WorldExecutor(ParallelConfig(nproc=2, plan="none"), world, _Ranks())  # type: ignore[arg-type]
    params = {"d_model": "16", "n_layers": "1", "n_heads": "2", "d_ff": "32", "seq_len": "8"}
    settings = FitSettings(1, 0, 2, 0.1, seed=0, params=params)  # AdamW: not plain SGD
    model = charlm.task.create_model(0, params)
    data = charlm.task.load_data({"max_bytes": 20_000})
    with pytest.raises(InnerOptimizerError, match=r"^train\.scaffold: .* is AdamW"):
        executor.train(
            charlm.task, "m:t", 1, model, data, settings, None, ScaffoldRound({}, {}, 0.1, 1)
        )
    assert sent and sent[0]["scaffold_lr"] == 0.1  # the other ranks were told: they refuse too
