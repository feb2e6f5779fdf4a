"""Identity layer: a private CA, one mTLS start-up folder per participant, peer identity,
revocation and update signatures.

Layout written by ``provision``::

    out/ca/{ca.pem, ca.key}
    out/coordinator/{ca.pem, cert.pem, key.pem}
    out/sites/<name>/{ca.pem, cert.pem, key.pem}
    out/admins/<name>/{ca.pem, cert.pem, key.pem}

A leaf certificate's CN is the participant's name and its OU is its role; authorisation
reads both from the verified peer certificate, never from anything the peer sends.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
import json
import re
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedra.config import is_valid_site_id

if TYPE_CHECKING:  # only the credentials need gRPC: a signature check loads none of it
    import grpc
from fedra.files import write_atomic

ROLES = ("coordinator", "site", "admin")
DEFAULT_COORDINATOR_HOSTS = ("localhost", "127.0.0.1")
CA_DAYS = 3650
# Certificates start slightly in the past so a peer whose clock lags a little accepts them.
_CLOCK_SKEW = dt.timedelta(minutes=5)
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_UPLOAD_DOMAIN = b"fedra.v1.update\0"
_SECAGG_KEYS_DOMAIN = b"fedra.v1.secagg-keys\0"
_KEY_MODE, _CERT_MODE, _DIR_MODE = 0o600, 0o644, 0o700


@dataclass(frozen=True)
class Participant:
    """One provisioned start-up folder."""

    role: str
    name: str
    folder: Path


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of the CA certificate, a participant's certificate and its private key."""

    ca: bytes
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class Identity:
    """Who a verified peer certificate says the caller is."""

    name: str
    role: str
    serial: int


class DenyListError(Exception):
    """The deny list exists but cannot be read or parsed; callers must fail closed."""


# --- files ------------------------------------------------------------------------------


