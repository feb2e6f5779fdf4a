"""A typed client for the coordinator's AdminService (what the CLI and the demo use)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from fedra.pki import TlsFiles, channel_credentials
from fedra.protos import wire
from fedra.protos.serde import runspec_to_proto
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc
from fedra.runspec import RunSpec

if TYPE_CHECKING:
    import torch

# Admin commands import torch (seconds) only to export a model.


class AdminClient:
    def __init__(self, address: str, tls: TlsFiles | None = None, timeout_s: float = 30.0) -> None:
        options = [("grpc.max_receive_message_length", wire.MAX_STATUS_BYTES)]
        if tls is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
        self.stub = admin_pb2_grpc.AdminServiceStub(self.channel)
        self._export_model = self.channel.unary_stream(
            wire.EXPORT_MODEL,
            request_serializer=admin_pb2.ExportModelRequest.SerializeToString,
            response_deserializer=wire.parse_model_chunk,
        )
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, spec: RunSpec) -> str:
        return self.submit_run(spec).run_id

    def submit_run(self, spec: RunSpec) -> admin_pb2.SubmitRunResponse:
        """The run id, and the daemon's warnings: why the run cannot start yet, if so."""
        request = admin_pb2.SubmitRunRequest(spec=runspec_to_proto(spec))
        return self.stub.SubmitRun(request, timeout=self.timeout_s)

    def status(
        self, run_id: str, first_round: int = 0, *, summary: bool = False
    ) -> admin_pb2.RunStatus:
        """The run and its rounds from ``first_round`` on, asked for in pages of about
        1 MiB, so that no run is too long to read (a daemon that predates paging sends
        every round in one reply). ``summary``: each round counted, not listed
        (``GetRunRequest.summary``; a daemon that predates it lists them)."""
        request = admin_pb2.GetRunRequest(
            run_id=run_id, first_round=first_round, page=True, summary=summary
        )
        status = self.stub.GetRun(request, timeout=self.timeout_s)
        rounds = list(status.rounds)
        provenance = admin_pb2.RunProvenance()
        provenance.CopyFrom(status.provenance)  # the first page's
        while status.more_rounds_follow and status.rounds:
            request.first_round = status.rounds[-1].number + 1
            status = self.stub.GetRun(request, timeout=self.timeout_s)
            rounds.extend(status.rounds)
        del status.rounds[:]  # (a daemon that predates first_round sends them all)
        status.rounds.extend(r for r in rounds if r.number >= first_round)
        status.more_rounds_follow = False
        status.provenance.CopyFrom(provenance)
        return status

    def runs(self) -> list[admin_pb2.RunStatus]:
        """Every run's status, without its rounds."""
        return list(self.stub.ListRuns(admin_pb2.ListRunsRequest(), timeout=self.timeout_s).runs)

    def watch(
        self,
        run_id: str,
        timeout_s: float | None = None,
        *,
        changed_rounds_only: bool = False,
        summary: bool = False,
    ) -> Iterator[admin_pb2.RunStatus]:
        """RunStatus now and after each change, until the run ends.

        The daemon sends only the rounds that changed; each status yielded here holds every
        round, kept by number. With ``changed_rounds_only`` the statuses are yielded as
        they come instead: the first with every round, later ones with only the rounds new
        or changed since the one before (what a follower that prints rounds needs).
        ``summary``: each round counted, not listed (``WatchRunRequest.summary``).
        """
        request = admin_pb2.WatchRunRequest(
            run_id=run_id, changed_rounds_only=True, summary=summary
        )
        stream = self.stub.WatchRun(request, timeout=timeout_s)
        if changed_rounds_only:
            yield from stream
            return
        rounds: dict[int, admin_pb2.RoundStatus] = {}
        for status in stream:  # a daemon that predates the flag sends every round: same result
            for r in status.rounds:
                rounds[r.number] = kept = admin_pb2.RoundStatus()
                kept.CopyFrom(r)
            if status.more_rounds_follow:  # the same look goes on in the next message
                continue
            del status.rounds[:]
            status.rounds.extend(rounds[n] for n in sorted(rounds))
            yield status

    def cancel(self, run_id: str) -> str:
        request = admin_pb2.CancelRunRequest(run_id=run_id)
        return self.stub.CancelRun(request, timeout=self.timeout_s).state

    def sites(self, page_size: int = 1000) -> list[admin_pb2.Site]:
        """Every site the coordinator knows, a page at a time."""
        return [s for page in self.site_pages(page_size) for s in page.sites]

    def site_pages(self, page_size: int = 1000) -> Iterator[admin_pb2.ListSitesResponse]:
        """The coordinator's site list, page by page (each with the counts)."""
        token = ""
        while True:
            request = admin_pb2.ListSitesRequest(page_size=page_size, page_token=token)
            page = self.stub.ListSites(request, timeout=self.timeout_s)
            yield page
            token = page.next_page_token
            if not token:
                return

    def site_counts(self) -> tuple[int, int]:
        """(sites registered, of them online now), without listing them."""
        request = admin_pb2.ListSitesRequest(summary_only=True)
        reply = self.stub.ListSites(request, timeout=self.timeout_s)
        return reply.total, reply.online

    def export_chunks(self, run_id: str, round_number: int | None = None) -> Iterator[memoryview]:
        """The model's safetensors bytes, chunk by chunk (views into the received messages)."""
        request = admin_pb2.ExportModelRequest(
            run_id=run_id, round=round_number or 0, latest=round_number is None
        )
        yield from self._export_model(request, timeout=self.timeout_s)

    def export_model(self, run_id: str, round_number: int | None = None) -> dict[str, torch.Tensor]:
        from fedra.protos.codec import decode_chunks  # noqa: PLC0415 - torch on export only

        return decode_chunks(self.export_chunks(run_id, round_number))

    def export_to_file(self, run_id: str, path: Path, round_number: int | None = None) -> int:
        """Write the model as a .safetensors file; returns its size."""
        tmp = path.with_suffix(path.suffix + ".part")
        size = 0
        try:
            with tmp.open("wb") as f:
                for chunk in self.export_chunks(run_id, round_number):
                    f.write(chunk)
                    size += len(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)
        return size


def provenance_dict(p: admin_pb2.RunProvenance) -> dict[str, Any]:
    """A run's provenance as plain data: ``run`` (its spec's digest, the coordinator's
    fedra) and ``sites``, by site id (task, its version and source digest, the data
    fingerprint, the site's config digest, versions, device, whether it changed)."""
    sites = {
        s.site_id: {
            "task": s.provenance.entry_point,
            "task_version": s.provenance.task_version,
            "task_source_sha256": s.provenance.task_source_sha256,
            "data_fingerprint": s.provenance.data_fingerprint,
            "config_sha256": s.provenance.config_sha256,
            "versions": dict(s.provenance.versions),
            "device": s.provenance.device,
            "changed": s.changed,
            "since_round": s.since_round,
        }
        for s in p.sites
    }
    run = {"spec_sha256": p.spec_sha256, "coordinator_version": p.coordinator_version}
    return {"run": run, "sites": sites}
