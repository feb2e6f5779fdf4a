"""Tests for configuration: run.toml into a RunSpec, site.toml into a SiteConfig, and Backoff.

Every bad input must raise ConfigError naming the dotted key and the reason.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from fedra.client.config import SiteConfig
from fedra.config import ConfigError, load_toml
from fedra.retry import Backoff
from fedra.runspec import (
    STRATEGY_PARAMS,
    AggregationSpec,
    AsyncSpec,
    PrivacySpec,
    RunSpec,
    SecAggSpec,
    TrainSpec,
    runspec_from_toml,
)

MINIMAL_RUN = 'task = "m:t"\nrounds = 3\n'

FULL_RUN = """\
name = "digits-momentum"
task = "fedra.examples.digits:task"
rounds = 5
sites_per_round = 3
min_sites = 2
round_deadline_s = 120
max_round_attempts = 4
join_timeout_s = 30.5
seed = 42

[train]
local_steps = 10
local_epochs = 0
batch_size = 16
learning_rate = 0.1

[train.params]
hidden = 64
activation = "relu"

[strategy]
name = "fedavgm"
momentum = 0.5
server_lr = 1
"""

FULL_SPEC = RunSpec(
    task="fedra.examples.digits:task",
    rounds=5,
    name="digits-momentum",
    sites_per_round=3,
    min_sites=2,
    round_deadline_s=120.0,
    max_round_attempts=4,
    join_timeout_s=30.5,
    seed=42,
    train=TrainSpec(
        local_steps=10,
        local_epochs=0,
        batch_size=16,
        learning_rate=0.1,
        params={"hidden": "64", "activation": "relu"},
    ),
    strategy="fedavgm",
    strategy_params={"momentum": 0.5, "server_lr": 1.0},
)


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _run_from_text(tmp_path: Path, text: str) -> RunSpec:
    return runspec_from_toml(load_toml(_write(tmp_path, text)))


# -- run.toml --------------------------------------------------------------------------


def test_full_run_toml(tmp_path: Path) -> None:
    spec = _run_from_text(tmp_path, FULL_RUN)
    assert spec == FULL_SPEC
    # Ints where floats are asked for become floats, so JSON and comparisons agree.
    assert isinstance(spec.round_deadline_s, float)
    assert isinstance(spec.strategy_params["server_lr"], float)
    assert spec.quorum == 2
    assert spec.strategy_param("momentum") == 0.5


def test_train_params_reach_the_task_as_text(tmp_path: Path) -> None:
    spec = _run_from_text(
        tmp_path,
        MINIMAL_RUN
        + '[train.params]\nname = "mlp"\nhidden = 64\nscale = 0.5\ntiny = 1e-05\n'
        + "big = 12345678901234\nfused = true\nnesterov = false\n",
    )
    assert spec.train.params == {
        "name": "mlp",
        "hidden": "64",
        "scale": "0.5",
        "tiny": "1e-05",
        "big": "12345678901234",
        "fused": "true",
        "nesterov": "false",
    }
    assert float(spec.train.params["tiny"]) == 1e-05


def test_run_spec_json_round_trip(tmp_path: Path) -> None:
    spec = _run_from_text(tmp_path, FULL_RUN)
    text = spec.to_json()
    again = RunSpec.from_json(text)
    assert again == spec
    assert isinstance(again.train, TrainSpec)
    assert again.to_json() == text
    assert again.validate() is again


def test_minimal_run_toml_uses_defaults(tmp_path: Path) -> None:
    spec = _run_from_text(tmp_path, MINIMAL_RUN)
    assert spec == RunSpec(task="m:t", rounds=3)
    assert spec.strategy == "fedavg"
    assert spec.strategy_params == {}
    assert spec.quorum == spec.sites_per_round == 2  # min_sites 0 means sites_per_round
    assert spec.strategy_param("server_lr") == STRATEGY_PARAMS["fedavg"]["server_lr"].default
    assert RunSpec.from_json(spec.to_json()) == spec


def test_boundary_values_are_accepted(tmp_path: Path) -> None:
    spec = _run_from_text(
        tmp_path,
        """\
        task = "pkg.mod:attr"
        rounds = 1000000
        sites_per_round = 1
        min_sites = 1
        [train]
        local_steps = 1
        local_epochs = 0
        [strategy]
        name = "fedadam"
        beta1 = 0.0
        beta2 = 0
        """,
    )
    assert spec.strategy_params == {"beta1": 0.0, "beta2": 0.0}
    assert spec.train.local_steps == 1


BAD_RUNS = [
    # (TOML text, dotted key, part of the reason)
    ("rounds = 3", "task", "required"),
    ('task = "no_colon"\nrounds = 3', "task", "package.module:attr"),
    ('task = "m:t"\nrounds = 0', "rounds", "must be an integer in [1, 1000000]"),
    ('task = "m:t"\nrounds = "3"', "rounds", "expected int, got str"),
    ('task = "m:t"\nrounds = true', "rounds", "expected int, got bool"),
    ('task = "m:t"\nrounds = 3.0', "rounds", "expected int, got float"),
    (MINIMAL_RUN + "sites_per_round = 2\nmin_sites = 3", "min_sites", "sites_per_round=2"),
    (MINIMAL_RUN + "round_deadline_s = nan", "round_deadline_s", "a finite number in (0, 604800]"),
    (MINIMAL_RUN + "join_timeout_s = 0", "join_timeout_s", "a finite number in (0, 604800]"),
    (MINIMAL_RUN + "seed = -1", "seed", "an integer in [0, 9223372036854775807]"),
    ('task = "m:t"\nrounds = 3\nround = 3', "round", "unknown key"),
    (MINIMAL_RUN + "[train.params]\nsizes = [1, 2]", "train.params.sizes", "got array [1, 2]"),
    (MINIMAL_RUN + '[codec]\nname = "int8"\nfraction = 0.1', "codec.fraction", "only the topk"),
    (MINIMAL_RUN + '[codec]\nname = "topk"\nblock = 64', "codec.block", "not 'topk'"),
    (MINIMAL_RUN + "[codec]\nblock = 64", "codec.block", "only the int8 codec uses it, not 'none'"),
    (MINIMAL_RUN + "[train.params.model]\nhidden = 4", "train.params.model", "got table"),
    (MINIMAL_RUN + "[train.params]\nday = 2026-11-30", "train.params.day", "got date"),
    (MINIMAL_RUN + "[train.params]\nlr = nan", "train.params.lr", "must be finite"),
    (MINIMAL_RUN + "[train]\nbatchsize = 8", "train.batchsize", "unknown key"),
    (MINIMAL_RUN + "[train]\nbatch_size = 0", "train.batch_size", "an integer in [1, 1048576]"),
    (MINIMAL_RUN + "[train]\nlearning_rate = -1", "train.learning_rate", "number in (0, 100]"),
    (MINIMAL_RUN + "[train]\nlearning_rate = inf", "train.learning_rate", "(0, 100]"),
    (MINIMAL_RUN + "[train]\nlocal_steps = -1", "train.local_steps", "an integer in [0, 1000000]"),
    (
        MINIMAL_RUN + "[train]\nlocal_steps = 0\nlocal_epochs = 0",
        "train.local_steps",
        "local_steps or local_epochs must be > 0",
    ),
    (MINIMAL_RUN + 'train = "fast"', "train", "expected dict"),
    (MINIMAL_RUN + '[strategy]\nname = "fedprox"', "strategy.name", "unknown strategy 'fedprox'"),
    (
        MINIMAL_RUN + '[strategy]\nname = "fedavg"\nmomentum = 0.5',
        "strategy.momentum",
        "unknown key",
    ),
    (
        MINIMAL_RUN + '[strategy]\nname = "fedavgm"\nmomentum = 1.0',
        "strategy.momentum",
        "must be a finite number in [0, 1)",
    ),
    (
        MINIMAL_RUN + '[strategy]\nname = "fedavgm"\nmomentum = -0.1',
        "strategy.momentum",
        "must be a finite number in [0, 1)",
    ),
    (MINIMAL_RUN + "[strategy]\nserver_lr = 0", "strategy.server_lr", "number in (0, 100]"),
    (
        MINIMAL_RUN + '[strategy]\nname = "fedadam"\ntau = inf',
        "strategy.tau",
        "must be a finite number in (0, 10]",
    ),
    (MINIMAL_RUN + '[strategy]\nserver_lr = "1"', "strategy.server_lr", "expected float"),
    (MINIMAL_RUN + "[strategy]\nname = 3", "strategy.name", "expected str"),
    # [aggregation], [privacy], [secagg]
    (MINIMAL_RUN + '[aggregation]\nrule = "mode"', "aggregation.rule", "one of mean, median"),
    (
        MINIMAL_RUN + '[aggregation]\nrule = "trimmed_mean"\ntrim = 0.5',
        "aggregation.trim",
        "a finite number in [0, 0.5)",
    ),
    (MINIMAL_RUN + "[aggregation]\nnorm_bound = -1.0", "aggregation.norm_bound", "[0, 1000000]"),
    (MINIMAL_RUN + "[aggregation]\nmedian = 1", "aggregation.median", "unknown key"),
    (
        MINIMAL_RUN + 'sites_per_round = 4\n[aggregation]\nrule = "krum"\nbyzantine = 1',
        "aggregation.byzantine",
        "needs at least 5 updates per round, but min_sites is 4",
    ),
    (MINIMAL_RUN + "[privacy]\nclip = 1.0", "privacy.epsilon", "required"),
    (MINIMAL_RUN + "[privacy]\nepsilon = 8\nclip = 0", "privacy.clip", "number in (0, 1000000]"),
    (MINIMAL_RUN + "[privacy]\nepsilon = 8\ndelta = 1.0", "privacy.delta", "number in (0, 1)"),
    (
        MINIMAL_RUN + "[privacy]\nepsilon = 1\nnoise_multiplier = 0.1",
        "privacy.epsilon",
        "one round with noise_multiplier 0.1 already spends epsilon",
    ),
    (
        MINIMAL_RUN + '[privacy]\nepsilon = 8\n[aggregation]\nrule = "median"',
        "aggregation.rule",
        "needs the clipped mean",
    ),
    (
        MINIMAL_RUN + "[privacy]\nepsilon = 8\n[aggregation]\nnorm_bound = 1.0",
        "aggregation.norm_bound",
        "[privacy] clip already bounds",
    ),
    (MINIMAL_RUN + "[secagg]\nthreshold = 0", "secagg.threshold", "a finite number in (0, 1]"),
    (MINIMAL_RUN + "[secagg]\ndegree = -1", "secagg.degree", "an integer in [0, 10000]"),
    (MINIMAL_RUN + "[secagg]\nclip = inf", "secagg.clip", "a finite number in (0, 1000000]"),
    (MINIMAL_RUN + "[secagg]\nkeys = 2", "secagg.keys", "unknown key"),
    (MINIMAL_RUN + "secagg = 1", "secagg", "expected a table"),
    (
        MINIMAL_RUN + '[secagg]\n[codec]\nname = "int8"',
        "codec.name",
        "cannot be combined with codec 'int8'",
    ),
    (
        MINIMAL_RUN + '[secagg]\n[aggregation]\nrule = "median"',
        "aggregation.rule",
        "cannot run with [secagg]",
    ),
    (
        MINIMAL_RUN + "sites_per_round = 1\n[secagg]",
        "min_sites",
        "needs a quorum of at least 2",
    ),
    (
        MINIMAL_RUN + "sites_per_round = 5\nmin_sites = 2\n[secagg]\nthreshold = 0.5",
        "min_sites",
        "a site's secrets need 2 shares, so a round needs at least 3 surviving sites",
    ),
    (MINIMAL_RUN + "[codec]\ndownload = true", "codec.download", "needs a compressing codec"),
    (MINIMAL_RUN + '[codec]\nname = "int8"\ndownload = 1', "codec.download", "expected bool"),
    (MINIMAL_RUN + "[async]\nbuffer = 3", "async.buffer", "sites_per_round=2"),
    (MINIMAL_RUN + "[async]\nbuffer = 0", "async.buffer", "an integer in [1, 10000]"),
    (MINIMAL_RUN + "[async]\nmax_staleness = -1", "async.max_staleness", "an integer in [0, 1000]"),
    (MINIMAL_RUN + '[async]\nstaleness = "poly"', "async.staleness", "sqrt, constant"),
    (MINIMAL_RUN + "[async]\nbuffers = 1", "async.buffers", "unknown key"),
    (MINIMAL_RUN + "min_sites = 1\n[async]", "min_sites", "leave min_sites unset"),
    (MINIMAL_RUN + "[async]\n[secagg]", "async", "cannot be combined with [secagg]"),
    (
        MINIMAL_RUN + 'sites_per_round = 3\n[async]\n[aggregation]\nrule = "median"',
        "aggregation.rule",
        "cannot run with [async]",
    ),
    (
        MINIMAL_RUN + "sites_per_round = 3\n[privacy]\nepsilon = 8\n[secagg]\nclip = 2.0",
        "secagg.clip",
        "at least privacy.clip + 6 x the noise std a site adds (4.464)",
    ),
    (MINIMAL_RUN + '[codec]\nname = "secagg"', "codec.name", "asked for with a [secagg] table"),
]


def test_async_table_and_staleness_weights(tmp_path: Path) -> None:
    spec = _run_from_text(
        tmp_path,
        MINIMAL_RUN + "sites_per_round = 4\n[async]\nbuffer = 3\nmax_staleness = 2\n",
    )
    assert spec.asynchronous == AsyncSpec(buffer=3, max_staleness=2, staleness="sqrt")
    assert spec.quorum == 3
    assert RunSpec.from_json(spec.to_json()) == spec
    assert spec.asynchronous.weight(0) == 1.0
    assert spec.asynchronous.weight(3) == pytest.approx(0.5)
    assert AsyncSpec(staleness="constant").weight(7) == 1.0


def test_privacy_and_secure_aggregation_tables(tmp_path: Path) -> None:
    spec = _run_from_text(
        tmp_path,
        MINIMAL_RUN
        + "sites_per_round = 5\n"
        + '[aggregation]\nrule = "mean"\n'
        + "[privacy]\nclip = 0.5\nnoise_multiplier = 2\nepsilon = 10\n"
        + "[secagg]\nthreshold = 0.6\ndegree = 2\nclip = 4\n",
    )
    assert spec.privacy == PrivacySpec(clip=0.5, noise_multiplier=2.0, epsilon=10.0)
    assert spec.secagg == SecAggSpec(threshold=0.6, degree=2, clip=4.0)
    assert RunSpec.from_json(spec.to_json()) == spec
    robust = _run_from_text(
        tmp_path,
        MINIMAL_RUN
        + "sites_per_round = 7\n"
        + '[aggregation]\nrule = "multikrum"\nbyzantine = 2\nselect = 3\nspill_mb = 0\n',
    )
    assert robust.aggregation == AggregationSpec("multikrum", byzantine=2, select=3, spill_mb=0)
    assert robust.privacy is None and robust.secagg is None
    assert RunSpec.from_json(robust.to_json()) == robust


@pytest.mark.parametrize(("text", "key", "reason"), BAD_RUNS)
def test_bad_run_toml_names_the_key(tmp_path: Path, text: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        _run_from_text(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert reason in message


def test_run_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'task = "m:t"\nrounds = = 3\n')
    with pytest.raises(ConfigError) as info:
        load_toml(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "line 2" in str(info.value)


def test_non_utf8_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes(b'task = "caf\xe9:t"\nrounds = 3\n')  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_toml(path)


def test_missing_run_toml_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "run.toml"
    with pytest.raises(ConfigError) as info:
        load_toml(path)
    assert str(info.value) == f"{path}: no such file"


def test_validate_checks_directly_built_specs() -> None:
    good = RunSpec(task="m:t", rounds=3, strategy="fedavgm", strategy_params={"momentum": 0.5})
    assert good.validate() is good
    with pytest.raises(ConfigError, match=r"^strategy\.momentum: "):
        replace(good, strategy_params={"momentum": math.nan}).validate()
    with pytest.raises(
        ConfigError, match=r"^max_round_attempts: must be an integer in \[1, 1000\],"
    ):
        replace(good, max_round_attempts=0).validate()
    with pytest.raises(ConfigError, match=r"^sites_per_round: must be an integer in \[1, 10000\]"):
        replace(good, sites_per_round=0, min_sites=0).validate()
    with pytest.raises(ConfigError, match=r"^train\.batch_size: "):
        replace(good, train=TrainSpec(batch_size=-2)).validate()


# -- site.toml -------------------------------------------------------------------------

SITE = """\
site_id = "hospital-a_1.eu"
coordinator = "coord.example.org:50051"
allowed_tasks = ["fedra.examples.digits:task", "pkg.mod:other"]
reconnect_max_s = 5
threads = 2
tls_dir = "/etc/fedra/hospital-a"

