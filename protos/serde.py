"""Conversions between protobuf messages and fedra's plain types, shared by both sides."""

from __future__ import annotations

from fedra.protos.v1 import admin_pb2, common_pb2, site_pb2
from fedra.provenance import MAX_PROVENANCE_CHARS, MAX_PROVENANCE_VERSIONS, Provenance
from fedra.runspec import (
    AggregationSpec,
    AsyncSpec,
    CodecSpec,
    PrivacySpec,
    PromotionSpec,
    RunSpec,
    SecAggSpec,
    TrainSpec,
)
from fedra.secagg_round import SecAggRound


def train_to_proto(t: TrainSpec) -> common_pb2.TrainSettings:
    return common_pb2.TrainSettings(
        local_steps=t.local_steps,
        local_epochs=t.local_epochs,
        batch_size=t.batch_size,
        learning_rate=t.learning_rate,
        params=dict(t.params),
        proximal_mu=t.proximal_mu,
        keep_optimizer_state=t.keep_optimizer_state,
        reset_optimizer_every=t.reset_optimizer_every,
        scaffold=t.scaffold,
        scaffold_population=t.scaffold_population,
        overlap=t.overlap,
    )


def train_from_proto(m: common_pb2.TrainSettings) -> TrainSpec:
    return TrainSpec(
        local_steps=m.local_steps,
        local_epochs=m.local_epochs,
        batch_size=m.batch_size,
        learning_rate=m.learning_rate,
        params=dict(m.params),
        proximal_mu=m.proximal_mu,
        keep_optimizer_state=m.keep_optimizer_state,
        reset_optimizer_every=m.reset_optimizer_every,
        scaffold=m.scaffold,
        scaffold_population=m.scaffold_population,
        overlap=m.overlap,
    )


def codec_to_proto(c: CodecSpec) -> common_pb2.Codec:
    return common_pb2.Codec(name=c.name, block=c.block, fraction=c.fraction, download=c.download)


def codec_from_proto(m: common_pb2.Codec) -> CodecSpec:
    """An unset message is "none"; a bad one raises ConfigError naming the field."""
    if not m.name:
        return CodecSpec()
    return CodecSpec(m.name, m.block or 256, m.fraction or 0.01, m.download)


def aggregation_to_proto(a: AggregationSpec) -> common_pb2.Aggregation:
    return common_pb2.Aggregation(
        rule=a.rule,
        trim=a.trim,
        byzantine=a.byzantine,
        select=a.select,
        norm_bound=a.norm_bound,
        spill_mb=a.spill_mb,
    )


def aggregation_from_proto(m: common_pb2.Aggregation) -> AggregationSpec:
    """An unset message is the streaming mean."""
    if not m.rule:
        return AggregationSpec(norm_bound=m.norm_bound)
    return AggregationSpec(m.rule, m.trim, m.byzantine, m.select, m.norm_bound, m.spill_mb)


def privacy_to_proto(p: PrivacySpec) -> common_pb2.Privacy:
    return common_pb2.Privacy(
        clip=p.clip, noise_multiplier=p.noise_multiplier, epsilon=p.epsilon, delta=p.delta,
        sampling=p.sampling, population=p.population, accountant=p.accountant,
    )  # fmt: skip


def privacy_from_proto(m: common_pb2.Privacy) -> PrivacySpec:
    """Unset (zero) fields take their defaults; epsilon has none (0 is refused), and a
    population of 0 is none declared."""
    d = PrivacySpec()
    return PrivacySpec(
        m.clip or d.clip, m.noise_multiplier or d.noise_multiplier, m.epsilon, m.delta or d.delta,
        m.sampling or d.sampling, m.population, m.accountant or d.accountant,
    )  # fmt: skip


def secagg_to_proto(s: SecAggSpec) -> common_pb2.SecAgg:
    return common_pb2.SecAgg(
        threshold=s.threshold,
        degree=s.degree,
        clip=s.clip,
        setup_timeout_s=s.setup_timeout_s,
        unmask_timeout_s=s.unmask_timeout_s,
    )


def secagg_from_proto(m: common_pb2.SecAgg) -> SecAggSpec:
    """Unset (zero) fields take their defaults: zero is never a valid value for them."""
    d = SecAggSpec()
    return SecAggSpec(
        m.threshold or d.threshold,
        m.degree,
        m.clip or d.clip,
        m.setup_timeout_s or d.setup_timeout_s,
        m.unmask_timeout_s or d.unmask_timeout_s,
    )


def async_to_proto(a: AsyncSpec) -> common_pb2.Async:
    return common_pb2.Async(buffer=a.buffer, max_staleness=a.max_staleness, staleness=a.staleness)


