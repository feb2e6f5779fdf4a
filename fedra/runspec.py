"""The run specification: what an operator submits, validated the same way on both sides."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedra.config import ConfigError, check_keys, get, require


@dataclass(frozen=True)
class Param:
    """A strategy parameter: its default and its open (low, high) or half-open [low, high) range."""

    default: float
    low: float
    high: float
    low_inclusive: bool = False

    def contains(self, value: float) -> bool:
        above = value >= self.low if self.low_inclusive else value > self.low
        return math.isfinite(value) and above and value < self.high

    def describe(self) -> str:
        return f"{'[' if self.low_inclusive else '('}{self.low}, {self.high})"


_POSITIVE = Param(1.0, 0.0, math.inf)
_UNIT = Param(0.9, 0.0, 1.0, low_inclusive=True)
_ADAPTIVE = {
    "server_lr": Param(0.01, 0.0, math.inf),
    "beta1": _UNIT,
    "beta2": Param(0.99, 0.0, 1.0, low_inclusive=True),
    "tau": Param(1e-3, 0.0, math.inf),
}
STRATEGY_PARAMS: dict[str, dict[str, Param]] = {
    "fedavg": {"server_lr": _POSITIVE},
    "fedavgm": {"server_lr": _POSITIVE, "momentum": _UNIT},
    "fedadam": _ADAPTIVE,
    "fedyogi": _ADAPTIVE,
    # Outer Nesterov SGD on the pseudo-gradient; defaults from the DiLoCo paper.
    "diloco": {"server_lr": Param(0.7, 0.0, math.inf), "momentum": _UNIT},
}
CODECS = ("none", "fp16", "bf16", "int8", "topk")


@dataclass(frozen=True)
class CodecSpec:
    """How sites compress their updates, and its parameters (``[codec]`` in run.toml)."""

    name: str = "none"
    block: int = 256  # int8: elements per block, each with its own fp32 absmax scale
    fraction: float = 0.01  # topk: share of each float tensor's elements sent (at least 1)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> CodecSpec:
        """Return self, or raise ConfigError naming the offending field."""
        if self.name not in CODECS:
            raise ConfigError(f"codec.name: must be one of {', '.join(CODECS)}, got {self.name!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ConfigError(f"codec.block: must be a positive int, got {self.block!r}")
        ok = isinstance(self.fraction, int | float) and not isinstance(self.fraction, bool)
        if not ok or not 0 < self.fraction <= 1:  # also refuses NaN
            raise ConfigError(f"codec.fraction: must be a number in (0, 1], got {self.fraction!r}")
        return self


@dataclass(frozen=True)
class TrainSpec:
    local_steps: int = 0
    local_epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    params: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        require(self.local_steps >= 0, "train.local_steps", "must be >= 0", self.local_steps)
        require(self.local_epochs >= 0, "train.local_epochs", "must be >= 0", self.local_epochs)
        require(
            self.local_steps > 0 or self.local_epochs > 0,
            "train.local_steps",
            "local_steps or local_epochs must be > 0",
            self.local_steps,
        )
        require(self.batch_size > 0, "train.batch_size", "must be > 0", self.batch_size)
        require(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "train.learning_rate",
            "must be a finite number > 0",
            self.learning_rate,
        )


@dataclass(frozen=True)
class RunSpec:
    task: str
    rounds: int
    name: str = ""
    sites_per_round: int = 2
    min_sites: int = 0  # 0: same as sites_per_round
    round_deadline_s: float = 300.0
    max_round_attempts: int = 3
    join_timeout_s: float = 60.0
    seed: int = 0
    train: TrainSpec = field(default_factory=TrainSpec)
    strategy: str = "fedavg"
    strategy_params: dict[str, float] = field(default_factory=dict)
    codec: CodecSpec = field(default_factory=CodecSpec)

    @property
    def quorum(self) -> int:
        return self.min_sites or self.sites_per_round

    def validate(self) -> RunSpec:
        """Raise ConfigError naming the first bad key; returns self for chaining."""
        module, sep, attr = self.task.partition(":")
        require(
            bool(module and sep and attr), "task", "must look like 'package.module:attr'", self.task
        )
        require(1 <= self.rounds <= 1_000_000, "rounds", "must be in [1, 1000000]", self.rounds)
        require(self.sites_per_round >= 1, "sites_per_round", "must be >= 1", self.sites_per_round)
        require(
            0 <= self.min_sites <= self.sites_per_round,
            "min_sites",
            f"must be in [1, sites_per_round={self.sites_per_round}] (0 means sites_per_round)",
            self.min_sites,
        )
        for key in ("round_deadline_s", "join_timeout_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, "must be a finite number > 0", value)
        require(
            self.max_round_attempts >= 1,
            "max_round_attempts",
            "must be >= 1",
            self.max_round_attempts,
        )
        require(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)
        self.train.validate()
        self._validate_strategy()
        return self

    def _validate_strategy(self) -> None:
        known = STRATEGY_PARAMS.get(self.strategy)
        if known is None:
            raise ConfigError(
                f"strategy.name: unknown strategy {self.strategy!r} "
                f"(expected one of {', '.join(STRATEGY_PARAMS)})"
            )
        check_keys(self.strategy_params, set(known), "strategy")
        for key, value in self.strategy_params.items():
            bound = known[key]
            require(
                bound.contains(value), f"strategy.{key}", f"must be in {bound.describe()}", value
            )

    def strategy_param(self, key: str) -> float:
        """The run's value for a strategy parameter, or the strategy's default."""
        return self.strategy_params.get(key, STRATEGY_PARAMS[self.strategy][key].default)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> RunSpec:
        raw = json.loads(text)
        raw["train"] = TrainSpec(**raw["train"])
        raw["codec"] = CodecSpec(**raw.get("codec", {}))
        return RunSpec(**raw)


_TOP_KEYS = {
    "name", "task", "rounds", "sites_per_round", "min_sites", "round_deadline_s",
    "max_round_attempts", "join_timeout_s", "seed", "train", "strategy", "codec",
}  # fmt: skip
_TRAIN_KEYS = {"local_steps", "local_epochs", "batch_size", "learning_rate", "params"}


def runspec_from_toml(doc: Mapping[str, Any]) -> RunSpec:
    """Build and validate a RunSpec from a parsed run.toml."""
    check_keys(doc, _TOP_KEYS, "")
    train_t = get(doc, "train", dict, "", {})
    check_keys(train_t, _TRAIN_KEYS, "train")
    params_t = get(train_t, "params", dict, "train", {})
    train = TrainSpec(
        local_steps=get(train_t, "local_steps", int, "train", 0),
        local_epochs=get(train_t, "local_epochs", int, "train", 1),
        batch_size=get(train_t, "batch_size", int, "train", 32),
        learning_rate=get(train_t, "learning_rate", float, "train", 0.05),
        params={str(k): str(v) for k, v in params_t.items()},
    )
    strategy_t = dict(get(doc, "strategy", dict, "", {"name": "fedavg"}))
    strategy_name = get(strategy_t, "name", str, "strategy", "fedavg")
    strategy_t.pop("name", None)
    strategy_params = {k: get(strategy_t, k, float, "strategy") for k in strategy_t}
    codec_t = get(doc, "codec", dict, "", {})
    check_keys(codec_t, {"name", "block", "fraction"}, "codec")
    codec = CodecSpec(
        name=get(codec_t, "name", str, "codec", "none"),
        block=get(codec_t, "block", int, "codec", 256),
        fraction=get(codec_t, "fraction", float, "codec", 0.01),
    )
    spec = RunSpec(
        codec=codec,
        task=get(doc, "task", str, ""),
        rounds=get(doc, "rounds", int, ""),
        name=get(doc, "name", str, "", ""),
        sites_per_round=get(doc, "sites_per_round", int, "", 2),
        min_sites=get(doc, "min_sites", int, "", 0),
        round_deadline_s=get(doc, "round_deadline_s", float, "", 300.0),
        max_round_attempts=get(doc, "max_round_attempts", int, "", 3),
        join_timeout_s=get(doc, "join_timeout_s", float, "", 60.0),
        seed=get(doc, "seed", int, "", 0),
        train=train,
        strategy=strategy_name,
        strategy_params=strategy_params,
    )
    return spec.validate()
