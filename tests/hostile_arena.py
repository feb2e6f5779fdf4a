"""A coordinator under attack, for the hostile-input suite (tests/test_hostile.py).

A real engine, SQLite store and mTLS gRPC server in this process: two honest sites
(site-a, site-b) with a round open, an attacker holding a valid site certificate
(mallory), and an admin. ``after_attack`` checks what must hold after every hostile
call: the daemon answers, nothing changed in the database or the blob stores, and the
coordinator's log has neither tracebacks nor forged or flooded lines.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch
from sqlalchemy import text

from fedra import pki
from fedra.coordinator.engine import EngineSettings
from fedra.coordinator.server import CoordinatorConfig, build_engine, create_server, shutdown
from fedra.examples import synthetic
from fedra.protos.codec import decode, encode
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, common_pb2, site_pb2, site_pb2_grpc

TASK = "fedra.examples.synthetic:task"
HONEST = ("site-a", "site-b")
ATTACKER = "mallory"
CALL_TIMEOUT_S = 10.0
# Every refusal must be one of these: INTERNAL and UNKNOWN are bugs, never a refusal.
DELIBERATE = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
MAX_LOG_CHARS = 2000  # a refusal's line: peer, code, and a message cut to 400 characters
# Columns a refused call may change by design: when a site was last heard from (any
# call), and the bytes of its refused uploads (the ledger counts them as cut).
VOLATILE = {"sites": {"last_seen_at"}, "participations": {"bytes_cut"}}
TABLES = ("runs", "sites", "rounds", "participations", "checkpoints", "events")


def model_state() -> dict[str, torch.Tensor]:
    model = synthetic.task.create_model(0, {})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def delta(scale: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, scale) for k, v in model_state().items()}


class LogRecorder(logging.Handler):
    """Every record of every logger, to check what the coordinator wrote."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def problems(self) -> list[str]:
        """Tracebacks, multi-line (forged) and flooded lines among the records so far."""
        found = []
        for r in self.records:
            message = r.getMessage()
            if r.exc_info or r.exc_text or r.stack_info:
                found.append(f"traceback from {r.name}: {message[:300]!r}")
            if "\n" in message or "\r" in message or len(message) > MAX_LOG_CHARS:
                found.append(f"{r.name}: {len(message)}-char line {message[:300]!r}")
        return found


