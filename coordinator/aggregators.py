"""How a run combines each attempt's updates: one ``Aggregator`` interface, one
implementation per choice, picked once per run from its spec (``make_aggregator``).

The round driver, folding and recovery only call the interface; which choice a run made
is looked up in ``_AGGREGATORS`` and nowhere else. The choices:

- ``StreamingMean``: rule ``mean``, the sample-weighted mean folded in as updates arrive
  (O(model) memory), each update optionally scaled to ``aggregation.norm_bound`` first and,
  in ``[async]`` runs, discounted by its staleness (FedBuff);
- ``PrivateMean``: rule ``mean`` with ``[privacy]`` (DP-FedAvg): every update clipped and
  counted once, Gaussian noise on the sum, a fixed denominator;
- ``RobustAggregate``: median, trimmed mean, Krum and Multi-Krum over every update of the
  attempt, spilled to disk past ``aggregation.spill_mb``;
- ``SecureSum`` and ``PrivateSecureSum``: ``[secagg]``, a sum of masked integers whose key
  exchange runs around the uploads; only the survivors' sum is ever unmasked;
- ``ScaffoldMean``: rule ``mean`` with ``[train] scaffold``: the model deltas as
  ``StreamingMean``, and each site's delta c_i (extra tensors of its update) in an
  unweighted mean beside them (``fedra.coordinator.scaffold``).

The outer step (FedAvg, FedAvgM, FedAdam, FedYogi, DiLoCo) is the run's
``ServerOptimizer``, applied to whichever mean update ``finish`` returns.
"""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from fedra.config import ConfigError
from fedra.coordinator.aggregation import WeightedSum
from fedra.coordinator.robust import RobustError, RobustRule, UpdateStore, aggregate
from fedra.coordinator.scaffold import CONTROL_PREFIX, control_specs, update_specs
from fedra.faults import crash_point
from fedra.privacy import add_secure_gaussian_, clip_factor
from fedra.protos.codec import TensorSpec
from fedra.protos.compression import Piece, floating_layout, unflatten_update
from fedra.runspec import CodecSpec, RunSpec
from fedra.secagg import SecAggError

if TYPE_CHECKING:
    from fedra.coordinator.engine.secure import SecureRound
    from fedra.coordinator.state import Assignment

log = logging.getLogger("fedra.coordinator")
# The event recorded just before a secure round's sum is unmasked.
UNMASKED_EVENT = "secagg_unmasked"


class AggregationError(Exception):
    """The attempt's updates cannot be combined (too few for a rule, an unmasking that
    failed): the attempt is retried, with this as its reason."""


