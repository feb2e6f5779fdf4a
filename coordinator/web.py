"""The status page's data: runs, a run's rounds and its sites, as JSON for ``/api``.

Read as ``fedra run status`` reads (``status.run_page``, a summary, from the database and
the engine's snapshot, never under the engine's lock), with rounds that can change no
more kept between refreshes (``FinalRounds``), so that a page left open on a long run
reads only its open rounds again; the table of sites is counted by the database
(``read_site_tallies``). An edge, like the servicers: protobuf stays in here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from fedra.coordinator.engine import Engine
from fedra.coordinator.ledger import DECLINED
from fedra.coordinator.status import (
    FinalRounds,
    run_header,
    run_page,
    run_provenance,
    shown_status,
)
from fedra.protos.v1 import admin_pb2
from fedra.storage.records import RunReads, SiteTally

MAX_PAGES = 64  # of a run's rounds read for one view, at most
FAILURES_SHOWN = 5  # a site's first failed tasks' errors, in its row


class StatusPages:
    """What the page asks for; every method is safe from any thread."""

    def __init__(self, engine: Engine, insecure: bool) -> None:
        self.engine, self.insecure = engine, insecure
        self.kept = FinalRounds(max_bytes=16 << 20)
        self._sites = SiteTables(engine.records, self.kept)

    def runs(self) -> list[dict[str, Any]]:
        records = self.engine.records.list_runs()
        return [_run(run_header(self.engine, r, self.insecure)) for r in reversed(records)]

    def run(self, run_id: str) -> dict[str, Any]:
        """The run, its rounds (counted, not listed) and a row per site: both counted by
        the database, so a federation of thousands of sites costs this process a row per
        site and per round, not one per participation."""
        first, pages = 0, 0
        header: admin_pb2.RunStatus | None = None
        rounds: list[dict[str, Any]] = []
        while True:
            page = run_page(self.engine, run_id, self.insecure, first, kept=self.kept, summary=True)
            header = header or page
            rounds.extend(_round(r) for r in page.rounds)
            pages += 1
            if not page.more_rounds_follow or not page.rounds or pages >= MAX_PAGES:
                break
            first = page.rounds[-1].number + 1
        assert header is not None
        first_round = rounds[0]["number"] if rounds else 0
        sites = {t.site_id: _site(t) for t in self._sites.tallies(run_id, first_round)}
        revoked = self.engine.barred()
        presence = self.engine.presence(sites)
        for site_id, row in sites.items():
            row["revoked"] = site_id in revoked  # offline then, whatever it did last
            online, seen = presence.get(site_id, (False, 0.0))
            row["online"] = online and not row["revoked"]
            row["last_seen_unix_s"] = seen  # now while it waits in a long poll
        out = _run(header)
        out["rounds"] = rounds
        out["sites"] = sorted(sites.values(), key=lambda s: s["site_id"])
        out["truncated"] = pages >= MAX_PAGES
        # Every site's provenance, not only the sites that changed (what a summary has).
        record = next((r for r in self.engine.records.list_runs() if r.id == run_id), None)
        prov = run_provenance(self.engine, record) if record else header.provenance
        out["provenance"] = {
            "spec_sha256": prov.spec_sha256,
            "coordinator_version": prov.coordinator_version,
            "sites": [
                {
                    "site_id": p.site_id, "changed": p.changed, "since_round": p.since_round,
                    "task": p.provenance.entry_point, "task_version": p.provenance.task_version,
                    "task_source_sha256": p.provenance.task_source_sha256,
                    "data_fingerprint": p.provenance.data_fingerprint,
                    "versions": dict(p.provenance.versions), "device": p.provenance.device,
                }
                for p in prov.sites
            ],
        }  # fmt: skip
        return out


class SiteTables:
    """Each run's table of sites: per site, the tallies of the rounds that can change no
    more (``final``: those its rounds' summaries kept) kept, and those of the rounds
    after them read again at each refresh. A page left open on a long run of thousands
    of sites reads only its open rounds' participations. Safe from any thread."""

    def __init__(self, records: RunReads, final: FinalRounds, runs: int = 8) -> None:
        self.records, self.final, self.runs = records, final, runs
        self._lock = threading.Lock()
        # By run: the rounds up to which its tallies are kept (excluded), and those.
        self._kept: OrderedDict[str, tuple[int, dict[str, SiteTally]]] = OrderedDict()

    def tallies(self, run_id: str, first_round: int = 0) -> list[SiteTally]:
        """The run's sites; ``first_round``: the number of its first round."""
        final = self.final.final_until(run_id, first_round)  # up to, excluded
        with self._lock:
            upto, kept = self._kept.get(run_id, (0, {}))
        if final > upto:  # more rounds can change no more: keep theirs too
            kept = _added(kept, self._read(run_id, upto, final))
            upto = final
            with self._lock:
                self._kept[run_id] = upto, kept
                self._kept.move_to_end(run_id)
                while len(self._kept) > self.runs:
                    self._kept.popitem(last=False)
        return list(_added(kept, self._read(run_id, upto, None)).values())

    def _read(self, run_id: str, since: int, until: int | None) -> list[SiteTally]:
        return self.records.read_site_tallies(
            run_id, since=since, until=until, flag_error=DECLINED, failures=FAILURES_SHOWN
        )


def _added(earlier: dict[str, SiteTally], later: list[SiteTally]) -> dict[str, SiteTally]:
    out = dict(earlier)
    for t in later:
        before = out.get(t.site_id)
        out[t.site_id] = t if before is None else before.then(t, FAILURES_SHOWN)
    return out


def _run(s: admin_pb2.RunStatus) -> dict[str, Any]:
    return {
        "run_id": s.run_id,
        "name": s.spec.name,
        "task": s.spec.task,
        "strategy": s.spec.strategy,
        "state": s.state,
        "reason": s.reason,  # while it waits for sites, why and for how long
        "rounds_total": s.spec.rounds,
        "rounds_completed": s.rounds_completed,
        "created_unix_s": s.created_unix_s,
        "updated_unix_s": s.updated_unix_s,
    }


def _round(r: admin_pb2.RoundStatus) -> dict[str, Any]:
    return {
        "number": r.number,
        "attempt": r.attempt,
        "status": r.status,
        "sampled": r.sampled_count,
        "updates": r.updates,
        "opened_unix_s": r.opened_unix_s,
        "duration_s": r.duration_s,
        "bytes_down": r.bytes_down,
        "bytes_up": r.bytes_up,
        "lost_bytes": r.lost_bytes,
        "idle_s": r.site_idle_s,
        "stages": dict(r.stages),
        "metrics": dict(r.metrics),
    }


def _site(t: SiteTally) -> dict[str, Any]:
    return {
        "site_id": t.site_id,
        "rounds": t.participations,
        "accepted": t.accepted,
        "failed": t.failed,
        "declined": t.declined,
        "bytes": t.bytes,
        "busy_s": t.busy_s,
        # Accepted in committed rounds: the time it sat idle, as the round's idle share
        # counts it, and the time that is counted over (``counted_s``).
        "idle_s": t.idle_s,
        "counted_s": t.counted_s,
        "failures": [f"round {n}: {error}" for n, error in t.failures],
        "state": shown_status(t.latest_state, t.latest_flagged),  # its latest task's
    }
