"""The identity layer over real gRPC: mTLS handshakes, peer identity, files, revocation
and update signatures."""

from __future__ import annotations

import datetime as dt
import json
import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedra import pki

SITES = ("site-a", "site-b")
ADMINS = ("alice",)


class WhoAmI(health.HealthServicer):  # type: ignore[misc]  # grpc_health has no stubs
    """The standard health service, remembering who each Check came from."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[pki.Identity | None] = []

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.seen.append(pki.peer_identity(context))
        return super().Check(request, context)


class Server:
    """A secure gRPC server on 127.0.0.1 port 0 with the coordinator's credentials."""

    def __init__(self, coordinator: Path) -> None:
        self.servicer = WhoAmI()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        creds = pki.server_credentials(pki.load_folder(coordinator))
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()

    def check(
        self,
        creds: grpc.ChannelCredentials | None,
        host: str = "127.0.0.1",
        options: list[tuple[str, Any]] | None = None,
    ) -> pki.Identity | None:
        """One health Check; returns the identity the server saw."""
        self.servicer.seen.clear()
        target = f"{host}:{self.port}"
        if creds is None:
            channel = grpc.insecure_channel(target)
        else:
            channel = grpc.secure_channel(target, creds, options=options)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert len(self.servicer.seen) == 1
        return self.servicer.seen[0]

    def refused(self, creds: grpc.ChannelCredentials | None, host: str = "127.0.0.1") -> None:
        """The call fails at the handshake: UNAVAILABLE, and the handler never runs."""
        with pytest.raises(grpc.RpcError) as err:
            self.check(creds, host)
        assert cast(grpc.Call, err.value).code() == grpc.StatusCode.UNAVAILABLE
        assert self.servicer.seen == []


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki") / "out"
    pki.provision(folder, sites=SITES, admins=ADMINS)
    return folder


@pytest.fixture(scope="module")
def server(out: Path) -> Iterator[Server]:
    s = Server(out / "coordinator")
    yield s
    s.server.stop(grace=None).wait()


def _creds(folder: Path) -> grpc.ChannelCredentials:
    return pki.channel_credentials(pki.load_folder(folder))


def _cert(folder: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((folder / "cert.pem").read_bytes())


# --- handshakes and identity ------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_site_identity_seen_by_server(out: Path, server: Server, host: str) -> None:
    folder = out / "sites" / "site-a"
    who = server.check(_creds(folder), host)
    assert who == pki.Identity(name="site-a", role="site", serial=_cert(folder).serial_number)


def test_admin_identity_seen_by_server(out: Path, server: Server) -> None:
    folder = out / "admins" / "alice"
    who = server.check(_creds(folder))
    assert who == pki.Identity(name="alice", role="admin", serial=_cert(folder).serial_number)


def test_no_client_certificate_refused(out: Path, server: Server) -> None:
    ca = (out / "ca" / "ca.pem").read_bytes()
    server.refused(grpc.ssl_channel_credentials(root_certificates=ca))


def test_certificate_from_another_ca_refused(out: Path, server: Server, tmp_path: Path) -> None:
    # Same CA name, different key: only the signature tells them apart.
    pki.provision(tmp_path, sites=["site-a"], admins=[])
    stranger = pki.load_folder(tmp_path / "sites" / "site-a")
    ours = (out / "ca" / "ca.pem").read_bytes()
    server.refused(pki.channel_credentials(pki.TlsFiles(ours, stranger.cert, stranger.key)))


def test_expired_certificate_refused(out: Path, server: Server) -> None:
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=30)
    files = pki.issue(out / "ca", "site", "site-old", days=1, valid_from=long_ago)
    expired = x509.load_pem_x509_certificate(files.cert).not_valid_after_utc
    assert expired < dt.datetime.now(dt.timezone.utc)
    server.refused(pki.channel_credentials(files))


def test_insecure_channel_refused(server: Server) -> None:
    server.refused(None)