class SpooledUpdate(Protocol):
    """One accepted update in the spool, read through as often as an aggregator asks."""

    def dense(self) -> Iterator[Piece]:
        """Its decompressed pieces, block by block."""
        ...

    def masked(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, values in [0, 2**32)) runs of a masked (``secagg``) update."""
        ...


@dataclass(frozen=True)
class Attempt:
    """The attempt an aggregator begins: whose updates it will combine, and their shape."""

    run_id: str
    round: int
    attempt: int
    sites: tuple[str, ...]  # the sites of the attempt, sorted
    specs: Mapping[str, TensorSpec]  # the global model's tensors
    spill_dir: Path  # where updates may go past the memory limit


@dataclass(frozen=True)
class StageChange:
    """What closing a stage before the uploads did to the attempt."""

    dropped: list[str] = field(default_factory=list)  # sites now out of the attempt
    dropped_why: str = ""  # their failure, as recorded
    broken: str = ""  # why the attempt cannot go on ('' when it can)
    moved: bool = False  # a stage closed: the sites waiting on it are to be woken

    @property
    def changed(self) -> bool:
        return bool(self.dropped or self.broken or self.moved)


class Aggregator(ABC):
    """How one run combines an attempt's accepted updates into its mean update.

    One per run; ``begin`` starts an attempt's aggregate and ``drop`` forgets it. ``fold``
    runs under the run's ``fold_lock``; the stage methods and ``seal`` under the engine's
    lock; ``finish`` under neither. Only aggregators with stages around the uploads (the
    secure sum's key exchange) override the stage methods."""

    upload_codec: CodecSpec  # how a training round's updates travel
    ordered = True  # fold in site order: a float sum depends on the order of its terms
    # The ledger event made durable before ``finish`` releases the aggregate ('' for none):
    # an open attempt that has one when the coordinator restarts must not be finished again.
    release_event = ""
    # Why a restart starts an open attempt again rather than folding its updates again
    # ('' when it folds them again).
    restart_reason = ""

    @property
    def secure(self) -> SecureRound | None:
        """The attempt's secure-aggregation key exchange, which the sites take part in."""
        return None

    def update_specs(self, model: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The tensors a site's update must hold (before the codec): the model's."""
        return dict(model)

    @abstractmethod
    def begin(self, attempt: Attempt) -> None:
        """Start the aggregate of a training round's attempt (the previous one dropped)."""

    @abstractmethod
    def fold(self, site_id: str, update: SpooledUpdate, samples: int, staleness: int) -> None:
        """Fold one accepted update in: trained on ``samples`` samples, on a global model
        ``staleness`` versions older than the open round's."""

    @abstractmethod
    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        """The mean update, shaped like the model, and how many updates it combines;
        AggregationError if they cannot be combined."""

    @abstractmethod
    def drop(self) -> None:
        """Forget the attempt's aggregate (spill files included); idempotent."""

    def advance(self, assignments: Mapping[str, Assignment], quorum: int) -> StageChange:
        """Close a stage before the uploads that is complete or overdue."""
        return StageChange()

    def close_uploads(self) -> str | None:
        """Uploads are closed: open the stage that follows them. None if there is none,
        else '' or why the attempt cannot go on."""
        return None

    def collecting(self) -> bool:
        """Whether the stage after the uploads still waits for the sites."""
        return False

    def seal(self) -> None:
        """``finish`` comes next: stop taking the sites' late contributions."""
        return


class StreamingMean(Aggregator):
    """Rule ``mean``: ``sum_i w_i u_i / sum_i n_i`` folded in as the updates arrive, with
    ``w_i`` the sample count ``n_i`` times the update's norm bound and staleness factors."""

    def __init__(self, spec: RunSpec) -> None:
        self.upload_codec = spec.codec
        self.bound = spec.aggregation.norm_bound
        buffered = spec.asynchronous
        self.ordered = buffered is None  # async: the result depends on arrival by design
        self._discount = buffered.weight if buffered is not None else _undiscounted
        self._sum: WeightedSum | None = None
        # The last attempt's sums, once dropped: the next attempt's memory. Nothing reads
        # them by then: the commit's model, stepped in their memory, is written and gone,
        # and every fold of a synchronous attempt ended before its close (an async run's
        # folds may outlast it, so its sums are not kept). A run waiting for its sites
        # between rounds keeps them: the same memory its next round would take anyway.
        self._spare: dict[str, torch.Tensor] | None = None

    @property
    def running_sum(self) -> WeightedSum | None:
        return self._sum

    def begin(self, attempt: Attempt) -> None:
        self._sum, self._spare = WeightedSum(attempt.specs, reuse=self._spare), None

    def _weight(self, samples: int) -> float:
        return float(samples)

    def fold(self, site_id: str, update: SpooledUpdate, samples: int, staleness: int) -> None:
        assert self._sum is not None
        weight = self._weight(samples)
        scale = self._discount(staleness)  # FedBuff: stale updates count less
        if self.bound > 0:  # a first pass for the norm: the spool is local and fast
            norm = math.sqrt(sum(_sum_of_squares(p) for p in update.dense()))
            scale *= clip_factor(norm, self.bound)
        self._sum.add_pieces(update.dense(), weight * scale)
        self._sum.finish_update(weight)

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self._sum is not None
        return self._sum.mean(), self._sum.count

    def drop(self) -> None:
        if self._sum is not None and self.ordered:
            self._spare = self._sum.sums
        self._sum = None


class ScaffoldMean(StreamingMean):
    """Rule ``mean`` with ``[train] scaffold``: the model part of each update folded as
    ``StreamingMean`` folds it (sample-weighted), its delta c_i into an unweighted sum
    (Algorithm 1 averages them over sites); ``finish`` returns both, the controls under
    ``CONTROL_PREFIX``, for the commit to split (``scaffold.split``)."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec)
        self._controls: WeightedSum | None = None

    def update_specs(self, model: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return update_specs(model)

    def begin(self, attempt: Attempt) -> None:
        super().begin(attempt)
        self._controls = WeightedSum(control_specs(attempt.specs))

    def fold(self, site_id: str, update: SpooledUpdate, samples: int, staleness: int) -> None:
        assert self._sum is not None and self._controls is not None
        weight = float(samples)
        for piece in update.dense():
            if piece.name.startswith(CONTROL_PREFIX):
                self._controls.add_pieces((piece,), 1.0)
            else:
                self._sum.add_pieces((piece,), weight)
            del piece
        self._sum.finish_update(weight)
        self._controls.finish_update(1.0)

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self._controls is not None
        mean, count = super().finish()
        return {**mean, **self._controls.mean()}, count

    def drop(self) -> None:
        super().drop()
        self._controls = None


class PrivateMean(StreamingMean):
    """Rule ``mean`` with ``[privacy]``, DP-FedAvg: each update clipped to ``clip`` and
    counted once (the sensitivity of the sum is then the clip), Gaussian noise of standard
    deviation ``noise_multiplier * clip`` on the sum, divided by ``sites_per_round`` (fixed,
    whoever took part: with Poisson sampling it is the expected cohort)."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec)
        assert spec.privacy is not None
        self.bound = spec.privacy.clip
        self.std = spec.privacy.noise_multiplier * spec.privacy.clip
        self.denominator = spec.sites_per_round

    def _weight(self, samples: int) -> float:
        return 1.0

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self._sum is not None
        for total in self._sum.sums.values():  # the Gaussian mechanism, on the clipped sum
            add_secure_gaussian_(total, self.std)
        return self._sum.mean(denominator=self.denominator), self._sum.count


class RobustAggregate(Aggregator):
    """The robust rules (``robust.aggregate``): every update counts once, and all of the
    attempt's are kept, in memory up to ``aggregation.spill_mb`` and on disk past it."""

    def __init__(self, spec: RunSpec, *, report_selection: bool = False) -> None:
        self.upload_codec = spec.codec
        self.settings = spec.aggregation
        self.memory_limit_bytes = spec.aggregation.spill_mb << 20
        self.report_selection = report_selection  # Krum: log which updates it kept
        self._store: UpdateStore | None = None
        self._tag = ""

    def begin(self, attempt: Attempt) -> None:
        self._store = UpdateStore(attempt.specs, attempt.spill_dir, self.memory_limit_bytes)
        self._tag = f"run {attempt.run_id}"

    def fold(self, site_id: str, update: SpooledUpdate, samples: int, staleness: int) -> None:
        assert self._store is not None
        writer = self._store.begin()
        try:
            writer.add_pieces(update.dense())
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self._store is not None
        s = self.settings
        try:
            rule = RobustRule(s.rule, s.trim, s.byzantine, s.select)
            result = aggregate(self._store, rule, norm_bound=s.norm_bound)
        except RobustError as exc:
            raise AggregationError(str(exc)) from exc
        if self.report_selection:
            log.info("%s: %s kept updates %s", self._tag, s.rule, result.selected)
        return result.mean, len(result.selected)

    def drop(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store = None


class SecureSum(Aggregator):
    """``[secagg]``: SecAgg+ masking. The sites exchange keys before they train, upload
    masked fixed-point integers that are summed modulo 2**32, and once the uploads close
    the survivors reveal what unmasks their sum: the coordinator never sees an update."""

    ordered = False  # a sum of integers modulo 2**32 is exact in any order
    release_event = UNMASKED_EVENT
    restart_reason = "secure aggregation starts the round again"  # the keys lived in memory

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.upload_codec = CodecSpec("secagg")
        self._round: SecureRound | None = None
        self._number = 0
        self._specs: Mapping[str, TensorSpec] = {}

    @property
    def secure(self) -> SecureRound | None:
        return self._round

    def begin(self, attempt: Attempt) -> None:
        from fedra.coordinator.engine.secure import SecureRound  # noqa: PLC0415 - it imports state

        length = sum(s.numel for _, s in floating_layout(attempt.specs))
        self._round = SecureRound(
            self.spec, attempt.run_id, attempt.round, attempt.attempt, list(attempt.sites), length
        )
        self._number, self._specs = attempt.round, attempt.specs

    def advance(self, assignments: Mapping[str, Assignment], quorum: int) -> StageChange:
        if self._round is None:  # round 0: no key exchange
            return StageChange()
        stage = self._round.stage
        out, why = self._round.advance(assignments, quorum)
        missed = "did not take part in the secure-aggregation key exchange in time"
        return StageChange(out, missed, why, self._round.stage != stage)

    def close_uploads(self) -> str | None:
        if self._round is None:
            return None
        return self._round.begin_unmask()  # ask the survivors for their shares

    def collecting(self) -> bool:
        return self._round is not None and not self._round.unmasked_ready()

    def seal(self) -> None:
        assert self._round is not None
        self._round.finishing = True  # late reveals are answered as not needed

    def fold(self, site_id: str, update: SpooledUpdate, samples: int, staleness: int) -> None:
        assert self._round is not None
        self._round.server.add_masked(site_id, update.masked())

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self._round is not None
        try:
            total, count = self._round.server.finish()
        except SecAggError as exc:
            raise AggregationError(str(exc)) from exc
        crash_point("after_unmask", self._number)
        total.div_(self._denominator(count))
        return unflatten_update(total, self._specs), count

    def _denominator(self, count: int) -> int:
        return count

    def drop(self) -> None:
        self._round = None


class PrivateSecureSum(SecureSum):
    """``[secagg]`` with ``[privacy]``: the sites add the noise; the denominator is fixed,
    as in DP-FedAvg, so that it reveals nothing about who dropped out."""

    def _denominator(self, count: int) -> int:
        return self.spec.sites_per_round


class Choice(NamedTuple):
    """What a run spec asks of aggregation: its rule, whether [secagg] and [privacy] are
    on, and whether its updates carry SCAFFOLD's control deltas."""

    rule: str
    secure: bool
    private: bool
    scaffold: bool = False

    @classmethod
    def of(cls, spec: RunSpec) -> Choice:
        return cls(
            spec.aggregation.rule, spec.secagg is not None, spec.privacy is not None,
            spec.train.scaffold,
        )  # fmt: skip

    def __str__(self) -> str:
        tables = [t for t, on in (("[secagg]", self.secure), ("[privacy]", self.private),
                                  ("train.scaffold", self.scaffold)) if on]  # fmt: skip
        return f"rule {self.rule!r}" + (f" with {' and '.join(tables)}" if tables else "")


_AGGREGATORS: dict[Choice, Callable[[RunSpec], Aggregator]] = {
    Choice("mean", secure=False, private=False): StreamingMean,
    Choice("mean", secure=False, private=True): PrivateMean,
    Choice("mean", secure=True, private=False): SecureSum,
    Choice("mean", secure=True, private=True): PrivateSecureSum,
    Choice("mean", secure=False, private=False, scaffold=True): ScaffoldMean,
    Choice("median", secure=False, private=False): RobustAggregate,
    Choice("trimmed_mean", secure=False, private=False): RobustAggregate,
    Choice("krum", secure=False, private=False): functools.partial(
        RobustAggregate, report_selection=True
    ),
    Choice("multikrum", secure=False, private=False): functools.partial(
        RobustAggregate, report_selection=True
    ),
}


def make_aggregator(spec: RunSpec) -> Aggregator:
    """The run's aggregator, for the choice its spec makes; ConfigError if none fits."""
    choice = Choice.of(spec)
    make = _AGGREGATORS.get(choice)
    if make is None:
        known = ", ".join(sorted({str(c) for c in _AGGREGATORS}))
        raise ConfigError(f"aggregation.rule: no aggregator for {choice} (there are: {known})")
    return make(spec)


def _undiscounted(staleness: int) -> float:
    return 1.0


def _sum_of_squares(piece: Piece) -> float:
    values = piece.values
    if not values.is_floating_point():
        return 0.0
    return float(values.double().square().sum())
