"""A site reuses a run's model object across rounds: same object, same training; and
what it logs when its coordinator cannot be reached."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import replace

import pytest
import torch
from torch import nn

from fedra.client.agent import SiteAgent, delta
from fedra.client.config import SiteConfig
from fedra.client.connection import Assignment
from fedra.client.executor import LocalExecutor
from fedra.examples.synthetic import SyntheticTask
from fedra.runspec import CodecSpec, TrainSpec
from tests.test_heartbeat import _Site

EP = "fedra.examples.synthetic:task"


class CountingTask(SyntheticTask):
    """The synthetic task, counting the models it builds."""

    def __init__(self) -> None:
        self.built = 0

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        self.built += 1
        return super().create_model(seed, params)


def _agent(task: CountingTask, executor: LocalExecutor | None = None) -> SiteAgent:
    # The address is never dialled: these tests call the agent's training path directly.
    config = SiteConfig("s1", "127.0.0.1:9", (EP,), insecure=True)
    data = {EP: task.load_data({"samples": 64, "seed": 1})}
    return SiteAgent(config, executor=executor or LocalExecutor(), tasks={EP: task}, data=data)


def _assignment(run_id: str, number: int) -> Assignment:
    train = TrainSpec(
        local_steps=3, batch_size=8, learning_rate=0.05, params={"extra_params": "1000"}
    )
    return Assignment(
        task_id=f"{run_id}-{number}",
        run_id=run_id,
        round=number,
        init=False,
        entry_point=EP,
        train=train,
        seed=7,
        model_sha256="",
        model_bytes=0,
        deadline_in_s=60.0,
        codec=CodecSpec("none"),
    )


def test_a_run_builds_its_model_once_and_another_run_builds_its_own() -> None:
    task = CountingTask()
    agent = _agent(task)
    first = agent._model(task, _assignment("r1", 1))
    assert agent._model(task, _assignment("r1", 2)) is first
    assert task.built == 1
    other = agent._model(task, _assignment("r2", 1))
    assert other is not first and task.built == 2
    agent.conn.close()


def test_no_reuse_where_training_leaves_the_model_elsewhere() -> None:
    task = CountingTask()
    agent = _agent(task, LocalExecutor(torch.device("cuda")))  # never trains here
    a = _assignment("r1", 1)
    assert agent._model(task, a) is not agent._model(task, replace(a, round=2))
    assert task.built == 2
    agent.conn.close()


def test_training_a_reused_model_gives_the_update_a_fresh_one_gives() -> None:
    """Round 2 on the object round 1 trained is round 2 on a freshly built model."""
    reference_task = CountingTask()
    start = {
        k: v.detach().clone()
        for k, v in reference_task.create_model(7, {"extra_params": "1000"}).state_dict().items()
    }
    reused_task = CountingTask()
    reused = _agent(reused_task)
    round1, *_ = reused._train(reused_task, _assignment("r1", 1), start)
    global2 = {k: start[k] + round1[k] for k in start}  # the next global model
    update_reused, samples_reused, _ = reused._train(reused_task, _assignment("r1", 2), global2)
    fresh_task = CountingTask()
    fresh = _agent(fresh_task)
    update_fresh, samples_fresh, _ = fresh._train(fresh_task, _assignment("r1", 2), global2)
    assert reused_task.built == 1 and fresh_task.built == 1
    assert samples_reused == samples_fresh
    for name, value in update_fresh.items():
        assert torch.equal(update_reused[name], value), name
    assert any(bool(v.abs().sum() > 0) for v in update_fresh.values())  # it did train
    reused.conn.close()
    fresh.conn.close()


def test_a_task_given_again_for_a_model_held_already_downloads_nothing() -> None:
    """After a coordinator restart a site may get the same round's task again, once it has
    applied the compressed step to that round's model: neither the step (its base is gone)
    nor the whole model needs fetching."""
    task = CountingTask()
    agent = _agent(task)
    held = {"w": torch.ones(3)}
    agent._globals = {"r1": ("sha-of-round-4", held)}
    again = replace(
        _assignment("r1", 4),
        model_sha256="sha-of-round-4",
        base_sha256="sha-of-round-3",
        delta_sha256="sha-of-the-step",
    )

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("the held model was fetched again")

    agent.conn.download = no_download  # type: ignore[method-assign]
    assert agent._global_model(task, again, timeout_s=5.0) is held
    agent.conn.close()


def test_a_heartbeat_after_the_site_closed_its_channel_ends_quietly() -> None:
    """A site stopping mid-task closes its channel under the task's heartbeat: its beats
    end, with no traceback in the site's log, and the process's beat clock goes on
    serving the other tasks' beats."""
    from fedra.client.connection import Connection
    from fedra.client.heartbeat import BeatClock, Heartbeat

    conn = Connection("127.0.0.1:1", "site-a")
    conn.close()
    errors: list[BaseException | None] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    clock = BeatClock()
    try:
        with Heartbeat(conn, "task-1", interval_s=0.01, clock=clock) as beat:
            assert beat.ended.wait(10)
        other = _Site()
        with Heartbeat(other, "task-2", interval_s=0.01, clock=clock):
            assert other.sent.wait(10)  # the clock's thread lives on
    finally:
        threading.excepthook = previous
    assert errors == []


