"""The engine's boundary: its lock, store and condition variable are its own.

Outside ``fedra.coordinator.engine`` nothing takes the engine's lock or touches its
database; the front door, the servicers, the status code and the daemon call its public
methods. These tests hold that line (ruff's SLF001 holds it in the linter too) and check
the few methods that stand in for the lock where a caller must never wait for it. They
also hold the two edges: the inside loads no protobuf module, and the servicers reach
the engine only through the front door (``CoordinatorAPI``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedra.coordinator.engine import Engine, EngineSettings
from fedra.storage import BlobStore, Store

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR = ROOT / "coordinator" / "engine"
PRIVATE = {"_lock", "_store", "_changed"}


def _outside_sources() -> Iterator[Path]:
    for top in ("coordinator", "client", "storage", "protos", "fedra", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_symlink() or ENGINE_DIR in path.parents or "_pb2" in path.name:
                continue
            yield path


def test_no_module_outside_the_engine_reaches_into_its_lock_or_store() -> None:
    reached: list[str] = []
    for path in _outside_sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in PRIVATE):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue  # a class's own lock or store, not the engine's
            reached.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not reached, "outside the engine, reaching into another object's state:\n" + (
        "\n".join(reached)
    )


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The check above is not vacuous: it sees an engine's lock taken from outside."""
    src = "def f(engine):\n    with engine._lock:\n        return engine._store\n"
    hits = [
        n.attr
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Attribute) and n.attr in PRIVATE
    ]
    assert hits == ["_lock", "_store"]
    assert any(_outside_sources()) and not any(ENGINE_DIR in p.parents for p in _outside_sources())


def _modules(package: str, folder: Path) -> list[str]:
    return [package if p.stem == "__init__" else f"{package}.{p.stem}" for p in folder.glob("*.py")]


# The inside: the engine, the aggregation and the storage, protobuf-free (converted at the
# edges, fedra.protos.serde); each engine and storage module imported by itself.
INSIDE = sorted(
    [
        *_modules("fedra.coordinator.engine", ENGINE_DIR),
        *_modules("fedra.storage", ROOT / "storage"),
        "fedra.coordinator.state",
        "fedra.coordinator.aggregators",
        "fedra.coordinator.robust",
        "fedra.coordinator.aggregation",
    ]
)
# Imports each module named in turn; prints a line for each that loaded generated
# protobuf modules or gRPC itself: its name, then theirs.
_LOADS_PB2 = """
import importlib, sys
def pb2():
    return {m for m in sys.modules if m.endswith(("_pb2", "_pb2_grpc")) or m == "grpc"}
for name in sys.argv[1:]:
    before = pb2()
    importlib.import_module(name)
    if pb2() - before:
        print(name, *sorted(pb2() - before))
"""


