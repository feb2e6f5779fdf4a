"""[train] overlap (client/overlap.py, inner.Rebase): a round trained ahead from the site's
own model and moved onto the global model at a step, against the same training written
out in plain torch; a move that comes after the training, cancelling, which task a
round trained ahead serves, the run.toml key and its refusals, and a run across real
processes whose sites train every round after the first ahead."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn
from torch.testing import assert_close

from fedra.client.agent import SiteAgent, _fit_seed
from fedra.client.config import ParallelConfig, SiteConfig
from fedra.client.connection import Assignment
from fedra.client.executor import LocalExecutor, WorldBroken, WorldExecutor, follow
from fedra.client.inner import Cancelled, KeepState, Rebase
from fedra.client.overlap import Ahead
from fedra.client.parallel.plan import SingleRunner, World
from fedra.client.parallel.trainer import WorldMove
from fedra.client.task import FitResult, FitSettings
from fedra.client.world import ControlChannel
from fedra.config import ConfigError
from fedra.examples import charlm
from fedra.local import LocalCluster
from fedra.protos.serde import train_from_proto, train_to_proto
from fedra.runspec import CodecSpec, RunSpec, TrainSpec, runspec_from_toml
from tests.test_optimizer_state import NoOtherRanks
from tests.test_parallel_sites import CHARLM

STEPS, LR = 6, 0.1


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


class _Linear:
    """A task whose fit calls ``at_step(i)`` before each step's forward pass."""

    def __init__(self, at_step: Callable[[int], None] = lambda i: None, adam: bool = False):
        self.at_step, self.adam = at_step, adam

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(3, 1)

    def load_data(self, config: Mapping[str, Any]) -> Any:
        return None

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        return {}

    def fit(self, model: nn.Module, data: Any, settings: FitSettings) -> FitResult:
        opt: torch.optim.Optimizer = (
            torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
            if self.adam
            else torch.optim.SGD(model.parameters(), lr=settings.learning_rate)
        )
        for i, (x, y) in enumerate(_batches(settings.seed)[: settings.local_steps]):
            self.at_step(i)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return FitResult(num_samples=8 * settings.local_steps)


