"""[privacy]'s sampling keys in a run spec: parsed from run.toml, carried over the wire,
checked against the rest of the spec with errors that name the key; and what a spec without
them keeps (no amplification), so no existing run changes its guarantee."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fedra.accounting import Accountant, RoundEvent
from fedra.config import ConfigError
from fedra.protos.serde import privacy_from_proto, privacy_to_proto, runspec_to_proto
from fedra.protos.v1 import common_pb2
from fedra.runspec import PrivacySpec, RunSpec, runspec_from_toml


def doc(privacy: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"task": "m:t", "rounds": 100, "sites_per_round": 10, "privacy": privacy, **top}


def test_defaults_keep_the_unamplified_guarantee() -> None:
    spec = runspec_from_toml(doc({"epsilon": 8.0}))
    assert spec.privacy is not None
    assert (spec.privacy.sampling, spec.privacy.population, spec.privacy.accountant) == (
        "none", 0, "rdp",
    )  # fmt: skip
    assert spec.privacy.round_event(spec.sites_per_round) == RoundEvent(1.0)
    assert spec.quorum == 10
    # A spec stored before these keys existed reads back the same.
    old = RunSpec.from_json(spec.to_json().replace(', "sampling": "none"', ""))
    assert old.privacy == spec.privacy


@pytest.mark.parametrize(
    ("privacy", "event"),
    [
        ({"sampling": "poisson", "population": 100}, RoundEvent(1.0, "poisson", 10, 100)),
        ({"sampling": "poisson", "population": 100, "accountant": "pld"},
         RoundEvent(1.0, "poisson", 10, 100, "pld")),
        ({"sampling": "fixed", "population": 10, "noise_multiplier": 2.0},
         RoundEvent(2.0, "fixed", 10, 10)),
        ({"accountant": "pld", "noise_multiplier": 3.0}, RoundEvent(3.0, accountant="pld")),
    ],
)  # fmt: skip
def test_sampling_keys_parse_and_travel(privacy: dict[str, Any], event: RoundEvent) -> None:
    spec = runspec_from_toml(doc({"epsilon": 50.0, **privacy}))
    assert spec.privacy is not None
    assert spec.privacy.round_event(spec.sites_per_round) == event
    assert privacy_from_proto(privacy_to_proto(spec.privacy)) == spec.privacy
    assert runspec_to_proto(spec).privacy.population == event.population


def test_an_unset_proto_field_takes_the_default() -> None:
    got = privacy_from_proto(common_pb2.Privacy(epsilon=8.0))
    assert got == PrivacySpec(epsilon=8.0)


def test_poisson_rounds_have_no_quorum() -> None:
    spec = runspec_from_toml(doc({"epsilon": 8.0, "sampling": "poisson", "population": 100}))
    assert spec.quorum == 0


REFUSED = [
    ({"sampling": "shuffle"}, {}, "privacy.sampling: must be one of none, poisson, fixed"),
    ({"accountant": "moments"}, {}, "privacy.accountant: must be one of rdp, pld"),
    ({"sampling": "poisson"}, {}, "privacy.population: sampling 'poisson' needs the population"),
    ({"sampling": "fixed", "population": 9}, {}, "privacy.population: sampling 'fixed' needs"),
    ({"population": 100}, {}, "privacy.population: only a sampled run uses it"),
    ({"population": -1}, {}, "privacy.population: must be an integer in [0, 10000000]"),
    ({"population": 10**8}, {}, "privacy.population: must be an integer"),
    ({"population": 1.5}, {}, "privacy.population: expected int"),
    ({"sampling": 3}, {}, "privacy.sampling: expected str"),
    ({"sampling": "fixed", "population": 100, "accountant": "pld"}, {},
     "privacy.accountant: dp-accounting has no PLD for fixed-size sampling"),
    ({"sampling": "poisson", "population": 100}, {"min_sites": 5},
     "min_sites: a Poisson-sampled private run commits each round"),
    ({"sampling": "poisson", "population": 100}, {"secagg": {"clip": 100.0}},
     "privacy.sampling: 'poisson' cannot be combined with [secagg]"),
    ({"poisson": True}, {}, "privacy.poisson: unknown key"),
    ({"noise_multiplier": 0.3, "sampling": "fixed", "population": 10, "epsilon": 2.0}, {},
     "privacy.epsilon: one round with noise_multiplier 0.3 already spends epsilon"),
]  # fmt: skip


@pytest.mark.parametrize(("privacy", "top", "says"), REFUSED, ids=[c[2] for c in REFUSED])
def test_bad_privacy_keys_are_refused_naming_the_key(
    privacy: dict[str, Any], top: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        runspec_from_toml(doc({"epsilon": 8.0, **privacy}, **top))
    assert str(info.value).startswith(says), info.value


def test_the_same_refusal_for_a_spec_built_in_python() -> None:
    spec = runspec_from_toml(doc({"epsilon": 8.0}))
    assert spec.privacy is not None
    bad = dataclasses.replace(spec, privacy=dataclasses.replace(spec.privacy, sampling="fixed"))
    with pytest.raises(ConfigError, match=r"^privacy\.population: "):
        bad.validate()


def test_fixed_sampling_combines_with_secagg() -> None:
    spec = runspec_from_toml(
        doc(
            {"epsilon": 50.0, "sampling": "fixed", "population": 20, "clip": 0.5},
            sites_per_round=4,
            secagg={"clip": 16.0},
        )
    )
    assert spec.privacy is not None
    assert Accountant(spec.privacy.round_event(4), 1).epsilon(1e-5) < 50.0
