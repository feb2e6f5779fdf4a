"""FedAdagrad and FedAdam's optional bias correction against plain torch over several
rounds, their state through a checkpoint, the streamed commit path, and their run.toml keys."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from torch.testing import assert_close

from fedra.config import ConfigError
from fedra.coordinator.aggregation import STEP_KEY, ServerOptimizer
from fedra.coordinator.engine.rounds import stepped_model
from fedra.protos.codec import decode, encode, encode_chunks, spec_of
from fedra.protos.serde import runspec_from_proto, runspec_to_proto
from fedra.protos.v1 import admin_pb2
from fedra.runspec import RunSpec, runspec_from_toml
from tests.conftest import InProcessCoordinator

ROUNDS = 6
SHAPES = {"w": (4, 3), "b": (5,)}


def _spec(strategy: str, **params: float) -> RunSpec:
    return RunSpec(task="m:t", rounds=3, strategy=strategy, strategy_params=params).validate()


def _start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


def _deltas(rounds: int = ROUNDS) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(8)
    # Of varied sizes round to round, so v's accumulation (or decay) matters.
    return [
        {k: torch.randn(s, generator=g, dtype=torch.float64) * (0.2 + r) for k, s in SHAPES.items()}
        for r in range(rounds)
    ]


def _run(spec: RunSpec) -> dict[str, torch.Tensor]:
    opt, model = ServerOptimizer(spec), _start()
    for d in _deltas():
        opt.step(model, d)
    return model


def _reference(step: str, lr: float, b1: float, b2: float, tau: float) -> dict[str, torch.Tensor]:
    """Reddi et al. 2021, Algorithm 2, in plain torch: ``step`` adagrad, adam or adam_bc
    (Adam's bias correction of the step size, as Flower's FedAdam: tau outside)."""
    x = _start()
    m = {k: torch.zeros_like(v) for k, v in x.items()}
    v = {k: torch.zeros_like(t) for k, t in x.items()}
    for t, delta in enumerate(_deltas(), start=1):
        for k, d in delta.items():
            m[k] = b1 * m[k] + (1 - b1) * d
            v[k] = v[k] + d * d if step == "adagrad" else b2 * v[k] + (1 - b2) * d * d
            eta = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if step == "adam_bc" else lr
            x[k] = x[k] + eta * m[k] / (torch.sqrt(v[k]) + tau)
    return x


def test_fedadagrad_is_reddi_et_al_algorithm_2() -> None:
    lr, b1, tau = 0.1, 0.8, 0.01
    got = _run(_spec("fedadagrad", server_lr=lr, beta1=b1, tau=tau))
    assert_close(got, _reference("adagrad", lr, b1, 0.0, tau), rtol=0, atol=1e-7)
    # Not FedAdam's: v accumulates rather than decays.
    adam = _run(_spec("fedadam", server_lr=lr, beta1=b1, tau=tau))
    assert not torch.allclose(got["w"], adam["w"], rtol=0, atol=1e-3)


def test_fedadagrad_without_momentum_is_torch_adagrad_on_the_pseudo_gradient() -> None:
    """beta1 = 0: x <- x + lr d / (sqrt(sum d^2) + tau), torch.optim.Adagrad with eps = tau."""
    lr, tau = 0.3, 0.05
    got = _run(_spec("fedadagrad", server_lr=lr, beta1=0.0, tau=tau))
    params = {k: torch.nn.Parameter(v) for k, v in _start().items()}
    adagrad = torch.optim.Adagrad(list(params.values()), lr=lr, eps=tau)
    for d in _deltas():
        for k, p in params.items():
            p.grad = -d[k]
        adagrad.step()
    assert_close(got, {k: p.detach() for k, p in params.items()}, rtol=0, atol=1e-7)


def test_fedadam_bias_correction_scales_the_step_as_flower_does() -> None:
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    corrected = _run(_spec("fedadam", server_lr=lr, beta1=b1, beta2=b2, tau=tau,
                           bias_correction=1.0))  # fmt: skip
    assert_close(corrected, _reference("adam_bc", lr, b1, b2, tau), rtol=0, atol=1e-7)
    plain = _run(_spec("fedadam", server_lr=lr, beta1=b1, beta2=b2, tau=tau))
    assert_close(plain, _reference("adam", lr, b1, b2, tau), rtol=0, atol=1e-7)
    assert not torch.allclose(corrected["w"], plain["w"], rtol=0, atol=1e-3)


def test_fedadam_bias_correction_with_tiny_tau_is_torch_adam() -> None:
    """torch.optim.Adam adds eps to the corrected sqrt(v): the same step when tau -> 0."""
    lr, b1, b2 = 0.05, 0.8, 0.95
    got = _run(_spec("fedadam", server_lr=lr, beta1=b1, beta2=b2, tau=1e-12, bias_correction=1.0))
    params = {k: torch.nn.Parameter(v) for k, v in _start().items()}
    adam = torch.optim.Adam(list(params.values()), lr=lr, betas=(b1, b2), eps=1e-12)
    for d in _deltas():
        for k, p in params.items():
            p.grad = -d[k]
        adam.step()
    assert_close(got, {k: p.detach() for k, p in params.items()}, rtol=0, atol=1e-7)


def test_the_first_bias_corrected_step_is_about_lr_times_the_sign() -> None:
    opt = ServerOptimizer(_spec("fedadam", server_lr=0.1, tau=1e-6, bias_correction=1.0))
    model = {"w": torch.zeros(3, dtype=torch.float64)}
    opt.step(model, {"w": torch.tensor([2.0, -0.5, 0.01], dtype=torch.float64)})
    assert_close(model["w"], torch.tensor([0.1, -0.1, 0.1], dtype=torch.float64), atol=1e-4, rtol=0)
    assert int(opt.state_dict()[STEP_KEY]) == 1


@pytest.mark.parametrize(
    "params",
    [
        ("fedadagrad", {"server_lr": 0.1, "beta1": 0.5, "tau": 0.01}),
        ("fedadam", {"server_lr": 0.1, "beta1": 0.8, "tau": 0.01, "bias_correction": 1.0}),
    ],
    ids=["fedadagrad", "fedadam-bias-corrected"],
)
def test_state_through_a_checkpoint_resumes_exactly(params: tuple[str, dict[str, float]]) -> None:
    spec = _spec(params[0], **params[1])
    deltas = _deltas()
    uninterrupted, model = ServerOptimizer(spec), _start()
    for d in deltas:
        uninterrupted.step(model, d)
    first, resumed_model = ServerOptimizer(spec), _start()
    for d in deltas[:3]:
        first.step(resumed_model, d)
    saved_state, saved_model = encode(first.state_dict()), encode(resumed_model)
    del first
    resumed = ServerOptimizer(spec)
    resumed.load_state_dict(decode(saved_state))
    resumed_model = decode(saved_model)
    for d in deltas[3:]:
        resumed.step(resumed_model, d)
    assert_close(resumed_model, model, rtol=0, atol=0)
    assert_close(resumed.state_dict(), uninterrupted.state_dict(), rtol=0, atol=0)
    counted = STEP_KEY in uninterrupted.state_dict()
    assert counted == (params[0] == "fedadam")  # only bias correction counts the steps
    if counted:
        assert int(uninterrupted.state_dict()[STEP_KEY]) == ROUNDS


def test_a_lost_step_count_would_change_the_result() -> None:
    """The count is what carries the correction across a restart (the check above can fail)."""
    spec = _spec("fedadam", server_lr=0.1, bias_correction=1.0)
    deltas = _deltas()
    a, model_a = ServerOptimizer(spec), _start()
    for d in deltas:
        a.step(model_a, d)
    b, model_b = ServerOptimizer(spec), _start()
    for d in deltas[:3]:
        b.step(model_b, d)
    state = {k: v for k, v in b.state_dict().items() if k != STEP_KEY}
    b = ServerOptimizer(spec)
    b.load_state_dict(state)
    for d in deltas[3:]:
        b.step(model_b, d)
    assert not torch.allclose(model_a["w"], model_b["w"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["fedadagrad", "fedadam"])
def test_a_streamed_commit_is_the_whole_tensor_step(strategy: str) -> None:
    """rounds.stepped_model counts the outer step once, however many pieces come."""
    extra = {"bias_correction": 1.0} if strategy == "fedadam" else {}
    spec = _spec(strategy, server_lr=0.2, **extra)
    whole, streamed = ServerOptimizer(spec), ServerOptimizer(spec)
    reference = {k: v.float() for k, v in _start().items()}
    current = {k: v.clone() for k, v in reference.items()}
    for d in _deltas(3):
        mean = {k: v.float() for k, v in d.items()}
        whole.step(reference, {k: v.clone() for k, v in mean.items()})
        current = stepped_model(encode_chunks(current, 7), spec_of(current), streamed, mean)
        for name, value in reference.items():
            assert torch.equal(current[name], value), name
    assert_close(streamed.state_dict(), whole.state_dict(), rtol=0, atol=0)


def test_step_piece_without_begin_step_is_refused_when_steps_count() -> None:
    opt = ServerOptimizer(_spec("fedadam", bias_correction=1.0))
    with pytest.raises(RuntimeError, match="begin_step"):
        opt.step_piece("w", (2,), 0, torch.zeros(2), torch.ones(2))


# -- run.toml and the wire ----------------------------------------------------------------


def _doc(strategy: dict[str, object]) -> dict[str, object]:
    return {"task": "m:t", "rounds": 3, "strategy": strategy}


def test_toml_keys() -> None:
    spec = runspec_from_toml(_doc({"name": "fedadam", "bias_correction": True}))
    assert spec.strategy_param("bias_correction") == 1.0
    assert runspec_from_toml(_doc({"name": "fedadam"})).strategy_param("bias_correction") == 0.0
    spec = runspec_from_toml(_doc({"name": "fedadagrad", "server_lr": 0.05, "beta1": 0.0}))
    assert (spec.strategy_param("server_lr"), spec.strategy_param("tau")) == (0.05, 1e-3)
    # Through the proto as submitted, unchanged.
    wired = runspec_from_proto(runspec_to_proto(spec)).validate()
    assert wired.strategy_params == spec.strategy_params


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ({"name": "fedadam", "bias_correction": 1}, r"^strategy\.bias_correction: expected bool"),
        ({"name": "fedadam", "bias_correction": "yes"}, r"^strategy\.bias_correction: expected"),
        ({"name": "fedyogi", "bias_correction": True}, r"^strategy\.bias_correction: unknown key"),
        ({"name": "fedadagrad", "beta2": 0.9}, r"^strategy\.beta2: unknown key"),
        ({"name": "fedadagrad", "beta1": 1.0}, r"^strategy\.beta1: must be"),
        ({"name": "fedadagrad", "tau": 0.0}, r"^strategy\.tau: must be"),
    ],
)
def test_bad_toml_names_the_key(strategy: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        runspec_from_toml(_doc(strategy))


def test_a_submitted_bias_correction_must_be_zero_or_one() -> None:
    with pytest.raises(ConfigError, match=r"^strategy\.bias_correction: must be true or false"):
        _spec("fedadam", bias_correction=0.5)


def test_submit_refuses_a_bias_correction_of_one_half_with_invalid_argument(
    coordinator: InProcessCoordinator,
) -> None:
    message = runspec_to_proto(_spec("fedadam"))
    message.strategy_params["bias_correction"] = 0.5
    with pytest.raises(grpc.RpcError) as info:
        coordinator.admin.SubmitRun(admin_pb2.SubmitRunRequest(spec=message), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("strategy.bias_correction: must be true or false")
