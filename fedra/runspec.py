"""The run specification: what an operator submits, validated the same way on both sides."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedra.accounting import ACCOUNTANTS, SAMPLINGS, RoundEvent, epsilon_after
from fedra.config import ConfigError, check_keys, get, require
from fedra.ranges import check


@dataclass(frozen=True)
class Param:
    """A strategy parameter's default; its range is ``ranges.RANGES['strategy.<name>']``.

    ``kind`` is what run.toml writes: a float, or a bool (``true``/``false``), which the
    spec (and the wire) carries as 1.0 / 0.0 like every other strategy parameter."""

    default: float
    kind: type[float] | type[bool] = float


_ADAPTIVE = {
    "server_lr": Param(0.01),
    "beta1": Param(0.9),
    "beta2": Param(0.99),
    "tau": Param(1e-3),
}
STRATEGY_PARAMS: dict[str, dict[str, Param]] = {
    "fedavg": {"server_lr": Param(1.0)},
    "fedavgm": {"server_lr": Param(1.0), "momentum": Param(0.9)},
    # Off by default: Reddi et al.'s Algorithm 2. On: Adam's, as Flower's FedAdam applies.
    "fedadam": {**_ADAPTIVE, "bias_correction": Param(0.0, bool)},
    "fedyogi": _ADAPTIVE,
    # v accumulates every d^2 (no beta2): the steps shrink as the run goes on.
    "fedadagrad": {k: v for k, v in _ADAPTIVE.items() if k != "beta2"},
    # Outer Nesterov SGD on the pseudo-gradient; defaults from the DiLoCo paper.
    "diloco": {"server_lr": Param(0.7), "momentum": Param(0.9)},
}
CODECS = ("none", "fp16", "bf16", "int8", "topk")
MAX_NAME_CHARS, MAX_TASK_CHARS = 200, 300  # a run's name and task entry point
# What the wire may carry: the user's codecs, and the masked integers of [secagg] runs.
WIRE_CODECS = (*CODECS, "secagg")


@dataclass(frozen=True)
class CodecSpec:
    """How sites compress their updates, and its parameters (``[codec]`` in run.toml)."""

    name: str = "none"
    block: int = 256  # int8: elements per block, each with its own fp32 absmax scale
    fraction: float = 0.01  # topk: share of each float tensor's elements sent (at least 1)
    # Also compress downloads: the coordinator moves the global model by the compressed
    # step only, and a site holding the previous model downloads just that step.
    download: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> CodecSpec:
        """Return self, or raise ConfigError naming the offending field."""
        if self.name not in WIRE_CODECS:
            raise ConfigError(f"codec.name: must be one of {', '.join(CODECS)}, got {self.name!r}")
        check("codec.block", self.block)
        check("codec.fraction", self.fraction)
        if not isinstance(self.download, bool):
            raise ConfigError(f"codec.download: must be true or false, got {self.download!r}")
        if self.download and self.name not in ("fp16", "bf16", "int8", "topk"):
            raise ConfigError(
                f"codec.download: needs a compressing codec (fp16, bf16, int8 or topk), "
                f"not {self.name!r}"
            )
        return self


AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "krum", "multikrum")


@dataclass(frozen=True)
class AggregationSpec:
    """How the round's updates are combined (``[aggregation]`` in run.toml).

    ``mean`` is the streaming, sample-weighted mean. The robust rules give every site one
    vote and need every update of the round (spilled to disk past ``spill_mb``).
    """

    rule: str = "mean"
    trim: float = 0.1  # trimmed_mean: share of updates cut at each end, in [0, 0.5)
    byzantine: int = 1  # krum, multikrum: bad updates tolerated (needs 2f + 3 updates)
    select: int = 0  # multikrum: how many best-scored updates are averaged (0: n - f)
    norm_bound: float = 0.0  # > 0: each update is scaled to at most this L2 norm first
    spill_mb: int = 256  # robust rules: updates past this much memory go to disk

    @property
    def robust(self) -> bool:
        return self.rule != "mean"

    def validate(self, sites_per_round: int, quorum: int) -> None:
        if self.rule not in AGGREGATION_RULES:
            raise ConfigError(
                f"aggregation.rule: must be one of {', '.join(AGGREGATION_RULES)}, "
                f"got {self.rule!r}"
            )
        for key in ("trim", "byzantine", "select", "norm_bound", "spill_mb"):
            check(f"aggregation.{key}", getattr(self, key))
        if self.rule in ("krum", "multikrum"):
            need = 2 * self.byzantine + 3
            require(
                quorum >= need,
                "aggregation.byzantine",
                f"{self.rule} with byzantine={self.byzantine} needs at least {need} updates "
                f"per round, but min_sites is {quorum}",
                self.byzantine,
            )
        if self.rule == "multikrum":
            require(
                self.select <= sites_per_round,
                "aggregation.select",
                f"must be <= sites_per_round ({sites_per_round})",
                self.select,
            )


@dataclass(frozen=True)
class PrivacySpec:
    """Central differential privacy, DP-FedAvg (``[privacy]`` in run.toml).

    Every update is clipped to L2 norm ``clip``; the sum gets Gaussian noise of standard
    deviation ``noise_multiplier * clip`` and is divided by ``sites_per_round``. A round
    that would take the run past (``epsilon``, ``delta``) is not started. ``sampling`` says
    how the coordinator picks a round's sites, and so what the accountant may claim
    (``fedra.accounting``): ``none`` (no amplification), ``poisson`` (each eligible site
    with probability ``sites_per_round / population``) or ``fixed`` (``sites_per_round``
    of at least ``population`` eligible sites); ``accountant`` is ``rdp`` or ``pld``.
    """

    clip: float = 1.0
    noise_multiplier: float = 1.0
    epsilon: float = 8.0
    delta: float = 1e-5
    sampling: str = "none"  # none | poisson | fixed
    population: int = 0  # the sites sampled from; 0 (not declared) only with sampling none
    accountant: str = "rdp"  # rdp | pld

    def round_event(self, sites_per_round: int) -> RoundEvent:
        """What one round is for the accountant (validate first)."""
        sampled = self.sampling != "none"
        return RoundEvent(
            self.noise_multiplier, self.sampling, sites_per_round if sampled else 0,
            self.population if sampled else 0, self.accountant,
        )  # fmt: skip

    def validate(self, sites_per_round: int) -> None:
        for key in ("clip", "noise_multiplier", "epsilon", "delta", "population"):
            check(f"privacy.{key}", getattr(self, key))
        require(self.sampling in SAMPLINGS, "privacy.sampling",
                f"must be one of {', '.join(SAMPLINGS)}", self.sampling)  # fmt: skip
        require(self.accountant in ACCOUNTANTS, "privacy.accountant",
                f"must be one of {', '.join(ACCOUNTANTS)}", self.accountant)  # fmt: skip
        if self.sampling == "none":
            require(self.population == 0, "privacy.population",
                    "only a sampled run uses it (set privacy.sampling to 'poisson' or "
                    "'fixed')", self.population)  # fmt: skip
        else:
            require(self.population >= sites_per_round, "privacy.population",
                    f"sampling {self.sampling!r} needs the population the sites are drawn "
                    f"from, at least sites_per_round ({sites_per_round})",
                    self.population)  # fmt: skip
        require(self.sampling != "fixed" or self.accountant == "rdp", "privacy.accountant",
                "dp-accounting has no PLD for fixed-size sampling: use 'rdp' with sampling "
                "'fixed'", self.accountant)  # fmt: skip
        event = self.round_event(sites_per_round)
        one = epsilon_after(event, 1, self.delta)
        if one > self.epsilon:
            raise ConfigError(
                f"privacy.epsilon: one round with noise_multiplier {self.noise_multiplier:g} "
                f"already spends epsilon {one:.4g} > {self.epsilon:g} (sampling "
                f"{self.sampling}, delta {self.delta:g}); raise noise_multiplier or epsilon"
            )


@dataclass(frozen=True)
class SecAggSpec:
    """Secure aggregation, SecAgg+ (``[secagg]`` in run.toml): the coordinator sees only
    the sum of the round's updates, each clipped per coordinate and quantised."""

    threshold: float = 0.5  # share of a site's neighbours needed to rebuild its secrets
    degree: int = 0  # neighbours per site (0: every other site, classic SecAgg)
    clip: float = 1.0  # each coordinate of an update is clipped to [-clip, clip]
    setup_timeout_s: float = 60.0  # for the key exchange, before training starts
    unmask_timeout_s: float = 60.0  # for the survivors' shares, after the uploads close

    def validate(self) -> None:
        for key in ("threshold", "degree", "clip", "setup_timeout_s", "unmask_timeout_s"):
            check(f"secagg.{key}", getattr(self, key))


