"""[train] keep_optimizer_state: the site's inner optimiser state through its file exactly,
carried into the next round's optimiser, reset on request, and across real processes
and a site restart."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.testing import assert_close

from fedra.client.config import ParallelConfig
from fedra.client.executor import LocalExecutor, WorldExecutor
from fedra.client.inner import InnerOptimizerError, KeepState
from fedra.client.optstate import (
    CarriedState,
    OptimizerStateError,
    OptimizerStates,
    load_file,
    to_bytes,
)
from fedra.client.parallel.plan import World
from fedra.client.task import FitResult, FitSettings
from fedra.config import ConfigError
from fedra.examples import charlm, synthetic
from fedra.local import LocalCluster
from fedra.protos.serde import train_from_proto, train_to_proto
from fedra.runspec import RunSpec, TrainSpec, runspec_from_toml

STEPS = 4
XY = tuple[torch.Tensor, torch.Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _data() -> XY:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, generator=g)
    return x, x.sum(1, keepdim=True)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, data: XY, offset: int = 0) -> None:
    x, y = data
    for step in range(STEPS):
        rows = slice((offset + step) * 4 % 32, (offset + step) * 4 % 32 + 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
        opt.step()


OPTIMISERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),  # its state holds None
    "two-groups": lambda ps: torch.optim.Adam(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.001}], lr=0.01
    ),
}


def _assert_same_state(
    a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]]
) -> None:
    assert sorted(a) == sorted(b)
    for index, entries in a.items():
        assert sorted(entries) == sorted(b[index]), index
        for name, value in entries.items():
            other = b[index][name]
            assert type(other) is type(value), (index, name)
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and value.shape == other.shape
                assert_close(other, value, rtol=0, atol=0)
            else:
                assert other == value


@pytest.mark.parametrize("kind", sorted(OPTIMISERS))
def test_the_file_gives_back_the_optimiser_s_state_exactly(kind: str, tmp_path: Path) -> None:
    model = _model()
    opt = OPTIMISERS[kind](list(model.parameters()))
    _steps(model, opt, _data())
    carried = CarriedState.of(opt, rounds=3, after_round=7)
    path = tmp_path / "optimizer-r.safetensors"
    path.write_bytes(to_bytes(carried))
    back = load_file(path)
    _assert_same_state(back.state, opt.state_dict()["state"])
    assert back.groups == [g["params"] for g in opt.state_dict()["param_groups"]]
    assert (back.rounds, back.after_round) == (3, 7)


@pytest.mark.parametrize("kind", sorted(OPTIMISERS))
def test_a_new_optimiser_given_the_state_continues_as_the_old_one(
    kind: str, tmp_path: Path
) -> None:
    data = _data()
    model_a, model_b = _model(), _model()
    old = OPTIMISERS[kind](list(model_a.parameters()))
    _steps(model_a, old, data)
    (tmp_path / "s.safetensors").write_bytes(to_bytes(CarriedState.of(old, 1, 1)))
    carried = load_file(tmp_path / "s.safetensors")
    model_b.load_state_dict(model_a.state_dict())
    new = OPTIMISERS[kind](list(model_b.parameters()))
    assert carried.fits(new)
    carried.load_into(new)
    _steps(model_a, old, data, offset=STEPS)
    _steps(model_b, new, data, offset=STEPS)
    assert_close(model_b.state_dict(), model_a.state_dict(), rtol=0, atol=0)
    assert new.param_groups[0]["lr"] == old.param_groups[0]["lr"]


def test_a_damaged_file_is_an_error_and_the_store_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "optimizer-r1.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(OptimizerStateError, match="not an optimiser state file"):
        load_file(path)
    assert OptimizerStates(tmp_path).load("r1", 5) is None
    # A safetensors file of someone else's: no header of ours.
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(OptimizerStateError):
        load_file(path)


class _AdamTask:
    """A task whose ``fit`` builds a fresh Adam every round, as most tasks do."""

    def create_model(self, seed: int, params: Mapping[str, str]) -> nn.Module:
        return _model()

    def load_data(self, config: Mapping[str, Any]) -> XY:
        return _data()

    def fit(self, model: nn.Module, data: XY, settings: FitSettings) -> FitResult:
        opt = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
        _steps(model, opt, data)
        return FitResult(num_samples=32)

    def evaluate(self, model: nn.Module, data: XY) -> dict[str, float]:
        return {}


def test_rounds_of_a_task_s_fit_carry_adam_s_state(tmp_path: Path) -> None:
    """Two rounds through the site's executor and store, against one Adam kept by hand."""
    settings = FitSettings(STEPS, 0, 4, 0.01, seed=0)
    executor, store, task = (
        LocalExecutor(torch.device("cpu")),
        OptimizerStates(tmp_path),
        _AdamTask(),
    )
    global_model = _model().state_dict()
    reference = _model()
    by_hand = torch.optim.Adam(reference.parameters(), lr=0.01)
    for round_number in (1, 2):
        model = _model()
        model.load_state_dict(global_model)
        keep = KeepState(store.load("run", round_number), round_number)
        state, _, metrics = executor.train(
            task, "t:adam", round_number, model, _data(), settings, keep
        )
        assert keep.result is not None
        store.save("run", keep.result)
        assert metrics["inner_state_rounds"] == round_number - 1
        reference.load_state_dict(global_model)  # each round starts from the global model
        _steps(reference, by_hand, _data())
        assert_close(state, reference.state_dict(), rtol=0, atol=0)
    saved = store.load("run", 3)
    assert saved is not None and saved.rounds == 2
    assert float(saved.state[0]["step"]) == 2 * STEPS  # Adam's step count went on
    # A round that starts afresh: the count starts again.
    keep = KeepState(None, 3)
    executor.train(task, "t:adam", 3, _model(), _data(), settings, keep)
    assert keep.result is not None and float(keep.result.state[0]["step"]) == STEPS


