"""Tests for streaming aggregation, the server optimisers and round metrics.

References are computed directly (float64 sums, plain-Python optimiser loops) and compared
with ``torch.testing.assert_close``; updates reach ``WeightedSum`` through the real codec.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch
from torch.testing import assert_close

from fedra.coordinator.aggregation import ServerOptimizer, WeightedSum, accumulation_dtype
from fedra.coordinator.engine.rounds import out_of_use, stepped_model, weighted_metrics
from fedra.metrics import format_metric, is_count_metric
from fedra.protos.codec import StreamDecoder, decode, encode, encode_chunks, spec_of
from fedra.runspec import STRATEGY_PARAMS, RunSpec
from fedra.storage.records import ParticipationRecord

CHUNK_SIZES = [1, 5, 4093]
WEIGHTS = [3.0, 10.0, 1.0]


def _update(seed: int) -> dict[str, torch.Tensor]:
    """One site's delta: every float dtype the codec carries, odd shapes and an int buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(4, 3, 3, generator=g),
        "conv.bias": torch.randn((), generator=g),  # 0-d
        "half": (torch.randn(7, 2, generator=g) * 100).half(),
        "bf": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f64": torch.randn(2, 3, 2, dtype=torch.float64, generator=g),
        "empty": torch.zeros(0, 3),
        "bn.num_batches_tracked": torch.tensor([seed * 1000 + 7, -3], dtype=torch.int64),
    }


def _fold(acc: WeightedSum, update: Mapping[str, torch.Tensor], weight: float, chunk: int) -> int:
    """Stream one encoded update into ``acc`` as the coordinator does; returns pieces seen."""
    decoder = StreamDecoder(acc.specs)
    seen = 0
    for data in encode_chunks(update, chunk):
        pieces = decoder.feed(data)
        seen += len(pieces)
        acc.add_pieces(pieces, weight)
    decoder.finish()
    acc.finish_update(weight)
    return seen