def test_server_name_must_match_san(out: Path, tmp_path: Path) -> None:
    pki.provision(tmp_path, coordinator_hosts=["coord.example"], sites=["s"], admins=[])
    other = Server(tmp_path / "coordinator")
    try:
        creds = _creds(tmp_path / "sites" / "s")
        other.refused(creds)  # dialled 127.0.0.1, which the SAN does not name
        override = [("grpc.ssl_target_name_override", "coord.example")]
        assert other.check(creds, options=override) is not None
    finally:
        other.server.stop(grace=None).wait()


def test_peer_identity_none_without_certificate() -> None:
    class Context:
        def auth_context(self) -> dict[str, list[bytes]]:
            return {"transport_security_type": [b"insecure"]}

    assert pki.peer_identity(cast(grpc.ServicerContext, Context())) is None


# --- files ------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_layout_and_permissions(out: Path) -> None:
    folders = [out / "coordinator", *(out / "sites" / s for s in SITES), out / "admins" / "alice"]
    for folder in [out, out / "ca", out / "sites", out / "admins", *folders]:
        assert _mode(folder) == 0o700, folder
    assert _mode(out / "ca" / "ca.key") == 0o600
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
        assert _mode(folder / "key.pem") == 0o600
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temp files left


def test_certificate_contents(out: Path) -> None:
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.pem").read_bytes())
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert basic.ca and basic.path_length == 0
    coordinator = _cert(out / "coordinator")
    sans = coordinator.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = coordinator.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    site = _cert(out / "sites" / "site-b")
    ou = site.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value
    assert (site.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value, ou) == (
        "site-b",
        "site",
    )
    assert not site.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = site.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert site.serial_number != _cert(out / "sites" / "site-a").serial_number


def test_provision_refuses_existing_ca(out: Path) -> None:
    with pytest.raises(ValueError, match="already holds a CA"):
        pki.provision(out, sites=["site-z"], admins=[])
    assert not (out / "sites" / "site-z").exists()


@pytest.mark.parametrize("name", ["", "a b", "..", ".", "x" * 129, "é", "a/b"])
def test_provision_refuses_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid name"):
        pki.provision(tmp_path / "out", sites=["ok", name], admins=[])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("sites", "admins"), [(["a", "a"], []), (["a"], ["a"])])
def test_provision_refuses_duplicates(tmp_path: Path, sites: list[str], admins: list[str]) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        pki.provision(tmp_path, sites=sites, admins=admins)