def test_a_fit_that_steps_no_optimiser_is_refused_naming_the_key() -> None:
    data = synthetic.task.load_data({"samples": 32})
    model = synthetic.task.create_model(0, {})
    with pytest.raises(InnerOptimizerError, match=r"^train\.keep_optimizer_state: task 't:s'"):
        LocalExecutor(torch.device("cpu")).train(
            synthetic.task, "t:s", 1, model, data, FitSettings(2, 0, 8, 0.01, seed=1),
            KeepState(None, 1),
        )  # fmt: skip


def test_reset_rounds() -> None:
    keep = TrainSpec(keep_optimizer_state=True, reset_optimizer_every=3)
    assert [r for r in range(1, 11) if keep.resets_optimizer(r)] == [1, 4, 7, 10]
    never = TrainSpec(keep_optimizer_state=True)
    assert [r for r in range(1, 11) if never.resets_optimizer(r)] == []  # (round 1: none yet)
    assert all(TrainSpec().resets_optimizer(r) for r in range(1, 5))  # the default: fresh


def test_run_toml_keys_and_the_wire() -> None:
    doc = {"task": "m:t", "rounds": 2,
           "train": {"keep_optimizer_state": True, "reset_optimizer_every": 5}}  # fmt: skip
    spec = runspec_from_toml(doc)
    assert spec.train.keep_optimizer_state and spec.train.reset_optimizer_every == 5
    assert train_from_proto(train_to_proto(spec.train)) == spec.train
    default = runspec_from_toml({"task": "m:t", "rounds": 2}).train
    assert not default.keep_optimizer_state and default.reset_optimizer_every == 0
    with pytest.raises(ConfigError, match=r"^train\.keep_optimizer_state: expected bool"):
        runspec_from_toml({**doc, "train": {"keep_optimizer_state": 1}})
    with pytest.raises(ConfigError, match=r"^train\.reset_optimizer_every: only a run that keeps"):
        runspec_from_toml({**doc, "train": {"reset_optimizer_every": 2}})
    with pytest.raises(ConfigError, match=r"^train\.reset_optimizer_every: must be"):
        runspec_from_toml({**doc, "train": {"keep_optimizer_state": True,
                                            "reset_optimizer_every": -1}})  # fmt: skip


# -- across processes ---------------------------------------------------------------------

CHARLM = "fedra.examples.charlm:task"
TINY = {"n_layers": "1", "d_model": "16", "n_heads": "2", "d_ff": "32", "seq_len": "16"}


