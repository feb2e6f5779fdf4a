"""Equivalence check of a parallel plan against one process, launched with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m fedra.client.parallel.check --plan tp --steps 3 --out tp.json

Every rank trains the reference character-level GPT with the plan; rank 0 also
trains it alone, compares the loss curves and the final parameters, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedra.client.executor import WorldResult, train_in_world
from fedra.client.inner import Cancelled, KeepState, Rebase
from fedra.client.optstate import CarriedState
from fedra.client.parallel.plan import PlanOptions, SingleRunner, World
from fedra.client.parallel.trainer import train
from fedra.client.task import FitSettings
from fedra.examples.charlm import task


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--tp-size", type=int, default=0)
    p.add_argument("--pp-size", type=int, default=0)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--proximal-mu", type=float, default=0.0, help="FedProx's mu (0: off)")
    p.add_argument(
        "--scaffold",
        action="store_true",
        help="SCAFFOLD: plain SGD, each gradient corrected by a seeded random c - c_i",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep_optimizer_state: two rounds, the second starting from the optimiser state "
        "the first left (gathered whole, then each rank's part); its state compared too",
    )
    p.add_argument(
        "--move-at",
        type=int,
        default=-1,
        help="train.overlap: move every rank's model by a seeded shift before step K's "
        "optimiser step (as a round trained ahead moves onto its global model), on both sides",
    )
    p.add_argument(
        "--cancel-first",
        action="store_true",
        help="train.overlap: first a round trained ahead that rank 0 stops at its first step; "
        "every rank must stop there, and the world train on",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the one-process run")
    p.add_argument(
        "--warmup", action="store_true", help="run one round first: time the steady state"
    )
    p.add_argument("--out", required=True)
    return p.parse_args()


def _init() -> World:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return World.current()


def main() -> None:
    args = _args()
    torch.set_num_threads(1)
    world = _init()
    params = {
        "n_layers": str(args.layers),
        "d_model": str(args.d_model),
        "n_heads": "4",
        "d_ff": str(4 * args.d_model),
        "seq_len": str(args.seq_len),
        "n_experts": str(args.experts),
        "top_k": "2" if args.experts > 1 else "1",
        "moe_every": "1",
    }
    if args.scaffold:
        params["optimizer"] = "sgd"  # SCAFFOLD's option II assumes plain SGD steps
    settings = FitSettings(
        args.steps, 0, args.batch_size, args.lr, seed=0, params=params, proximal_mu=args.proximal_mu
    )
    options = PlanOptions(args.tp_size, args.pp_size, args.schedule, args.microbatches)
    data = task.load_data({"part": 0, "num_parts": 1, "max_bytes": 200_000})

    if args.warmup:  # imports, first connections, allocator: what only the first round pays
        warm = FitSettings(1, 0, args.batch_size, args.lr, seed=0, params=params)
        train_in_world(task, task.create_model(0, params), data, warm, 0, args.plan, options, world)
    if args.cancel_first:
        _cancelled_round(settings, data, params, args.plan, options, world)
    model = task.create_model(0, params)
    scaffold_lr = args.lr if args.scaffold else 0.0
    corrections = _corrections(model) if args.scaffold and world.rank == 0 else None
    keep = KeepState(None, 1) if args.keep else None
    move, overlap = _move_at(model, args.move_at, world), args.move_at >= 0
    # The same code path a site's local world runs every round.
    result = train_in_world(
        task, model, data, settings, 0, args.plan, options, world, scaffold_lr, corrections, keep,
        move, overlap,
    )  # fmt: skip
    result = _settled(result, move)
    if keep is not None:  # a second round from the first's model and optimiser state
        model = task.create_model(0, params)
        if world.rank == 0:
            assert result.state is not None
            model.load_state_dict(result.state)
        keep = KeepState(keep.result, 2)
        move = _move_at(model, args.move_at, world)
        result = train_in_world(
            task, model, data, settings, 0, args.plan, options, world, scaffold_lr, corrections,
            keep, move, overlap,
        )  # fmt: skip
        result = _settled(result, move)
    full, stats = result.state, result.stats
    if world.rank == 0:
        assert full is not None
        report: dict[str, Any] = {"plan": args.plan, "world": world.size, "backend": world.backend}
        report.update(losses=stats.losses, tokens_per_s=stats.tokens / stats.seconds)
        report.update(proximal_steps=stats.inner.get("proximal_steps", 0.0))
        report.update(scaffold_steps=stats.inner.get("scaffold_steps", 0.0))
        report.update(inner_state_rounds=stats.inner.get("inner_state_rounds", 0.0))
        report.update(moved_at_step=-1 if move is None else move.moved_at_step)
        report.update(scatter_s=result.scatter_s, train_s=stats.seconds, gather_s=result.gather_s)
        if not args.no_reference:
            kept = keep.result if keep is not None else None
            report.update(
                _compare(full, settings, data, params, world, scaffold_lr, kept, args.move_at)
            )
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # Everything is written and the group is gone. Skip the interpreter's teardown: on
    # this torch/gloo build a background thread occasionally aborts the process while
    # static objects are destroyed ("terminate called without an active exception"),
    # which would turn a finished, correct check into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _MoveAt(Rebase):
    """A round trained ahead whose global model arrives just before step ``at``: the
    shift is seeded and large, so a rank that left its part out, or moved at another
    step, ends far beyond the check's tolerance."""

    def __init__(self, model: torch.nn.Module, at: int) -> None:
        super().__init__(model)
        self.at = at
        g = torch.Generator().manual_seed(4321)
        state = model.state_dict()
        self.zero = {k: torch.zeros_like(v) for k, v in state.items()}
        self.shift = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}

    def poll(self, steps: int) -> dict[str, torch.Tensor] | None:
        if steps == self.at:
            self.move(self.zero, self.shift)
        return super().poll(steps)


