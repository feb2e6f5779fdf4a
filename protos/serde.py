"""Conversions between protobuf messages and fedra's plain types, shared by both sides."""

from __future__ import annotations

from fedra.protos.v1 import admin_pb2, common_pb2
from fedra.runspec import CodecSpec, RunSpec, TrainSpec


def train_to_proto(t: TrainSpec) -> common_pb2.TrainSettings:
    return common_pb2.TrainSettings(
        local_steps=t.local_steps,
        local_epochs=t.local_epochs,
        batch_size=t.batch_size,
        learning_rate=t.learning_rate,
        params=dict(t.params),
    )


def train_from_proto(m: common_pb2.TrainSettings) -> TrainSpec:
    return TrainSpec(
        local_steps=m.local_steps,
        local_epochs=m.local_epochs,
        batch_size=m.batch_size,
        learning_rate=m.learning_rate,
        params=dict(m.params),
    )


def codec_to_proto(c: CodecSpec) -> common_pb2.Codec:
    return common_pb2.Codec(name=c.name, block=c.block, fraction=c.fraction)


def codec_from_proto(m: common_pb2.Codec) -> CodecSpec:
    """An unset message is "none"; a bad one raises ConfigError naming the field."""
    if not m.name:
        return CodecSpec()
    return CodecSpec(m.name, m.block or 256, m.fraction or 0.01)


def runspec_to_proto(s: RunSpec) -> admin_pb2.RunSpec:
    return admin_pb2.RunSpec(
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