def _state_file(cluster: LocalCluster, site_id: str, run_id: str) -> CarriedState:
    return load_file(cluster.state_dir / "sites" / site_id / f"optimizer-{run_id}.safetensors")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_adam_s_state_is_carried_across_rounds_and_a_site_restart_and_reset(
    cluster: LocalCluster,
) -> None:
    """Two real sites, AdamW in the task's fit: its step count goes on from round to round,
    through a SIGKILL of one site the instant its round-2 update was accepted (before it
    kept anything of it), and starts again in the round the run resets it."""
    cluster.start_coordinator(
        flags=["--heartbeat-s", "0.5", "--site-timeout-s", "3", "--poll-timeout-s", "5"]
    )
    ids = ["site-0", "site-1"]
    data = [{"part": i, "num_parts": 2, "max_bytes": 20_000} for i in range(2)]
    for site_id, d in zip(ids, data, strict=True):
        fault = {"FEDRA_FAULT_CRASH": "after_upload:2"} if site_id == "site-0" else None
        cluster.start_site(site_id, [CHARLM], d, extra_env=fault)
    cluster.wait_for_sites(ids)
    steps = 2
    train = TrainSpec(local_steps=steps, batch_size=4, learning_rate=1e-3, params=TINY,
                      keep_optimizer_state=True, reset_optimizer_every=3)  # fmt: skip
    spec = RunSpec(task=CHARLM, rounds=4, sites_per_round=2, seed=3, round_deadline_s=60.0,
                   join_timeout_s=60.0, train=train).validate()  # fmt: skip
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        # The site's memory goes; only its state_dir can carry round 2's state on.
        assert cluster.sites["site-0"].popen.wait(120) == -signal.SIGKILL
        cluster.start_site("site-0", [CHARLM], data[0])
        status = next(s for s in admin.watch(run_id, timeout_s=240)
                      if s.state in ("completed", "failed", "cancelled"))  # fmt: skip
    assert status.state == "completed", status.reason
    # Rounds 1 and 4 start afresh (reset every 3); 2 and 3 carry 1 and 2 earlier rounds.
    expected = {1: 0.0, 2: 1.0, 3: 2.0, 4: 0.0}
    seen = [(r.number, p.attempt, p.site_id, p.status, p.metrics.get("inner_state_rounds"),
             p.error) for r in status.rounds for p in r.participations]  # fmt: skip
    for r in (r for r in status.rounds if r.number > 0):
        # The committed attempt's; an attempt retried (a site lost to the kill) trained
        # again from the state the rounds before it left, which these show too.
        accepted = [
            p for p in r.participations if p.status == "accepted" and p.attempt == r.attempt
        ]
        assert sorted(p.site_id for p in accepted) == ids, seen
        for p in accepted:
            assert p.metrics["inner_state_rounds"] == expected[r.number], seen
    for site_id in ids:
        # Promoted once the site hears its update was accepted: a moment after the commit.
        deadline = time.monotonic() + 30
        while (saved := _state_file(cluster, site_id, run_id)).after_round < 4:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling the site's file, with a deadline
        assert (saved.after_round, saved.rounds) == (4, 1), site_id
        assert float(saved.state[0]["step"]) == steps  # reset in round 4: counted afresh


@pytest.mark.parametrize("on_disk", [True, False], ids=["state_dir", "memory"])
def test_a_round_trained_again_starts_from_the_rounds_before_it(
    tmp_path: Path, on_disk: bool
) -> None:
    """A retried attempt of round 3 must not carry its own first attempt's state."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, _data())
    store = OptimizerStates(tmp_path if on_disk else None)
    assert store.load("run", 1) is None
    store.save("run", CarriedState.of(opt, 1, after_round=2))
    store.save("run", CarriedState.of(opt, 2, after_round=3))  # round 3, first attempt
    again = store.load("run", 3)
    assert again is not None and again.after_round == 2
    store.save("run", CarriedState.of(opt, 2, after_round=3))  # round 3 again: replaced
    again = store.load("run", 3)
    assert again is not None and again.after_round == 2
    latest = store.load("run", 4)
    assert latest is not None and latest.after_round == 3
    store.save("run", CarriedState.of(opt, 3, after_round=4))
    assert [store.load("run", r).after_round for r in (4, 5)] == [3, 4]  # type: ignore[union-attr]
    assert store.load("run", 3) is None  # two generations only
    if on_disk:
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "optimizer-run.prev.safetensors", "optimizer-run.safetensors",
        ]  # fmt: skip


@pytest.mark.parametrize("on_disk", [True, False], ids=["state_dir", "memory"])
def test_a_staged_state_counts_only_once_promoted(tmp_path: Path, on_disk: bool) -> None:
    """Staged before the update leaves; seen by no round until promoted; promoting twice
    (a restart settling an update it had already kept) or for another round does nothing;
    discarded, it is gone."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, _data())
    store = OptimizerStates(tmp_path if on_disk else None)
    store.save("run", CarriedState.of(opt, 1, after_round=1))
    store.stage("run", CarriedState.of(opt, 2, after_round=2))
    assert store.load("run", 3).after_round == 1  # type: ignore[union-attr]
    assert not store.promote("run", 3)  # staged for round 2, not 3
    assert store.promote("run", 2)
    assert not store.promote("run", 2)  # already the latest
    assert [store.load("run", r).after_round for r in (2, 3)] == [1, 2]  # type: ignore[union-attr]
    store.stage("run", CarriedState.of(opt, 3, after_round=3))
    store.discard("run")
    assert not store.promote("run", 3)
    assert store.load("run", 4).after_round == 2  # type: ignore[union-attr]
    if on_disk:
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "optimizer-run.prev.safetensors", "optimizer-run.safetensors",
        ]  # fmt: skip


