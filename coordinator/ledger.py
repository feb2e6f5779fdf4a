"""What the rows of a run's ledger mean, for the round driver that writes them and every
reader (the status, the operators' read process): names, and the idle formula. Imports
neither torch nor the engine, so a reader process starts light."""

from __future__ import annotations

from fedra.storage.records import MAX_MEASURED_S, ParticipationRecord

MAX_ID_CHARS = 128  # a run, task or site id, a page token
SITES_PAGE, MAX_SITES_PAGE = 1000, 5000  # sites in one ListSites reply: default, most
DECLINED = "site declined: "
PROVENANCE_EVENT = "site_provenance"  # the ledger's record of what a site's updates come from
RUN_PROVENANCE_EVENT = "run_provenance"  # the coordinator's version, at submit and resume


def idle_s(opened_at: float, closed_at: float, accepted: list[ParticipationRecord]) -> float:
    """The mean, over the sites whose updates a round accepted, of the time from their
    task to the round's commit less their own download, compute and upload (the site's
    measures where it sent them, each within [0, ``MAX_MEASURED_S``]). That is the time
    each sat idle: waiting for its task once the round opened, for slower sites, for the
    aggregate and the checkpoint. (An async task carried in from an earlier round counts
    from its own assignment.)"""
    idle = [max(0.0, closed_at - min(opened_at, p.assigned_at) - _busy_s(p)) for p in accepted]
    return sum(idle) / len(idle) if idle else 0.0


def _busy_s(p: ParticipationRecord) -> float:
    download_s = p.metrics.get("download_s", p.download_s)
    return sum(_measured(x) for x in (download_s, p.metrics.get("compute_s", 0.0), p.upload_s))


def _measured(seconds: float) -> float:
    return min(max(seconds, 0.0), MAX_MEASURED_S)  # as Store.read_run_summary counts it


def page_limit(asked: int) -> int:
    """The sites one ListSites page holds when ``asked`` for (0: the default)."""
    return max(1, min(asked or SITES_PAGE, MAX_SITES_PAGE))
