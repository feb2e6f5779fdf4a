"""mTLS identities and authorisation against a real coordinator server.

Each refusal names what was wrong with the right status, and changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fedra import pki
from fedra.client.connection import Connection, check_neighbour_keys
from fedra.coordinator.server import CoordinatorConfig, build_engine, create_server, shutdown
from fedra.examples import synthetic
from fedra.protos.codec import encode
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc, common_pb2, site_pb2, site_pb2_grpc
from fedra.secagg import SecAggError, SiteSecAgg

TASK = "fedra.examples.synthetic:task"


class SecureCoordinator:
    def __init__(self, root: Path) -> None:
        self.pki = root / "pki"
        pki.provision(
            self.pki,
            coordinator_hosts=["localhost", "127.0.0.1"],
            sites=["site-a", "site-b"],
            admins=["ops"],
        )
        state = root / "state"
        tls = pki.load_folder(self.pki / "coordinator")
        config = CoordinatorConfig(
            state_dir=state, tls_dir=self.pki / "coordinator", max_workers=16
        )
        self.engine = build_engine(config)
        self.engine.start()
        self.deny_list = config.deny_list_path
        self.server, port = create_server(
            self.engine, "127.0.0.1:0", config.max_workers, tls, self.deny_list
        )
        self.server.start()
        self.address = f"localhost:{port}"
        self._channels: list[grpc.Channel] = []

    def channel(self, folder: Path | None) -> grpc.Channel:
        if folder is None:
            ch = grpc.insecure_channel(self.address)
        else:
            ch = grpc.secure_channel(self.address, pki.channel_credentials(pki.load_folder(folder)))
        self._channels.append(ch)
        return ch

    def site(self, name: str, folder: Path | None = None) -> site_pb2_grpc.SiteServiceStub:
        return site_pb2_grpc.SiteServiceStub(self.channel(folder or self.pki / "sites" / name))

    def admin(self, folder: Path | None = None) -> admin_pb2_grpc.AdminServiceStub:
        return admin_pb2_grpc.AdminServiceStub(self.channel(folder or self.pki / "admins" / "ops"))

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        shutdown(self.server, self.engine, grace_s=0)


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[SecureCoordinator]:
    c = SecureCoordinator(tmp_path)
    try:
        yield c
    finally:
        c.close()


def one_site_spec(rounds: int) -> admin_pb2.RunSpec:
    return admin_pb2.RunSpec(
        task=TASK,
        rounds=rounds,
        sites_per_round=1,
        round_deadline_s=60,
        join_timeout_s=5,
        max_round_attempts=1,
        strategy="fedavg",
        train=common_pb2.TrainSettings(local_steps=1, batch_size=4, learning_rate=0.1),
    )


def register(stub: site_pb2_grpc.SiteServiceStub, site_id: str) -> None:
    stub.Register(site_pb2.RegisterRequest(site_id=site_id, tasks=[TASK]), timeout=10)


def refused(call, request, code: grpc.StatusCode, text: str = "") -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert text in (info.value.details() or ""), info.value.details()


def sites_known(secure: SecureCoordinator) -> list[str]:
    reply = secure.admin().ListSites(admin_pb2.ListSitesRequest(), timeout=10)
    return [s.site_id for s in reply.sites]


def test_a_provisioned_site_and_admin_are_served(secure: SecureCoordinator) -> None:
    register(secure.site("site-a"), "site-a")
    assert sites_known(secure) == ["site-a"]


def test_no_certificate_is_refused_at_the_handshake(secure: SecureCoordinator) -> None:
    plain = site_pb2_grpc.SiteServiceStub(secure.channel(None))
    refused(
        plain.Register,
        site_pb2.RegisterRequest(site_id="site-a", tasks=[TASK]),
        grpc.StatusCode.UNAVAILABLE,
    )
    server_only = grpc.secure_channel(
        secure.address,
        grpc.ssl_channel_credentials(root_certificates=(secure.pki / "ca" / "ca.pem").read_bytes()),
    )
    try:
        stub = site_pb2_grpc.SiteServiceStub(server_only)
        refused(
            stub.Register,
            site_pb2.RegisterRequest(site_id="site-a", tasks=[TASK]),
            grpc.StatusCode.UNAVAILABLE,
        )
    finally:
        server_only.close()
    assert sites_known(secure) == []


def test_a_certificate_from_another_ca_is_refused(
    secure: SecureCoordinator, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    pki.provision(other, coordinator_hosts=["localhost"], sites=["site-a"], admins=[])
    # Trust our CA (so the server is accepted) but present the other CA's site certificate.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.pem").write_bytes((secure.pki / "ca" / "ca.pem").read_bytes())
    for name in ("cert.pem", "key.pem"):
        (mixed / name).write_bytes((other / "sites" / "site-a" / name).read_bytes())
    stub = secure.site("site-a", mixed)
    refused(
        stub.Register,
        site_pb2.RegisterRequest(site_id="site-a", tasks=[TASK]),
        grpc.StatusCode.UNAVAILABLE,
    )
    assert sites_known(secure) == []


def test_a_revoked_certificate_is_refused_at_once(secure: SecureCoordinator) -> None:
    stub = secure.site("site-a")
    register(stub, "site-a")
    pki.revoke(secure.deny_list, secure.pki / "sites" / "site-a")
    refused(
        stub.Heartbeat,
        site_pb2.HeartbeatRequest(site_id="site-a"),
        grpc.StatusCode.UNAUTHENTICATED,
        "revoked",
    )
    register(secure.site("site-b"), "site-b")  # others are unaffected


def test_a_site_revoked_while_its_poll_waits_is_not_sampled_nor_given_a_task(
    secure: SecureCoordinator,
) -> None:
    stub = secure.site("site-a")
    register(stub, "site-a")
    register(secure.site("site-b"), "site-b")  # online too: registered a moment ago
    poll = stub.PollTask.future(site_pb2.PollTaskRequest(site_id="site-a"), timeout=4)
    deadline = time.monotonic() + 10
    while secure.engine.wakeups.waiting() < 1:  # the poll is parked, admitted before the revoke
        assert time.monotonic() < deadline and not poll.done(), "the poll never waited"
        time.sleep(0.01)
    pki.revoke(secure.deny_list, secure.pki / "sites" / "site-a")
    reply = secure.admin().SubmitRun(
        admin_pb2.SubmitRunRequest(spec=one_site_spec(rounds=1)), timeout=10
    )
    run = secure.engine.runs[reply.run_id]
    while run.open_round is None:  # round 0 samples one of the online sites
        assert time.monotonic() < deadline, "no round opened"
        time.sleep(0.01)
    assert sorted(run.assignments) == ["site-b"]  # online, but revoked: never sampled
    try:
        answer = poll.result(timeout=20)  # its poll runs out with nothing for it
        assert not answer.HasField("task")
    except grpc.RpcError as exc:  # or its deadline did first: no task either way
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()


def test_an_unreadable_deny_list_refuses_everyone(secure: SecureCoordinator) -> None:
    secure.deny_list.write_text("{not json")
    stub = secure.site("site-a")
    refused(
        stub.Register,
        site_pb2.RegisterRequest(site_id="site-a", tasks=[TASK]),
        grpc.StatusCode.UNAVAILABLE,  # sites retry: a fixed file lets them back in
        "cannot check revocations",
    )
    assert secure.deny_list.exists()


def test_a_site_can_only_act_as_itself(secure: SecureCoordinator) -> None:
    stub = secure.site("site-a")
    request = site_pb2.RegisterRequest(site_id="site-b", tasks=[TASK])
    refused(stub.Register, request, grpc.StatusCode.PERMISSION_DENIED, "may only act as itself")
    refused(
        stub.PollTask, site_pb2.PollTaskRequest(site_id="site-b"), grpc.StatusCode.PERMISSION_DENIED
    )
    assert sites_known(secure) == []


def test_admin_calls_need_an_admin_certificate(secure: SecureCoordinator) -> None:
    as_site = secure.admin(secure.pki / "sites" / "site-a")
    refused(
        as_site.ListRuns, admin_pb2.ListRunsRequest(), grpc.StatusCode.PERMISSION_DENIED, "admin"
    )
    refused(
        as_site.SubmitRun,
        admin_pb2.SubmitRunRequest(spec=one_site_spec(rounds=1)),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert secure.admin().ListRuns(admin_pb2.ListRunsRequest(), timeout=10).runs == []
    # and an admin is not a site
    as_admin = secure.site("ops", secure.pki / "admins" / "ops")
    refused(
        as_admin.Register,
        site_pb2.RegisterRequest(site_id="ops", tasks=[TASK]),
        grpc.StatusCode.PERMISSION_DENIED,
    )


def _initial_upload(
    secure: SecureCoordinator,
) -> tuple[site_pb2_grpc.SiteServiceStub, site_pb2.Task, bytes]:
    stub = secure.site("site-a")
    register(stub, "site-a")
    secure.admin().SubmitRun(admin_pb2.SubmitRunRequest(spec=one_site_spec(rounds=2)), timeout=10)
    task = stub.PollTask(site_pb2.PollTaskRequest(site_id="site-a"), timeout=10).task
    assert task.task_id
    model = {
        k: v.detach().clone() for k, v in synthetic.task.create_model(0, {}).state_dict().items()
    }
    return stub, task, encode(model)


def _upload(
    stub, task, payload: bytes, *, nonce: bytes, key: bytes, round_number: int | None = None
):  # type: ignore[no-untyped-def]
    sha = hashlib.sha256(payload).hexdigest()
    signed = pki.upload_message(
        task.run_id, task.round, "site-a", task.task_id, nonce, sha,
        num_samples=1, codec="none", payload_bytes=len(payload),
    )  # fmt: skip
    header = site_pb2.UpdateHeader(
        site_id="site-a",
        run_id=task.run_id,
        round=task.round if round_number is None else round_number,
        task_id=task.task_id,
        num_samples=1,
        codec="none",
        sha256=sha,
        nonce=nonce,
        payload_bytes=len(payload),
        signature=pki.sign(key, signed),
    )
    msgs = [site_pb2.UpdateChunk(header=header), site_pb2.UpdateChunk(data=payload)]
    return stub.UploadUpdate(iter(msgs), timeout=30)


def test_uploads_must_be_signed_by_the_site_and_cannot_be_replayed(
    secure: SecureCoordinator,
) -> None:
    stub, task, payload = _initial_upload(secure)
    key_a = (secure.pki / "sites" / "site-a" / "key.pem").read_bytes()
    key_b = (secure.pki / "sites" / "site-b" / "key.pem").read_bytes()
    with pytest.raises(grpc.RpcError) as info:  # signed with another site's key
        _upload(stub, task, payload, nonce=os.urandom(16), key=key_b)
    assert (
        info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "signature" in info.value.details()
    )
    with pytest.raises(grpc.RpcError) as info:  # header altered after signing
        _upload(stub, task, payload, nonce=os.urandom(16), key=key_a, round_number=task.round + 1)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    nonce = os.urandom(16)
    _upload(stub, task, payload, nonce=nonce, key=key_a)
    try:  # the same signed update again: it never counts twice (r0.updates below)
        again = _upload(stub, task, payload, nonce=nonce, key=key_a)
    except grpc.RpcError as exc:  # the round has moved on, or the task is done
        assert exc.code() in (
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.FAILED_PRECONDITION,
        ), exc
    else:  # still the current task: answered as done, as a retry after a lost reply is
        assert again.bytes_received == len(payload)
    (run,) = secure.admin().ListRuns(admin_pb2.ListRunsRequest(), timeout=10).runs
    status = secure.admin().GetRun(admin_pb2.GetRunRequest(run_id=run.run_id), timeout=10)
    (r0,) = [r for r in status.rounds if r.number == 0]
    assert r0.updates == 1
    assert not run.coordinator_insecure and not status.coordinator_insecure


def test_secure_aggregation_keys_are_signed_and_checked_by_the_neighbours(
    secure: SecureCoordinator, tmp_path: Path
) -> None:
    """A site's SecAgg public keys are signed with its certificate key: the coordinator
    refuses keys signed by anyone else, and a site refuses neighbour keys that are not
    signed by that neighbour's certificate from the project's CA."""
    sites = ("site-a", "site-b")
    stubs = {s: secure.site(s) for s in sites}
    for s in sites:
        register(stubs[s], s)
    spec = one_site_spec(rounds=1)
    spec.sites_per_round, spec.min_sites = 2, 2
    spec.secagg.CopyFrom(common_pb2.SecAgg(clip=4.0))
    run_id = secure.admin().SubmitRun(admin_pb2.SubmitRunRequest(spec=spec), timeout=10).run_id
    tasks = {
        s: stubs[s].PollTask(site_pb2.PollTaskRequest(site_id=s), timeout=10).task for s in sites
    }
    (init_site,) = [s for s in sites if tasks[s].task_id]
    model = {
        k: v.detach().clone() for k, v in synthetic.task.create_model(0, {}).state_dict().items()
    }
    key = (secure.pki / "sites" / init_site / "key.pem").read_bytes()
    _upload_as(stubs[init_site], init_site, tasks[init_site], encode(model), key)
    tasks = {}
    for s in sites:
        for _ in range(20):  # round 1 opens right after round 0 commits
            task = stubs[s].PollTask(site_pb2.PollTaskRequest(site_id=s), timeout=10).task
            if task.round == 1:
                tasks[s] = task
                break
    assert sorted(tasks) == list(sites) and all(t.run_id == run_id for t in tasks.values())
    context = tasks["site-a"].secagg.context
    conns = {
        s: Connection(secure.address, s, pki.load_folder(secure.pki / "sites" / s)) for s in sites
    }
    maskers = {s: SiteSecAgg(s, tasks[s].secagg.threshold, context) for s in sites}
    try:
        # Keys signed with another site's key: refused, and nothing recorded.
        key_b = (secure.pki / "sites" / "site-b" / "key.pem").read_bytes()
        forged = site_pb2.SecAggKeysRequest(
            site_id="site-a",
            task_id=tasks["site-a"].task_id,
            public_keys=maskers["site-a"].public_keys(),
            signature=pki.sign(
                key_b, pki.secagg_keys_message(context, "site-a", maskers["site-a"].public_keys())
            ),
        )
        refused(
            stubs["site-a"].SecAggKeys, forged, grpc.StatusCode.UNAUTHENTICATED, "key signature"
        )
        unsigned = site_pb2.SecAggKeysRequest(
            site_id="site-a",
            task_id=tasks["site-a"].task_id,
            public_keys=maskers["site-a"].public_keys(),
        )
        refused(
            stubs["site-a"].SecAggKeys, unsigned, grpc.StatusCode.UNAUTHENTICATED, "key signature"
        )
        # Through the site's own connection: signed, relayed, and checked on arrival.
        ready, _ = conns["site-a"].secagg_keys(
            tasks["site-a"].task_id, context, maskers["site-a"].public_keys(), 0.0
        )
        assert not ready
        conns["site-b"].secagg_keys(
            tasks["site-b"].task_id, context, maskers["site-b"].public_keys(), 0.0
        )
        ready, keys = conns["site-a"].secagg_keys(tasks["site-a"].task_id, context, b"", 10.0)
        assert ready and keys == {"site-b": maskers["site-b"].public_keys()}
        reply = stubs["site-a"].SecAggKeys(
            site_pb2.SecAggKeysRequest(site_id="site-a", task_id=tasks["site-a"].task_id, wait_s=1),
            timeout=10,
        )
        ca = pki.load_folder(secure.pki / "sites" / "site-a").ca
        relayed = (dict(reply.neighbour_keys), dict(reply.signatures), dict(reply.certificates))
        check_neighbour_keys(ca, context, *relayed)  # what the coordinator relayed checks out
        # What a lying coordinator could relay instead is refused by the site.
        pki.provision(tmp_path / "other", coordinator_hosts=["x"], sites=["site-b"], admins=[])
        foreign = (tmp_path / "other" / "sites" / "site-b" / "cert.pem").read_bytes()
        own_a = (secure.pki / "sites" / "site-a" / "cert.pem").read_bytes()
        swapped = {"site-b": SiteSecAgg("site-b", 1, context).public_keys()}
        for bad, why in [
            ((swapped, relayed[1], relayed[2]), "signature does not match"),
            ((relayed[0], relayed[1], {"site-b": foreign}), "not issued by this project's CA"),
            ((relayed[0], relayed[1], {"site-b": own_a}), "it names site 'site-a'"),
            ((relayed[0], relayed[1], {}), "unreadable certificate"),
        ]:
            with pytest.raises(SecAggError, match=why):
                check_neighbour_keys(ca, context, *bad)
        with pytest.raises(SecAggError, match="signature does not match"):
            check_neighbour_keys(ca, b"another round", *relayed)
    finally:
        for conn in conns.values():
            conn.close()


def _upload_as(stub, site: str, task, payload: bytes, key: bytes):  # type: ignore[no-untyped-def]
    nonce, sha = os.urandom(16), hashlib.sha256(payload).hexdigest()
    signed = pki.upload_message(
        task.run_id, task.round, site, task.task_id, nonce, sha,
        num_samples=1, codec="none", payload_bytes=len(payload),
    )  # fmt: skip
    header = site_pb2.UpdateHeader(
        site_id=site, run_id=task.run_id, round=task.round, task_id=task.task_id,
        num_samples=1, codec="none", sha256=sha, nonce=nonce, payload_bytes=len(payload),
        signature=pki.sign(key, signed),
    )  # fmt: skip
    msgs = [site_pb2.UpdateChunk(header=header), site_pb2.UpdateChunk(data=payload)]
    return stub.UploadUpdate(iter(msgs), timeout=30)


def test_the_daemon_refuses_a_certificate_that_is_not_a_coordinators(tmp_path: Path) -> None:
    """Started with a site's folder, it would serve, and every client's handshake would
    fail with 'unsupported certificate purpose': it refuses at start instead."""
    import subprocess
    import sys

    pki.provision(tmp_path / "pki", coordinator_hosts=["localhost"], sites=["site-a"], admins=[])
    started = subprocess.run(
        [
            sys.executable, "-m", "fedra", "coordinator", "--state-dir", str(tmp_path / "state"),
            "--tls-dir", str(tmp_path / "pki" / "sites" / "site-a"), "--port", "0",
        ],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert "--tls-dir:" in started.stderr and "the site 'site-a''s, not a coordinator's" in (
        started.stderr
    )
    assert not (tmp_path / "state" / "coordinator.json").exists()


def test_a_plaintext_admin_is_told_the_coordinator_serves_tls(secure: SecureCoordinator) -> None:
    """gRPC says only that the socket closed: the CLI says what to change."""
    import subprocess
    import sys

    refused = subprocess.run(
        [sys.executable, "-m", "fedra", "sites", "--coordinator", secure.address, "--insecure"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    assert "UNAVAILABLE" in refused.stderr
    assert "give an admin --tls-dir instead of --insecure" in refused.stderr, refused.stderr
