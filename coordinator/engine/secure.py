"""Secure-aggregation rounds on the coordinator: the stages, their deadlines, the RPCs.

A ``[secagg]`` round runs SecAgg+ (``fedra.secagg``) around the usual round:

1. ``keys``: every sampled site sends two public keys (before it trains);
2. ``shares``: each sends its secrets' shares, encrypted to each neighbour;
3. ``masked``: each trains and uploads its masked, quantised update (the usual upload,
   codec ``secagg``), folded into a running sum modulo 2**32 as it is accepted;
4. ``unmask``: once uploads close, each surviving site reveals, for each neighbour, the
   share that removes that neighbour's masks; then the sum is unmasked and committed.

A stage ends when every site still in the round has done its part, or at its deadline
(``setup_timeout_s`` for 1 and 2, the round deadline for 3, ``unmask_timeout_s`` for 4).
A site that misses stage 1 or 2 is out of the round. This state lives in memory only:
a coordinator restart retries the round with fresh keys (see ``recovery``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fedra import pki
from fedra.coordinator.errors import FailedPrecondition, InvalidArgument
from fedra.coordinator.state import ActiveRun, Assignment
from fedra.runspec import RunSpec
from fedra.secagg import RoundPlan, SecAggError, ServerSecAgg, plan_round, quant_bits
from fedra.secagg_round import SecAggRound

if TYPE_CHECKING:
    from fedra.coordinator.engine.core import Engine

STAGE_WAIT_CAP_S = 30.0  # the longest one long-poll call of a stage waits


class SecureRound:
    """One attempt's secure aggregation (engine lock held for every method)."""

    def __init__(
        self, spec: RunSpec, run_id: str, number: int, attempt: int, sites: list[str], length: int
    ) -> None:
        assert spec.secagg is not None
        self.spec = spec
        self.settings = spec.secagg
        self.context = f"fedra-secagg/v1|{run_id}|{number}|{attempt}".encode()
        # The neighbour graph is drawn from fresh randomness: nobody can steer it.
        self.plan: RoundPlan = plan_round(
            sites,
            degree=self.settings.degree,
            threshold=self.settings.threshold,
            seed=os.urandom(32),
        )
        self.bits = quant_bits(len(sites))
        self.server = ServerSecAgg(
            self.plan, self.context, length, clip=self.settings.clip, bits=self.bits
        )
        self.stage = "keys"
        self.deadline = time.monotonic() + self.settings.setup_timeout_s
        self.keys_from: set[str] = set()
        self.shares_from: set[str] = set()
        self.revealed: set[str] = set()
        self.credentials: dict[str, tuple[bytes, bytes]] = {}  # (signature, certificate)
        # Set (engine lock held) before the driver unmasks, which holds the server's own
        # lock for a while: from then on no RPC calls into the server, none waits on it.
        self.finishing = False

    def task(self) -> SecAggRound:
        privacy = self.spec.privacy
        l2_clip = noise_std = 0.0
        if privacy is not None:
            # Each of at least `quorum` summed updates carries noise of variance
            # (z C)^2 / quorum, so the sum carries at least (z C)^2, as central DP would.
            l2_clip = privacy.clip
            noise_std = privacy.noise_multiplier * privacy.clip / math.sqrt(self.spec.quorum)
        return SecAggRound(
            self.context, self.plan.threshold, self.settings.clip, self.bits, l2_clip, noise_std
        )

    # -- the driver's side ------------------------------------------------------

    def advance(self, assignments: Mapping[str, Assignment], quorum: int) -> tuple[list[str], str]:
        """Close the key or share stage when it is complete or overdue.

        Returns the sites that are now out of the round, and why the attempt cannot go
        on ('' when it can).
        """
        now = time.monotonic()
        if self.stage == "keys":
            done, what = self.keys_from, "sent their keys"
            waiting = [s for s, a in assignments.items() if s not in done and not a.final]
        elif self.stage == "shares":
            done, what = self.shares_from, "sent their key shares"
            waiting = [
                s for s, a in assignments.items() if s in self.keys_from and s not in done
                and not a.final
            ]  # fmt: skip
        else:
            return [], ""
        if waiting and now < self.deadline:
            return [], ""
        out = [s for s, a in assignments.items() if s not in done and not a.final]
        if len(done) < quorum:
            return out, (
                f"secure aggregation: only {len(done)} of {len(assignments)} sites {what} "
                f"within {self.settings.setup_timeout_s:g} s; the quorum is {quorum}"
            )
        try:
            if self.stage == "keys":
                self.server.close_advertise()
                self.stage, self.deadline = "shares", now + self.settings.setup_timeout_s
            else:
                self.server.close_shares()
                self.stage = "masked"
        except SecAggError as exc:
            return out, f"secure aggregation: {exc}"
        return out, ""

    def begin_unmask(self) -> str:
        """Close the uploads and ask the survivors for their shares; '' or why not."""
        try:
            self.server.close_masked()
        except SecAggError as exc:
            return f"secure aggregation: {exc}"
        self.stage = "unmask"
        self.deadline = time.monotonic() + self.settings.unmask_timeout_s
        return ""

    def unmasked_ready(self) -> bool:
        return not self.server.missing() or time.monotonic() >= self.deadline


# -- the sites' RPCs -------------------------------------------------------------


