"""Who may call what: identities from client certificates, checked on every call.

Over mTLS a caller is the name and role in its certificate (``fedra.pki``): a site
may act only as itself, admin RPCs need an admin certificate, a revoked certificate
is refused at once (the deny list is read per call and an unreadable one refuses
everything), and an upload must be signed by the site's key. In insecure mode
(localhost development) there is no identity and nothing is checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fedra import pki
from fedra.coordinator.audit import who_of
from fedra.coordinator.errors import PermissionDenied, Unauthenticated, Unavailable

log = logging.getLogger("fedra.coordinator")


class Guard:
    def __init__(
        self,
        deny_list: pki.DenyList | None,
        insecure: bool = False,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        if deny_list is None and not insecure:
            raise ValueError("a secure coordinator needs a deny list")
        self.deny_list = deny_list
        self.insecure = insecure
        self._site_serials: dict[str, int] = {}  # the certificate each site last called with
        # Told (who, why) of each identity refused: the audit trail (AuditTrail).
        self.on_refused = on_refused or (lambda who, why: None)

    def _refuse(self, who: pki.Identity | None, why: str) -> None:
        self.on_refused("unknown" if who is None else who_of(who), why)

    def identity(self, context: Any) -> pki.Identity | None:
        """The verified caller, or None in insecure mode; Unauthenticated otherwise."""
        if self.insecure:
            return None
        return self.checked(pki.peer_identity(context))

    def checked(self, who: pki.Identity | None) -> pki.Identity:
        """``who`` (from a certificate verified against the project CA) if it is not
        revoked; Unauthenticated without one, or revoked; Unavailable while the deny list
        cannot be read (fail closed)."""
        if who is None:
            self._refuse(None, "no verified client certificate")
            raise Unauthenticated("no verified client certificate")
        assert self.deny_list is not None
        if who.role == "site":
            self._site_serials[who.name] = who.serial
        try:
            revoked = self.deny_list.is_revoked(who.serial)
        except pki.DenyListError as exc:  # fail closed: a deny list we cannot read denies all
            log.error("deny list unreadable, refusing every call: %s", exc)
            # UNAVAILABLE: sites retry with backoff instead of giving up for good.
            raise Unavailable("the coordinator cannot check revocations right now") from exc
        if revoked:
            self._refuse(who, "revoked")
            raise Unauthenticated(f"the certificate of {who.role} {who.name!r} is revoked")
        return who

    def admin_certificate(self, cert_pem: bytes | None) -> pki.Identity:
        """The admin a verified client certificate (PEM, from a TLS edge other than gRPC,
        e.g. the status page) names; refused as the admin calls are refused."""
        who = self.checked(pki.identity_of(cert_pem) if cert_pem else None)
        if who.role != "admin":
            self._refuse(who, "not an admin")
            raise PermissionDenied(
                f"this endpoint needs an admin certificate; {who.role} {who.name!r} has none"
            )
        return who

    def site_serials(self) -> dict[str, int]:
        """The certificate serial each site last called with (the operators' read process
        is told them, to judge revocations as this guard does)."""
        return dict(self._site_serials)

    def know_serials(self, serials: dict[str, int]) -> None:
        """Take ``serials`` as the certificates the sites last called with."""
        self._site_serials = dict(serials)

    def revoked_sites(self) -> frozenset[str]:
        """The sites whose certificate is revoked: the one each last called with, or
        (for a site not heard from since this daemon started) any listed under its name.
        Empty without a deny list, or while it cannot be read (every call is refused
        then anyway)."""
        if self.deny_list is None:
            return frozenset()
        try:
            named = self.deny_list.names("site")
            serials = dict(self._site_serials)  # one atomic copy: calls go on
            return frozenset(
                name
                for name in named | serials.keys()
                if (self.deny_list.is_revoked(serials[name]) if name in serials else True)
            )
        except pki.DenyListError:
            return frozenset()

    def any_site(self, context: Any) -> None:
        """The caller must be a site, not revoked: checked from its certificate alone,
        before its request is read (which site it claims to be is checked after)."""
        who = self.identity(context)
        if who is not None and who.role != "site":
            self._refuse(who, "not a site")
            raise PermissionDenied(f"{who.role} {who.name!r} is not a site")

    def site(self, context: Any, site_id: str) -> None:
        """The caller must be site ``site_id`` itself."""
        who = self.identity(context)
        if who is None:
            return
        if who.role != "site":
            self._refuse(who, "not a site")
            raise PermissionDenied(f"{who.role} {who.name!r} is not a site")
        if who.name != site_id:
            self._refuse(who, "acting as another site")
            raise PermissionDenied(f"site {who.name!r} may only act as itself, not as {site_id!r}")

    def admin(self, context: Any) -> str:
        """The caller must be an admin; returns how the audit log names it."""
        who = self.identity(context)
        if who is not None and who.role != "admin":
            self._refuse(who, "not an admin")
            raise PermissionDenied(
                f"admin calls need an admin certificate; {who.role} {who.name!r} has none"
            )
        return who_of(who)

    def signed(self, context: Any, message: bytes, signature: bytes, what: str) -> bytes:
        """The caller's certificate (PEM), once ``signature`` over ``message`` checks out
        against it; b'' in insecure mode."""
        if self.insecure:
            return b""
        certs = context.auth_context().get("x509_pem_cert") or []
        if not certs or not signature or not pki.verify(certs[0], signature, message):
            self._refuse(pki.peer_identity(context), f"bad {what} signature")
            raise Unauthenticated(f"the {what} signature does not match the site's certificate")
        return bytes(certs[0])

    def upload(self, context: Any, message: bytes, signature: bytes) -> None:
        """The update header must be signed by the calling site's certificate key."""
        if self.insecure:
            return
        certs = context.auth_context().get("x509_pem_cert") or []
        if not certs or not signature or not pki.verify(certs[0], signature, message):
            self._refuse(pki.peer_identity(context), "bad update signature")
            raise Unauthenticated("the update's signature does not match the site's certificate")