def async_from_proto(m: common_pb2.Async) -> AsyncSpec:
    """buffer 0 and an empty staleness take their defaults (neither is ever valid)."""
    d = AsyncSpec()
    return AsyncSpec(m.buffer or d.buffer, m.max_staleness, m.staleness or d.staleness)


def promotion_to_proto(p: PromotionSpec) -> common_pb2.Promotion:
    return common_pb2.Promotion(
        metric=p.metric, goal=p.goal, max_regression=p.max_regression, patience=p.patience,
        on_patience=p.on_patience,
    )  # fmt: skip


def promotion_from_proto(m: common_pb2.Promotion) -> PromotionSpec:
    """Empty strings and a patience of 0 take their defaults (none is ever valid)."""
    d = PromotionSpec()
    return PromotionSpec(
        m.metric or d.metric, m.goal or d.goal, m.max_regression, m.patience or d.patience,
        m.on_patience or d.on_patience,
    )  # fmt: skip


def runspec_to_proto(s: RunSpec) -> admin_pb2.RunSpec:
    return admin_pb2.RunSpec(
        asynchronous=async_to_proto(s.asynchronous) if s.asynchronous is not None else None,
        promotion=promotion_to_proto(s.promotion) if s.promotion is not None else None,
        aggregation=aggregation_to_proto(s.aggregation),
        privacy=privacy_to_proto(s.privacy) if s.privacy is not None else None,
        secagg=secagg_to_proto(s.secagg) if s.secagg is not None else None,
        name=s.name,
        task=s.task,
        rounds=s.rounds,
        sites_per_round=s.sites_per_round,
        min_sites=s.min_sites,
        round_deadline_s=s.round_deadline_s,
        max_round_attempts=s.max_round_attempts,
        join_timeout_s=s.join_timeout_s,
        train=train_to_proto(s.train),
        strategy=s.strategy,
        strategy_params=dict(s.strategy_params),
        seed=s.seed,
        codec=codec_to_proto(s.codec),
    )


def runspec_from_proto(m: admin_pb2.RunSpec) -> RunSpec:
    """The RunSpec a message carries; not validated (call ``validate``)."""
    return RunSpec(
        asynchronous=async_from_proto(m.asynchronous) if m.HasField("asynchronous") else None,
        promotion=promotion_from_proto(m.promotion) if m.HasField("promotion") else None,
        aggregation=aggregation_from_proto(m.aggregation),
        privacy=privacy_from_proto(m.privacy) if m.HasField("privacy") else None,
        secagg=secagg_from_proto(m.secagg) if m.HasField("secagg") else None,
        name=m.name,
        task=m.task,
        rounds=m.rounds,
        sites_per_round=m.sites_per_round,
        min_sites=m.min_sites,
        round_deadline_s=m.round_deadline_s,
        max_round_attempts=m.max_round_attempts,
        join_timeout_s=m.join_timeout_s,
        train=train_from_proto(m.train),
        strategy=m.strategy,
        strategy_params=dict(m.strategy_params),
        seed=m.seed,
        codec=codec_from_proto(m.codec),
    )


def secagg_round_to_proto(s: SecAggRound) -> site_pb2.SecAggRound:
    return site_pb2.SecAggRound(
        context=s.context,
        threshold=s.threshold,
        clip=s.clip,
        bits=s.bits,
        l2_clip=s.l2_clip,
        noise_std=s.noise_std,
    )


def secagg_round_from_proto(m: site_pb2.SecAggRound) -> SecAggRound:
    return SecAggRound(m.context, m.threshold, m.clip, m.bits, m.l2_clip, m.noise_std)


def provenance_to_proto(p: Provenance) -> common_pb2.Provenance:
    return common_pb2.Provenance(
        entry_point=p.entry_point, task_version=p.task_version,
        task_source_sha256=p.task_source_sha256, data_fingerprint=p.data_fingerprint,
        config_sha256=p.config_sha256, versions=dict(p.versions), device=p.device,
    )  # fmt: skip


def provenance_from_proto(m: common_pb2.Provenance) -> Provenance:
    """ValueError naming the field for one too long or with too many versions."""
    fields = {
        "entry_point": m.entry_point, "task_version": m.task_version,
        "task_source_sha256": m.task_source_sha256, "data_fingerprint": m.data_fingerprint,
        "config_sha256": m.config_sha256, "device": m.device,
    }  # fmt: skip
    for name, value in [*fields.items(), *(("versions", k + v) for k, v in m.versions.items())]:
        if len(value) > MAX_PROVENANCE_CHARS:
            raise ValueError(
                f"provenance.{name}: at most {MAX_PROVENANCE_CHARS} characters, got {len(value)}"
            )
    if len(m.versions) > MAX_PROVENANCE_VERSIONS:
        raise ValueError(f"provenance.versions: at most {MAX_PROVENANCE_VERSIONS} entries")
    return Provenance(**fields, versions=dict(sorted(m.versions.items())))