def test_the_update_is_computed_in_the_trained_model_s_own_memory() -> None:
    trained = {"w": torch.full((3,), 5.0), "b": torch.full((2,), 1.5)}
    global_state = {"w": torch.full((3,), 2.0), "b": torch.full((2,), 1.0)}
    where = {k: v.data_ptr() for k, v in trained.items()}
    update = delta(trained, global_state)
    assert {k: v.data_ptr() for k, v in update.items()} == where  # no second model
    assert torch.equal(update["w"], torch.full((3,), 3.0))
    assert torch.equal(update["b"], torch.full((2,), 0.5))
    assert torch.equal(global_state["w"], torch.full((3,), 2.0))  # the global model is kept


def test_tied_weights_and_changed_dtypes_get_the_update_out_of_place() -> None:
    """A tied weight appears under two names with one memory: subtracting in place under
    each name would subtract twice. A task that trained in bf16 still sends fp32."""
    tied = torch.full((4,), 5.0)
    trained = {"embed": tied, "head": tied, "half": torch.full((2,), 3.0, dtype=torch.bfloat16)}
    global_state = {
        "embed": torch.full((4,), 1.0),
        "head": torch.full((4,), 1.0),
        "half": torch.full((2,), 1.0),
        "steps": torch.tensor([7]),
    }
    trained["steps"] = torch.tensor([9])
    update = delta(trained, global_state)
    assert torch.equal(update["embed"], torch.full((4,), 4.0))
    assert torch.equal(update["head"], torch.full((4,), 4.0))
    assert update["half"].dtype == torch.float32
    assert torch.equal(update["half"], torch.full((2,), 2.0))
    assert torch.equal(update["steps"], torch.tensor([0]))  # integer buffers are not averaged
    assert torch.equal(tied, torch.full((4,), 5.0))


def test_a_view_of_a_trained_tensor_gets_the_update_of_its_own_values() -> None:
    """A state entry that is a strided view of another's memory (a column of a table):
    neither is written in place, whichever comes first."""
    table = torch.arange(12.0).view(3, 4)
    trained = {"table": table, "column": table[:, 1]}
    global_state = {"table": torch.ones(3, 4), "column": torch.ones(3)}
    update = delta(trained, global_state)
    assert torch.equal(update["table"], torch.arange(12.0).view(3, 4) - 1)
    assert torch.equal(update["column"], torch.tensor([0.0, 4.0, 8.0]))
    assert torch.equal(table, torch.arange(12.0).view(3, 4))


def test_a_full_download_is_decoded_into_the_held_model() -> None:
    task = CountingTask()
    agent = _agent(task)
    held = {"w": torch.zeros(3)}
    agent._globals = {"r1": ("sha-of-round-3", held)}
    seen: dict[str, object] = {}

    def download(
        task_: Assignment,
        timeout_s: float,
        delta: bool = False,
        reuse: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        seen["reuse"], seen["held_then"] = reuse, dict(agent._globals)
        return {"w": torch.ones(3)}

    agent.conn.download = download  # type: ignore[method-assign]
    nxt = replace(_assignment("r1", 5), model_sha256="sha-of-round-5")
    model = agent._global_model(task, nxt, timeout_s=5.0)
    assert seen["reuse"] is held
    # Not held while it is overwritten: a failed download leaves no half-written model held.
    assert seen["held_then"] == {}
    assert agent._globals == {"r1": ("sha-of-round-5", model)}
    agent.conn.close()


def test_a_site_that_cannot_reach_its_coordinator_logs_grpc_s_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not only UNAVAILABLE: the log says what failed (here a refused connection), as the
    admin commands do, so a mistyped address is found from the site's log alone."""
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        task = CountingTask()
        config = SiteConfig("s1", f"127.0.0.1:{port}", (EP,), insecure=True, reconnect_max_s=0.2)
        agent = SiteAgent(config, executor=LocalExecutor(), tasks={EP: task}, data={})
        caplog.set_level(logging.WARNING, logger="fedra.site")
        runner = threading.Thread(target=agent.run, daemon=True)
        runner.start()
        try:
            for _ in range(200):  # bounded: each try is refused at once
                if any("unreachable" in r.getMessage() for r in caplog.records):
                    break
                agent.stop.wait(0.05)
        finally:
            agent.stop.set()
            runner.join(10)
    assert not runner.is_alive()
    warning = next(r.getMessage() for r in caplog.records if "unreachable" in r.getMessage())
    assert "UNAVAILABLE: " in warning
    assert "refused" in warning.lower(), warning
    assert "check the address" in warning