def _reference(start: dict[str, torch.Tensor], shift: dict[str, torch.Tensor], at: int,
               seed: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Plain SGD from ``start``; before step ``at``'s update (its gradient already taken
    at the old point) every weight gains ``shift``."""
    model = nn.Linear(3, 1)
    model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def move() -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(shift[name])

    for i, (x, y) in enumerate(_batches(seed)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == at:
            move()
        opt.step()
    if at >= STEPS and shift:  # the training ended before the move
        move()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _settings(seed: int = 3) -> FitSettings:
    return FitSettings(local_steps=STEPS, local_epochs=0, batch_size=8, learning_rate=LR, seed=seed)


@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_move_at_a_step_is_that_step_taken_from_the_new_base(at: int) -> None:
    own = _Linear().create_model(1, {})
    glob = _Linear().create_model(2, {})
    base = {k: v.detach().clone() for k, v in own.state_dict().items()}
    target = {k: v.detach().clone() for k, v in glob.state_dict().items()}
    rebase = Rebase(own)
    task = _Linear(at_step=lambda i: rebase.move(base, target) if i == at else None)
    state, samples, _ = LocalExecutor().train(task, "t:t", 2, own, None, _settings(), rebase=rebase)
    assert rebase.moved_at_step == at and not rebase.pending()
    shift = {k: target[k] - base[k] for k in base}
    expected = _reference(base, shift, at, seed=3)
    assert samples == 8 * STEPS
    for k in expected:
        assert_close(state[k], expected[k], rtol=1e-6, atol=1e-7)


def test_a_move_after_the_training_ended_is_added_to_what_it_left() -> None:
    own, glob = _Linear().create_model(1, {}), _Linear().create_model(2, {})
    base = {k: v.detach().clone() for k, v in own.state_dict().items()}
    rebase = Rebase(own)
    state, _, _ = LocalExecutor().train(_Linear(), "t:t", 2, own, None, _settings(), rebase=rebase)
    trained = {k: v.clone() for k, v in state.items()}
    rebase.move(base, glob.state_dict())
    settled = rebase.settle(state)
    assert rebase.moved_at_step == STEPS  # every step was taken before the move
    for k, value in trained.items():
        assert_close(settled[k], value + glob.state_dict()[k] - base[k])


def _assignment(
    round_number: int = 1,
    run_id: str = "run",
    entry_point: str = "t:t",
    rounds: int = 0,
    **train: Any,
) -> Assignment:
    return Assignment(
        task_id=f"t{round_number}", run_id=run_id, round=round_number, init=False,
        entry_point=entry_point, train=TrainSpec(local_steps=STEPS, learning_rate=LR, overlap=True,
                                            **train),
        seed=0, model_sha256="", model_bytes=0, deadline_in_s=60.0, codec=CodecSpec(),
        rounds=rounds,
    )  # fmt: skip


def _start(task: Assignment, impl: _Linear, keep: KeepState | None = None) -> Ahead:
    model = impl.create_model(1, {})
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    executor = LocalExecutor()

    def fit(m: nn.Module, k: KeepState | None, rebase: Rebase) -> Any:
        return executor.train(impl, "t:t", task.round + 1, m, None, _settings(), k, None, rebase)

    return Ahead.start(task, trained, model, keep, fit)


class _Gate:
    """Holds a training before step ``at``: ``reached`` once there, on until ``open``."""

    def __init__(self, at: int) -> None:
        self.at, self.reached, self._open = at, threading.Event(), threading.Event()

    def __call__(self, i: int) -> None:
        if i == self.at:
            self.reached.set()
            self._open.wait(30)

    def open(self) -> None:
        self._open.set()


def test_a_round_trained_ahead_serves_only_the_next_round_of_its_run_as_it_was() -> None:
    gate = _Gate(at=1)
    ahead = _start(_assignment(1), _Linear(at_step=gate))
    assert ahead.matches(_assignment(2))
    assert not ahead.matches(_assignment(3))  # not sampled in round 2
    assert not ahead.matches(_assignment(1))  # round 1 retried
    assert not ahead.matches(_assignment(2, run_id="other"))
    assert not ahead.matches(_assignment(2, batch_size=7))  # the settings changed
    assert gate.reached.wait(30)  # one step taken, the second about to be
    ahead.rebase.cancelled.set()
    gate.open()
    ahead.cancel()  # it stopped at its next step, without a result
    assert ahead.rebase.done.is_set() and ahead.rebase.steps_seen == 1


def test_finishing_moves_it_and_gives_the_steps_taken_before() -> None:
    gate = _Gate(at=2)
    ahead = _start(_assignment(1), _Linear(at_step=gate))
    assert gate.reached.wait(30)
    glob = _Linear().create_model(5, {}).state_dict()
    done = threading.Thread(target=lambda: results.append(ahead.finish(glob)))
    results: list[Any] = []
    done.start()
    while not ahead.rebase.pending():  # finish asked for the move; the step may now go on
        threading.Event().wait(0.01)
    gate.open()
    done.join(30)
    state, samples, metrics = results[0]
    assert metrics["overlap_moved_at_step"] == 2.0 and samples == 8 * STEPS
    shift = {k: glob[k] - ahead.base[k] for k in glob}
    expected = _reference(ahead.base, shift, 2, seed=3)
    for k in expected:
        assert_close(state[k], expected[k], rtol=1e-6, atol=1e-7)


def test_a_failing_training_ahead_fails_the_round_it_was_for() -> None:
    def boom(i: int) -> None:
        raise RuntimeError("the task's own bug")

    ahead = _start(_assignment(1), _Linear(at_step=boom))
    with pytest.raises(RuntimeError, match="the task's own bug"):
        ahead.finish(_Linear().create_model(5, {}).state_dict())


CHARLM_PARAMS = {"d_model": "16", "n_layers": "2", "n_heads": "2", "d_ff": "32", "seq_len": "16"}


class _MoveBefore(Rebase):
    """A round trained ahead whose global model arrives just before step ``at``."""

    def __init__(self, model: nn.Module, at: int, target: Mapping[str, torch.Tensor]) -> None:
        super().__init__(model)
        self.at, self.target = at, target
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def poll(self, steps: int) -> dict[str, torch.Tensor] | None:
        if steps == self.at:
            self.move(self.base, self.target)
        return super().poll(steps)


@pytest.mark.parametrize("at", [0, 1])  # of 3: a later step's gradient sees the move
def test_a_local_world_moves_at_the_step_a_single_process_moves_at(
    world_of_one: World, at: int
) -> None:
    """A site's local world (a world of one, through the same path as every plan: rank 0
    tells every rank at each step whether to move, and each adds its part) moves a round
    trained ahead onto the global model at the very step the task's own ``fit`` in one
    process does, to the same weights."""
    settings = FitSettings(3, 0, 4, 1e-2, seed=0, params=CHARLM_PARAMS)
    data = charlm.task.load_data({"max_bytes": 20_000})
    target = charlm.task.create_model(9, CHARLM_PARAMS).state_dict()
    world = WorldExecutor(ParallelConfig(nproc=1, plan="none"), world_of_one, NoOtherRanks())  # type: ignore[arg-type]
    states = []
    for executor in (world, LocalExecutor(torch.device("cpu"))):
        model = charlm.task.create_model(0, CHARLM_PARAMS)
        rebase = _MoveBefore(model, at, target)
        state, _, _ = executor.train(
            charlm.task, "fedra.examples.charlm:task", 2, model, data, settings, rebase=rebase
        )
        assert rebase.moved_at_step == at and not rebase.pending()
        states.append(rebase.settle(state))
    moved, alone = states
    for key, tensor in alone.items():
        assert_close(moved[key], tensor, rtol=0, atol=1e-6, msg=key)
    unmoved = charlm.task.create_model(0, CHARLM_PARAMS).state_dict()
    assert any((moved[k] - unmoved[k]).abs().max() > 0.1 for k in unmoved)  # it did move


def test_a_local_world_stops_a_round_no_longer_wanted_and_trains_on(world_of_one: World) -> None:
    """Cancelled at a step, not the world broken: the world trains the next task."""
    settings = FitSettings(3, 0, 4, 1e-2, seed=0, params=CHARLM_PARAMS)
    data = charlm.task.load_data({"max_bytes": 20_000})
    world = WorldExecutor(ParallelConfig(nproc=1, plan="none"), world_of_one, NoOtherRanks())  # type: ignore[arg-type]
    model = charlm.task.create_model(0, CHARLM_PARAMS)
    rebase = Rebase(model)
    rebase.cancelled.set()
    with pytest.raises(Cancelled):
        world.train(charlm.task, "fedra.examples.charlm:task", 2, model, data, settings,
                    rebase=rebase)  # fmt: skip
    assert rebase.steps_seen == 0
    _, _, metrics = world.train(charlm.task, "fedra.examples.charlm:task", 2, model, data, settings)
    assert metrics["steps"] == 3


def test_a_world_moves_its_parameters_at_the_step_and_its_buffers_with_the_state(
    world_of_one: World,
) -> None:
    """``WorldMove`` adds the shift to the parameters the rank holds at the step; a
    floating buffer's part (a running statistic) is added to the gathered state."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plain = [(n, p.shape, p.requires_grad) for n, p in model.named_parameters()]
    buffers = {n for n, b in model.named_buffers() if b.is_floating_point()}
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rebase = Rebase(model)
    rebase.move(base, {k: v + 1 if v.is_floating_point() else v for k, v in base.items()})
    WorldMove(SingleRunner(model), plain, world_of_one, rebase, buffers).at_step(0)
    assert rebase.moved_at_step == 0 and not rebase.pending()
    for name, param in model.named_parameters():
        assert_close(param.detach(), base[name] + 1)
    assert set(rebase.late) == buffers == {"1.running_mean", "1.running_var"}
    assert_close(model.state_dict()["1.running_mean"], base["1.running_mean"])  # not yet
    state = rebase.settle(model.state_dict())
    for name in buffers:
        assert_close(state[name], base[name] + 1)
    assert state["1.num_batches_tracked"] == base["1.num_batches_tracked"]  # not floating


