"""Helpers of the hostile OAuth tests (``test_oauth_hostile.py``, ``test_registration.py``):
what the database holds for a client, the query of a redirect, a TLS server for Client ID
Metadata Documents with its own CA, and a TCP listener that counts who connects.

Everything here talks to loopback only.
"""

from __future__ import annotations

import json
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from deploy.tls import self_signed_certificate
from tests.infra import Instance

# --- the database, through manage.py shell ----------------------------------------------


def shell_json(inst: Instance, code: str) -> Any:
    """Run ``code`` in ``manage.py shell`` of ``inst``; it must end by printing one JSON
    value, which is returned."""
    done = inst.manage("shell", "-c", code)
    return json.loads(done.stdout.strip().splitlines()[-1])


_STORED = """
import json
from oauth2_provider.models import AccessToken, Application, Grant, RefreshToken
from oauth2_provider.settings import oauth2_settings
REGISTRATION = oauth2_settings.DCR_REGISTRATION_SCOPE
app = Application.objects.filter(client_id={client_id!r}).first()
rows = {{"application": app is not None, "grants": 0, "access_tokens": 0, "live_refresh_tokens": 0}}
if app is not None:
    rows["grants"] = Grant.objects.filter(application=app).count()
    # DCR's registration access token (RFC 7592) is an AccessToken row too: not a grant.
    rows["access_tokens"] = AccessToken.objects.filter(application=app).exclude(scope=REGISTRATION).count()
    rows["live_refresh_tokens"] = RefreshToken.objects.filter(application=app, revoked__isnull=True).count()
print(json.dumps(rows))
"""


def stored(inst: Instance, client_id: str) -> dict[str, Any]:
    """What the database holds for ``client_id``: ``{"application": bool, "grants": n,
    "access_tokens": n, "live_refresh_tokens": n}`` (access tokens: not counting DCR's
    registration access token; live: not revoked)."""
    return dict(shell_json(inst, _STORED.format(client_id=client_id)))


NOTHING_ISSUED = {"application": True, "grants": 0, "access_tokens": 0, "live_refresh_tokens": 0}


def set_policy(inst: Instance, **switches: bool) -> None:
    """Set ``OAuthPolicy`` switches (``dcr_enabled``, ``cimd_enabled``,
    ``cimd_private_addresses``) as an admin would on the settings page."""
    assignments = "; ".join(f"p.{name} = {value!r}" for name, value in switches.items())
    shell_json(
        inst,
        "import json; from oauth.models import OAuthPolicy; p = OAuthPolicy.current(); "
        f"{assignments}; p.save(); print(json.dumps(True))",
    )


# --- redirects ------------------------------------------------------------------------------


def redirect_query(answer: httpx.Response) -> dict[str, str]:
    """The query parameters of a redirect's ``Location`` (one value each)."""
    query = parse_qs(urlsplit(answer.headers["location"]).query)
    return {name: values[0] for name, values in query.items()}


def redirect_target(answer: httpx.Response) -> str:
    """``scheme://netloc/path`` of a redirect's ``Location``."""
    parts = urlsplit(answer.headers["location"])
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


# --- a CA and a TLS server for Client ID Metadata Documents ------------------------------


@dataclass(frozen=True)
class MetadataCA:
    """A CA's certificate file (what the server process trusts through ``SSL_CERT_FILE``) and
    a certificate signed by it for 127.0.0.1 and localhost (``cert_file``, ``key_file``)."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def make_ca(folder: Path) -> MetadataCA:
    """A fresh self-signed certificate for 127.0.0.1 and localhost under ``folder``, its own CA
    (``deploy.tls``, what ``make cluster CLUSTER_TLS=1`` uses): the server process trusts it
    through ``SSL_CERT_FILE``, the document server serves it."""
    certificate = self_signed_certificate(folder)
    return MetadataCA(ca_file=certificate.cert, cert_file=certificate.cert, key_file=certificate.key)


@dataclass
class Document:
    """What the metadata server answers at one path: ``body`` (bytes) after ``delay``
    seconds, with ``content_type``; with ``drip`` (seconds), the headers at once and the
    body one byte every ``drip`` seconds; with ``header_drip`` (seconds), the status line
    and headers (padded to a few hundred bytes) one byte every ``header_drip`` seconds."""

    body: bytes
    delay: float = 0.0
    drip: float = 0.0
    content_type: str = "application/json"
    header_drip: float = 0.0


@dataclass
class MetadataServer:
    """An HTTPS server on 127.0.0.1 answering ``documents`` (path → ``Document``) and
    counting requests per path (``hits``)."""

    port: int
    documents: dict[str, Document] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def publish(
        self,
        path: str,
        metadata: dict[str, Any] | bytes,
        *,
        delay: float = 0.0,
        drip: float = 0.0,
        header_drip: float = 0.0,
    ) -> str:
        """Serve ``metadata`` (a JSON object, or raw bytes) at ``path``; returns its URL."""
        body = metadata if isinstance(metadata, bytes) else json.dumps(metadata).encode()
        self.documents[path] = Document(body=body, delay=delay, drip=drip, header_drip=header_drip)
        return self.url(path)


@contextmanager
def metadata_server(ca: MetadataCA) -> Iterator[MetadataServer]:
    """A ``MetadataServer`` with ``ca``'s server certificate, stopped on exit."""
    state = MetadataServer(port=0)
    stopping = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path
            state.hits[path] = state.hits.get(path, 0) + 1
            document = state.documents.get(path)
            if document is None:
                self.send_error(404)
                return
            # A slow server: wait (but not past the test's end) before answering at all.
            stopping.wait(document.delay)
            try:
                if document.header_drip:
                    head = (
                        f"HTTP/1.1 200 OK\r\nContent-Type: {document.content_type}\r\n"
                        f"Content-Length: {len(document.body)}\r\nX-Padding: {'p' * 300}\r\n\r\n"
                    ).encode()
                    for index in range(len(head)):
                        if stopping.wait(document.header_drip):
                            return
                        self.wfile.write(head[index : index + 1])
                        self.wfile.flush()
                    self.wfile.write(document.body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", document.content_type)
                self.send_header("Content-Length", str(len(document.body)))
                self.end_headers()
                if not document.drip:
                    self.wfile.write(document.body)
                    return
                self.wfile.flush()
                for index in range(len(document.body)):
                    if stopping.wait(document.drip):
                        return
                    self.wfile.write(document.body[index : index + 1])
                    self.wfile.flush()
            except OSError:
                pass  # the fetcher gave up and closed the connection: what the test wants

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(ca.cert_file), str(ca.key_file))
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    state.port = int(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, name="cimd-https", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stopping.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@dataclass
class Listener:
    """A plain TCP listener on 127.0.0.1 that accepts and counts connections (``accepted``)."""

    port: int
    accepted: int = 0


@contextmanager
def tcp_listener() -> Iterator[Listener]:
    """A ``Listener`` accepting in a thread until exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.1)
    state = Listener(port=int(sock.getsockname()[1]))
    stopping = threading.Event()

    def accept() -> None:
        while not stopping.is_set():
            try:
                conn, _address = sock.accept()
            except (TimeoutError, OSError):
                continue
            state.accepted += 1
            conn.close()

    thread = threading.Thread(target=accept, name="tcp-listener", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stopping.set()
        thread.join(5)
        sock.close()


def temp_folder() -> Path:
    """A new temporary folder (the CA's files)."""
    return Path(tempfile.mkdtemp(prefix="dispatch-oauth-ca-"))


def elapsed(start: float) -> float:
    """Seconds since ``start`` (``time.monotonic()``)."""
    return time.monotonic() - start