def test_the_inside_loads_neither_protobuf_nor_grpc() -> None:
    """Nor gRPC: the domain is free of it. Imported in a fresh interpreter (this one
    loaded the stubs long ago) in this checkout (``-c`` puts the working directory first
    on the path)."""
    out = subprocess.run(
        [sys.executable, "-c", _LOADS_PB2, *INSIDE],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    loads = [" loads ".join(line.split(" ", 1)) for line in out.stdout.splitlines()]
    assert not loads, "the inside loads protobuf modules or gRPC:\n" + "\n".join(loads)


# The servicers and the operators' read process: handed the front door (the first two)
# or, by the composition root, an engine of their own (replica, web).
SERVICERS = ("service.py", "admin_reads.py", "replica.py", "web.py")
GIVEN_ONLY_THE_FRONT_DOOR = ("service.py", "admin_reads.py")


def _past_the_front_door(source: str, given_only_the_front_door: bool) -> list[int]:
    """Lines reaching the engine behind a front door (``api.engine``, ``self.api.engine``);
    with ``given_only_the_front_door``, any ``.engine`` at all."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr == "engine"):
            continue
        owner = node.value
        of_api = (isinstance(owner, ast.Name) and owner.id == "api") or (
            isinstance(owner, ast.Attribute) and owner.attr == "api"
        )
        if of_api or given_only_the_front_door:
            lines.add(node.lineno)
    return sorted(lines)


def test_servicers_reach_the_engine_only_through_the_front_door() -> None:
    reached = [
        f"coordinator/{name}:{line}"
        for name in SERVICERS
        for line in _past_the_front_door(
            (ROOT / "coordinator" / name).read_text(), name in GIVEN_ONLY_THE_FRONT_DOOR
        )
    ]
    assert not reached, "a servicer reaches past the front door to its engine:\n" + (
        "\n".join(reached)
    )


def test_the_front_door_scan_finds_what_it_looks_for() -> None:
    src = "def f(self, api):\n    a = api.engine\n    b = self.api.engine\n    c = self.engine\n"
    assert _past_the_front_door(src, False) == [2, 3]
    assert _past_the_front_door(src, True) == [2, 3, 4]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(
        Store(f"sqlite:///{tmp_path / 'db.sqlite'}"),
        BlobStore(tmp_path / "models"),
        BlobStore(tmp_path / "updates"),
        EngineSettings(),
    )
    yield e
    e.stop()
    e.close()


def test_the_engine_has_no_public_lock_store_or_condition(engine: Engine) -> None:
    for name in ("lock", "store", "changed"):
        assert not hasattr(engine, name), name


def _hold(engine: Engine) -> tuple[threading.Event, threading.Thread]:
    """Another thread holds the engine's lock until the event is set."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        engine.locked(lambda: (held.set(), release.wait(10)))

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    return release, thread


def test_if_free_runs_now_when_the_lock_is_free_and_never_waits_when_taken(
    engine: Engine,
) -> None:
    assert engine.if_free(lambda x: x * 2, 21) == (True, 42)
    assert engine.is_free()
    ran: list[int] = []
    release, thread = _hold(engine)
    try:
        assert engine.if_free(ran.append, 1) == (False, None)
        assert not engine.is_free()
    finally:
        release.set()
        thread.join(10)
    assert ran == []  # not run later either: the caller decides what to do instead
    assert engine.is_free()


def test_locked_waits_for_the_lock_and_runs_holding_it(engine: Engine) -> None:
    release, thread = _hold(engine)
    out: list[int] = []
    waiter = threading.Thread(target=lambda: out.append(engine.locked(int, "7")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and out == []  # waiting behind the holder
    release.set()
    thread.join(10)
    waiter.join(10)
    assert out == [7]

    seen: list[tuple[bool, object]] = []

    def inside() -> None:  # another thread, while fn runs: the lock is not free
        other = threading.Thread(target=lambda: seen.append(engine.if_free(int)))
        other.start()
        other.join(10)

    engine.locked(inside)
    assert seen == [(False, None)]
    assert engine.if_free(int) == (True, 0)


def test_no_site_is_barred_until_the_engine_is_told_who_is(engine: Engine) -> None:
    assert not engine.barred()
    revoked = {"site-a"}
    engine.bar_sites_by(lambda: frozenset(revoked))
    revoked.add("site-b")  # asked each time: a deny list reloaded counts at once
    assert engine.barred() == {"site-a", "site-b"}


def test_begin_stop_wakes_and_marks_the_engine_stopping(engine: Engine) -> None:
    version = engine.version
    engine.begin_stop()
    assert engine.stopping and engine.version > version


def test_holds_claim_is_the_store_s_claim(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}", migrate=False)
    store.claim()
    store.upgrade()
    e = Engine(store, BlobStore(tmp_path / "m"), BlobStore(tmp_path / "u"), EngineSettings())
    try:
        assert e.holds_claim()
    finally:
        e.stop()
        e.close()
    unclaimed = Engine(
        Store(f"sqlite:///{tmp_path / 'db.sqlite'}"),
        BlobStore(tmp_path / "m"),
        BlobStore(tmp_path / "u"),
        EngineSettings(),
    )
    try:
        assert not unclaimed.holds_claim()
    finally:
        unclaimed.stop()
        unclaimed.close()


def test_records_read_and_cannot_write(engine: Engine) -> None:
    """What status code is handed: the stored runs to read, and nothing that writes; the
    same object each time (status caches provenance by it)."""
    records = engine.records
    assert records is engine.records
    assert records.list_runs() == [] and records.read_run("nope") is None
    for write in ("create_run", "add_event", "write_batch", "close"):
        assert not hasattr(records, write), write