def test_a_tied_weight_moves_once() -> None:
    """One tensor under two names in the state (tied weights) gains the shift once."""
    first, second = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert sorted(base) == ["0.weight", "1.weight"]
    rebase = Rebase(model)
    rebase.move(base, {k: v + 1 for k, v in base.items()})
    rebase.apply(0)
    assert_close(first.weight.detach(), base["0.weight"] + 1)


def _stop_then_train(rank: int, store: str) -> None:
    """Rank 0 asks for a round trained ahead that it stops at its first step, then for a
    round as usual, then stops the world; rank 1 follows, as a site's other ranks do."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        world, control = World.current(), ControlChannel()
        config = ParallelConfig(nproc=2, plan="fsdp")
        settings = FitSettings(3, 0, 4, 1e-2, seed=0, params=CHARLM_PARAMS)
        data = charlm.task.load_data({"max_bytes": 20_000})
        if rank != 0:
            follow({CHARLM: charlm.task}, {CHARLM: data}, config, world, control)
            return  # rank 0 said stop: the dropped round did not break the world
        executor = WorldExecutor(config, world, control)
        model = charlm.task.create_model(0, CHARLM_PARAMS)
        stop = Rebase(model)
        stop.cancelled.set()
        with pytest.raises(Cancelled):
            executor.train(charlm.task, CHARLM, 2, model, data, settings, rebase=stop)
        model = charlm.task.create_model(0, CHARLM_PARAMS)  # the plan sharded the last one
        _, _, metrics = executor.train(charlm.task, CHARLM, 2, model, data, settings)
        assert metrics["steps"] == 3
        executor.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_site_of_two_processes_drops_a_round_trained_ahead_and_trains_on(
    tmp_path: Path,
) -> None:
    """Both ranks stop at the same step (rank 1 in ``follow``), and the world trains the
    next task: a rank that went on would wait in a collective for ever."""
    spawn(_stop_then_train, args=(str(tmp_path / "store"),), nprocs=2)  # type: ignore[no-untyped-call]


class _FailingEvaluate(_Linear):
    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        raise RuntimeError("the task's evaluate failed")


def test_a_task_that_fails_before_the_move_leaves_no_training_ahead_running(
    tmp_path: Path,
) -> None:
    """The next round's task fails before its training ahead is moved (its evaluate
    raises): the training ahead is stopped, not left running beside the next task's."""
    config = SiteConfig(site_id="s1", coordinator="127.0.0.1:1", allowed_tasks=(ENTRY,),
                        insecure=True, state_dir=tmp_path)  # fmt: skip
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={ENTRY: LINEAR},
                      data={ENTRY: None})  # fmt: skip
    held: list[Ahead] = []
    # The training ahead waits at its second step until it is told to stop (30 s at most).
    waiting = _Linear(at_step=lambda i: held[0].rebase.cancelled.wait(30) if i == 1 else None)
    try:
        held.append(_start(_assignment(1, entry_point=ENTRY), waiting))
        agent._ahead = held[0]
        x2 = _Linear().create_model(7, {}).state_dict()
        with pytest.raises(RuntimeError, match="evaluate failed"):
            agent._train(_FailingEvaluate(), _assignment(2, entry_point=ENTRY), x2)
        assert held[0]._thread is not None and not held[0]._thread.is_alive()
        assert held[0].rebase.done.is_set() and agent._ahead is None
    finally:
        held[0].cancel()
        agent.conn.close()