def _move_at(model: torch.nn.Module, at: int, world: World) -> _MoveAt | None:
    """Rank 0's round trained ahead that moves at step ``at`` (None: no overlap)."""
    return _MoveAt(model, at) if at >= 0 and world.rank == 0 else None


def _settled(result: WorldResult, move: Rebase | None) -> WorldResult:
    """Rank 0's state with what the move left to the end (``Rebase.settle``)."""
    if move is None or result.state is None:
        return result
    return replace(result, state=move.settle(result.state))


def _cancelled_round(
    settings: FitSettings,
    data: Any,
    params: dict[str, str],
    plan: str,
    options: PlanOptions,
    world: World,
) -> None:
    """A round trained ahead that rank 0 stops at its first step: every rank must
    raise Cancelled there (one that went on would wait in a collective for ever)."""
    model = task.create_model(0, params)
    stop = Rebase(model) if world.rank == 0 else None
    if stop is not None:
        stop.cancelled.set()
    try:
        train_in_world(task, model, data, settings, 0, plan, options, world, 0.0, None, None,
                       stop, True)  # fmt: skip
    except Cancelled:
        return
    raise AssertionError(f"rank {world.rank}: a round trained ahead was not stopped")


def _corrections(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A seeded ``c - c_i`` for every trainable parameter, large enough that a rank that
    left its part out would move its parameters far beyond the check's tolerance."""
    g = torch.Generator().manual_seed(1234)
    return {
        name: 0.05 * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _compare(
    full: dict[str, torch.Tensor],
    settings: FitSettings,
    data: Any,
    params: dict[str, str],
    world: World,
    scaffold_lr: float = 0.0,
    kept: CarriedState | None = None,
    move_at: int = -1,
) -> dict[str, Any]:
    reference = task.create_model(0, params).to(world.device)
    ref_runner = SingleRunner(reference)
    one = World(0, 1, world.backend, world.device)
    corrections = _corrections(reference) if scaffold_lr > 0 else None
    plain = [(name, p.shape, p.requires_grad) for name, p in reference.named_parameters()]
    keep = KeepState(None, 1) if kept is not None else None
    move = _move_at(reference, move_at, one)
    ref_stats = train(
        ref_runner, task, data, settings, one, corrections, scaffold_lr, keep, plain, move
    )
    if keep is not None:
        if move is not None:  # the first round's state as main's second round starts from it
            first = ref_runner.full_state_dict()
            assert first is not None
            reference.load_state_dict(move.settle(first))
        keep = KeepState(keep.result, 2)
        ref_runner = SingleRunner(reference)
        move = _move_at(reference, move_at, one)
        ref_stats = train(
            ref_runner, task, data, settings, one, corrections, scaffold_lr, keep, plain, move
        )
    ref_state = ref_runner.full_state_dict()
    assert ref_state is not None
    if move is not None:
        ref_state = move.settle(ref_state)
    missing = sorted(set(ref_state) ^ set(full))
    diffs = {
        name: float((full[name].float() - ref.float()).abs().max())
        if full[name].shape == ref.shape
        else float("inf")
        for name, ref in ref_state.items()
        if name in full
    }
    state_diff = 0.0
    if kept is not None:  # the optimiser state the second round left, entry by entry
        assert keep is not None and keep.result is not None
        expected = keep.result.state
        assert sorted(kept.state) == sorted(expected), (sorted(kept.state), sorted(expected))
        for index, entries in expected.items():
            assert sorted(kept.state[index]) == sorted(entries)
            for key, want in entries.items():
                got = kept.state[index][key]
                if isinstance(want, torch.Tensor):
                    delta = (
                        (got.float() - want.float()).abs().max()
                        if got.shape == want.shape
                        else float("inf")
                    )
                    state_diff = max(state_diff, float(delta))
                elif got != want:
                    state_diff = float("inf")
    return {
        "state_max_abs_diff": state_diff,
        "reference_losses": ref_stats.losses,
        "reference_tokens_per_s": ref_stats.tokens / ref_stats.seconds,
        "mismatched_names": missing,
        "max_abs_diff": max(diffs.values(), default=float("inf")),
        "worst_param": max(diffs, key=lambda k: diffs[k]) if diffs else "",
    }


if __name__ == "__main__":
    main()
