"""Who may register an OAuth client, and how (docs/mcp.md#oauth-clients).

Three ways, in the order MCP clients try them: a client an admin registered by hand (the
admin site), a Client ID Metadata Document (``client_id`` is an https URL; django-oauth-toolkit
fetches and caches the document, ``MetadataDocumentFetcher`` decides where it may fetch from),
and open Dynamic Client Registration (RFC 7591, ``RegistrationView``). An admin turns either
of the last two off on the settings page (``OAuthPolicy``).

Open registration is a door for anyone, so ``RegistrationView`` adds what the library leaves to
the site: a rate per client address (``DISPATCH_OAUTH_DCR_RATE``), a cap on stored registered
clients (``DISPATCH_OAUTH_DCR_MAX_CLIENTS``: registered clients never used for
``DISPATCH_OAUTH_DCR_UNUSED_SECONDS`` are deleted first to make room), and redirect URIs that are
https or loopback http (RFC 8252 §7.3; RFC 9700 §2.1).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any

import urllib3
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from limits import parse
from oauth2_provider import cimd
from oauth2_provider.compat import login_not_required
from oauth2_provider.models import get_application_model
from oauth2_provider.settings import oauth2_settings
from oauth2_provider.views import DynamicClientRegistrationManagementView, DynamicClientRegistrationView

from core import wire
from core.errors import unavailable_error
from core.outage import RETRY_AFTER_SECONDS
from core.services import rate_limiter
from oauth.models import OAuthPolicy
from oauth.services import registered_client_over_cap, registered_clients_at_cap
from oauth.validators import has_nul, redirect_uri_problem

logger = logging.getLogger(__name__)

# --- Dynamic Client Registration (RFC 7591) -----------------------------------------------


class OpenRegistration:
    """DCR permission: anyone may register while the admin leaves DCR on."""

    def has_permission(self, request: HttpRequest) -> bool:
        return bool(OAuthPolicy.current().dcr_enabled)


def rate_key(address: str) -> str:
    """Whom a rate counts: an IPv4 address, or an IPv6 address's /64 (one host commonly holds
    a whole /64, so counting single addresses would count nothing)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _error(error: str, description: str, status: int, **headers: str) -> JsonResponse:
    response = JsonResponse({"error": error, "error_description": description}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


GRANT_TYPES = frozenset(["authorization_code", "refresh_token"])
"""The only grants a client may register for (RFC 7591 §2 ``grant_types``): a person signs
in; no client credentials, implicit, password or device grants, whose tokens name no user."""


def _metadata_refused(request: HttpRequest) -> JsonResponse | None:
    """The RFC 7591 §3.2.2 error for a registration body (RFC 7591 §2) Dispatch does not take,
    or ``None`` to let the library check the rest: ``invalid_redirect_uri`` for a redirect URI
    ``redirect_uri_problem`` refuses, or none at all; ``invalid_client_metadata`` for a grant
    type other than ``authorization_code`` and ``refresh_token``, or a response type other than
    ``code``."""
    try:
        body = json.loads(request.body or b"{}")
    except RecursionError:
        return _error("invalid_client_metadata", "the body is nested too deeply", 400)
    except ValueError:
        return None  # the library answers invalid_client_metadata
    if not isinstance(body, dict):
        return None
    if has_nul(body):
        return _error("invalid_client_metadata", "a value holds a NUL character", 400)
    unstorable = wire.problem(body)
    if unstorable is not None:
        return _error("invalid_client_metadata", unstorable, 400)
    for name in ("client_name", "client_uri", "logo_uri", "scope", "token_endpoint_auth_method"):
        if body.get(name) is not None and not isinstance(body[name], str):  # null: as if absent
            return _error("invalid_client_metadata", f"{name} must be a string", 400)
    for name in ("grant_types", "response_types", "contacts"):
        if body.get(name) is not None and not isinstance(body[name], list):
            return _error("invalid_client_metadata", f"{name} must be a list", 400)
    uris = body.get("redirect_uris")
    if not isinstance(uris, list) or not uris:
        return _error("invalid_redirect_uri", "redirect_uris must list at least one redirect URI", 400)
    for uri in uris:
        problem = redirect_uri_problem(uri) if isinstance(uri, str) else None
        if problem is not None:
            return _error("invalid_redirect_uri", problem, 400)
    grant_types = body.get("grant_types", ["authorization_code"])
    if isinstance(grant_types, list) and not set(map(str, grant_types)) <= GRANT_TYPES:
        other = sorted(set(map(str, grant_types)) - GRANT_TYPES)
        return _error(
            "invalid_client_metadata",
            f"grant_types may hold authorization_code and refresh_token only, not {', '.join(other)[:200]}",
            400,
        )
    response_types = body.get("response_types", ["code"])
    if isinstance(response_types, list) and set(map(str, response_types)) - {"code"}:
        return _error("invalid_client_metadata", "response_types may hold code only", 400)
    return None


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(login_not_required, name="dispatch")
class RegistrationView(DynamicClientRegistrationView):
    """``POST /oauth/register/``: RFC 7591 registration, refused with an RFC 7591 §3.2.2
    error when DCR is off (403 ``access_denied``), past the address's rate (429
    ``slow_down``, ``Retry-After``), at the cap (503 ``temporarily_unavailable``), for a
    redirect URI ``redirect_uri_problem`` refuses (400 ``invalid_redirect_uri``) or a grant
    other than the authorization code's (400 ``invalid_client_metadata``)."""

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not OAuthPolicy.current().dcr_enabled:
            return _error("access_denied", "dynamic client registration is turned off on this server", 403)
        limit = parse(settings.OAUTH_DCR_RATE)
        address = rate_key(str(request.META.get("REMOTE_ADDR") or ""))
        try:
            allowed = rate_limiter().hit(limit, settings.REDIS_PREFIX, "oauth-dcr", address)
        except Exception as exc:  # Redis down or frozen: the RFC 7591 error shape, not the site's 503 page
            mapped = unavailable_error(exc)
            if mapped is None:
                raise
            return _error("temporarily_unavailable", mapped.message, 503, Retry_After=str(RETRY_AFTER_SECONDS))
        if not allowed:
            return _error(
                "slow_down",
                f"too many client registrations from this address (at most {settings.OAUTH_DCR_RATE})",
                429,
                Retry_After="60",
            )
        refused = _metadata_refused(request)
        if refused is not None:
            return refused
        if registered_clients_at_cap():
            return _cap_reached()
        with transaction.atomic():
            response: HttpResponse = super().post(request, *args, **kwargs)
            if response.status_code == 201 and registered_client_over_cap():
                # Registrations that passed the count above together: the last to take the
                # lock finds the others' rows and undoes its own.
                transaction.set_rollback(True)
                return _cap_reached()
        return response


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(login_not_required, name="dispatch")
class RegistrationManagementView(DynamicClientRegistrationManagementView):
    """``/oauth/register/<client_id>/`` (RFC 7592, with the registration access token): read,
    update or delete one's own registration. An update is held to the registration's rules
    (``_metadata_refused``)."""

    def put(self, request: HttpRequest, client_id: str, *args: Any, **kwargs: Any) -> HttpResponse:
        refused = _metadata_refused(request)
        if refused is not None:
            return refused
        response: HttpResponse = super().put(request, client_id, *args, **kwargs)
        return response


# --- Client ID Metadata Documents ----------------------------------------------------------


class MetadataDocumentRegistration:
    """CIMD permission: any https ``client_id`` URL while the admin leaves CIMD on. A URL
    seen for the first time costs a fetch and stores a client, so it is taken only in an
    authorization request (behind Dispatch's login; the token and revocation endpoints answer
    anyone), and held to a registration's bounds: ``DISPATCH_OAUTH_CIMD_RATE`` first sightings
    per client address, and the cap on stored registered clients (unused ones cleaned first).
    A refusal makes the client unknown to the request."""

    def has_permission(self, request: Any, client_id: str) -> bool:
        if not OAuthPolicy.current().cimd_enabled:
            return False
        Application = get_application_model()
        if Application.objects.filter(client_id=client_id).exists():
            return True  # known: a refetch of its document, no new row
        if not getattr(request, "response_type", None):
            # First sight only at the authorization endpoint, behind the login: the token
            # and revocation endpoints answer anyone, and would fetch and store for anyone.
            return False
        address = rate_key(str((getattr(request, "headers", None) or {}).get("REMOTE_ADDR") or ""))
        if not rate_limiter().hit(parse(settings.OAUTH_CIMD_RATE), settings.REDIS_PREFIX, "oauth-cimd", address):
            logger.info("CIMD client %r refused: %s looked up too many new ones", client_id[:200], address)
            return False
        if registered_clients_at_cap():
            logger.warning("CIMD client %r refused: the cap on registered clients is reached", client_id[:200])
            return False
        return True


def _cap_reached() -> JsonResponse:
    logger.warning("OAuth client registration refused: the cap on registered clients is reached")
    return _error(
        "temporarily_unavailable",
        "this server holds as many registered clients as it may; try again later",
        503,
        Retry_After="3600",
    )


class _Buffered:
    """A response whose body was read already: what the library's ``_read_document`` reads."""

    def __init__(self, response: Any, body: bytes) -> None:
        self.status = response.status
        self.headers = response.headers
        self._body = body

    def read(self, amount: int | None = None) -> bytes:
        return self._body if amount is None else self._body[:amount]


class _DeadlinePool(urllib3.HTTPSConnectionPool):
    """A connection pool that remembers its connections, so a timer can cut them at the
    fetch's deadline wherever they are blocked (connecting, reading the status line and
    headers, or the body)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened: list[Any] = []

    def _new_conn(self) -> Any:
        connection = super()._new_conn()
        self.opened.append(connection)
        return connection

    def cut(self) -> None:
        """Shut every connection's socket down: a read blocked in it returns at once."""
        for connection in self.opened:
            sock = getattr(connection, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    # The plain socket's shutdown, under TLS: SSLSocket.shutdown would also
                    # drop the TLS state another thread is reading with.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)


class MetadataDocumentFetcher(cimd.SafeMetadataFetcher):
    """django-oauth-toolkit's fetcher rules (https only, every resolved address public, the
    connection pinned to the address checked, no redirects, ``CIMD_MAX_DOCUMENT_SIZE`` bytes
    at most), with what it leaves out:

    - ``CIMD_FETCH_TIMEOUT_SECONDS`` (``DISPATCH_OAUTH_CIMD_TIMEOUT``) bounds the whole fetch
      from the first connection to the last byte: a timer shuts the connection down at the
      deadline. Socket timeouts alone bound each read, so a server sending its headers or
      its document a byte at a time held the authorization request (and a thread) for as
      long as it dripped. (Name resolution is left to the system resolver's own timeout.)
    - the document's ``redirect_uris`` are held to the registration's rules
      (``redirect_uri_problem``): one refused URI refuses the document, as it refuses a DCR
      registration;
    - when an admin allows private addresses (a metadata document on the same network), the
      address check is skipped and everything else holds.

    Raises ``cimd.CIMDError`` (the client is then unknown to the authorization request)."""

    def fetch(self, client_id: str) -> tuple[dict[str, Any], int]:
        self._deadline = time.monotonic() + float(oauth2_settings.CIMD_FETCH_TIMEOUT_SECONDS)
        try:
            parsed = cimd._validate_client_id_url(client_id)
        except ValueError as exc:  # urlsplit's own refusal (https://[::1/x): an unknown client, not an error
            raise cimd.CIMDError(f"client_id is not a URL: {exc}") from exc
        port = parsed.port or 443
        if OAuthPolicy.current().cimd_private_addresses:
            addresses = _resolve_any(str(parsed.hostname), port)
        else:
            addresses = cimd._resolve_and_validate(parsed.hostname, port)
        fetched: tuple[dict[str, Any], int] | None = None
        failure: BaseException | str = "no time left"
        for address in addresses:
            if time.monotonic() >= self._deadline:
                break
            try:
                fetched = self._fetch_from(address, parsed, port)
                break
            except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                failure = exc
        if fetched is None:
            raise cimd.CIMDError(f"could not fetch client_id document: {failure}")
        document, max_age = fetched
        if has_nul(document) or wire.problem(document) is not None:
            raise cimd.CIMDError("client_id document holds a NUL character or a lone surrogate")
        uris = document.get("redirect_uris")
        for uri in uris if isinstance(uris, list) else []:
            problem = redirect_uri_problem(uri) if isinstance(uri, str) else "a redirect URI is not a string"
            if problem is not None:
                raise cimd.CIMDError(f"client_id document refused: {problem}")
        return document, max_age

    def _fetch_from(self, address: str, parsed: Any, port: int) -> tuple[dict[str, Any], int]:
        remaining = self._deadline - time.monotonic()
        pool = _DeadlinePool(
            host=address,
            port=port,
            timeout=urllib3.Timeout(connect=remaining, read=remaining, total=remaining),
            retries=False,
            maxsize=1,
            ssl_context=ssl.create_default_context(),
            server_hostname=parsed.hostname,
        )
        watchdog = threading.Timer(remaining, pool.cut)
        watchdog.daemon = True
        watchdog.start()
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        headers = {"Host": parsed.netloc, "Accept": "application/json, application/*+json"}
        try:
            response = pool.urlopen("GET", path, headers=headers, redirect=False, preload_content=False)
            try:
                return self._read_document(response)
            finally:
                response.release_conn()
        finally:
            watchdog.cancel()
            pool.close()

    def _read_document(self, response: Any) -> tuple[dict[str, Any], int]:
        limit = int(oauth2_settings.CIMD_MAX_DOCUMENT_SIZE) + 1
        chunks: list[bytes] = []
        size = 0
        if response.status == 200:
            while size < limit:
                if time.monotonic() > self._deadline:
                    raise cimd.CIMDError("client_id document took too long to arrive")
                chunk = response.read1(min(4096, limit - size)) if hasattr(response, "read1") else b""
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        if time.monotonic() > self._deadline:
            raise cimd.CIMDError("client_id document took too long to arrive")  # cut short at the deadline
        document: tuple[dict[str, Any], int] = super()._read_document(_Buffered(response, b"".join(chunks)))
        return document


def _resolve_any(hostname: str, port: int) -> list[str]:
    """``hostname``'s addresses, private ones included (the admin allowed them); never the
    unspecified address (0.0.0.0, ::), which connects to this host."""
    try:
        infos = socket.getaddrinfo(hostname, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise cimd.CIMDError(f"could not resolve client_id host: {exc}") from exc
    addresses = [str(info[4][0]) for info in infos if not ipaddress.ip_address(info[4][0]).is_unspecified]
    if not addresses:
        raise cimd.CIMDError("client_id host did not resolve to a usable address")
    return addresses
