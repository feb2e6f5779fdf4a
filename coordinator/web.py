"""The status page's data: runs, a run's rounds and its sites, as JSON for ``/api``.

Read as ``fedra run status`` reads (``status.run_page``, from the database and the
engine's snapshot, never under the engine's lock), with rounds that can change no more
kept between refreshes (``FinalRounds``), so that a page left open on a long run reads
only its open rounds again. An edge, like the servicers: protobuf stays in here.
"""

from __future__ import annotations

from typing import Any

from fedra.coordinator.engine import Engine
from fedra.coordinator.status import FinalRounds, run_header, run_page
from fedra.protos.v1 import admin_pb2

MAX_PAGES = 64  # of a run's rounds read for one view, at most (about 64 MiB of status)


class StatusPages:
    """What the page asks for; every method is safe from any thread."""

    def __init__(self, engine: Engine, insecure: bool) -> None:
        self.engine, self.insecure = engine, insecure
        self.kept = FinalRounds(max_bytes=16 << 20)

    def runs(self) -> list[dict[str, Any]]:
        records = self.engine.records.list_runs()
        return [_run(run_header(self.engine, r, self.insecure)) for r in reversed(records)]

    def run(self, run_id: str) -> dict[str, Any]:
        """The run, its rounds (without their participations) and a row per site."""
        first, pages = 0, 0
        header: admin_pb2.RunStatus | None = None
        rounds: list[dict[str, Any]] = []
        sites: dict[str, dict[str, Any]] = {}
        while True:
            page = run_page(self.engine, run_id, self.insecure, first, kept=self.kept)
            header = header or page
            for r in page.rounds:
                rounds.append(_round(r))
                for p in r.participations:
                    _count(sites, r, p)
            pages += 1
            if not page.more_rounds_follow or not page.rounds or pages >= MAX_PAGES:
                break
            first = page.rounds[-1].number + 1
        assert header is not None
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
        prov = header.provenance
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
        "sampled": len(r.sampled_sites),
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


def _count(sites: dict[str, dict[str, Any]], r: admin_pb2.RoundStatus, p: Any) -> None:
    row = sites.setdefault(p.site_id, {
        "site_id": p.site_id, "rounds": 0, "accepted": 0, "failed": 0, "declined": 0, "bytes": 0,
        "busy_s": 0.0, "idle_s": 0.0, "counted_s": 0.0, "failures": [], "state": "",
    })  # fmt: skip
    busy_s = p.metrics.get("download_s", p.download_s) + p.metrics.get("compute_s", 0.0)
    busy_s += p.upload_s
    row["rounds"] += 1
    row["bytes"] += p.bytes_down + p.bytes_up + p.bytes_cut
    row["busy_s"] += busy_s
    row["state"] = p.status  # its latest task's
    if p.status == "accepted":
        row["accepted"] += 1
        if r.status == "committed" and r.duration_s > 0:
            # As the round's idle share counts it: from the opening to the commit, less its
            # own download, compute and upload (``counted_s``: those rounds' time).
            row["idle_s"] += max(0.0, r.duration_s - busy_s)
            row["counted_s"] += r.duration_s
    elif p.status == "declined":  # the site's policy: not a failure
        row["declined"] += 1
        if p.error and len(row["failures"]) < 5:
            row["failures"].append(f"round {r.number}: {p.error}")
    elif p.status in ("failed", "expired"):
        row["failed"] += 1
        if p.error and len(row["failures"]) < 5:
            row["failures"].append(f"round {r.number}: {p.error}")