def test_a_broken_local_world_found_by_a_dropped_training_ahead_is_raised(
    tmp_path: Path,
) -> None:
    """A training ahead that the next task does not want, and that ended with the local
    world broken: dropping it raises WorldBroken, so the world restarts before training."""
    config = SiteConfig(site_id="s1", coordinator="127.0.0.1:1", allowed_tasks=(ENTRY,),
                        insecure=True, state_dir=tmp_path)  # fmt: skip
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={ENTRY: LINEAR},
                      data={ENTRY: None})  # fmt: skip

    def broken(i: int) -> None:
        raise WorldBroken("RuntimeError: a rank of the local world died")

    try:
        agent._ahead = _start(_assignment(1, entry_point=ENTRY), _Linear(at_step=broken))
        with pytest.raises(WorldBroken, match="a rank of the local world died"):
            agent._take_ahead(_assignment(5, entry_point=ENTRY))  # not the one it trained for
        assert agent._ahead is None
    finally:
        agent.conn.close()


def test_run_toml_key_wire_and_refusals() -> None:
    doc = {"task": "a:b", "rounds": 2, "train": {"local_steps": 4, "overlap": True}}
    spec = runspec_from_toml(doc)
    assert spec.train.overlap
    assert train_from_proto(train_to_proto(spec.train)) == spec.train
    with pytest.raises(ConfigError, match=r"train\.overlap: expected bool"):
        runspec_from_toml({**doc, "train": {"local_steps": 4, "overlap": "yes"}})
    with pytest.raises(ConfigError, match=r"train\.overlap: cannot be combined with train\.scaf"):
        TrainSpec(local_steps=4, overlap=True, scaffold=True).validate()
    with pytest.raises(ConfigError, match=r"train\.overlap: cannot be combined with train\.prox"):
        TrainSpec(local_steps=4, overlap=True, proximal_mu=0.1).validate()


LINEAR = _Linear()
ENTRY = "tests.test_overlap:LINEAR"