def test_provision_refuses_bad_host(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid coordinator host"):
        pki.provision(tmp_path, coordinator_hosts=["bad host"], sites=[], admins=[])


def test_add_participant_uses_existing_ca(out: Path, server: Server) -> None:
    made = pki.add_participant(out, "site", "site-c")
    assert made == pki.Participant("site", "site-c", out / "sites" / "site-c")
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.pem").read_bytes())
    _cert(made.folder).verify_directly_issued_by(ca)
    assert _mode(made.folder) == 0o700 and _mode(made.folder / "key.pem") == 0o600
    assert server.check(_creds(made.folder)) == pki.Identity(
        "site-c", "site", _cert(made.folder).serial_number
    )
    with pytest.raises(ValueError, match="already provisioned"):
        pki.add_participant(out, "site", "site-c")
    with pytest.raises(ValueError, match="unknown role"):
        pki.add_participant(out, "root", "x")


def test_load_folder_errors(out: Path, tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes((out / "ca" / "ca.pem").read_bytes())
    (tmp_path / "cert.pem").write_bytes((out / "sites" / "site-a" / "cert.pem").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"key\.pem"):
        pki.load_folder(tmp_path)
    (tmp_path / "key.pem").write_bytes((out / "sites" / "site-b" / "key.pem").read_bytes())
    with pytest.raises(ValueError, match="does not belong"):
        pki.load_folder(tmp_path)


def test_load_folder_checks_the_role_it_is_asked_for(out: Path) -> None:
    assert pki.load_folder(out / "coordinator", role="coordinator").cert
    assert pki.load_folder(out / "sites" / "site-a", role="site").cert
    with pytest.raises(ValueError, match="the site 'site-a''s, not a coordinator's"):
        pki.load_folder(out / "sites" / "site-a", role="coordinator")
    with pytest.raises(ValueError, match="the admin 'alice''s, not a site's"):
        pki.load_folder(out / "admins" / "alice", role="site")


# --- revocation -------------------------------------------------------------------------


def test_deny_list_missing_file_revokes_nothing(tmp_path: Path) -> None:
    assert not pki.DenyList(tmp_path / "deny.json").is_revoked(1234)


def test_revoke_is_seen_at_once(out: Path, tmp_path: Path) -> None:
    path = tmp_path / "deny.json"
    deny = pki.DenyList(path)
    a, b = (out / "sites" / s for s in SITES)
    serial_a, serial_b = (pki.serial_of((f / "cert.pem").read_bytes()) for f in (a, b))
    assert not deny.is_revoked(serial_a)
    assert pki.revoke(path, a) == serial_a
    assert deny.is_revoked(serial_a) and not deny.is_revoked(serial_b)
    pki.revoke(path, b / "cert.pem")
    pki.revoke(path, (a / "cert.pem").read_bytes())  # again: no second entry
    assert deny.is_revoked(serial_b)
    assert deny.names("site") == {"site-a", "site-b"} and deny.names("admin") == set()
    entries = json.loads(path.read_text())["revoked"]
    assert [(e["name"], e["role"], int(e["serial"], 16)) for e in entries] == [
        ("site-a", "site", serial_a),
        ("site-b", "site", serial_b),
    ]


@pytest.mark.parametrize(
    "body", ["{not json", "[]", '{"revoked": "x"}', '{"revoked": [{"serial": "zz"}]}']
)
def test_corrupt_deny_list_fails_closed(out: Path, tmp_path: Path, body: str) -> None:
    path = tmp_path / "deny.json"
    deny = pki.DenyList(path)
    assert not deny.is_revoked(1)
    path.write_text(body)
    with pytest.raises(pki.DenyListError):
        deny.is_revoked(1)
    with pytest.raises(pki.DenyListError):  # and revoke does not overwrite it
        pki.revoke(path, out / "sites" / "site-a")
    assert path.read_text() == body


# --- update signatures ------------------------------------------------------------------

DIGEST = "ab" * 32


def test_sign_verify_round_trip(out: Path) -> None:
    a, b = (pki.load_folder(out / "sites" / s) for s in SITES)
    message = pki.upload_message("run-1", 3, "site-a", "task-9", b"\x01" * 16, DIGEST)
    signature = pki.sign(a.key, message)
    assert pki.verify(a.cert, signature, message)
    assert not pki.verify(a.cert, signature, message + b"x")
    assert not pki.verify(b.cert, signature, message)
    assert not pki.verify(a.cert, signature[:-1], message)
    assert not pki.verify(a.cert, b"", message)


def test_upload_message_is_unambiguous() -> None:
    base: tuple[Any, ...] = ("run", 1, "site", "task", b"nonce", DIGEST)
    variants = [base]
    for i, changed in enumerate(("rum", 2, "sitf", "tasj", b"nonc3", "cd" * 32)):
        variants.append((*base[:i], changed, *base[i + 1 :]))
    shifts = [
        ("ab", 1, "c", "t", b"n", DIGEST),
        ("a", 1, "bc", "t", b"n", DIGEST),
        ("r", 1, "ab", "c", b"n", DIGEST),
        ("r", 1, "a", "bc", b"n", DIGEST),
        ("r", 1, "s", "t", b"n1", DIGEST),
        ("r", 1, "s", "t", b"n", "1" + DIGEST),
    ]
    messages = [pki.upload_message(*v) for v in variants + shifts]
    assert len(set(messages)) == len(messages)
    assert all(m.startswith(b"fedra.v1.update\0") for m in messages)
