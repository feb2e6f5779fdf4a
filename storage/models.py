"""SQLAlchemy 2 table definitions. The schema itself is created by Alembic migrations."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    task: Mapped[str] = mapped_column(String(300))
    spec_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    rounds_completed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class Site(Base):
    __tablename__ = "sites"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tasks_json: Mapped[str] = mapped_column(Text)
    version: Mapped[str] = mapped_column(String(64), default="")
    registered_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)


class Round(Base):
    """One row per (run, round number): a retried round updates its attempt in place."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "number", name="uq_rounds_run_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    sampled_json: Mapped[str] = mapped_column(Text)
    opened_at: Mapped[float] = mapped_column(Float)
    deadline_at: Mapped[float] = mapped_column(Float)
    closed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics_json: Mapped[str] = mapped_column(Text, default="{}")
    # The round's ledger: seconds spent in each stage (distribute, compute, transfer,
    # aggregate, checkpoint), written when the round commits.
    stages_json: Mapped[str] = mapped_column(Text, default="{}", server_default="{}")


class Participation(Base):
    """A site asked to do one attempt of one round: its task, outcome, bytes and timings."""

    __tablename__ = "participations"
    __table_args__ = (
        UniqueConstraint("run_id", "round_number", "attempt", "site_id", name="uq_participation"),
        Index("ix_participations_run_round", "run_id", "round_number"),
        Index("ix_participations_update_sha256", "update_sha256"),
    )

    task_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round_number: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    site_id: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))
    assigned_at: Mapped[float] = mapped_column(Float)
    nonce: Mapped[bytes | None] = mapped_column(LargeBinary(32), nullable=True, unique=True)
    update_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    num_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    # Transfers cut off or refused (a partial download, a refused or late upload).
    bytes_cut: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    download_s: Mapped[float] = mapped_column(Float, default=0.0)
    upload_s: Mapped[float] = mapped_column(Float, default=0.0)
    metrics_json: Mapped[str] = mapped_column(Text, default="{}")
    error: Mapped[str] = mapped_column(Text, default="")
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Async runs: the round named in the site's task (a task still training when its
    # round commits moves on to the next one), and the round whose model it downloaded.
    issued_round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    base_round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # A small accepted update's own bytes (storage.spool), until its round ends; larger
    # updates are files. Never loaded with the row.
    update_data: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "round_number", name="uq_checkpoint_run_round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round_number: Mapped[int] = mapped_column(Integer)
    model_sha256: Mapped[str] = mapped_column(String(64))
    model_bytes: Mapped[int] = mapped_column(BigInteger)
    optimizer_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    # With compressed downloads: the compressed step from the previous round's model.
    delta_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Event(Base):
    """The run's ledger: what happened, when, with numbers in ``data_json``."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data_json: Mapped[str] = mapped_column(Text, default="{}")
    created_at: Mapped[float] = mapped_column(Float)
