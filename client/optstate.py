"""A site's inner optimiser state, carried from one round of a run to the next.

One file per run in the site's state directory, ``optimizer-<run>.safetensors``: the
state's tensors (moments, step counts) as safetensors, and, as JSON in the same file's
header, the rest: which parameter each entry belongs to, the values that are not tensors,
the param groups' layout, the rounds it carries. One file, so it is replaced whole
(temporary file, fsync, rename). No pickle: reading it runs no code.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, save

from fedra.files import fsync_dir, write_atomic

log = logging.getLogger("fedra.site")
_META_KEY = "fedra.optimizer_state"
_FORMAT = 1
_SCALARS = (bool, int, float, str, type(None))


class OptimizerStateError(ValueError):
    """A state file that cannot be read back (damaged, another format)."""


@dataclass(eq=False)
class CarriedState:
    """``optimizer.state_dict()["state"]`` and its param groups' layout, after a round."""

    state: dict[int, dict[str, Any]]  # parameter index -> its entries (tensors, scalars)
    groups: list[list[int]]  # each param group's parameter indices, in order
    rounds: int  # the rounds whose training it carries (1 after the first)
    after_round: int  # the run's round that left it

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, rounds: int, after_round: int) -> CarriedState:
        """A copy of the optimiser's per-parameter state (on the CPU; its hyperparameters
        are not kept: each round's optimiser brings its own)."""
        sd = optimizer.state_dict()
        state = {
            int(index): {k: _cpu_copy(v) for k, v in entries.items()}
            for index, entries in sd["state"].items()
        }
        groups = [list(g["params"]) for g in sd["param_groups"]]
        return CarriedState(state, groups, rounds, after_round)

    def fits(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimiser has the same param groups and parameters (by index)."""
        return self.groups == [list(g["params"]) for g in optimizer.state_dict()["param_groups"]]

    def load_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` this state, keeping its own hyperparameters (lr, betas...)."""
        groups = optimizer.state_dict()["param_groups"]
        state = {i: {k: _cpu_copy(v) for k, v in e.items()} for i, e in self.state.items()}
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    if not isinstance(value, _SCALARS):
        raise TypeError(
            f"train.keep_optimizer_state: an optimiser state entry of type "
            f"{type(value).__name__} cannot be kept (tensors, numbers, strings, None only)"
        )
    return value


def to_bytes(carried: CarriedState) -> bytes:
    """The safetensors file: tensors under ``<index>/<name>``; the rest in its header."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in carried.state.items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {
        "format": _FORMAT,
        "indices": sorted(carried.state),
        "scalars": scalars,
        "groups": carried.groups,
        "rounds": carried.rounds,
        "after_round": carried.after_round,
    }
    return save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})


def read_tagged(
    path: Path, meta_key: str, fmt: int, what: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A safetensors file's tensors and the JSON its header keeps under ``meta_key``,
    whose ``format`` must be ``fmt``; OptimizerStateError naming ``what`` otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header: Mapping[str, str] = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
        meta: dict[str, Any] = json.loads(header[meta_key])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # damaged, not ours
        raise OptimizerStateError(f"{path}: not {what}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise OptimizerStateError(f"{path}: format {got!r}, not {fmt}")
    return tensors, meta


def load_file(path: Path) -> CarriedState:
    """Read a file ``to_bytes`` wrote; OptimizerStateError if it is not one."""
    tensors, meta = read_tagged(path, _META_KEY, _FORMAT, "an optimiser state file")
    return _carried(path, tensors, meta)


def from_bytes(data: bytes) -> CarriedState:
    """What ``to_bytes`` made, read back from memory (a rank receiving rank 0's state)."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        meta: dict[str, Any] = json.loads(header["__metadata__"][_META_KEY])
        tensors = load(data)
    except (ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise OptimizerStateError(f"not an optimiser state: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise OptimizerStateError(f"an optimiser state of format {meta!r}, not {_FORMAT}")
    return _carried(Path("<received>"), tensors, meta)


def _carried(path: Path, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> CarriedState:
    try:
        state: dict[int, dict[str, Any]] = {int(i): {} for i in meta["indices"]}
        for index, entries in meta["scalars"].items():
            state[int(index)].update(entries)
        for key, tensor in tensors.items():
            index, _, name = key.partition("/")
            state[int(index)][name] = tensor
        groups = [[int(i) for i in g] for g in meta["groups"]]
        return CarriedState(state, groups, int(meta["rounds"]), int(meta["after_round"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a header not ours
        raise OptimizerStateError(f"{path}: not an optimiser state file: {exc}") from exc


def _link_into(src: Path, dst: Path) -> None:
    """``dst`` becomes another name of ``src``'s file, in one rename (of a hard link made
    beside it), so ``src`` never goes missing; where the file system has no hard links,
    ``src`` is renamed to ``dst``."""
    tmp = dst.with_name(dst.name + ".link")
    tmp.unlink(missing_ok=True)  # one a crash left
    try:
        os.link(src, tmp)
    except OSError:
        src.replace(dst)
        return
    tmp.replace(dst)


class Dated(Protocol):
    """What a kept state says of itself: the run's round that left it."""

    @property
    def after_round(self) -> int: ...


T = TypeVar("T", bound=Dated)


class TwoGenerations(Generic[T]):
    """Each run's kept state of one kind: ``<stem>-<run>.safetensors`` in the site's state
    directory, or in memory without one.

    Two generations are kept, the latest and the one before, so that a round trained again
    (a retried attempt, the same task after a restart) starts from the state the rounds
    before it left, not from its own first attempt's. A file that cannot be read
    (``decode`` raises ``OptimizerStateError``) is dropped with a warning.

    A round's state is first *staged* (``<stem>-<run>.staged.safetensors``), written whole
    before its update leaves the site, and *promoted* to the latest once the update is
    known to be accepted: a site killed between the coordinator's accept and its own
    bookkeeping still has the state its counted round left, and promotes it when it
    learns the update counted (``fedra.client.pending``)."""

    def __init__(
        self,
        state_dir: Path | None,
        stem: str,
        encode: Callable[[T], bytes],
        decode: Callable[[Path], T],
    ) -> None:
        self.state_dir, self.stem = state_dir, stem
        self._encode, self._decode = encode, decode
        self._memory: dict[str, list[T]] = {}  # oldest first, at most two
        self._staged: dict[str, T] = {}  # without a state_dir

    def path(self, run_id: str, generation: str = "") -> Path | None:
        """The file of the latest state, or of ``generation`` ("prev", "staged")."""
        if self.state_dir is None:
            return None
        tail = f".{generation}" if generation else ""
        return self.state_dir / f"{self.stem}-{run_id}{tail}.safetensors"

    def load(self, run_id: str, before_round: int) -> T | None:
        """The latest state a round before ``before_round`` left, or None: none yet, or a
        file that cannot be read (then the state starts afresh). Staged states are not
        seen: they count once promoted."""
        for kept in reversed(self._generations(run_id)):
            if kept.after_round < before_round:
                return kept
        return None

    def _read(self, path: Path | None) -> T | None:
        if path is None or not path.exists():
            return None
        try:
            return self._decode(path)
        except OptimizerStateError as exc:
            log.warning("%s state dropped: %s", self.stem, exc)
            return None

    def _generations(self, run_id: str) -> list[T]:
        if self.state_dir is None:
            return self._memory.get(run_id, [])
        found = (self._read(self.path(run_id, g)) for g in ("prev", ""))
        return [kept for kept in found if kept is not None]

    def stage(self, run_id: str, kept: T) -> None:
        """Keep ``kept`` aside, durably, until ``promote`` (or the next ``stage``)."""
        path = self.path(run_id, "staged")
        if path is None:
            self._staged = {run_id: kept}  # one run's at a time
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, [self._encode(kept)])

    def promote(self, run_id: str, round_number: int) -> bool:
        """Make the state staged for ``round_number`` the latest; the latest of an earlier
        round becomes the one before (one of the same round, an earlier attempt's, is
        replaced). Nothing staged for that round: nothing to do (so doing it twice, as a
        restart may, is harmless). Whether a state was promoted."""
        staged, latest, previous = (self.path(run_id, g) for g in ("staged", "", "prev"))
        if staged is None or latest is None or previous is None:
            kept = self._staged.get(run_id)
            if kept is None or kept.after_round != round_number:
                return False
            del self._staged[run_id]
            older = [c for c in self._memory.get(run_id, []) if c.after_round < round_number]
            self._memory = {run_id: [*older[-1:], kept]}  # one run's at a time
            return True
        found = self._read(staged)
        if found is None or found.after_round != round_number:
            return False  # none, or another round's left by a kill before its upload
        current = self._read(latest)
        if current is not None and current.after_round < round_number:
            # The latest stays in place meanwhile: a reader, or a restart after a crash
            # between the two, finds it, and the staged file, which promoting again moves on.
            _link_into(latest, previous)
        staged.replace(latest)
        fsync_dir(latest.parent)
        return True

    def discard(self, run_id: str) -> None:
        """Forget the staged state: its update did not count."""
        self._staged.pop(run_id, None)
        path = self.path(run_id, "staged")
        if path is not None:
            path.unlink(missing_ok=True)

    def save(self, run_id: str, kept: T) -> None:
        """Keep ``kept`` as the latest at once (``stage`` then ``promote``)."""
        self.stage(run_id, kept)
        self.promote(run_id, kept.after_round)


class OptimizerStates(TwoGenerations[CarriedState]):
    """Each run's carried inner optimiser state, ``optimizer-<run>.safetensors``."""

    def __init__(self, state_dir: Path | None) -> None:
        super().__init__(state_dir, "optimizer", to_bytes, load_file)
