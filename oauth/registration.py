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

import ipaddress
import json
import logging
import socket
import ssl
import time
from typing import Any

import urllib3
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from limits import parse
from oauth2_provider import cimd
from oauth2_provider.compat import login_not_required
from oauth2_provider.models import get_application_model
from oauth2_provider.settings import oauth2_settings
from oauth2_provider.views import DynamicClientRegistrationView

from core.services import rate_limiter
from oauth.models import OAuthPolicy
from oauth.services import registered_clients_cleanup
from oauth.validators import redirect_uri_problem

logger = logging.getLogger(__name__)

# --- Dynamic Client Registration (RFC 7591) -----------------------------------------------


class OpenRegistration:
    """DCR permission: anyone may register while the admin leaves DCR on."""

    def has_permission(self, request: HttpRequest) -> bool:
        return bool(OAuthPolicy.current().dcr_enabled)


def _error(error: str, description: str, status: int, **headers: str) -> JsonResponse:
    response = JsonResponse({"error": error, "error_description": description}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(login_not_required, name="dispatch")
class RegistrationView(DynamicClientRegistrationView):
    """``POST /oauth/register/``: RFC 7591 registration, refused with an RFC 7591 §3.2.2
    error when DCR is off (403 ``access_denied``), past the address's rate (429
    ``slow_down``, ``Retry-After``), at the cap (503 ``temporarily_unavailable``) or for a
    redirect URI that is neither https nor loopback (400 ``invalid_redirect_uri``)."""

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not OAuthPolicy.current().dcr_enabled:
            return _error("access_denied", "dynamic client registration is turned off on this server", 403)
        limit = parse(settings.OAUTH_DCR_RATE)
        address = str(request.META.get("REMOTE_ADDR") or "")
        if not rate_limiter().hit(limit, settings.REDIS_PREFIX, "oauth-dcr", address):
            return _error(
                "slow_down",
                f"too many client registrations from this address (at most {settings.OAUTH_DCR_RATE})",
                429,
                Retry_After="60",
            )
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            body = None  # the library answers invalid_client_metadata
        uris = body.get("redirect_uris") if isinstance(body, dict) else None
        if isinstance(uris, list):
            for uri in uris:
                problem = redirect_uri_problem(uri) if isinstance(uri, str) else None
                if problem is not None:
                    return _error("invalid_redirect_uri", problem, 400)
        Application = get_application_model()
        registered = Application.objects.filter(registration_source=Application.RegistrationSource.DCR)
        if registered.count() >= settings.OAUTH_DCR_MAX_CLIENTS:
            registered_clients_cleanup()
            if registered.count() >= settings.OAUTH_DCR_MAX_CLIENTS:
                logger.warning("OAuth client registration refused: %d registered clients", registered.count())
                return _error(
                    "temporarily_unavailable",
                    "this server holds as many registered clients as it may; try again later",
                    503,
                    Retry_After="3600",
                )
        return super().post(request, *args, **kwargs)


# --- Client ID Metadata Documents ----------------------------------------------------------


class MetadataDocumentRegistration:
    """CIMD permission: any https ``client_id`` URL while the admin leaves CIMD on."""

    def has_permission(self, request: Any, client_id: str) -> bool:
        return bool(OAuthPolicy.current().cimd_enabled)


class MetadataDocumentFetcher(cimd.SafeMetadataFetcher):
    """django-oauth-toolkit's fetcher (https only, every resolved address public, the
    connection pinned to the address checked, no redirects, ``CIMD_FETCH_TIMEOUT_SECONDS``
    for the whole fetch, ``CIMD_MAX_DOCUMENT_SIZE`` bytes at most); when an admin allows
    private addresses (a metadata document on the same network), the address check is
    skipped and everything else holds. Raises ``cimd.CIMDError``."""

    def fetch(self, client_id: str) -> tuple[dict[str, Any], int]:
        if not OAuthPolicy.current().cimd_private_addresses:
            return super().fetch(client_id)
        parsed = cimd._validate_client_id_url(client_id)
        port = parsed.port or 443
        try:
            infos = socket.getaddrinfo(parsed.hostname, port, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise cimd.CIMDError(f"could not resolve client_id host: {exc}") from exc
        address = str(infos[0][4][0]) if infos else None
        if address is None or ipaddress.ip_address(address).is_unspecified:
            raise cimd.CIMDError("client_id host did not resolve to a usable address")
        timeout = float(oauth2_settings.CIMD_FETCH_TIMEOUT_SECONDS)
        deadline = time.monotonic() + timeout
        pool = urllib3.HTTPSConnectionPool(
            host=address,
            port=port,
            timeout=urllib3.Timeout(connect=timeout, read=timeout, total=timeout),
            retries=False,
            maxsize=1,
            ssl_context=ssl.create_default_context(),
            server_hostname=parsed.hostname,
        )
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        headers = {"Host": parsed.netloc, "Accept": "application/json, application/*+json"}
        try:
            response = pool.urlopen("GET", path, headers=headers, redirect=False, preload_content=False)
            try:
                if time.monotonic() > deadline:
                    raise cimd.CIMDError("client_id document took too long")
                return self._read_document(response)
            finally:
                response.release_conn()
        except urllib3.exceptions.HTTPError as exc:
            raise cimd.CIMDError(f"could not fetch client_id document: {exc}") from exc
        finally:
            pool.close()