class Arena:
    """The coordinator, its honest sites with round 1 open, the attacker and an admin."""

    def __init__(self, root: Path) -> None:
        self.pki = root / "pki"
        pki.provision(
            self.pki,
            coordinator_hosts=["localhost"],
            sites=[*HONEST, ATTACKER],
            admins=["ops"],
        )
        settings = EngineSettings(
            heartbeat_interval_s=1.0, poll_timeout_s=0.3, site_timeout_s=300.0, chunk_bytes=65536
        )
        config = CoordinatorConfig(
            state_dir=root / "state", tls_dir=self.pki / "coordinator", engine=settings,
            max_workers=32,
        )  # fmt: skip
        self.state_dir = config.state_dir
        self.engine = build_engine(config)
        self.engine.start()
        tls = pki.load_folder(self.pki / "coordinator")
        self.server, port = create_server(
            self.engine, "127.0.0.1:0", config.max_workers, tls, config.deny_list_path
        )
        self.server.start()
        self.address = f"localhost:{port}"
        self.channels: dict[str, grpc.Channel] = {}
        self.log = LogRecorder()
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self.log)
        root.setLevel(logging.INFO)
        self._setup_round()

    # -- connections -----------------------------------------------------------

    def channel(self, who: str) -> grpc.Channel:
        """A channel with ``who``'s certificate (a site, or "ops" the admin)."""
        if who not in self.channels:
            kind = "admins" if who == "ops" else "sites"
            files = pki.load_folder(self.pki / kind / who)
            self.channels[who] = grpc.secure_channel(self.address, pki.channel_credentials(files))
        return self.channels[who]

    def site(self, who: str) -> site_pb2_grpc.SiteServiceStub:
        return site_pb2_grpc.SiteServiceStub(self.channel(who))

    def admin(self, who: str = "ops") -> admin_pb2_grpc.AdminServiceStub:
        return admin_pb2_grpc.AdminServiceStub(self.channel(who))

    def key(self, site: str) -> bytes:
        return (self.pki / "sites" / site / "key.pem").read_bytes()

    def close(self) -> None:
        logging.getLogger().removeHandler(self.log)
        logging.getLogger().setLevel(self._level)
        for ch in self.channels.values():
            ch.close()
        shutdown(self.server, self.engine, grace_s=0)

    # -- the honest round ------------------------------------------------------

    def _setup_round(self) -> None:
        for s in HONEST:
            self.site(s).Register(site_pb2.RegisterRequest(site_id=s, tasks=[TASK]), timeout=10)
        reg = site_pb2.RegisterRequest(site_id=ATTACKER, tasks=["hostile.none:task"])
        self.site(ATTACKER).Register(reg, timeout=10)
        spec = admin_pb2.RunSpec(
            name="honest", task=TASK, rounds=1, sites_per_round=2, min_sites=2,
            round_deadline_s=600, join_timeout_s=30, max_round_attempts=1, strategy="fedavg",
            train=common_pb2.TrainSettings(local_steps=1, batch_size=4, learning_rate=0.1),
        )  # fmt: skip
        submit = admin_pb2.SubmitRunRequest(spec=spec)
        self.run_id = self.admin().SubmitRun(submit, timeout=10).run_id
        ((init_site, init_task),) = self._tasks(0).items()
        self.init_site = init_site
        self.init_messages = self.upload_messages(init_site, init_task, encode(model_state()))
        self.site(init_site).UploadUpdate(iter(self.init_messages), timeout=30)
        self.tasks = self._tasks(1)
        assert sorted(self.tasks) == list(HONEST), self.tasks

    def _tasks(self, number: int) -> dict[str, site_pb2.Task]:
        """The tasks of round ``number``, once it is open, from the sites it sampled."""
        watch = admin_pb2.WatchRunRequest(run_id=self.run_id)
        for status in self.admin().WatchRun(watch, timeout=30):
            rounds = [r for r in status.rounds if r.number == number and r.status == "open"]
            if rounds:
                break
        else:
            raise AssertionError(f"round {number} never opened")
        tasks = {}
        for s in rounds[0].sampled_sites:
            reply = self.site(s).PollTask(site_pb2.PollTaskRequest(site_id=s), timeout=10)
            assert reply.task.round == number, reply
            tasks[s] = reply.task
        # A small model comes with its task, counted as a download: in the database
        # before any snapshot is taken.
        assert self.engine.downloads.flush(10)
        return tasks

    def upload_messages(
        self, site: str, task: site_pb2.Task, payload: bytes, *, chunk: int = 1000,
        key_of: str | None = None, nonce: bytes | None = None, **fields: Any,
    ) -> list[site_pb2.UpdateChunk]:  # fmt: skip
        """A signed upload of ``payload`` (``fields`` override the header after signing)."""
        header = site_pb2.UpdateHeader(
            site_id=site, run_id=task.run_id, round=task.round, task_id=task.task_id,
            num_samples=10, codec="none", sha256=hashlib.sha256(payload).hexdigest(),
            nonce=nonce or os.urandom(16), payload_bytes=len(payload), metrics={"loss": 1.0},
        )  # fmt: skip
        signed = pki.upload_message(
            header.run_id, header.round, header.site_id, header.task_id, header.nonce,
            header.sha256, num_samples=header.num_samples, codec=header.codec,
            payload_bytes=header.payload_bytes,
        )  # fmt: skip
        header.signature = pki.sign(self.key(key_of or site), signed)
        for name, value in fields.items():
            setattr(header, name, value)
        data = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
        return [site_pb2.UpdateChunk(header=header)] + [site_pb2.UpdateChunk(data=d) for d in data]

    def finish_round(self) -> None:
        """The honest sites deliver; the round commits with their exact weighted mean."""
        for i, s in enumerate(HONEST):
            msgs = self.upload_messages(s, self.tasks[s], encode(delta(0.1 * (i + 1))))
            self.site(s).UploadUpdate(iter(msgs), timeout=30)
        watch = admin_pb2.WatchRunRequest(run_id=self.run_id)
        for status in self.admin().WatchRun(watch, timeout=60):
            if status.state != "running":
                break
        assert status.state == "completed", status.reason
        export = admin_pb2.ExportModelRequest(run_id=self.run_id, round=1)
        model = decode(b"".join(m.data for m in self.admin().ExportModel(export, timeout=30)))
        for name, value in model_state().items():  # both sites sent 10 samples
            torch.testing.assert_close(model[name], value + (0.1 + 0.2) / 2)

    # -- what an attack must leave as it was -----------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The database's rows (less VOLATILE columns, less the attacker's own site row,
        which its Register may rewrite), every file of the blob stores, the tasks' states."""
        rows: dict[str, Any] = {}
        with self.engine._store.engine.connect() as conn:
            for table in TABLES:
                result = conn.execute(text(f"SELECT * FROM {table}"))
                keep = [c for c in result.keys() if c not in VOLATILE.get(table, set())]  # noqa: SIM118
                got = [tuple(str(row._mapping[c]) for c in keep) for row in result]
                if table == "sites":
                    got = [r for r in got if r[0] != ATTACKER]
                rows[table] = sorted(got)
        files = sorted(
            (str(p.relative_to(self.state_dir)), p.stat().st_size)
            for d in ("blobs", "updates")
            for p in (self.state_dir / d).rglob("*")
            if p.is_file()
        )
        states = sorted(
            (a.site_id, a.state, a.update_sha256 or "")
            for run in self.engine.runs.values()
            for a in run.assignments.values()
        )
        return {"rows": rows, "files": files, "tasks": states}

    def alive(self) -> None:
        """A legitimate call is served: the daemon is up and the honest task still current."""
        beat = site_pb2.HeartbeatRequest(site_id="site-a", task_id=self.tasks["site-a"].task_id)
        assert self.site("site-a").Heartbeat(beat, timeout=CALL_TIMEOUT_S).task_current

    def after_attack(self, before: dict[str, Any], what: str) -> None:
        self.alive()
        assert self.snapshot() == before, f"{what} changed the coordinator's state"
        problems = self.log.problems()
        self.log.records.clear()
        assert not problems, f"{what}: {problems}"


# Every hostile call's outcome, by status name: the suite's figures (FEDRA_HOSTILE_REPORT).
TALLY: Counter[str] = Counter()


def check_refusal(call: Callable[[], Any], what: str) -> grpc.StatusCode:
    """Run a hostile call; OK, or a deliberate status with a message (returned)."""
    try:
        reply = call()
        if isinstance(reply, Iterator):
            for _ in reply:
                pass
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in DELIBERATE, f"{what}: {code} {exc.details()!r}"
        assert exc.details(), f"{what}: {code} without a message"
        assert len(exc.details()) <= 2000, f"{what}: a {len(exc.details())}-char status message"
        TALLY[code.name] += 1
        return code  # type: ignore[no-any-return]
    TALLY["OK"] += 1
    return grpc.StatusCode.OK


@contextmanager
def arena(root: Path) -> Iterator[Arena]:
    """An Arena under ``root``, closed afterwards."""
    a = Arena(root)
    try:
        yield a
    finally:
        a.close()
