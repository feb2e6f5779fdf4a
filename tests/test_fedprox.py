"""FedProx (``[train] proximal_mu``): the site's hook on the task's inner optimiser against
a plain torch loop with the proximal term in the loss, on both training paths (a task's
own ``fit``, the site's trainer for a ``ParallelTask``), and a run across real processes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedra.client.executor import LocalExecutor
from fedra.client.inner import InnerHooks, InnerOptimizerError
from fedra.client.parallel.plan import SingleRunner, World
from fedra.client.parallel.trainer import train
from fedra.client.task import FitResult, FitSettings
from fedra.config import ConfigError
from fedra.examples import synthetic
from fedra.local import LocalCluster
from fedra.protos.serde import train_from_proto, train_to_proto
from fedra.runspec import RunSpec, TrainSpec, runspec_from_toml

STEPS, BATCH, LR = 12, 8, 0.1
XY = tuple[torch.Tensor, torch.Tensor]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _data() -> XY:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    return x, torch.randn(64, 2, generator=g, dtype=torch.float64) + x[:, :2]


def _rows(step: int) -> slice:
    start = (step * BATCH) % 64
    return slice(start, start + BATCH)


def _settings(mu: float) -> FitSettings:
    return FitSettings(STEPS, 0, BATCH, LR, seed=3, proximal_mu=mu)


def _optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":  # momentum: the term must enter the gradient, not the weights
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.Adam(params, lr=LR * 0.1)


def _reference(model: nn.Module, data: XY, mu: float, kind: str) -> dict[str, torch.Tensor]:
    """The FedProx objective written out: loss + (mu/2) ||w - w_global||^2, plain torch."""
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = _optimizer(kind, list(model.parameters()))
    x, y = data
    for step in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[_rows(step)]), y[_rows(step)])
        prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
        (loss + mu / 2 * prox).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _FitTask:
    """A task whose own ``fit`` builds and steps its optimiser (as most tasks do)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        return _model(seed)

    def load_data(self, config: Mapping[str, Any]) -> XY:
        return _data()

    def fit(self, model: nn.Module, data: XY, settings: FitSettings) -> FitResult:
        opt = _optimizer(self.kind, list(model.parameters()))
        x, y = data
        for step in range(settings.local_steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[_rows(step)]), y[_rows(step)]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return FitResult(num_samples=64)

    def evaluate(self, model: nn.Module, data: XY) -> dict[str, float]:
        return {}


class _ParallelTask(_FitTask):
    """The same, as a ParallelTask: the site's trainer owns the loop."""

    def batch(self, data: XY, settings: FitSettings, step: int) -> XY:
        return data[0][_rows(step)], data[1][_rows(step)]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def optimizer(self, params: list[nn.Parameter], settings: FitSettings) -> torch.optim.Optimizer:
        return _optimizer(self.kind, params)

    def num_steps(self, data: XY, settings: FitSettings) -> int:
        return settings.local_steps

    def num_samples(self, data: XY) -> int:
        return 64


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_a_task_s_own_fit_takes_the_proximal_term(kind: str, mu: float) -> None:
    expected = _reference(_model(), _data(), mu, kind)
    task = _FitTask(kind)
    state, _, metrics = LocalExecutor(torch.device("cpu")).train(
        task, "tests:fit", 1, _model(), _data(), _settings(mu)
    )
    assert_close(state, expected, rtol=0, atol=1e-6)
    if mu:
        assert metrics["proximal_steps"] == STEPS
        plain = _reference(_model(), _data(), 0.0, kind)  # the term changed the result
        assert not torch.allclose(state["2.weight"], plain["2.weight"], atol=1e-3)
    else:
        assert "proximal_steps" not in metrics


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_the_site_s_trainer_takes_the_proximal_term(kind: str) -> None:
    expected = _reference(_model(), _data(), 0.5, kind)
    model = _model()
    task, world = _ParallelTask(kind), World.current()
    stats = train(SingleRunner(model), task, _data(), _settings(0.5), world)
    assert_close(model.state_dict(), expected, rtol=0, atol=1e-6)
    assert stats.metrics()["proximal_steps"] == STEPS