def _secure_task(engine: Engine, site_id: str, task_id: str) -> tuple[ActiveRun, SecureRound]:
    """The run and secure round of a site's task in the open attempt (lock held)."""
    engine.seen(site_id)
    found = engine.find_task(task_id)
    if found is None:
        # Closed or unknown: current_task says which, with the right status.
        engine.current_task(site_id, task_id)
        raise FailedPrecondition(f"task {task_id!r} is not in an open round")
    run, a = found
    if a.site_id != site_id:
        engine.current_task(site_id, task_id)  # raises PermissionDenied
    if run.secure is None:
        raise FailedPrecondition(
            f"run {run.run_id} round {run.open_round} does not use secure aggregation"
        )
    return run, run.secure


def stage_id(engine: Engine, site_id: str, task_id: str) -> str:
    """The run whose stage a site's stage call waits on (lock taken): see ``wakeups``."""
    with engine._lock:
        run, _ = _secure_task(engine, site_id, task_id)
        return run.run_id


def post_keys(
    engine: Engine,
    site_id: str,
    task_id: str,
    public_keys: bytes,
    signature: bytes,
    verify: Callable[[bytes, bytes], bytes],
) -> None:
    """Take a site's public keys (``verify(message, signature)`` returns its certificate,
    b'' in insecure mode); none: the site asks again for its neighbours' keys."""
    with engine._lock:
        run, sec = _secure_task(engine, site_id, task_id)
        if public_keys:
            if sec.stage != "keys":
                raise FailedPrecondition(
                    f"the key exchange of run {run.run_id} round {run.open_round} has closed"
                )
            cert = verify(pki.secagg_keys_message(sec.context, site_id, public_keys), signature)
            try:
                sec.server.advertise(site_id, public_keys)
            except SecAggError as exc:
                raise InvalidArgument(f"public_keys: {exc}") from exc
            sec.keys_from.add(site_id)
            sec.credentials[site_id] = (signature, cert)
            engine.notify(run.run_id)
        elif site_id not in sec.keys_from:
            raise FailedPrecondition("send public_keys first")


def keys_answer(
    engine: Engine, site_id: str, task_id: str
) -> tuple[bool, dict[str, tuple[bytes, bytes, bytes]]]:
    """Once the key stage has closed: each neighbour's (keys, signature, certificate)."""
    with engine._lock:
        _, sec = _secure_task(engine, site_id, task_id)
        if sec.stage == "keys":
            return False, {}
        return True, {
            peer: (peer_keys, *sec.credentials[peer])
            for peer, peer_keys in sec.server.neighbour_keys(site_id).items()
        }


def post_shares(
    engine: Engine, site_id: str, task_id: str, ciphertexts: Mapping[str, bytes]
) -> None:
    with engine._lock:
        run, sec = _secure_task(engine, site_id, task_id)
        if ciphertexts:
            if sec.stage != "shares" or site_id not in sec.keys_from:
                raise FailedPrecondition(
                    f"the share exchange of run {run.run_id} round {run.open_round} is not open "
                    f"to site {site_id!r} (stage {sec.stage})"
                )
            try:
                sec.server.post_shares(site_id, ciphertexts)
            except SecAggError as exc:
                raise InvalidArgument(f"ciphertexts: {exc}") from exc
            sec.shares_from.add(site_id)
            engine.notify(run.run_id)
        elif site_id not in sec.shares_from:
            raise FailedPrecondition("send ciphertexts first")


def shares_answer(engine: Engine, site_id: str, task_id: str) -> tuple[bool, dict[str, bytes]]:
    """Once the share stage has closed: the ciphertexts addressed to the site."""
    with engine._lock:
        _, sec = _secure_task(engine, site_id, task_id)
        if sec.stage in ("keys", "shares"):
            return False, {}
        return True, sec.server.inbox(site_id)


def check_unmask(engine: Engine, site_id: str, task_id: str) -> None:
    with engine._lock:
        _, sec = _secure_task(engine, site_id, task_id)
        if site_id not in sec.shares_from:
            raise FailedPrecondition(f"site {site_id!r} is not part of this round's masked sum")


def unmask_answer(
    engine: Engine, site_id: str, task_id: str
) -> tuple[bool, tuple[list[str], list[str]]]:
    """Once uploads have closed: the survivors whose shares the site reveals, and the
    dropped sites whose masks it helps remove."""
    with engine._lock:
        _, sec = _secure_task(engine, site_id, task_id)
        if sec.stage != "unmask":
            return False, ([], [])
        if sec.finishing:
            return True, ([], [])  # unmasked with the shares already in: none needed from it
        try:
            return True, sec.server.unmask_request(site_id)
        except SecAggError as exc:
            raise FailedPrecondition(str(exc)) from exc


def reveal(engine: Engine, site_id: str, task_id: str, revealed: Mapping[str, bytes]) -> None:
    with engine._lock:
        run, sec = _secure_task(engine, site_id, task_id)
        if sec.stage != "unmask":
            raise FailedPrecondition(f"shares are revealed only once uploads close ({sec.stage})")
        if sec.finishing:
            return  # the sum is being unmasked already: these shares are not needed
        try:
            sec.server.post_reveal(site_id, revealed)
        except SecAggError as exc:
            raise InvalidArgument(f"shares: {exc}") from exc
        sec.revealed.add(site_id)
        engine.notify(run.run_id)
