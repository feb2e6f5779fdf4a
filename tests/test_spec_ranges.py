"""Every number of a run spec has a range (fedra.ranges.RANGES): a value outside it, NaN or
infinity is refused with an error that names the key, on every path a spec takes: built
in Python, loaded from run.toml, and submitted over gRPC."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, get_type_hints

import grpc
import pytest

from fedra.config import ConfigError
from fedra.protos.serde import runspec_to_proto
from fedra.protos.v1 import admin_pb2
from fedra.ranges import MAX_SITES, RANGES, Bound
from fedra.runspec import (
    STRATEGY_PARAMS,
    AggregationSpec,
    AsyncSpec,
    CodecSpec,
    PrivacySpec,
    PromotionSpec,
    RunSpec,
    SecAggSpec,
    TrainSpec,
    runspec_from_toml,
)
from tests.conftest import InProcessCoordinator

# The run.toml table that holds each spec dataclass, and its attribute on RunSpec.
_TABLES: dict[type, tuple[str, str]] = {
    TrainSpec: ("train", "train"),
    CodecSpec: ("codec", "codec"),
    AggregationSpec: ("aggregation", "aggregation"),
    PrivacySpec: ("privacy", "privacy"),
    SecAggSpec: ("secagg", "secagg"),
    AsyncSpec: ("async", "asynchronous"),
    PromotionSpec: ("promotion", "promotion"),
}
_STRATEGY_OF = {"momentum": "fedavgm", "server_lr": "fedavg"}  # beta1, beta2, tau: fedadam


def _base_doc(key: str) -> dict[str, Any]:
    """A valid run.toml (as parsed) in which ``key`` is used: its table, codec, strategy."""
    doc: dict[str, Any] = {"task": "m:t", "rounds": 3, "sites_per_round": 3}
    table, _, name = key.rpartition(".")
    if table == "strategy":
        doc["strategy"] = {"name": _STRATEGY_OF.get(name, "fedadam")}
    elif table == "codec":
        doc["codec"] = {"name": "int8" if name == "block" else "topk"}
    elif table == "privacy" and name == "population":  # used by a sampled run only
        doc["privacy"] = {"epsilon": 8.0, "sampling": "poisson", "population": 100}
    elif table == "privacy":
        doc["privacy"] = {"epsilon": 8.0}
    elif key == "train.reset_optimizer_every":  # only a run that keeps the state resets it
        doc["train"] = {"keep_optimizer_state": True}
    elif key == "train.scaffold_population":  # only a SCAFFOLD run has one
        doc["train"] = {"scaffold": True}
    elif table in ("secagg", "async", "aggregation", "promotion"):
        doc[table] = {}
    return doc


def _with(doc: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    table, _, name = key.rpartition(".")
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    (out.setdefault(table, {}) if table else out)[name] = value
    return out


def _outside(bound: Bound) -> list[object]:
    """Values just past each end, and the non-finite ones."""
    if bound.integer:
        return [int(bound.low) - 1, int(bound.high) + 1, math.nan, math.inf]
    low = bound.low if bound.low_open else math.nextafter(bound.low, -math.inf)
    high = bound.high if bound.high_open else math.nextafter(bound.high, math.inf)
    return [low, high, math.nan, math.inf, -math.inf]


def _inside(bound: Bound) -> list[float]:
    """The extreme values the range still holds."""
    if bound.integer:
        return [int(bound.low), int(bound.high)]
    low = math.nextafter(bound.low, math.inf) if bound.low_open else bound.low
    high = math.nextafter(bound.high, -math.inf) if bound.high_open else bound.high
    return [low, high]


CASES = [(key, value) for key, bound in RANGES.items() for value in _outside(bound)]


def test_every_number_of_a_spec_has_a_range() -> None:
    """The table is complete: each int or float field of the spec and its tables, and
    every strategy parameter, has an entry (so a new field cannot go unchecked)."""
    numeric = {name for name, kind in get_type_hints(RunSpec).items() if kind in (int, float)}
    for cls, (table, _) in _TABLES.items():
        hints = get_type_hints(cls)
        numeric |= {
            f"{table}.{f.name}" for f in dataclasses.fields(cls) if hints[f.name] in (int, float)
        }
    numeric |= {f"strategy.{p}" for params in STRATEGY_PARAMS.values() for p in params}
    assert numeric == set(RANGES)


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_a_value_out_of_range_is_refused_naming_the_key(key: str, value: object) -> None:
    doc = _with(_base_doc(key), key, value)
    with pytest.raises(ConfigError) as info:
        runspec_from_toml(doc)
    assert str(info.value).startswith(f"{key}: "), info.value
    # Built in Python, validated: the same refusal.
    with pytest.raises(ConfigError) as direct:
        _python_spec(key, value).validate()
    assert str(direct.value).startswith(f"{key}: "), direct.value


def _python_spec(key: str, value: object) -> RunSpec:
    """The base spec of ``key`` with the value set on the dataclass (no TOML involved)."""
    spec = runspec_from_toml(_base_doc(key))
    table, _, name = key.rpartition(".")
    if not table:
        return dataclasses.replace(spec, **{name: value})
    if table == "strategy":
        return dataclasses.replace(spec, strategy_params={name: value})  # type: ignore[dict-item]
    attr = next(a for cls, (t, a) in _TABLES.items() if t == table)
    return dataclasses.replace(
        spec, **{attr: dataclasses.replace(getattr(spec, attr), **{name: value})}
    )


# Edge values that another rule refuses, whatever the range says.
_CROSS_RULES = {
    ("privacy.epsilon", "low"): "one round's noise already spends more",
    ("privacy.noise_multiplier", "low"): "one round's noise already spends more",
    ("privacy.delta", "low"): "one round's noise already spends more",
    ("privacy.population", "low"): "a sampled run needs at least sites_per_round",
}


@pytest.mark.parametrize("key", sorted(RANGES))
def test_the_ends_of_each_range_are_accepted(key: str) -> None:
    for end, value in zip(("low", "high"), _inside(RANGES[key]), strict=True):
        if (key, end) in _CROSS_RULES:
            continue
        written = bool(value) if _is_bool_param(key) else value  # true / false in run.toml
        doc = _with(_base_doc(key), key, written)
        if key.endswith(("min_sites", "buffer", "select", "byzantine")) or key == "sites_per_round":
            doc["sites_per_round"] = MAX_SITES  # these are bounded by it too
        if key == "train.local_epochs":
            doc["train"]["local_steps"] = 1  # one of the two must be > 0
        if key == "aggregation.byzantine" and end == "high":
            continue  # krum needs 2f + 3 updates: the rule, not the range, limits it
        spec = runspec_from_toml(doc)
        assert spec.validate() is spec


def _is_bool_param(key: str) -> bool:
    table, _, name = key.rpartition(".")
    return table == "strategy" and any(
        params[name].kind is bool for params in STRATEGY_PARAMS.values() if name in params
    )


def _proto_with(key: str, value: float) -> admin_pb2.RunSpec:
    m = runspec_to_proto(runspec_from_toml(_base_doc(key)))
    table, _, name = key.rpartition(".")
    if table == "strategy":
        m.strategy_params[name] = value
        return m
    target = {"": m, "async": m.asynchronous}.get(table) or getattr(m, table)
    setattr(target, name, value)
    return m


def _wire_cases() -> list[tuple[str, float]]:
    """Each key with the values its proto field can carry: a uint field cannot hold a
    negative number, and zero means unset there."""
    cases = []
    for key, bound in RANGES.items():
        if bound.integer:
            cases.append((key, int(bound.high) + 1))
        else:
            cases += [(key, v) for v in (math.nan, math.inf, math.nextafter(bound.high, math.inf))]
    return cases


WIRE = _wire_cases()


def test_submit_run_refuses_each_out_of_range_value_with_invalid_argument(
    coordinator: InProcessCoordinator,
) -> None:
    """Over gRPC, as the CLI submits: INVALID_ARGUMENT naming the key, and no run made."""
    for key, value in WIRE:
        request = admin_pb2.SubmitRunRequest(spec=_proto_with(key, value))
        with pytest.raises(grpc.RpcError) as info:
            coordinator.admin.SubmitRun(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (key, value)
        assert info.value.details().startswith(f"{key}: "), (key, value, info.value.details())
    assert coordinator.admin.ListRuns(admin_pb2.ListRunsRequest()).runs == []


def test_an_integer_too_large_for_a_float_is_out_of_range_not_a_crash() -> None:
    with pytest.raises(ConfigError, match=r"^rounds: "):
        RunSpec(task="pkg.mod:task", rounds=10**400).validate()