STALENESS = ("sqrt", "constant")


@dataclass(frozen=True)
class PromotionSpec:
    """Never promote a worse model (``[promotion]`` in run.toml).

    Each committed round's model is a candidate. The sites of the next round evaluate it
    as their incoming global model (``metric``, e.g. ``eval_loss``, weighted by their
    samples); it is promoted if that is within ``max_regression`` of the best promoted so
    far (lower is better with ``goal = "min"``). After ``patience`` judged candidates in a
    row without a promotion, the run rolls back to the promoted model (its server
    optimiser state too) or stops, as ``on_patience`` says. Exports default to it.
    """

    metric: str = "eval_loss"
    goal: str = "min"  # min | max
    max_regression: float = 0.0  # absolute, in the metric's units
    patience: int = 3
    on_patience: str = "rollback"  # rollback | stop

    def validate(self) -> None:
        require(0 < len(self.metric) <= 100, "promotion.metric",
                "must be a metric's name (at most 100 characters)", self.metric)  # fmt: skip
        require(self.goal in ("min", "max"), "promotion.goal", "must be 'min' or 'max'",
                self.goal)  # fmt: skip
        check("promotion.max_regression", self.max_regression)
        check("promotion.patience", self.patience)
        require(self.on_patience in ("rollback", "stop"), "promotion.on_patience",
                "must be 'rollback' or 'stop'", self.on_patience)  # fmt: skip