def test_another_model_s_optimiser_is_left_alone() -> None:
    """The global hook acts on this model's parameters only (two sites in one process)."""
    ours, theirs = _model(0), _model(1)
    before = {k: v.clone() for k, v in theirs.state_dict().items()}
    hooks = InnerHooks(ours.parameters(), proximal_mu=100.0)
    for p in ours.parameters():  # ours moved away from its anchor
        p.data.add_(1.0)
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    with pytest.raises(InnerOptimizerError), hooks.around_fit("tests:other"):
        for p in theirs.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # zero gradients: nothing moves unless the hook touched them
    assert_close(theirs.state_dict(), before, rtol=0, atol=0)


def test_a_fit_that_steps_no_optimiser_is_refused_naming_the_key() -> None:
    """The synthetic task updates its weights by hand: the term cannot be applied."""
    data = synthetic.task.load_data({"samples": 32})
    model = synthetic.task.create_model(0, {})
    settings = FitSettings(2, 0, 8, 0.01, seed=1, proximal_mu=0.1)
    with pytest.raises(InnerOptimizerError, match=r"^train\.proximal_mu: task 'tests:synthetic'"):
        LocalExecutor(torch.device("cpu")).train(
            synthetic.task, "tests:synthetic", 1, model, data, settings
        )
    plain = FitSettings(2, 0, 8, 0.01, seed=1)  # without the term it trains as ever
    LocalExecutor(torch.device("cpu")).train(synthetic.task, "t:s", 1, model, data, plain)


def test_a_closure_step_is_refused() -> None:
    model = _model()
    hooks = InnerHooks(model.parameters(), proximal_mu=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks.attach(opt)

    def closure() -> float:
        return 0.0

    with pytest.raises(InnerOptimizerError, match="closure"):
        opt.step(closure)


def test_run_toml_key_and_the_wire() -> None:
    doc = {"task": "m:t", "rounds": 2, "train": {"local_steps": 3, "proximal_mu": 0.01}}
    spec = runspec_from_toml(doc)
    assert spec.train.proximal_mu == 0.01
    assert train_from_proto(train_to_proto(spec.train)) == spec.train
    assert runspec_from_toml({"task": "m:t", "rounds": 2}).train.proximal_mu == 0.0
    with pytest.raises(ConfigError, match=r"^train\.proximal_mu: must be"):
        runspec_from_toml({**doc, "train": {"proximal_mu": -1.0}})
    with pytest.raises(ConfigError, match=r"^train\.proximal_mu: expected float"):
        runspec_from_toml({**doc, "train": {"proximal_mu": "0.1"}})


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_fedprox_run_across_processes(cluster: LocalCluster) -> None:
    """Two real sites on the digits task: every inner step of every round took the term."""
    cluster.start_coordinator(flags=["--heartbeat-s", "0.5", "--poll-timeout-s", "5"])
    ids = ["site-0", "site-1"]
    for i, site_id in enumerate(ids):
        cluster.start_site(site_id, ["fedra.examples.digits:task"],
                           {"partition": i, "num_partitions": 2})  # fmt: skip
    cluster.wait_for_sites(ids)
    steps = 6
    spec = RunSpec(
        task="fedra.examples.digits:task", rounds=2, sites_per_round=2, seed=5,
        round_deadline_s=60.0, join_timeout_s=30.0,
        train=TrainSpec(local_steps=steps, batch_size=16, learning_rate=0.05, proximal_mu=0.1),
    ).validate()  # fmt: skip
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = next(s for s in admin.watch(run_id, timeout_s=180)
                      if s.state in ("completed", "failed", "cancelled"))  # fmt: skip
    assert status.state == "completed", status.reason
    trained = [r for r in status.rounds if r.number > 0]
    assert len(trained) == 2
    for r in trained:
        assert sorted(p.site_id for p in r.participations if p.status == "accepted") == ids
        for p in r.participations:
            assert p.metrics["proximal_steps"] == steps, (r.number, p.site_id, dict(p.metrics))
