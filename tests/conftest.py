"""Shared fixtures: an in-process coordinator on a real gRPC port, and a local cluster
of real processes started through the CLI."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from fedra.coordinator.engine import Engine, EngineSettings
from fedra.coordinator.server import CoordinatorConfig, build_engine, create_server
from fedra.local import LocalCluster
from fedra.protos.v1 import admin_pb2_grpc, site_pb2_grpc

# Multi-process tests share 2 cores: one thread per process keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class InProcessCoordinator:
    """The real engine and gRPC server in this process, bound to port 0."""

    def __init__(self, state_dir: Path, settings: EngineSettings) -> None:
        config = CoordinatorConfig(state_dir=state_dir, engine=settings, insecure=True)
        self.engine: Engine = build_engine(config)
        self.engine.start()
        self.server, port = create_server(self.engine, "127.0.0.1:0", max_workers=32)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.site = site_pb2_grpc.SiteServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        with self.engine.lock:
            self.engine.stopping = True
            self.engine.notify()
        self.server.stop(0).wait()
        self.engine.stop()
        self.engine.store.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    settings = EngineSettings(heartbeat_interval_s=1.0, poll_timeout_s=2.0, site_timeout_s=30.0)
    c = InProcessCoordinator(tmp_path / "state", settings)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster") as c:
        yield c