@dataclass(frozen=True)
class AsyncSpec:
    """Buffered asynchronous rounds, FedBuff-style (``[async]`` in run.toml).

    ``sites_per_round`` sites train at once; every ``buffer`` accepted updates make the
    next global model, and a site that finishes gets a task on the newest model at once.
    An update trained on a model ``tau`` versions old counts with weight
    ``1 / sqrt(1 + tau)`` (``sqrt``) or 1 (``constant``); past ``max_staleness`` it is refused.
    """

    buffer: int = 2
    max_staleness: int = 4
    staleness: str = "sqrt"

    def weight(self, tau: int) -> float:
        """How much an update ``tau`` versions stale counts."""
        return 1.0 if self.staleness == "constant" else 1.0 / math.sqrt(1.0 + tau)

    def validate(self, sites_per_round: int) -> None:
        check("async.buffer", self.buffer)
        require(
            self.buffer <= sites_per_round,
            "async.buffer",
            f"must be in [1, sites_per_round={sites_per_round}]",
            self.buffer,
        )
        check("async.max_staleness", self.max_staleness)
        if self.staleness not in STALENESS:
            raise ConfigError(
                f"async.staleness: must be one of {', '.join(STALENESS)}, got {self.staleness!r}"
            )


@dataclass(frozen=True)
class TrainSpec:
    local_steps: int = 0
    local_epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    params: dict[str, str] = field(default_factory=dict)
    # FedProx: each site adds (mu/2)||w - w_global||^2 to its local loss; 0: off.
    proximal_mu: float = 0.0
    # Each site carries its inner optimiser's state from round to round of the run (in its
    # state_dir) instead of a fresh optimiser every round; reset_optimizer_every = N > 0
    # starts it afresh in rounds 1, N + 1, 2N + 1, ...
    keep_optimizer_state: bool = False
    reset_optimizer_every: int = 0
    # SCAFFOLD (Karimireddy et al. 2020, option II): control variates correct each site's
    # drift; scaffold_population is the N of c <- c + (|S| / N) mean(delta c_i), the sites
    # the rounds are drawn from (0: sites_per_round, every site in every round).
    scaffold: bool = False
    scaffold_population: int = 0
    # Overlap communication with compute: a site trains round r + 1 from its own round-r
    # model while its update uploads and the round commits, and moves that progress onto
    # the round's new global model when it arrives (a one-step-delayed outer update).
    overlap: bool = False

    def resets_optimizer(self, round_number: int) -> bool:
        """Whether round ``round_number`` (1 the first trained) starts a fresh optimiser."""
        n = self.reset_optimizer_every
        return not self.keep_optimizer_state or (n > 0 and (round_number - 1) % n == 0)

    def validate(self) -> None:
        for key in ("local_steps", "local_epochs", "batch_size", "learning_rate", "proximal_mu",
                    "reset_optimizer_every", "scaffold_population"):  # fmt: skip
            check(f"train.{key}", getattr(self, key))
        require(isinstance(self.keep_optimizer_state, bool), "train.keep_optimizer_state",
                "must be true or false", self.keep_optimizer_state)  # fmt: skip
        require(self.keep_optimizer_state or self.reset_optimizer_every == 0,
                "train.reset_optimizer_every",
                "only a run that keeps the state resets it (set train.keep_optimizer_state = "
                "true)", self.reset_optimizer_every)  # fmt: skip
        require(isinstance(self.scaffold, bool), "train.scaffold", "must be true or false",
                self.scaffold)  # fmt: skip
        require(self.scaffold or self.scaffold_population == 0, "train.scaffold_population",
                "only a SCAFFOLD run uses it (set train.scaffold = true)",
                self.scaffold_population)  # fmt: skip
        require(isinstance(self.overlap, bool), "train.overlap", "must be true or false",
                self.overlap)  # fmt: skip
        if self.overlap:  # both anchor on the round's global model, which comes late
            require(not self.scaffold, "train.overlap", "cannot be combined with "
                    "train.scaffold (c_i+ assumes every step was taken from the global "
                    "model)", self.overlap)  # fmt: skip
            require(self.proximal_mu == 0, "train.overlap", "cannot be combined with "
                    "train.proximal_mu yet (its anchor is the global model)",
                    self.overlap)  # fmt: skip
        if self.scaffold:  # option II's c_i+ assumes plain SGD steps on the loss alone
            require(self.proximal_mu == 0, "train.proximal_mu",
                    "cannot be combined with train.scaffold yet", self.proximal_mu)  # fmt: skip
            require(not self.keep_optimizer_state, "train.keep_optimizer_state",
                    "cannot be combined with train.scaffold (its inner optimiser is plain "
                    "SGD, which keeps no state)", self.keep_optimizer_state)  # fmt: skip
        require(
            self.local_steps > 0 or self.local_epochs > 0,
            "train.local_steps",
            "local_steps or local_epochs must be > 0",
            self.local_steps,
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
    aggregation: AggregationSpec = field(default_factory=AggregationSpec)
    privacy: PrivacySpec | None = None
    secagg: SecAggSpec | None = None
    asynchronous: AsyncSpec | None = None  # [async]
    promotion: PromotionSpec | None = None  # [promotion]

    @property
    def quorum(self) -> int:
        """Updates a round needs: min_sites, sites_per_round, an async run's buffer, or
        none for a Poisson-sampled private run."""
        if self.asynchronous is not None:
            return self.asynchronous.buffer
        if self.privacy is not None and self.privacy.sampling == "poisson":
            return 0  # a Poisson round commits what its sample delivers (rounds.py says why)
        return self.min_sites or self.sites_per_round

    def validate(self) -> RunSpec:
        """Raise ConfigError naming the first bad key; returns self for chaining."""
        module, sep, attr = self.task.partition(":")
        require(
            bool(module and sep and attr), "task", "must look like 'package.module:attr'", self.task
        )
        # As the database stores them (PostgreSQL refuses longer values).
        require(len(self.task) <= MAX_TASK_CHARS, "task", f"at most {MAX_TASK_CHARS} characters",
                f"{len(self.task)} characters")  # fmt: skip
        require(len(self.name) <= MAX_NAME_CHARS, "name", f"at most {MAX_NAME_CHARS} characters",
                f"{len(self.name)} characters")  # fmt: skip
        for key in _TOP_NUMBERS:
            check(key, getattr(self, key))
        require(
            self.min_sites <= self.sites_per_round,
            "min_sites",
            f"must be in [1, sites_per_round={self.sites_per_round}] (0 means sites_per_round)",
            self.min_sites,
        )
        self.train.validate()
        self._validate_scaffold()
        self._validate_strategy()
        self._validate_aggregation()
        self._validate_async()
        if self.promotion is not None:
            self.promotion.validate()
            if self.asynchronous is not None:
                raise ConfigError(
                    "promotion: cannot be combined with [async] (its models are not rounds "
                    "that a next round's sites evaluate)"
                )
        return self

    def scaffold_population(self) -> int:
        """SCAFFOLD's N: the declared population, or sites_per_round."""
        return self.train.scaffold_population or self.sites_per_round

    def _validate_scaffold(self) -> None:
        """SCAFFOLD at first only with the plain streaming mean: its delta c_i must reach
        the coordinator in the clear, unclipped and unmixed with stale rounds."""
        if not self.train.scaffold:
            return
        population = self.train.scaffold_population
        require(population == 0 or population >= self.sites_per_round,
                "train.scaffold_population",
                f"must be at least sites_per_round ({self.sites_per_round}), or 0",
                population)  # fmt: skip
        why = {
            "secagg": "the coordinator must see each site's delta c_i, not a masked sum",
            "privacy": "the control variates would need their own clipping and noise",
            "async": "a stale site's delta c_i would move c by a step it was not trained on",
        }
        for table, value in (("secagg", self.secagg), ("privacy", self.privacy),
                             ("async", self.asynchronous)):  # fmt: skip
            if value is not None:
                raise ConfigError(
                    f"train.scaffold: cannot be combined with [{table}] yet ({why[table]})"
                )
        if self.aggregation.robust:
            raise ConfigError(
                f"train.scaffold: cannot be combined with aggregation.rule "
                f"{self.aggregation.rule!r} yet (SCAFFOLD's c is the plain mean of the sites' "
                "delta c_i; use rule 'mean')"
            )
        if self.aggregation.norm_bound:
            raise ConfigError(
                "train.scaffold: cannot be combined with aggregation.norm_bound yet (a bound "
                "on the model update alone would leave delta c_i unbounded)"
            )
        if self.promotion is not None and self.promotion.on_patience == "rollback":
            raise ConfigError(
                "train.scaffold: cannot be combined with promotion.on_patience 'rollback' yet "
                "(a rollback would set the model and c back, but not the sites' c_i; use "
                "'stop')"
            )

    def _validate_async(self) -> None:
        if self.asynchronous is None:
            return
        self.asynchronous.validate(self.sites_per_round)
        require(
            self.min_sites == 0,
            "min_sites",
            "an [async] run commits every async.buffer updates; leave min_sites unset",
            self.min_sites,
        )
        for table, value in (("secagg", self.secagg), ("privacy", self.privacy)):
            if value is not None:
                raise ConfigError(f"async: cannot be combined with [{table}] yet")
        if self.aggregation.robust:
            raise ConfigError(
                f"aggregation.rule: {self.aggregation.rule!r} cannot run with [async] "
                "(robust rules compare one round's updates; use rule 'mean')"
            )

    def _validate_aggregation(self) -> None:
        if self.codec.name not in CODECS:
            raise ConfigError(
                f"codec.name: must be one of {', '.join(CODECS)}, got {self.codec.name!r} "
                "(secure aggregation is asked for with a [secagg] table)"
            )
        self.aggregation.validate(self.sites_per_round, self.quorum)
        if self.privacy is not None:
            self.privacy.validate(self.sites_per_round)
            self._validate_sampling(self.privacy)
            if self.aggregation.robust:
                raise ConfigError(
                    f"aggregation.rule: {self.aggregation.rule!r} cannot run with [privacy]: "
                    "differential privacy needs the clipped mean (rule 'mean')"
                )
            if self.aggregation.norm_bound:
                raise ConfigError(
                    "aggregation.norm_bound: [privacy] clip already bounds every update; "
                    "leave norm_bound at 0"
                )
        if self.secagg is not None:
            self.secagg.validate()
            if self.aggregation.robust:
                raise ConfigError(
                    f"aggregation.rule: {self.aggregation.rule!r} needs every update in the "
                    "clear; it cannot run with [secagg] (use rule 'mean')"
                )
            if self.aggregation.norm_bound:
                raise ConfigError(
                    "aggregation.norm_bound: the coordinator cannot see masked updates; "
                    "bound them with secagg.clip instead"
                )
            if self.codec.name != "none":
                raise ConfigError(
                    f"codec.name: secure aggregation sends masked fixed-point integers; "
                    f"it cannot be combined with codec {self.codec.name!r} (use 'none')"
                )
            require(
                self.quorum >= 2,
                "min_sites",
                "secure aggregation needs a quorum of at least 2 (a sum of one update is "
                "that update)",
                self.quorum,
            )
            from fedra.secagg import share_threshold  # noqa: PLC0415 - torch, for secagg runs only

            t = share_threshold(self.sites_per_round, self.secagg.degree, self.secagg.threshold)
            if self.privacy is not None:
                # Each site's noise (std z C / sqrt(quorum)) must pass the per-coordinate
                # clamp unharmed, or the released sum carries less noise than accounted for.
                site_std = (
                    self.privacy.noise_multiplier * self.privacy.clip / math.sqrt(self.quorum)
                )
                need = self.privacy.clip + 6 * site_std
                require(
                    self.secagg.clip >= need,
                    "secagg.clip",
                    f"with [privacy] it must be at least privacy.clip + 6 x the noise std a "
                    f"site adds ({need:.4g}), so the clamp never cuts the noise",
                    self.secagg.clip,
                )
            require(
                self.quorum >= t + 1,
                "min_sites",
                f"with secagg.threshold {self.secagg.threshold:g} a site's secrets need {t} "
                f"shares, so a round needs at least {t + 1} surviving sites",
                self.quorum,
            )

    def _validate_sampling(self, privacy: PrivacySpec) -> None:
        if privacy.sampling != "poisson":
            return
        require(
            self.min_sites == 0,
            "min_sites",
            "a Poisson-sampled private run commits each round with the updates its sample "
            "delivers: a quorum would make a round's cohort depend on who was sampled, "
            "which the accountant does not allow for; leave min_sites unset",
            self.min_sites,
        )
        if self.secagg is not None:
            raise ConfigError(
                "privacy.sampling: 'poisson' cannot be combined with [secagg] yet (each "
                "site's share of the noise is sized by a quorum, which Poisson rounds lack); "
                "use sampling 'fixed' or 'none'"
            )

    def _validate_strategy(self) -> None:
        known = STRATEGY_PARAMS.get(self.strategy)
        if known is None:
            raise ConfigError(
                f"strategy.name: unknown strategy {self.strategy!r} "
                f"(expected one of {', '.join(STRATEGY_PARAMS)})"
            )
        check_keys(self.strategy_params, set(known), "strategy")
        for key, value in self.strategy_params.items():
            check(f"strategy.{key}", value)
            if known[key].kind is bool:
                require(value in (0.0, 1.0), f"strategy.{key}",
                        "must be true or false (1 or 0 in a submitted spec)", value)  # fmt: skip

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
        raw["aggregation"] = AggregationSpec(**raw.get("aggregation", {}))
        if raw.get("privacy") is not None:
            raw["privacy"] = PrivacySpec(**raw["privacy"])
        if raw.get("secagg") is not None:
            raw["secagg"] = SecAggSpec(**raw["secagg"])
        if raw.get("asynchronous") is not None:
            raw["asynchronous"] = AsyncSpec(**raw["asynchronous"])
        if raw.get("promotion") is not None:
            raw["promotion"] = PromotionSpec(**raw["promotion"])
        return RunSpec(**raw)


_TOP_NUMBERS = (
    "rounds", "sites_per_round", "min_sites", "round_deadline_s", "max_round_attempts",
    "join_timeout_s", "seed",
)  # fmt: skip
_TOP_KEYS = {
    "name", "task", "rounds", "sites_per_round", "min_sites", "round_deadline_s",
    "max_round_attempts", "join_timeout_s", "seed", "train", "strategy", "codec",
    "aggregation", "privacy", "secagg", "async", "promotion",
}  # fmt: skip
_TRAIN_KEYS = {
    "local_steps", "local_epochs", "batch_size", "learning_rate", "params", "proximal_mu",
    "keep_optimizer_state", "reset_optimizer_every", "scaffold", "scaffold_population",
    "overlap",
}  # fmt: skip


def param_text(name: str, value: object) -> str:
    """A ``[train.params]`` value as the text a task receives (params travel as strings):
    a string as it is, a number in its TOML form, a boolean as ``true``/``false``."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{name}: must be finite, got {value!r}")
        return repr(value)
    kind = "array" if isinstance(value, list) else "table" if isinstance(value, dict) else ""
    kind = kind or type(value).__name__
    raise ConfigError(
        f"{name}: must be a string, number or boolean (a task receives its params as "
        f"text), got {kind} {value!r}"
    )


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
        params={str(k): param_text(f"train.params.{k}", v) for k, v in params_t.items()},
        proximal_mu=get(train_t, "proximal_mu", float, "train", 0.0),
        keep_optimizer_state=get(train_t, "keep_optimizer_state", bool, "train", False),
        reset_optimizer_every=get(train_t, "reset_optimizer_every", int, "train", 0),
        scaffold=get(train_t, "scaffold", bool, "train", False),
        scaffold_population=get(train_t, "scaffold_population", int, "train", 0),
        overlap=get(train_t, "overlap", bool, "train", False),
    )
    strategy_t = dict(get(doc, "strategy", dict, "", {"name": "fedavg"}))
    strategy_name = get(strategy_t, "name", str, "strategy", "fedavg")
    strategy_t.pop("name", None)
    strategy_params = _strategy_params_from_toml(strategy_name, strategy_t)
    codec_t = get(doc, "codec", dict, "", {})
    check_keys(codec_t, {"name", "block", "fraction", "download"}, "codec")
    codec_name = codec_t.get("name", "none")
    for key, owner in (("block", "int8"), ("fraction", "topk")):
        if key in codec_t and codec_name != owner:  # a leftover of another codec's set-up
            raise ConfigError(f"codec.{key}: only the {owner} codec uses it, not {codec_name!r}")
    codec = CodecSpec(
        name=get(codec_t, "name", str, "codec", "none"),
        block=get(codec_t, "block", int, "codec", 256),
        fraction=get(codec_t, "fraction", float, "codec", 0.01),
        download=get(codec_t, "download", bool, "codec", False),
    )
    spec = RunSpec(
        codec=codec,
        aggregation=_aggregation_from_toml(get(doc, "aggregation", dict, "", {})),
        privacy=_privacy_from_toml(doc["privacy"]) if "privacy" in doc else None,
        secagg=_secagg_from_toml(doc["secagg"]) if "secagg" in doc else None,
        asynchronous=_async_from_toml(doc["async"]) if "async" in doc else None,
        promotion=_promotion_from_toml(doc["promotion"]) if "promotion" in doc else None,
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


def _strategy_params_from_toml(name: str, table: Mapping[str, Any]) -> dict[str, float]:
    """Each parameter read as its kind (a bool as 1.0 / 0.0); an unknown one is refused,
    naming the key (an unknown strategy by ``validate``)."""
    known = STRATEGY_PARAMS.get(name)
    if known is None:
        return {key: get(table, key, float, "strategy") for key in table}
    check_keys(table, set(known), "strategy")
    out = {}
    for key in table:
        out[key] = float(get(table, key, known[key].kind, "strategy"))
    return out


def _aggregation_from_toml(t: Mapping[str, Any]) -> AggregationSpec:
    keys = {"rule", "trim", "byzantine", "select", "norm_bound", "spill_mb"}
    check_keys(t, keys, "aggregation")
    d = AggregationSpec()
    return AggregationSpec(
        rule=get(t, "rule", str, "aggregation", d.rule),
        trim=get(t, "trim", float, "aggregation", d.trim),
        byzantine=get(t, "byzantine", int, "aggregation", d.byzantine),
        select=get(t, "select", int, "aggregation", d.select),
        norm_bound=get(t, "norm_bound", float, "aggregation", d.norm_bound),
        spill_mb=get(t, "spill_mb", int, "aggregation", d.spill_mb),
    )


def _privacy_from_toml(raw: Any) -> PrivacySpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"privacy: expected a table, got {type(raw).__name__}")
    keys = {"clip", "noise_multiplier", "epsilon", "delta", "sampling", "population", "accountant"}
    check_keys(raw, keys, "privacy")
    d = PrivacySpec()
    return PrivacySpec(
        clip=get(raw, "clip", float, "privacy", d.clip),
        noise_multiplier=get(raw, "noise_multiplier", float, "privacy", d.noise_multiplier),
        epsilon=get(raw, "epsilon", float, "privacy"),
        delta=get(raw, "delta", float, "privacy", d.delta),
        sampling=get(raw, "sampling", str, "privacy", d.sampling),
        population=get(raw, "population", int, "privacy", d.population),
        accountant=get(raw, "accountant", str, "privacy", d.accountant),
    )


def _secagg_from_toml(raw: Any) -> SecAggSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"secagg: expected a table, got {type(raw).__name__}")
    keys = {"threshold", "degree", "clip", "setup_timeout_s", "unmask_timeout_s"}
    check_keys(raw, keys, "secagg")
    d = SecAggSpec()
    return SecAggSpec(
        threshold=get(raw, "threshold", float, "secagg", d.threshold),
        degree=get(raw, "degree", int, "secagg", d.degree),
        clip=get(raw, "clip", float, "secagg", d.clip),
        setup_timeout_s=get(raw, "setup_timeout_s", float, "secagg", d.setup_timeout_s),
        unmask_timeout_s=get(raw, "unmask_timeout_s", float, "secagg", d.unmask_timeout_s),
    )


def _promotion_from_toml(raw: Any) -> PromotionSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"promotion: expected a table, got {type(raw).__name__}")
    check_keys(raw, {"metric", "goal", "max_regression", "patience", "on_patience"}, "promotion")
    d = PromotionSpec()
    return PromotionSpec(
        metric=get(raw, "metric", str, "promotion", d.metric),
        goal=get(raw, "goal", str, "promotion", d.goal),
        max_regression=get(raw, "max_regression", float, "promotion", d.max_regression),
        patience=get(raw, "patience", int, "promotion", d.patience),
        on_patience=get(raw, "on_patience", str, "promotion", d.on_patience),
    )


def _async_from_toml(raw: Any) -> AsyncSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"async: expected a table, got {type(raw).__name__}")
    check_keys(raw, {"buffer", "max_staleness", "staleness"}, "async")
    d = AsyncSpec()
    return AsyncSpec(
        buffer=get(raw, "buffer", int, "async", d.buffer),
        max_staleness=get(raw, "max_staleness", int, "async", d.max_staleness),
        staleness=get(raw, "staleness", str, "async", d.staleness),
    )
