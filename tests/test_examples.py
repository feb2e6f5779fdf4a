"""The tasks that ship with fedra: the digits classifier and the synthetic regression task."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedra.client.task import FitSettings, Task, load_task
from fedra.config import ConfigError
from fedra.examples import digits, synthetic
from fedra.examples.layers import seeded_linear

# (entry point, params) for each task; the synthetic one with its big block switched on.
TASKS = [
    ("fedra.examples.digits:task", {"hidden": "32"}),
    ("fedra.examples.synthetic:task", {"dim": "4", "extra_params": "1000"}),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # These models are tiny: extra threads only add contention on a small CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _settings(steps: int = 0, epochs: int = 1, batch: int = 32, lr: float = 0.1) -> FitSettings:
    return FitSettings(
        local_steps=steps, local_epochs=epochs, batch_size=batch, learning_rate=lr, seed=5
    )


def _digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        hasher.update(name.encode())
        hasher.update(tensor.numpy().tobytes())
    return hasher.hexdigest()


# --- both tasks ---------------------------------------------------------------------------


def test_shipped_tasks_satisfy_the_protocol() -> None:
    assert isinstance(digits.task, Task)
    assert isinstance(synthetic.task, Task)
    assert load_task("fedra.examples.digits:task") is digits.task
    assert load_task("fedra.examples.synthetic:task") is synthetic.task


@pytest.mark.parametrize(("entry_point", "params"), TASKS)
def test_seed_alone_decides_the_initial_weights(entry_point: str, params: dict[str, str]) -> None:
    task = load_task(entry_point)
    torch.manual_seed(99)
    first = task.create_model(7, params).state_dict()
    torch.manual_seed(100)  # the global RNG must not matter
    again = task.create_model(7, params).state_dict()
    other = task.create_model(8, params).state_dict()
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert all(not torch.equal(first[name], other[name]) for name in first)


@pytest.mark.parametrize(("entry_point", "params"), TASKS)
def test_create_model_leaves_the_global_rng_alone(entry_point: str, params: dict[str, str]) -> None:
    before = torch.get_rng_state()
    load_task(entry_point).create_model(3, params)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(("in_features", "out_features"), [(8, 1), (64, 32), (32, 10)])
def test_seeded_linear_draws_nn_linear_s_init_from_its_generator(
    in_features: int, out_features: int
) -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    layer = seeded_linear(in_features, out_features, torch.Generator().manual_seed(11))
    assert torch.equal(before, torch.get_rng_state())
    assert type(layer) is torch.nn.Linear  # a plain layer, in type and repr
    # nn.Linear's default distribution, U(-1/sqrt(in), 1/sqrt(in)): weight first, then bias.
    generator, bound = torch.Generator().manual_seed(11), 1.0 / math.sqrt(in_features)
    weight = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=generator)
    bias = torch.empty(out_features).uniform_(-bound, bound, generator=generator)
    assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
    assert layer.weight.dtype == torch.float32 and layer.weight.requires_grad


def test_initial_weights_are_bit_identical_in_another_process() -> None:
    script = (
        "import hashlib, json, sys, torch\n"
        "from fedra.client.task import load_task\n"
        "torch.manual_seed(12345)\n"
        "for entry, params in json.loads(sys.argv[1]):\n"
        "    hasher = hashlib.sha256()\n"
        "    for name, tensor in load_task(entry).create_model(7, params).state_dict().items():\n"
        "        hasher.update(name.encode())\n"
        "        hasher.update(tensor.numpy().tobytes())\n"
        "    print(hasher.hexdigest())\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(TASKS)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    ).stdout.split()
    assert out == [_digest(load_task(entry).create_model(7, params)) for entry, params in TASKS]


def test_both_tasks_read_one_shared_data_table() -> None:
    # A site has a single [data] table for every task it serves: each task skips the
    # other's keys instead of refusing them.
    shared = {"partition": 0, "num_partitions": 2, "samples": 32, "shift": 1.0}
    assert len(digits.task.load_data(shared).y_train) > 0
    assert len(synthetic.task.load_data(shared).y_train) == 32


# --- digits: data ---------------------------------------------------------------------------


def test_pooled_split_is_a_deterministic_stratified_80_20_split() -> None:
    (x_train, y_train), (_, y_test) = digits.pooled_split()
    assert x_train.dtype == torch.float32 and x_train.shape[1] == digits.NUM_FEATURES
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0
    assert len(y_train) + len(y_test) == 1797
    assert len(y_test) == pytest.approx(0.2 * 1797, abs=10)
    train_share = torch.bincount(y_train, minlength=10) / len(y_train)
    test_share = torch.bincount(y_test, minlength=10) / len(y_test)
    torch.testing.assert_close(train_share, test_share, atol=0.01, rtol=0)
    (x_again, _), _ = digits.pooled_split()
    assert torch.equal(x_train, x_again)
    (x_other, _), _ = digits.pooled_split(seed=1)
    assert not torch.equal(x_train, x_other)


def test_partition_is_disjoint_covering_non_empty_and_deterministic() -> None:
    (_, y_train), _ = digits.pooled_split()
    parts = digits.partition(y_train, 5, 0.5, seed=3)
    joined = np.concatenate(parts)
    assert len(joined) == len(y_train)
    assert np.array_equal(np.sort(joined), np.arange(len(y_train)))
    assert all(len(part) > 0 for part in parts)
    again = digits.partition(y_train, 5, 0.5, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = digits.partition(y_train, 5, 0.5, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def _label_distances(y: torch.Tensor, parts: list[np.ndarray[Any, Any]]) -> list[float]:
    """Total-variation distance between each part's label mix and the whole set's."""
    labels = y.numpy()
    pooled = np.bincount(labels, minlength=10) / len(labels)
    mixes = [np.bincount(labels[part], minlength=10) / len(part) for part in parts]
    return [0.5 * float(np.abs(mix - pooled).sum()) for mix in mixes]


@pytest.mark.parametrize("seed", range(5))
def test_partition_skews_labels(seed: int) -> None:
    (_, y_train), _ = digits.pooled_split()
    parts = digits.partition(y_train, 3, 0.5, seed)
    # Over 50 seeds, Dirichlet(0.5) put every site >= 0.14 away from the pooled mix, and
    # some site had one label at >= 21% of its data (balanced classes give 10%).
    assert min(_label_distances(y_train, parts)) >= 0.1
    assert max(np.bincount(y_train.numpy()[part]).max() / len(part) for part in parts) >= 0.2
    # A near-uniform allocation stays within 0.01, so the bounds above have teeth.
    assert max(_label_distances(y_train, digits.partition(y_train, 3, 1e6, seed))) < 0.02


def test_partition_keeps_every_site_at_min_size_even_with_extreme_skew() -> None:
    (_, y_train), _ = digits.pooled_split()
    parts = digits.partition(y_train, 100, 0.01, seed=0, min_size=2)
    assert min(len(part) for part in parts) >= 2
    assert sum(len(part) for part in parts) == len(y_train)


@pytest.mark.parametrize(
    ("num_partitions", "alpha", "needle"),
    [(0, 0.5, "num_partitions"), (10_000, 0.5, "num_partitions"), (3, 0.0, "alpha")],
)
def test_partition_rejects_bad_arguments(num_partitions: int, alpha: float, needle: str) -> None:
    (_, y_train), _ = digits.pooled_split()
    with pytest.raises(ValueError, match=needle):
        digits.partition(y_train, num_partitions, alpha, seed=0)


def test_sites_split_the_pooled_training_set_between_them() -> None:
    (_, y_train), _ = digits.pooled_split()
    sites = [digits.task.load_data({"partition": p, "num_partitions": 4}) for p in range(4)]
    assert sum(len(s.y_train) + len(s.y_eval) for s in sites) == len(y_train)
    for site in sites:
        share = len(site.y_eval) / (len(site.y_train) + len(site.y_eval))
        assert share == pytest.approx(digits.LOCAL_EVAL_FRACTION, abs=0.01)
    again = digits.task.load_data({"partition": 2, "num_partitions": 4})
    assert torch.equal(again.x_train, sites[2].x_train)
    assert torch.equal(again.y_eval, sites[2].y_eval)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_partitions": 3}, "data.partition: required"),
        ({"partition": 5, "num_partitions": 3}, r"data.partition: must be in \[0, 3\), got 5"),
        ({"partition": -1, "num_partitions": 3}, "data.partition"),
        ({"partition": "0", "num_partitions": 3}, "data.partition: expected int, got str"),
        ({"partition": True, "num_partitions": 3}, "data.partition: expected int, got bool"),
        ({"partition": 0}, "data.num_partitions: required"),
        ({"partition": 0, "num_partitions": 0}, "data.num_partitions: must be >= 1"),
        ({"partition": 0, "num_partitions": 100_000}, "data.num_partitions: must be <="),
        (
            {"partition": 0, "num_partitions": 3, "alpha": 0},
            "data.alpha: must be a finite number > 0",
        ),
        ({"partition": 0, "num_partitions": 3, "alpha": "x"}, "data.alpha: expected float"),
        ({"partition": 0, "num_partitions": 3, "alpha": float("nan")}, "data.alpha"),
        ({"partition": 0, "num_partitions": 3, "seed": -1}, "data.seed: must be >= 0"),
    ],
)
def test_digits_load_data_names_the_bad_key(config: Mapping[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        digits.task.load_data(config)


def test_digits_create_model_names_a_bad_param() -> None:
    with pytest.raises(ConfigError, match=r"params\.hidden"):
        digits.task.create_model(0, {"hidden": "wide"})


# --- digits: learning -------------------------------------------------------------------


def test_digits_fit_learns_the_local_data() -> None:
    data = digits.task.load_data({"partition": 1, "num_partitions": 3, "alpha": 0.5})
    model = digits.task.create_model(0, {})
    before = digits.task.evaluate(model, data)
    result = digits.task.fit(model, data, _settings(epochs=5))
    after = digits.task.evaluate(model, data)
    # Untrained: chance-level loss; this site's skewed eval split happens to sit at ~7%.
    assert before["loss"] == pytest.approx(math.log(10), abs=0.1)
    assert before["accuracy"] < 0.2
    assert after["accuracy"] > 0.7
    assert after["loss"] < before["loss"]
    assert result.num_samples == len(data.y_train)
    assert result.metrics["samples_seen"] == 5 * len(data.y_train)
    assert np.isfinite(result.metrics["train_loss"])


def test_digits_fit_counts_steps_and_is_deterministic() -> None:
    data = digits.task.load_data({"partition": 1, "num_partitions": 3})
    models = [digits.task.create_model(0, {}) for _ in range(2)]
    results = [digits.task.fit(m, data, _settings(steps=7, batch=16)) for m in models]
    assert results[0].metrics["samples_seen"] == 7 * 16
    assert results[0] == results[1]
    torch.testing.assert_close(models[0].state_dict(), models[1].state_dict(), rtol=0, atol=0)


def test_train_centralised_reaches_the_baseline_accuracy() -> None:
    model = digits.train_centralised(seed=0, steps=300, batch_size=32, lr=0.1, params={})
    _, (x_test, y_test) = digits.pooled_split()
    assert digits.evaluate_on(model, x_test, y_test)["accuracy"] > 0.9


def test_the_baseline_pools_what_the_sites_train_on_and_not_what_they_hold_out() -> None:
    """The demo's centralised baseline trains on the sites' training rows pooled: every
    one of them, and none of the rows a site keeps to evaluate on."""
    x, y = digits.sites_training_data(3, 0.5, 0)
    sites = [digits.task.load_data({"partition": i, "num_partitions": 3, "alpha": 0.5,
                                    "seed": 0}) for i in range(3)]  # fmt: skip
    assert len(y) == sum(len(d.y_train) for d in sites) < len(digits.pooled_split()[0][1])
    rows = {tuple(r.tolist()) for r in x}
    for d in sites:
        assert all(tuple(r.tolist()) in rows for r in d.x_train)
        assert not any(tuple(r.tolist()) in rows for r in d.x_eval)


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_fit_reduces_the_loss() -> None:
    data = synthetic.task.load_data({"samples": 128, "seed": 2})
    model = synthetic.task.create_model(0, {})
    before = synthetic.task.evaluate(model, data)["loss"]
    result = synthetic.task.fit(model, data, _settings(epochs=5, lr=0.05))
    after = synthetic.task.evaluate(model, data)["loss"]
    assert after < 0.1 * before
    assert result.num_samples == 128
    assert result.metrics["samples_seen"] == 5 * 128


def test_synthetic_sites_share_true_weights_but_not_inputs() -> None:
    near = synthetic.task.load_data({"seed": 1})
    far = synthetic.task.load_data({"seed": 1, "shift": 3.0})
    assert float(near.x_train.mean()) == pytest.approx(0.0, abs=0.2)
    assert float(far.x_train.mean()) == pytest.approx(3.0, abs=0.2)
    w_star = synthetic.true_weights(8)
    for data in (near, far):
        residual = data.y_eval - data.x_eval @ w_star
        assert float(residual.abs().max()) < 0.1
        assert data.x_eval.shape == (synthetic.EVAL_SAMPLES, 8)


def test_synthetic_extra_block_is_big_frozen_and_updated_cheaply() -> None:
    model = synthetic.task.create_model(0, {"extra_params": "100000"})
    extra = model.state_dict()["extra"]
    assert extra.shape == (100_000,) and extra.dtype == torch.float32
    assert not model.get_parameter("extra").requires_grad
    start = extra.clone()
    synthetic.task.fit(model, synthetic.task.load_data({}), _settings(steps=3, lr=0.5))
    expected = start * (1 - 0.5 * synthetic.EXTRA_DECAY) ** 3
    torch.testing.assert_close(model.get_parameter("extra").detach(), expected)
    assert "extra" not in synthetic.task.create_model(0, {}).state_dict()


def test_synthetic_fit_delay_makes_a_slow_site() -> None:
    data = synthetic.task.load_data({"fit_delay_s": 0.05})
    started = time.monotonic()
    synthetic.task.fit(synthetic.task.create_model(0, {}), data, _settings(steps=1))
    assert time.monotonic() - started >= 0.05


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"samples": 0}, "data.samples: must be > 0"),
        ({"samples": 2.5}, "data.samples: expected int"),
        ({"dim": 0}, "data.dim: must be > 0"),
        ({"shift": "left"}, "data.shift: expected float"),
        ({"shift": float("inf")}, "data.shift"),
        ({"seed": -3}, "data.seed: must be >= 0"),
        ({"fit_delay_s": -1.0}, "data.fit_delay_s: must be finite and >= 0"),
    ],
)
def test_synthetic_load_data_names_the_bad_key(config: Mapping[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        synthetic.task.load_data(config)


@pytest.mark.parametrize(
    ("params", "message"),
    [({"dim": "0"}, "params.dim"), ({"extra_params": "-1"}, "params.extra_params")],
)
def test_synthetic_create_model_names_a_bad_param(params: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        synthetic.task.create_model(0, params)