def _reference_mean(
    updates: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    total = sum(weights)
    out = {}
    for name, tensor in updates[0].items():
        if not tensor.dtype.is_floating_point:
            continue
        acc = torch.zeros(tensor.shape, dtype=torch.float64)
        for u, w in zip(updates, weights, strict=True):
            acc += w * u[name].double()
        out[name] = (acc / total).to(accumulation_dtype(tensor.dtype))
    return out


# -- accumulation_dtype / WeightedSum ------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_accumulation_dtype(dtype: torch.dtype, expected: torch.dtype) -> None:
    assert accumulation_dtype(dtype) == expected


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_weighted_sum_matches_direct_weighted_mean(chunk: int) -> None:
    updates = [_update(seed) for seed in range(len(WEIGHTS))]
    acc = WeightedSum(spec_of(updates[0]))
    assert "bn.num_batches_tracked" not in acc.sums  # integer buffers are not averaged
    assert acc.sums["half"].dtype == torch.float32
    assert acc.sums["bf"].dtype == torch.float32
    assert acc.sums["f64"].dtype == torch.float64

    pieces = [_fold(acc, u, w, chunk) for u, w in zip(updates, WEIGHTS, strict=True)]
    if chunk == 1:
        # Element by element, the int buffer's pieces included (and then skipped).
        assert pieces == [sum(t.numel() for t in updates[0].values())] * len(WEIGHTS)

    assert acc.count == len(WEIGHTS)
    assert acc.total_weight == sum(WEIGHTS)
    mean = acc.mean()
    expected = _reference_mean(updates, WEIGHTS)
    assert set(mean) == set(expected)
    for name, ref in expected.items():
        assert mean[name].shape == updates[0][name].shape, name
        assert_close(mean[name], ref, msg=name)


def test_weighted_sum_is_independent_of_chunking() -> None:
    updates = [_update(seed) for seed in range(len(WEIGHTS))]
    means = []
    for chunk in CHUNK_SIZES:
        acc = WeightedSum(spec_of(updates[0]))
        for u, w in zip(updates, WEIGHTS, strict=True):
            _fold(acc, u, w, chunk)
        means.append(acc.mean())
    for other in means[1:]:
        assert_close(other, means[0], rtol=0, atol=0)


def test_weighted_sum_interleaved_uploads() -> None:
    """Concurrent uploads feed pieces of different updates in any interleaving."""
    updates = [_update(seed) for seed in range(2)]
    weights = [2.0, 5.0]
    acc = WeightedSum(spec_of(updates[0]))
    decoders = [StreamDecoder(acc.specs) for _ in updates]
    streams = [list(encode_chunks(u, 7)) for u in updates]
    for i in range(max(map(len, streams))):
        for decoder, stream, w in zip(decoders, streams, weights, strict=True):
            if i < len(stream):
                acc.add_pieces(decoder.feed(stream[i]), w)
    for decoder, w in zip(decoders, weights, strict=True):
        decoder.finish()
        acc.finish_update(w)
    assert_close(acc.mean(), _reference_mean(updates, weights))


def test_weighted_sum_half_precision_does_not_overflow() -> None:
    """fp16 deltas near fp16's max, times sample counts, must be summed in fp32."""
    big = {"w": torch.full((4,), 60000.0, dtype=torch.float16)}
    acc = WeightedSum(spec_of(big))
    _fold(acc, big, 100.0, 5)
    _fold(acc, {"w": -big["w"]}, 50.0, 5)
    assert_close(acc.mean()["w"], torch.full((4,), 20000.0))


def test_weighted_sum_single_update_is_identity() -> None:
    update = _update(4)
    acc = WeightedSum(spec_of(update))
    _fold(acc, update, 17.0, 4093)
    for name, tensor in acc.mean().items():
        assert_close(tensor, update[name].to(tensor.dtype), msg=name)


def test_weighted_sum_mean_without_updates_raises() -> None:
    acc = WeightedSum(spec_of(_update(0)))
    with pytest.raises(ValueError, match="no updates"):
        acc.mean()


# -- ServerOptimizer -------------------------------------------------------------------


def _spec(strategy: str, **params: float) -> RunSpec:
    return RunSpec(task="m:t", rounds=3, strategy=strategy, strategy_params=params).validate()


X0 = [1.0, -2.0, 0.25]
DELTAS = [[0.5, 1.0, -0.125], [-0.25, 0.5, 2.0], [1.0, -1.0, 0.0]]


def _run(opt: ServerOptimizer, x0: list[float], deltas: list[list[float]]) -> torch.Tensor:
    model = {"w": torch.tensor(x0, dtype=torch.float64)}
    for d in deltas:
        opt.step(model, {"w": torch.tensor(d, dtype=torch.float64)})
    return model["w"]


def _adam_reference(
    x0: list[float], deltas: list[list[float]], lr: float, b1: float, b2: float, tau: float
) -> list[float]:
    """Reddi et al. 2021, FedAdam without bias correction, element by element."""
    x, m, v = list(x0), [0.0] * len(x0), [0.0] * len(x0)
    for d in deltas:
        for i, di in enumerate(d):
            m[i] = b1 * m[i] + (1 - b1) * di
            v[i] = b2 * v[i] + (1 - b2) * di * di
            x[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
    return x


def test_fedavg_step_is_x_plus_lr_delta() -> None:
    opt = ServerOptimizer(_spec("fedavg", server_lr=0.7))
    model = {
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "count": torch.tensor([5], dtype=torch.int64),
    }
    opt.step(model, {"w": torch.tensor([[0.5, -1.0], [0.0, 2.0]])})
    assert_close(model["w"], torch.tensor([[1.35, 1.3], [3.0, 5.4]]))
    assert model["count"].item() == 5  # not in the mean delta: keeps the global value
    assert opt.state_dict() == {}


def test_fedavgm_matches_hand_computation() -> None:
    # beta = 0.5, lr = 0.7:
    # v1 = d1 = [0.5, 1, -0.125]                     x1 = [1.35, -1.3, 0.1625]
    # v2 = 0.5 v1 + d2 = [0, 1, 1.9375]               x2 = [1.35, -0.6, 1.51875]
    # v3 = 0.5 v2 + d3 = [1, -0.5, 0.96875]           x3 = [2.05, -0.95, 2.196875]
    opt = ServerOptimizer(_spec("fedavgm", momentum=0.5, server_lr=0.7))
    x = _run(opt, X0, DELTAS)
    assert_close(x, torch.tensor([2.05, -0.95, 2.196875], dtype=torch.float64))
    (velocity,) = opt.state_dict().values()
    assert_close(velocity, torch.tensor([1.0, -0.5, 0.96875], dtype=torch.float64))


def test_fedadam_matches_reddi_et_al() -> None:
    lr, b1, b2, tau = 0.1, 0.8, 0.95, 0.01
    opt = ServerOptimizer(_spec("fedadam", server_lr=lr, beta1=b1, beta2=b2, tau=tau))
    x = _run(opt, X0, DELTAS)
    expected = _adam_reference(X0, DELTAS, lr, b1, b2, tau)
    assert_close(x, torch.tensor(expected, dtype=torch.float64))
    # One step by hand, as a check on the reference: m = 0.2 d, v = 0.05 d^2.
    one = _adam_reference([0.0], [[2.0]], lr, b1, b2, tau)
    assert one[0] == pytest.approx(0.1 * 0.4 / (math.sqrt(0.2) + 0.01))


def test_fedyogi_matches_reddi_et_al() -> None:
    lr, b1, b2, tau = 0.1, 0.8, 0.95, 0.01
    opt = ServerOptimizer(_spec("fedyogi", server_lr=lr, beta1=b1, beta2=b2, tau=tau))
    x = _run(opt, X0, DELTAS)
    xs, m, v = list(X0), [0.0] * 3, [0.0] * 3
    for d in DELTAS:
        for i, di in enumerate(d):
            m[i] = b1 * m[i] + (1 - b1) * di
            v[i] = v[i] - (1 - b2) * di * di * math.copysign(1.0, v[i] - di * di) * (
                v[i] != di * di
            )
            xs[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
    assert_close(x, torch.tensor(xs, dtype=torch.float64))
    # Yogi differs from Adam once v is populated: its v grows additively, not by decay.
    assert not torch.allclose(x, _run(ServerOptimizer(_spec("fedadam", server_lr=lr)), X0, DELTAS))


def test_diloco_is_torch_nesterov_sgd_on_the_pseudo_gradient() -> None:
    """x <- SGD(lr, momentum, nesterov) stepped with grad = global - local = -delta."""
    lr, mu = 0.7, 0.9
    opt = ServerOptimizer(_spec("diloco", server_lr=lr, momentum=mu))
    x = _run(opt, X0, DELTAS)
    param = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    sgd = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True)
    for d in DELTAS:
        param.grad = -torch.tensor(d, dtype=torch.float64)
        sgd.step()
    assert_close(x, param.detach())
    assert STRATEGY_PARAMS["diloco"]["server_lr"].default == 0.7
    assert STRATEGY_PARAMS["diloco"]["momentum"].default == 0.9


@pytest.mark.parametrize("strategy", sorted(STRATEGY_PARAMS))
def test_optimizer_defaults_come_from_strategy_params(strategy: str) -> None:
    defaults = {k: p.default for k, p in STRATEGY_PARAMS[strategy].items()}
    opt = ServerOptimizer(_spec(strategy))
    x = _run(opt, X0, DELTAS)
    lr = defaults["server_lr"]
    if strategy == "fedavg":
        expected = [x0 + lr * sum(d[i] for d in DELTAS) for i, x0 in enumerate(X0)]
    elif strategy == "fedavgm":
        beta, v, expected = defaults["momentum"], [0.0] * 3, list(X0)
        for d in DELTAS:
            for i in range(3):
                v[i] = beta * v[i] + d[i]
                expected[i] += lr * v[i]
    elif strategy == "diloco":  # x <- x + lr (d + mu b), b <- mu b + d
        mu, b, expected = defaults["momentum"], [0.0] * 3, list(X0)
        for d in DELTAS:
            for i in range(3):
                b[i] = mu * b[i] + d[i]
                expected[i] += lr * (d[i] + mu * b[i])
    elif strategy == "fedyogi":
        b1, b2, tau = defaults["beta1"], defaults["beta2"], defaults["tau"]
        m, v, expected = [0.0] * 3, [0.0] * 3, list(X0)
        for d in DELTAS:
            for i in range(3):
                m[i] = b1 * m[i] + (1 - b1) * d[i]
                sq = d[i] * d[i]
                v[i] -= (1 - b2) * sq * (v[i] > sq) - (1 - b2) * sq * (v[i] < sq)
                expected[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
    elif strategy == "fedadagrad":
        b1, tau = defaults["beta1"], defaults["tau"]
        m, v, expected = [0.0] * 3, [0.0] * 3, list(X0)
        for d in DELTAS:
            for i in range(3):
                m[i] = b1 * m[i] + (1 - b1) * d[i]
                v[i] += d[i] * d[i]
                expected[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
    else:
        assert strategy == "fedadam" and defaults["bias_correction"] == 0.0
        expected = _adam_reference(
            X0, DELTAS, lr, defaults["beta1"], defaults["beta2"], defaults["tau"]
        )
    assert_close(x, torch.tensor(expected, dtype=torch.float64))


def test_optimizer_partial_params_fall_back_to_defaults() -> None:
    momentum_only = ServerOptimizer(_spec("fedavgm", momentum=0.5))
    explicit = ServerOptimizer(
        _spec("fedavgm", momentum=0.5, server_lr=STRATEGY_PARAMS["fedavgm"]["server_lr"].default)
    )
    assert_close(_run(momentum_only, X0, DELTAS), _run(explicit, X0, DELTAS), rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec",
    [
        _spec("fedavgm", momentum=0.5, server_lr=0.7),
        _spec("fedadam", server_lr=0.1, beta1=0.8, beta2=0.95, tau=0.01),
    ],
    ids=["fedavgm", "fedadam"],
)
def test_optimizer_state_round_trip_resumes_exactly(spec: RunSpec) -> None:
    def deltas(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}

    start = {"a": torch.ones(3, 4), "b": torch.zeros(5)}
    uninterrupted = ServerOptimizer(spec)
    model = {k: v.clone() for k, v in start.items()}
    for step in range(4):
        uninterrupted.step(model, deltas(step))

    first = ServerOptimizer(spec)
    resumed_model = {k: v.clone() for k, v in start.items()}
    for step in range(2):
        first.step(resumed_model, deltas(step))
    # Through the codec, as the checkpoint is stored; the model too.
    saved_state = encode(first.state_dict())
    saved_model = encode(resumed_model)
    del first
    resumed = ServerOptimizer(spec)
    resumed.load_state_dict(decode(saved_state))
    resumed_model = decode(saved_model)
    for step in range(2, 4):
        resumed.step(resumed_model, deltas(step))

    assert_close(resumed_model, model, rtol=0, atol=0)
    assert_close(resumed.state_dict(), uninterrupted.state_dict(), rtol=0, atol=0)


def test_load_state_dict_does_not_alias_its_input() -> None:
    spec = _spec("fedavgm", momentum=0.5)
    state = {"m.w": torch.tensor([1.0, 2.0])}
    opt = ServerOptimizer(spec)
    opt.load_state_dict(state)
    model = {"w": torch.zeros(2)}
    opt.step(model, {"w": torch.zeros(2)})
    assert_close(state["m.w"], torch.tensor([1.0, 2.0]))
    assert_close(model["w"], torch.tensor([0.5, 1.0]))  # the loaded velocity was used


@pytest.mark.parametrize("strategy", sorted(STRATEGY_PARAMS))
def test_half_precision_params_are_updated_in_their_own_dtype(strategy: str) -> None:
    opt = ServerOptimizer(_spec(strategy, server_lr=0.5))
    w = torch.tensor([1.0, -2.0, 100.0, 0.125], dtype=torch.float16)
    model = {"w": w, "step": torch.tensor(3)}
    delta = torch.tensor([0.25, 1e-3, -4.0, 0.5])  # fp32, as WeightedSum.mean() gives
    before = w.float()
    opt.step(model, {"w": delta})
    assert model["w"] is w  # in place
    assert w.dtype == torch.float16
    if strategy in ("fedadam", "fedyogi"):  # from zero state both give v = (1 - b2) d^2
        b1, b2, tau = (STRATEGY_PARAMS[strategy][k].default for k in ("beta1", "beta2", "tau"))
        m, v = (1 - b1) * delta, (1 - b2) * delta * delta
        direction = m / (v.sqrt() + tau)
    elif strategy == "fedadagrad":  # from zero state v = d^2
        b1, tau = (STRATEGY_PARAMS[strategy][k].default for k in ("beta1", "tau"))
        direction = (1 - b1) * delta / (delta.abs() + tau)
    elif strategy == "diloco":  # first Nesterov step: d + mu d
        direction = delta * (1 + STRATEGY_PARAMS["diloco"]["momentum"].default)
    else:
        direction = delta
    assert_close(w, (before + 0.5 * direction).half())
    for state in opt.state_dict().values():
        assert state.dtype == torch.float32  # optimiser state keeps the accumulation precision
    assert model["step"].item() == 3


# -- weighted_metrics ------------------------------------------------------------------


def _part(site: str, num_samples: int, metrics: dict[str, float]) -> ParticipationRecord:
    return ParticipationRecord(
        task_id=f"task-{site}",
        run_id="run-1",
        round_number=2,
        attempt=1,
        site_id=site,
        state="accepted",
        assigned_at=0.0,
        num_samples=num_samples,
        metrics=metrics,
    )


def test_weighted_metrics_are_sample_weighted() -> None:
    parts = [_part("a", 10, {"loss": 1.0}), _part("b", 30, {"loss": 2.0})]
    assert weighted_metrics(parts) == {"loss": pytest.approx((10 * 1.0 + 30 * 2.0) / 40)}


def test_weighted_metrics_average_over_reporting_sites_only() -> None:
    parts = [
        _part("a", 10, {"loss": 1.0, "accuracy": 0.5}),
        _part("b", 30, {"loss": 2.0}),
        _part("c", 60, {"loss": 0.5, "accuracy": 0.8, "auc": 0.9}),
    ]
    metrics = weighted_metrics(parts)
    assert metrics == {
        "accuracy": pytest.approx((10 * 0.5 + 60 * 0.8) / 70),
        "auc": pytest.approx(0.9),
        "loss": pytest.approx((10 * 1.0 + 30 * 2.0 + 60 * 0.5) / 100),
    }
    assert list(metrics) == sorted(metrics)


def test_counts_add_up_over_the_sites_instead_of_being_averaged() -> None:
    parts = [
        _part("a", 10, {"loss": 1.0, "samples_seen": 50.0, "batch_count": 5.0}),
        _part("b", 30, {"loss": 2.0, "samples_seen": 150.0, "tokens_total": 7.0}),
        _part("c", 0, {"samples_seen": 0.0, "steps": 3.0}),
    ]
    assert weighted_metrics(parts) == {
        "batch_count": 5.0,
        "loss": pytest.approx((10 * 1.0 + 30 * 2.0) / 40),
        "samples_seen": 200.0,
        "steps": 3.0,
        "tokens_total": 7.0,
    }
    assert is_count_metric("samples_seen") and not is_count_metric("train_loss")
    assert format_metric("samples_seen", 1223.0) == "1223"
    assert format_metric("train_loss", 0.123456) == "0.1235"


def test_weighted_metrics_edge_cases() -> None:
    assert weighted_metrics([]) == {}
    assert weighted_metrics([_part("a", 5, {})]) == {}
    # A site that trained on nothing carries no weight.
    parts = [_part("a", 0, {"loss": 100.0, "only_a": 1.0}), _part("b", 4, {"loss": 2.0})]
    assert weighted_metrics(parts) == {"loss": pytest.approx(2.0)}


@pytest.mark.parametrize("strategy", sorted(STRATEGY_PARAMS))
def test_a_step_taken_piece_by_piece_is_the_whole_tensor_step(strategy: str) -> None:
    """A commit streams the old model through step_piece in runs of any length: bit for bit
    the step of the whole tensor."""
    params = {"server_lr": 0.7} if strategy != "fedavg" else {"server_lr": 1.3}
    whole, pieces = (
        ServerOptimizer(_spec(strategy, **params)),
        ServerOptimizer(_spec(strategy, **params)),
    )
    g = torch.Generator().manual_seed(3)
    shape = (37, 29)
    model_a = {"w": torch.randn(shape, generator=g)}
    model_b = {"w": model_a["w"].clone()}
    for _ in range(3):  # state (momenta) carries across rounds
        delta = torch.randn(shape, generator=g)
        whole.step(model_a, {"w": delta})
        flat, offset = model_b["w"].view(-1), 0
        for run in (1, 7, 64, 300, 1000):  # ragged runs, as chunk boundaries fall
            end = min(offset + run, flat.numel())
            pieces.step_piece("w", shape, offset, flat[offset:end], delta.view(-1)[offset:end])
            offset = end
        if offset < flat.numel():
            pieces.step_piece("w", shape, offset, flat[offset:], delta.view(-1)[offset:])
        assert_close(model_b["w"], model_a["w"], rtol=0, atol=0)
    for key, value in whole.state_dict().items():
        assert_close(pieces.state_dict()[key], value, rtol=0, atol=0)
        assert value.shape == shape


def _stepped_case(
    strategy: str, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], RunSpec]:
    g = torch.Generator().manual_seed(11)
    model = {
        "w": torch.randn(13, 7, generator=g).to(dtype),
        "b": torch.randn(5, generator=g).to(dtype),
        "steps": torch.tensor([3, 4], dtype=torch.int64),  # an integer buffer
        "none": torch.zeros(0, dtype=dtype),  # an empty float tensor
    }
    acc = accumulation_dtype(dtype)
    means = []
    for _ in range(3):
        mean = {k: torch.randn(v.shape, generator=g).to(acc) for k, v in model.items()}
        mean["w"] = mean["w"].t().contiguous().t()  # non-contiguous: new values elsewhere
        del mean["steps"]
        means.append(mean)
    return model, means, _spec(strategy, server_lr=0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strategy", sorted(STRATEGY_PARAMS))
def test_stepped_model_streams_the_old_model_through_the_step(
    strategy: str, dtype: torch.dtype
) -> None:
    """rounds.stepped_model (a commit) against ServerOptimizer.step on whole tensors, with
    7-byte chunks: pieces split elements, integer buffers and an empty tensor ride along."""
    model, means, spec = _stepped_case(strategy, dtype)
    whole, streamed = ServerOptimizer(spec), ServerOptimizer(spec)
    reference = {k: v.clone() for k, v in model.items()}
    current = {k: v.clone() for k, v in model.items()}
    exact = dtype in (torch.float32, torch.float64)
    for mean in means:
        whole.step(reference, {k: v.clone() for k, v in mean.items()})
        given = {k: v.clone() for k, v in mean.items()}
        current = stepped_model(encode_chunks(current, 7), spec_of(current), streamed, given)
        assert set(current) == set(reference)
        for name, value in reference.items():
            assert current[name].dtype == value.dtype and current[name].shape == value.shape
            if exact or not value.is_floating_point():
                assert torch.equal(current[name], value), name
            else:  # half precision: the last bit may differ where a piece ends
                ulp = torch.finfo(dtype).eps * float(value.abs().amax()) if value.numel() else 0.0
                assert_close(current[name], value, rtol=0, atol=4 * ulp)
        if exact:  # fp32 and fp64: the new values were written into the mean's memory
            assert current["b"].data_ptr() == given["b"].data_ptr()
        assert current["w"].data_ptr() != given["w"].data_ptr()  # not contiguous: not reused
    assert set(streamed.state_dict()) == set(whole.state_dict())  # "none" has state too
    for key, value in whole.state_dict().items():
        assert streamed.state_dict()[key].shape == value.shape
        assert_close(streamed.state_dict()[key], value, rtol=0, atol=0)


def test_a_commit_leaves_out_of_use_only_what_neither_checkpoint_serves() -> None:
    a, b, c, d, e, f = (ch * 64 for ch in "abcdef")
    # The model, step and controls the last round served, and the new optimiser state.
    assert out_of_use((a, b, c), (d, e, f), "9" * 64) == {a, b, c, "9" * 64}
    # A model that did not move, a rollback to a model served before, no step, no state.
    assert out_of_use((a, "", ""), (a, "", ""), None) == set()
    assert out_of_use((a, b, ""), (d, "", a), None) == {b}
    # The state's blob is the same bytes as one still served: it stays.
    assert out_of_use((a, "", ""), (d, "", ""), d) == {a}
