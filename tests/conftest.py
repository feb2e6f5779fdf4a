"""Shared fixtures: an in-process coordinator on a real gRPC port, and a local cluster
of real processes started through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from fedra.client.parallel.plan import World
from fedra.coordinator.engine import Engine, EngineSettings
from fedra.coordinator.server import CoordinatorConfig, build_engine, create_server, shutdown
from fedra.local import LocalCluster
from fedra.protos.v1 import admin_pb2_grpc, site_pb2_grpc

# Multi-process tests share 2 cores: one thread per process keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class InProcessCoordinator:
    """The real engine and gRPC server in this process, bound to port 0."""

    def __init__(self, state_dir: Path, settings: EngineSettings, workers: int = 32) -> None:
        config = CoordinatorConfig(
            state_dir=state_dir, engine=settings, insecure=True, max_workers=workers
        )
        self.engine: Engine = build_engine(config)
        self.engine.start()
        self.server, port = create_server(
            self.engine, "127.0.0.1:0", max_workers=config.max_workers
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.site = site_pb2_grpc.SiteServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        shutdown(self.server, self.engine, grace_s=0)


def fedra_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """``python -m fedra ARGS`` in a subprocess (no stdin, bounded), its output captured;
    an inherited $FEDRA_COORDINATOR is dropped, so only what a test gives counts."""
    return run_python("-m", "fedra", *args, env=env, cwd=cwd, timeout_s=timeout_s)


def run_python(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` (a script, or ``-m`` a module) as ``fedra_cli`` runs it."""
    environ = {k: v for k, v in os.environ.items() if k != "FEDRA_COORDINATOR"}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
        env={**environ, **(env or {})},
        cwd=cwd,
    )


PG_URL = os.environ.get(
    "FEDRA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@contextmanager
def postgres_database(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards; skips (fails under CI=true) without one."""
    admin_url = make_url(PG_URL)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        admin = create_engine(
            admin_url,
            isolation_level="AUTOCOMMIT",
            poolclass=NullPool,
            connect_args={"connect_timeout": 5},
        )
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except (DBAPIError, ImportError) as exc:
        where = admin_url.render_as_string(hide_password=True)
        reason = f"PostgreSQL at {where} is not usable: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: a missing database must fail the build)")
        pytest.skip(reason)
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    # Tests on this one make each call by hand, a download included: no model comes with
    # a task (test_small_models covers the models that do).
    settings = EngineSettings(
        heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0, inline_model_bytes=0
    )
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[World]:
    """A real gloo process group of one process (a file store: no port)."""
    dist.init_process_group("gloo", f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield World.current()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster") as c:
        yield c


# Property-based suites (tests/test_hostile.py) run a bounded, repeatable number of examples
# in CI; FEDRA_HOSTILE_EXAMPLES=N runs more, and HYPOTHESIS_PROFILE=explore new ones each time.
_EXAMPLES = int(os.environ.get("FEDRA_HOSTILE_EXAMPLES", "50"))
settings.register_profile(
    "ci",
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("explore", settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
