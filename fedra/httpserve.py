"""A small read-only HTTP endpoint on threads of its own, for metrics and status pages.

Shared by the coordinator's ``--http`` and a site's ``[metrics] http``: the address is
checked the same way, a port in use fails the start with the flag's name, port 0 binds
a free one (``address`` says which), and requests are served on daemon threads so that
a slow scraper or an open page never waits for a round, nor a round for them.

With an ``ssl.SSLContext`` each connection's TLS handshake runs on its request thread
(never on the accepting one: a client that stalls its handshake holds only its own
thread) and the handler can read the verified client certificate (``peer_pem``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fedra.config import ConfigError, check_host_port

log = logging.getLogger("fedra.http")

HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client that says nothing for this long is dropped


def parse_address(address: str, flag: str) -> tuple[str, int, bool]:
    """(host, port, whether the host is a loopback one) of ``HOST:PORT`` (port 0: a
    free one; an IPv6 host in brackets), or ConfigError naming ``flag``."""
    check_host_port(address, flag, allow_port_zero=True)
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return host, int(port), loopback


def tls_context(folder: Path) -> ssl.SSLContext:
    """A server context from a ``fedra provision`` folder (its cert.pem and key.pem, and
    its ca.pem as the only CA): clients must present a certificate of that CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    ctx.load_verify_locations(cafile=str(folder / "ca.pem"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:  # on this request's own thread
            request.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as exc:  # no or a foreign certificate, plain HTTP
                log.debug("http: TLS handshake with %s failed: %s", client_address[0], exc)
                return
            request.settimeout(None)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-reply is routine: not worth a traceback on stderr.
        log.debug("http: request from %s failed", client_address[0], exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpServer:
    """Serve ``handler`` on ``address`` (checked by ``parse_address``); ``start`` and
    ``stop`` it. ``address`` afterwards is the one bound, with the port for port 0."""

    def __init__(
        self,
        address: str,
        flag: str,
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        host, port, _ = parse_address(address, flag)
        try:
            self._server = (_Server6 if ":" in host else _Server)((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"{flag} {address}: cannot listen there: {exc.strerror}") from None
        self._server.tls = tls
        bracketed = f"[{host}]" if ":" in host else host
        self.address = f"{bracketed}:{self._server.server_address[1]}"
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and free the port; safe before ``start`` and twice."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


class Replies(BaseHTTPRequestHandler):
    """A handler's replies: whole bodies with their length, never cached, logged at debug.
    Read-only: a subclass defines ``do_GET`` alone (other methods get 501)."""

    timeout = 30.0  # a connection silent this long is closed: an idle one pins no thread

    def reply(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def peer_pem(self) -> bytes | None:
        """The client's verified certificate (PEM) on a TLS endpoint; None otherwise."""
        conn = self.connection
        if not isinstance(conn, ssl.SSLSocket):
            return None
        der = conn.getpeercert(binary_form=True)
        return ssl.DER_cert_to_PEM_cert(der).encode() if der else None

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)