def _promoting(tmp_path: Path) -> tuple[OptimizerStates, torch.optim.Optimizer, Path, Path]:
    """A store on disk with round 1's state the latest and round 2's staged; its optimiser,
    and the latest and previous files."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, _data())
    store = OptimizerStates(tmp_path)
    store.save("run", CarriedState.of(opt, 1, after_round=1))
    store.stage("run", CarriedState.of(opt, 2, after_round=2))
    latest, previous = store.path("run"), store.path("run", "prev")
    assert latest is not None and previous is not None
    return store, opt, latest, previous


def test_a_promotion_cut_between_its_renames_completes_when_done_again(tmp_path: Path) -> None:
    """Killed after the latest became the previous and before the staged became the
    latest: the round before is still there, and promoting again finishes the move."""
    store, _, latest, previous = _promoting(tmp_path)
    latest.replace(previous)  # the first rename, as a kill would leave it
    assert store.load("run", 3).after_round == 1  # type: ignore[union-attr]
    assert store.promote("run", 2)
    assert [store.load("run", r).after_round for r in (2, 3)] == [1, 2]  # type: ignore[union-attr]


def test_a_promotion_never_leaves_the_latest_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of the site's files during a promotion (an operator, a test) always finds
    the latest state: the previous one is a second name of its file before the staged one
    takes its place. Killed in between, the two are the same state, a link may be left
    over, and promoting again finishes the move."""
    store, opt, latest, previous = _promoting(tmp_path)
    seen: list[bool] = []
    replace = Path.replace

    def watched(self: Path, target: Path | str) -> Path:
        seen.append(latest.exists())
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", watched)
    assert store.promote("run", 2)
    monkeypatch.undo()
    assert seen and all(seen), seen  # before each rename, and so between them
    assert [store.load("run", r).after_round for r in (2, 3)] == [1, 2]  # type: ignore[union-attr]

    store.stage("run", CarriedState.of(opt, 3, after_round=3))  # killed after the link:
    os.link(latest, previous.with_name(previous.name + ".link"))
    assert store.load("run", 4).after_round == 2  # type: ignore[union-attr]
    assert store.promote("run", 3)
    assert [store.load("run", r).after_round for r in (3, 4)] == [2, 3]  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "optimizer-run.prev.safetensors", "optimizer-run.safetensors",
    ]  # fmt: skip


def test_a_local_world_keeps_the_state_a_single_process_keeps(world_of_one: World) -> None:
    """A site's local world (here a world of one through the same path: the kept state
    shared from rank 0, each rank's part loaded, the whole gathered back) keeps its
    optimiser's state in the very layout a site of one process keeps it in (the task's own
    ``fit``): a site may change its plan between rounds, and a state file is a state file.
    Two rounds each way; the second starts from the state the first left."""
    params = {"d_model": "16", "n_layers": "2", "n_heads": "2", "d_ff": "32", "seq_len": "16"}
    settings = FitSettings(3, 0, 4, 1e-2, seed=0, params=params)
    data = charlm.task.load_data({"max_bytes": 20_000})
    executor = WorldExecutor(ParallelConfig(nproc=1, plan="none"), world_of_one, NoOtherRanks())  # type: ignore[arg-type]
    local = LocalExecutor(torch.device("cpu"))
    out: dict[str, tuple[dict[str, torch.Tensor], CarriedState]] = {}
    for name, run in (("world", executor), ("single", local)):
        model, keep = charlm.task.create_model(0, params), KeepState(None, 1)
        for round_number in (1, 2):
            state, _, metrics = run.train(
                charlm.task, CHARLM, round_number, model, data, settings, keep
            )
            assert keep.result is not None and keep.result.after_round == round_number
            assert metrics["inner_state_rounds"] == round_number - 1
            model = charlm.task.create_model(0, params)
            model.load_state_dict(state)
            keep = KeepState(keep.result, round_number + 1)
        assert keep.carried is not None and keep.carried.rounds == 2
        out[name] = (state, keep.carried)
    (world_model, world_kept), (single_model, single_kept) = out["world"], out["single"]
    for key, tensor in single_model.items():
        assert_close(world_model[key], tensor, rtol=0, atol=1e-6, msg=key)
    assert world_kept.groups == single_kept.groups
    assert sorted(world_kept.state) == sorted(single_kept.state)
    for index, entries in single_kept.state.items():
        assert sorted(world_kept.state[index]) == sorted(entries)
        for key, value in entries.items():
            assert_close(world_kept.state[index][key], value, rtol=0, atol=1e-6)


class NoOtherRanks:
    """The other ranks' channel of a world of one: nobody to tell."""

    def send(self, message: object) -> None:
        pass