def test_the_agent_trains_ahead_from_its_trained_model_and_sends_the_moved_one(
    tmp_path: Path,
) -> None:
    """The agent's own path: round 1 trains as usual and starts round 2 from the model it
    trained (not from the update it sends, which is computed in that model's memory);
    round 2's update is the training moved onto round 2's global model."""
    config = SiteConfig(site_id="s1", coordinator="127.0.0.1:1", allowed_tasks=(ENTRY,),
                        insecure=True, state_dir=tmp_path)  # fmt: skip
    agent = SiteAgent(config, executor=LocalExecutor(), tasks={ENTRY: LINEAR},
                      data={ENTRY: None})  # fmt: skip
    try:
        x1 = {k: v.detach().clone() for k, v in LINEAR.create_model(1, {}).state_dict().items()}
        first = _assignment(1, entry_point=ENTRY)
        update1, _, _ = agent._train(LINEAR, first, {k: v.clone() for k, v in x1.items()})
        y1 = {k: x1[k] + update1[k] for k in x1}
        expected_y1 = _reference(x1, {}, STEPS + 1, seed=_fit_seed(0, 1, "s1"))
        for k in x1:
            assert_close(y1[k], expected_y1[k], rtol=1e-6, atol=1e-7)
        ahead = agent._ahead
        assert ahead is not None and ahead.round_number == 2
        for k in x1:  # the round trained ahead starts from the trained model itself
            assert_close(ahead.base[k], expected_y1[k], rtol=1e-6, atol=1e-7)
        x2 = {k: v.detach().clone() for k, v in LINEAR.create_model(7, {}).state_dict().items()}
        last = _assignment(2, entry_point=ENTRY, rounds=2)  # the run's last round
        update2, _, metrics = agent._train(LINEAR, last, x2)
        at = int(metrics["overlap_moved_at_step"])
        shift = {k: x2[k] - y1[k] for k in x2}
        expected = _reference(y1, shift, at, seed=_fit_seed(0, 2, "s1"))
        for k, x in x2.items():
            assert_close(x + update2[k], expected[k], rtol=1e-5, atol=1e-6)
        assert agent._ahead is None  # nothing is trained ahead of a round that never comes
    finally:
        if agent._ahead is not None:
            agent._ahead.cancel()
        agent.conn.close()


TINY_GPT = {"d_model": "32", "seq_len": "32", "n_layers": "2", "n_heads": "4"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_run_with_overlap_trains_every_round_after_the_first_ahead(
    cluster: LocalCluster,
) -> None:
    """Two real sites, one of them a local world of two processes (fsdp: each rank moves
    its shard): from round 2 on each round was trained ahead and moved (the metric says
    at which step), its compute counted, the kept optimiser state carried on, and the run
    still learns."""
    cluster.start_coordinator(flags=["--heartbeat-s", "0.5", "--admin-port", "none"])
    ids = ["site-0", "site-1"]
    for i, site_id in enumerate(ids):
        data = {"part": i, "num_parts": 2, "max_bytes": 100_000}
        parallel = {"nproc": 2, "plan": "fsdp"} if i == 0 else None
        cluster.start_site(site_id, [CHARLM], data, parallel=parallel)
    cluster.wait_for_sites(ids, timeout_s=120)
    train = TrainSpec(local_steps=12, batch_size=8, learning_rate=3e-3, overlap=True,
                      keep_optimizer_state=True, params=TINY_GPT)  # fmt: skip
    spec = RunSpec(task=CHARLM, rounds=4, sites_per_round=2, seed=4, train=train,
                   round_deadline_s=120.0, join_timeout_s=90.0).validate()  # fmt: skip
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        status = next(s for s in admin.watch(run_id, timeout_s=240)
                      if s.state in ("completed", "failed", "cancelled"))  # fmt: skip
    assert status.state == "completed", status.reason
    losses, world_moves = [], []
    for r in (r for r in status.rounds if r.number > 0):
        counted = [p for p in r.participations
                   if p.status == "accepted" and p.attempt == r.attempt]  # fmt: skip
        assert sorted(p.site_id for p in counted) == ids
        for p in counted:
            moved = p.metrics.get("overlap_moved_at_step")
            if r.number == 1:
                assert moved is None  # nothing to train ahead of the first round
            else:
                assert moved is not None and 0 <= moved <= 12, (r.number, p.metrics)
                assert p.metrics["overlap_ahead_s"] >= 0
                if p.site_id == "site-0":
                    world_moves.append(moved)
            assert p.metrics["compute_s"] > 0
            assert p.metrics["inner_state_rounds"] == r.number - 1  # the state goes on
        losses.append(sum(p.metrics["eval_loss"] for p in counted))
    # The slower site (its world of two shares the cores) gets its next task while its
    # training ahead is under way: its ranks moved mid-training, not only after it.
    assert min(world_moves) < 12, world_moves
    log = (cluster.state_dir / "logs" / "site-0.log").read_text()
    assert "local world of 2 ranks" in log and "plan fsdp" in log
    assert losses[-1] < losses[0]