[data]
shard = 1
path = "/data/a"
"""


def test_site_toml(tmp_path: Path) -> None:
    config = SiteConfig.load(_write(tmp_path, SITE, "site.toml"))
    assert config == SiteConfig(
        path=tmp_path / "site.toml",
        site_id="hospital-a_1.eu",
        coordinator="coord.example.org:50051",
        allowed_tasks=("fedra.examples.digits:task", "pkg.mod:other"),
        data={"shard": 1, "path": "/data/a"},
        reconnect_max_s=5.0,
        threads=2,
        tls_dir=Path("/etc/fedra/hospital-a"),
    )
    assert isinstance(config.reconnect_max_s, float)


def test_a_data_key_no_allowed_task_reads_is_refused(tmp_path: Path) -> None:
    """One [data] table serves every task a site allows: a key that none of them reads
    is a typo, refused at start naming the site file; a task that does not say which
    keys it reads lets any key through."""
    from fedra.client.agent import check_data_keys, load_data
    from fedra.examples import digits, synthetic

    tasks = {"d:t": digits.task}
    check_data_keys({"partition": 0, "num_partitions": 2, "alpha": 0.1}, tasks)
    with pytest.raises(ConfigError) as info:
        check_data_keys({"partition": 0, "num_partitions": 2, "alhpa": 0.1}, tasks)
    assert str(info.value) == (
        "data.alhpa: unknown key: no task this site allows reads it (they read alpha, "
        "num_partitions, partition, seed)"
    )
    both = {"d:t": digits.task, "s:t": synthetic.task}
    check_data_keys({"partition": 0, "num_partitions": 2, "samples": 64}, both)

    class Quiet:  # says nothing about its keys
        pass

    check_data_keys({"anything": 1}, {"d:t": digits.task, "q:t": Quiet()})  # type: ignore[dict-item]
    path = _write(
        tmp_path,
        'site_id = "s1"\ncoordinator = "127.0.0.1:1"\nallowed_tasks = ["d:t"]\n'
        "insecure = true\n[data]\npartition = 0\nnum_partitions = 2\nalhpa = 0.1\n",
        "site.toml",
    )
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: data\.alhpa: unknown key"):
        load_data(SiteConfig.load(path), tasks)
    bad_value = SiteConfig.from_toml(
        {"site_id": "s1", "coordinator": "h:1", "allowed_tasks": ["d:t"], "insecure": True,
         "data": {"partition": 5, "num_partitions": 2}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^data\.partition: must be in \[0, 2\)"):
        load_data(bad_value, tasks)  # not read from a file: no path to name


def test_minimal_site_toml_uses_defaults() -> None:
    doc = {"site_id": "s1", "coordinator": "[::1]:7000", "allowed_tasks": ["m:t"], "insecure": True}
    config = SiteConfig.from_toml(doc)
    assert config == SiteConfig("s1", "[::1]:7000", ("m:t",), insecure=True)
    assert config.reconnect_max_s == 30.0
    assert config.threads == 0
    assert config.data == {}


def _site_doc(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "site_id": "site-1",
        "coordinator": "localhost:50051",
        "allowed_tasks": ["m:t"],
        "insecure": True,
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


BAD_SITES = [
    (_site_doc(site_id="site a"), "site_id", "letters, digits"),
    (_site_doc(site_id=""), "site_id", "letters, digits"),
    (_site_doc(site_id="x" * 129), "site_id", "1-128"),
    (_site_doc(site_id="../etc"), "site_id", "letters, digits"),
    (_site_doc(site_id=None), "site_id", "required"),
    (_site_doc(coordinator="localhost"), "coordinator", "host:port"),
    (_site_doc(coordinator="localhost:"), "coordinator", "host:port"),
    (_site_doc(coordinator=":50051"), "coordinator", "host:port"),
    (_site_doc(coordinator="localhost:port"), "coordinator", "host:port"),
    (_site_doc(coordinator="localhost:\u00b2"), "coordinator", "port in 1-65535"),
    (_site_doc(coordinator="localhost:0"), "coordinator", "port in 1-65535"),
    (_site_doc(coordinator="::1:50051"), "coordinator", "IPv6 host in brackets"),
    (_site_doc(allowed_tasks=[]), "allowed_tasks", "at least one"),
    (_site_doc(allowed_tasks="m:t"), "allowed_tasks", "expected list"),
    (_site_doc(allowed_tasks=["m:t", "no_attr"]), "allowed_tasks[1]", "package.module:attr"),
    (_site_doc(allowed_tasks=["m:"]), "allowed_tasks[0]", "package.module:attr"),
    (_site_doc(allowed_tasks=[":t"]), "allowed_tasks[0]", "package.module:attr"),
    (_site_doc(allowed_tasks=[3]), "allowed_tasks[0]", "package.module:attr"),
    (_site_doc(threads=-1), "threads", "must be >= 0"),
    (_site_doc(threads=1.5), "threads", "expected int"),
    (_site_doc(reconnect_max_s=0), "reconnect_max_s", "> 0"),
    (_site_doc(reconnect_max_s=math.inf), "reconnect_max_s", "> 0"),
    (_site_doc(data=["a"]), "data", "expected dict"),
    (_site_doc(thread=2), "thread", "unknown key"),
    (_site_doc(insecure=None), "tls_dir", "fedra provision"),
    (_site_doc(tls_dir="/x"), "tls_dir", "not both"),
    (_site_doc(site_id=".."), "site_id", "letters, digits"),
]


@pytest.mark.parametrize(("doc", "key", "reason"), BAD_SITES)
def test_bad_site_config_names_the_key(doc: dict[str, object], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        SiteConfig.from_toml(doc)
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert reason in message


def test_bad_site_file_names_the_path_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, SITE.replace('"hospital-a_1.eu"', '"hospital a"'), "site.toml")
    with pytest.raises(ConfigError) as info:
        SiteConfig.load(path)
    assert str(info.value).startswith(f"{path}: site_id: ")


def test_site_file_unknown_key(tmp_path: Path) -> None:
    path = _write(tmp_path, SITE + "\n[extra]\nx = 1\n", "site.toml")
    with pytest.raises(ConfigError, match=r": extra: unknown key"):
        SiteConfig.load(path)


def test_missing_site_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    with pytest.raises(ConfigError) as info:
        SiteConfig.load(path)
    assert str(path) in str(info.value)
    assert "no such file" in str(info.value)


# -- Backoff ---------------------------------------------------------------------------


def _ceilings(base: float, cap: float, n: int) -> list[float]:
    return [min(cap, base * 2**i) for i in range(n)]


def test_backoff_delays_stay_within_jitter_bounds() -> None:
    backoff = Backoff(base_s=0.5, cap_s=4.0, _rng=random.Random(1234))
    ceilings = _ceilings(0.5, 4.0, 12)
    assert ceilings[:5] == [0.5, 1.0, 2.0, 4.0, 4.0]
    delays = [backoff.next_delay_s() for _ in ceilings]
    for delay, c in zip(delays, ceilings, strict=True):
        assert c / 2 <= delay <= c
    # Growing while under the cap: failure n+1 waits at least the ceiling of failure n.
    assert delays[0] < delays[3]
    assert all(a <= b for a, b in itertools.pairwise(delays[:4]))
    assert max(delays) <= 4.0
    assert backoff.attempts == len(ceilings)


def test_backoff_draws_uniformly_from_its_rng() -> None:
    backoff = Backoff(base_s=0.2, cap_s=3.0, _rng=random.Random(7))
    twin = random.Random(7)
    expected = [twin.uniform(c / 2, c) for c in _ceilings(0.2, 3.0, 10)]
    assert [backoff.next_delay_s() for _ in expected] == expected


def test_backoff_jitter_spreads_over_the_range() -> None:
    """Many sites failing together must not wait the same time."""
    delays = [Backoff(base_s=1.0, _rng=random.Random(seed)).next_delay_s() for seed in range(200)]
    assert all(0.5 <= d <= 1.0 for d in delays)
    assert min(delays) < 0.6
    assert max(delays) > 0.9


def test_backoff_reset_starts_over() -> None:
    backoff = Backoff(base_s=0.5, cap_s=4.0, _rng=random.Random(99))
    for _ in range(6):
        backoff.next_delay_s()
    assert 2.0 <= backoff.next_delay_s() <= 4.0
    backoff.reset()
    assert backoff.attempts == 0
    assert 0.25 <= backoff.next_delay_s() <= 0.5
    assert 0.5 <= backoff.next_delay_s() <= 1.0


def test_backoff_after_very_many_failures_stays_at_the_cap() -> None:
    """A site retrying through a long outage keeps waiting ~cap, and never crashes."""
    backoff = Backoff(base_s=0.2, cap_s=30.0, _rng=random.Random(3))
    backoff.attempts = 5000
    for _ in range(3):
        assert 15.0 <= backoff.next_delay_s() <= 30.0


def test_the_cli_and_run_specs_do_not_import_torch() -> None:
    """Every `fedra` command started in seconds while torch loaded; submitting, watching or
    listing needs none of it (a [privacy] spec's accounting is plain math)."""
    spec = MINIMAL_RUN + "[privacy]\nepsilon = 8\nclip = 1.0\n"
    code = (
        "import sys, tomllib\n"
        "import fedra.cli\n"
        "from fedra.runspec import runspec_from_toml\n"
        f"runspec_from_toml(tomllib.loads({spec!r})).validate()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
