"""The round engine: the coordinator's domain, free of gRPC.

One ``Engine`` (``core``) keeps the live state of every active run under one lock and
writes every change to the database before acting on it. Its parts live in this package
and share that lock and that store:

- ``rounds``: one ``RoundDriver`` thread a run (open, wait, close, commit);
- ``uploads``: an update's checks, its spool and its accept;
- ``secure``: the secure-aggregation stages;
- ``folding``: the deterministic order updates are folded in;
- ``recovery``: a run taken up again after a restart;
- ``storage_faults``: a round driver's answer to a full disk or a lost database.

The boundary: nothing outside this package touches the engine's lock, its store or its
condition variable (they are private, ``Engine._lock``, ``_store``, ``_changed``, and the
linter refuses a private member reached from outside: ruff's SLF001). The front door
(``fedra.coordinator.api``), the servicers, the status code and the daemon call the
engine's public, typed methods.
"""

from fedra.coordinator.engine.core import (
    LIVENESS_WRITE_S,
    Engine,
    EngineSettings,
    Gauges,
    GivenModel,
    RoundOutcome,
    TaskView,
)

__all__ = [
    "LIVENESS_WRITE_S",
    "Engine",
    "EngineSettings",
    "Gauges",
    "GivenModel",
    "RoundOutcome",
    "TaskView",
]