def _make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents as 0700 (chmod because mkdir obeys the umask)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir()
        folder.chmod(_DIR_MODE)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` durably with ``mode``, creating 0700 folders as needed."""
    _make_dirs(path.parent)
    write_atomic(path, [data], mode)


def participant_folder(out: Path, role: str, name: str) -> Path:
    """Where ``provision`` puts the start-up folder of (role, name)."""
    if role == "coordinator":
        return out / "coordinator"
    return out / {"site": "sites", "admin": "admins"}[role] / name


def _write_folder(folder: Path, files: TlsFiles) -> None:
    _make_dirs(folder)
    _write_atomic(folder / "ca.pem", files.ca, _CERT_MODE)
    _write_atomic(folder / "key.pem", files.key, _KEY_MODE)
    _write_atomic(folder / "cert.pem", files.cert, _CERT_MODE)


# --- issuing ----------------------------------------------------------------------------


def _check_name(name: str) -> None:
    # "." and ".." match the site-id pattern but would escape the folder layout.
    if not is_valid_site_id(name) or name in {".", ".."}:
        raise ValueError(f"invalid name {name!r}: use 1-128 ASCII letters, digits, '-', '_', '.'")


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")


def _san_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if _HOST.fullmatch(host) is None:
        raise ValueError(f"invalid coordinator host {host!r}: expected a DNS name or IP address")
    return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _key_usage(digital_signature: bool, cert_sign: bool) -> x509.KeyUsage:
    # Positional: digital_signature, content_commitment, key_encipherment, data_encipherment,
    # key_agreement, key_cert_sign, crl_sign, encipher_only, decipher_only.
    f = False
    return x509.KeyUsage(digital_signature, f, f, f, f, cert_sign, cert_sign, f, f)


@dataclass(frozen=True)
class _Ca:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _new_ca(days: int) -> _Ca:
    """A self-signed CA that may sign leaves only (path_length=0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedra CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(False, cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _Ca(cert, key)


def _load_ca(ca_folder: Path) -> _Ca:
    cert = x509.load_pem_x509_certificate(_read(ca_folder / "ca.pem"))
    key = serialization.load_pem_private_key(_read(ca_folder / "ca.key"), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_folder / 'ca.key'}: not an EC private key")
    return _Ca(cert, key)


def _leaf_extensions(
    builder: x509.CertificateBuilder, role: str, hosts: Sequence[str]
) -> x509.CertificateBuilder:
    eku = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role == "coordinator":
        eku.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        # gRPC checks the name the client dialled against these entries.
        sans = [_san_entry(h) for h in (hosts or DEFAULT_COORDINATOR_HOSTS)]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(True, cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    )


def issue(
    ca_folder: Path,
    role: str,
    name: str,
    *,
    hosts: Sequence[str] = (),
    days: int = 365,
    valid_from: dt.datetime | None = None,
) -> TlsFiles:
    """Issue a fresh key and leaf certificate from the CA in ``ca_folder``; writes nothing."""
    return _issue(_load_ca(Path(ca_folder)), role, name, hosts, days, valid_from)


def _issue(
    ca: _Ca, role: str, name: str, hosts: Sequence[str], days: int, valid_from: dt.datetime | None
) -> TlsFiles:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
    _check_name(name)
    _check_days(days)
    if hosts and role != "coordinator":
        raise ValueError(f"hosts are only for the coordinator, not role {role!r}")
    start = (valid_from or dt.datetime.now(dt.timezone.utc)) - _CLOCK_SKEW
    end = start + _CLOCK_SKEW + dt.timedelta(days=days)
    if end > ca.cert.not_valid_after_utc:
        raise ValueError(f"certificate would outlive its CA ({ca.cert.not_valid_after_utc})")
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [(NameOID.ORGANIZATIONAL_UNIT_NAME, role), (NameOID.COMMON_NAME, name)]
    subject = x509.Name([x509.NameAttribute(oid, value) for oid, value in attrs])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    cert = _leaf_extensions(builder, role, hosts).sign(ca.key, hashes.SHA256())
    return TlsFiles(ca.pem, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def provision(
    out: Path,
    *,
    coordinator_hosts: Sequence[str] = DEFAULT_COORDINATOR_HOSTS,
    sites: Sequence[str],
    admins: Sequence[str],
    days: int = 365,
) -> list[Participant]:
    """Create a CA under ``out/ca`` and a start-up folder for the coordinator and each name."""
    out = Path(out)
    _check_days(days)
    if (out / "ca" / "ca.pem").exists() or (out / "ca" / "ca.key").exists():
        raise ValueError(f"{out / 'ca'} already holds a CA; use add_participant to extend it")
    names = [*sites, *admins]
    for name in names:
        _check_name(name)
    # A name is an identity in logs and the deny list: one name, one participant.
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate participant names: {dupes}")
    for host in coordinator_hosts:
        _san_entry(host)
    wanted = [("coordinator", "coordinator"), *[("site", s) for s in sites]]
    wanted += [("admin", a) for a in admins]
    ca = _new_ca(max(CA_DAYS, days + 1))
    participants = []
    for role, name in wanted:
        hosts = coordinator_hosts if role == "coordinator" else ()
        folder = participant_folder(out, role, name)
        _write_folder(folder, _issue(ca, role, name, hosts, days, None))
        participants.append(Participant(role=role, name=name, folder=folder))
    # The CA goes last: after a crash midway provision runs over the folder again rather
    # than refusing it, and the unsaved CA's half-issued certificates are replaced.
    _write_atomic(out / "ca" / "ca.pem", ca.pem, _CERT_MODE)
    _write_atomic(out / "ca" / "ca.key", _key_pem(ca.key), _KEY_MODE)
    return participants


def add_participant(
    out: Path, role: str, name: str, *, hosts: Sequence[str] = (), days: int = 365
) -> Participant:
    """Issue one more start-up folder from the existing CA in ``out/ca``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
    _check_name(name)
    folder = participant_folder(Path(out), role, name)
    if (folder / "cert.pem").exists():
        raise ValueError(f"{folder} is already provisioned; revoke and remove it first")
    _write_folder(folder, issue(Path(out) / "ca", role, name, hosts=hosts, days=days))
    return Participant(role=role, name=name, folder=folder)


# --- loading and gRPC -------------------------------------------------------------------


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"missing TLS file: {path}") from None


def load_folder(folder: Path, role: str | None = None) -> TlsFiles:
    """Read ca.pem, cert.pem and key.pem and check that the key belongs to the certificate
    (and, given ``role``, that the certificate is one of that role's)."""
    folder = Path(folder)
    files = TlsFiles(*(_read(folder / n) for n in ("ca.pem", "cert.pem", "key.pem")))
    try:
        cert = x509.load_pem_x509_certificate(files.cert)
        key = serialization.load_pem_private_key(files.key, password=None)
        x509.load_pem_x509_certificate(files.ca)
    except ValueError as exc:
        raise ValueError(f"{folder}: unreadable PEM: {exc}") from exc
    # A mismatched pair only shows up later as an opaque handshake failure.
    if cert.public_key() != key.public_key():
        raise ValueError(f"{folder}: key.pem does not belong to cert.pem")
    if role is not None:
        who = _identity_from_pem(files.cert)
        if who is None or who.role != role:
            what = "not one of fedra's" if who is None else f"the {who.role} {who.name!r}'s"
            raise ValueError(
                f"{folder}: cert.pem is {what}, not a {role}'s: give the {role}'s folder "
                "from `fedra provision`"
            )
    return files


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """mTLS server credentials: a client without a certificate from our CA is refused."""
    import grpc  # noqa: PLC0415 - the edges' alone

    return grpc.ssl_server_credentials(
        [(files.key, files.cert)], root_certificates=files.ca, require_client_auth=True
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials presenting our certificate and trusting only our CA."""
    import grpc  # noqa: PLC0415 - the edges' alone

    return grpc.ssl_channel_credentials(
        root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
    )


@functools.lru_cache(maxsize=1024)
def _identity_from_pem(pem: bytes) -> Identity | None:
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(names) != 1 or len(roles) != 1 or roles[0].value not in ROLES:
        return None
    return Identity(name=str(names[0].value), role=str(roles[0].value), serial=cert.serial_number)


def identity_of(cert_pem: bytes) -> Identity | None:
    """Who a certificate (PEM) names, or None if it is not a fedra participant's. Says
    nothing of its validity: only for a certificate a TLS handshake has verified."""
    return _identity_from_pem(cert_pem)


def peer_identity(context: grpc.ServicerContext) -> Identity | None:
    """The caller's identity from its certificate, or None without one.

    Trustworthy only on a server built with ``server_credentials`` (client certs required
    and verified during the handshake); gRPC does not say whether a cert was verified.
    """
    # types-grpcio says the values are bytes; grpc really gives a list of bytes per key.
    pems: object = context.auth_context().get("x509_pem_cert")
    if not isinstance(pems, (list, tuple)) or len(pems) != 1 or not isinstance(pems[0], bytes):
        return None
    return _identity_from_pem(pems[0])


# --- revocation -------------------------------------------------------------------------


def serial_of(cert_pem: bytes) -> int:
    """The serial number of a PEM certificate."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number


def _parse_deny_list(path: Path) -> list[dict[str, Any]]:
    """Entries of an existing deny list file; raises FileNotFoundError or DenyListError."""
    try:
        doc = json.loads(path.read_bytes())
        entries = doc["revoked"]
        if not isinstance(entries, list):
            raise TypeError("'revoked' is not a list")
        for e in entries:
            int(e["serial"], 16)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DenyListError(f"{path}: unreadable deny list: {exc!r}") from exc
    return entries


class DenyList:
    """Revoked serials from a JSON file, re-read whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self._names: frozenset[tuple[str, str]] = frozenset()  # (role, name) of each entry

    def is_revoked(self, serial: int) -> bool:
        """True if ``serial`` is listed; raises DenyListError if the file is unreadable."""
        with self._lock:
            return serial in self._current()

    def names(self, role: str) -> frozenset[str]:
        """The names of ``role`` whose certificates are listed (as ``revoke`` recorded
        them); raises DenyListError if the file is unreadable."""
        with self._lock:
            self._current()
            return frozenset(name for r, name in self._names if r == role)

    def _current(self) -> frozenset[int]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen, self._serials, self._names = None, frozenset(), frozenset()
            return self._serials
        except OSError as exc:
            raise DenyListError(f"{self.path}: {exc}") from exc
        # revoke() renames a new file into place, so the inode changes even when mtime
        # and size would not.
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            try:
                entries = _parse_deny_list(self.path)
            except FileNotFoundError:
                entries = []
            self._serials = frozenset(int(e["serial"], 16) for e in entries)
            self._names = frozenset(
                (str(e.get("role", "")), str(e.get("name", ""))) for e in entries
            )
            self._seen = seen
        return self._serials


def revoke(path: Path, cert_pem_or_folder: bytes | Path) -> int:
    """Add a certificate (PEM bytes, a cert.pem path or a start-up folder) to the deny list.

    Returns the serial; one writer at a time (concurrent revokes can lose an entry).
    """
    path = Path(path)
    pem = cert_pem_or_folder
    if isinstance(pem, Path):
        pem = _read(pem / "cert.pem" if pem.is_dir() else pem)
    cert = x509.load_pem_x509_certificate(pem)
    identity = _identity_from_pem(pem)
    try:
        entries = _parse_deny_list(path)
    except FileNotFoundError:
        entries = []
    if all(int(e["serial"], 16) != cert.serial_number for e in entries):
        entries.append(
            {
                "serial": format(cert.serial_number, "x"),
                "name": identity.name if identity else "",
                "role": identity.role if identity else "",
                "revoked_unix_s": int(time.time()),
            }
        )
        body = json.dumps({"revoked": entries}, indent=2).encode() + b"\n"
        _write_atomic(path, body, _CERT_MODE)
    return cert.serial_number


# --- update signatures ------------------------------------------------------------------


def sign(key_pem: bytes, message: bytes) -> bytes:
    """ECDSA-SHA256 signature (DER) of ``message`` with a PEM private key."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("signing key is not an EC private key")
    return key.sign(message, ec.ECDSA(hashes.SHA256()))


def verify(cert_pem: bytes, signature: bytes, message: bytes) -> bool:
    """True if ``signature`` is the certificate key's ECDSA-SHA256 signature of ``message``."""
    key = x509.load_pem_x509_certificate(cert_pem).public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return False
    try:
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def upload_message(
    run_id: str,
    round: int,
    site_id: str,
    task_id: str,
    nonce: bytes,
    sha256: str,
    *,
    num_samples: int = 0,
    codec: str = "",
    payload_bytes: int = 0,
) -> bytes:
    """The bytes a site signs for an update: domain prefix, then length-prefixed fields.

    Binds everything that decides what the update does to the aggregate, its weight
    (``num_samples``) and encoding included. It encodes and does not validate: the
    coordinator calls it on an untrusted header.
    """
    for name, value in (
        ("round", round),
        ("num_samples", num_samples),
        ("payload_bytes", payload_bytes),
    ):
        if not 0 <= value < 2**64:
            raise ValueError(f"{name} out of range: {value}")
    fields = [
        run_id.encode(),
        struct.pack(">Q", round),
        site_id.encode(),
        task_id.encode(),
        bytes(nonce),
        sha256.encode(),
        struct.pack(">Q", num_samples),
        codec.encode(),
        struct.pack(">Q", payload_bytes),
    ]
    return _UPLOAD_DOMAIN + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def secagg_keys_message(context: bytes, site_id: str, public_keys: bytes) -> bytes:
    """The bytes a site signs for its secure-aggregation public keys of one round."""
    fields = [bytes(context), site_id.encode(), bytes(public_keys)]
    return _SECAGG_KEYS_DOMAIN + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def check_peer_certificate(ca_pem: bytes, cert_pem: bytes, role: str, name: str) -> str:
    """Why ``cert_pem`` is not a valid certificate of ``role`` ``name`` under our CA ('' if it is).

    What a site checks before it trusts a neighbour's keys relayed by the coordinator:
    issued by the project CA, within its validity period, and naming that participant.
    (Revocation is the coordinator's deny list; a site cannot see it.)
    """
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        return f"unreadable certificate: {exc}"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "not issued by this project's CA"
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return "expired or not yet valid"
    who = _identity_from_pem(cert_pem)
    if who is None or who.role != role or who.name != name:
        return f"it names {who.role} {who.name!r}" if who else "it names no fedra participant"
    return ""
