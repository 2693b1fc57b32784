"""DRF authentication by ``Authorization: Bearer <api token>`` (user API tokens and registered kinds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from core import credential_cache
from core.models import ApiToken
from core.services import AuthenticationFailed, api_token_authenticate, token_digest

BearerCredential = Callable[[str], "tuple[User, Any] | None"]
"""A bearer-token kind other than the user API token: ``raw token → (user, credential)`` or
``None`` when the token is not of this kind (or is revoked, expired, of an inactive user)."""

_BEARER_KINDS: list[BearerCredential] = []


def bearer_kind_register(kind: BearerCredential) -> None:
    """Accept another kind of bearer token after the user API token (idempotent). The
    agents app registers its agent tokens here in ``AgentsConfig.ready``, so the kernel
    authenticates them without importing the app (docs/architecture.md)."""
    if kind not in _BEARER_KINDS:
        _BEARER_KINDS.append(kind)


def other_bearer_credential(raw_token: str) -> tuple[User, Any] | None:
    """``(user, credential)`` of the first registered token kind that knows ``raw_token``,
    or ``None`` (sync: database reads)."""
    for kind in _BEARER_KINDS:
        found = kind(raw_token)
        if found is not None:
            return found
    return None


def bearer_cache_get(raw_token: str) -> tuple[User, Any] | None:
    """The ``(user, credential)`` a valid ``raw_token`` was found to be less than
    ``core.credential_cache.BEARER_CACHE_SECONDS`` ago in this process, or ``None`` (no
    database access: safe on the event loop)."""
    if not raw_token or len(raw_token) > 200:
        return None
    return credential_cache.cached(token_digest(raw_token))


def bearer_cache_clear() -> None:
    """Forget every cached lookup (a credential ended; ``core.credential_cache.clear``)."""
    credential_cache.clear()


def api_token_cached(raw_token: str) -> ApiToken | None:
    """The user API token ``raw_token`` was found to be less than
    ``core.credential_cache.BEARER_CACHE_SECONDS`` ago in this process (``bearer_cache_get``),
    with its user loaded, or ``None`` (not cached, or another kind of token). No database
    access: safe on the event loop."""
    cached = bearer_cache_get(raw_token)
    if cached is None or not isinstance(cached[1], ApiToken):
        return None
    return cached[1]


def api_token_credential(raw_token: str) -> ApiToken:
    """``core.services.api_token_authenticate`` through the process's bearer cache, which
    it shares with ``bearer_credential`` (the same entry serves REST and ``/ws``): only a
    user API token is accepted. A found token is cached for
    ``core.credential_cache.BEARER_CACHE_SECONDS``; a refusal never is, and ending a token
    empties the cache (``core.revocation``).

    Raises ``core.services.AuthenticationFailed`` for an unknown, revoked or expired token
    or an inactive user (sync: database reads; docs/ws-protocol.md#authentication)."""
    token = api_token_cached(raw_token)
    if token is not None:
        return token
    started = time.monotonic()
    token = api_token_authenticate(raw_token)
    credential_cache.remember(token_digest(raw_token), started, token.user, token)
    return token


def bearer_credential(raw_token: str) -> tuple[User, Any]:
    """Who a bearer token is: ``(user, ApiToken)`` for a user API token (its ``last_used_at``
    touched as ``api_token_authenticate`` does), else the first registered kind that knows
    it (``(owner, Agent)`` for an agent token). A found pair is cached for
    ``core.credential_cache.BEARER_CACHE_SECONDS`` (``bearer_cache_get``); a refusal never is.

    Raises ``core.services.AuthenticationFailed`` for an unknown, revoked or expired token,
    an inactive user (sync: database reads).
    """
    cached = bearer_cache_get(raw_token)
    if cached is not None:
        return cached
    started = time.monotonic()
    found: tuple[User, Any] | None
    try:
        token = api_token_authenticate(raw_token)
        found = (token.user, token)
    except AuthenticationFailed:
        found = other_bearer_credential(raw_token)
        if found is None:
            raise
    credential_cache.remember(token_digest(raw_token), started, found[0], found[1])
    return found


class BearerTokenAuthentication(BaseAuthentication):
    """Authenticate a request by a user API token or an agent token (its ``DISPATCH_MCP_TOKEN``).

    A user token gives ``(user, ApiToken)``; an agent token gives ``(owner, Agent)``, so
    ``request.auth`` is the calling agent (``calling_agent``). 401 with
    ``WWW-Authenticate: Bearer`` otherwise (docs/architecture.md#errors).
    """

    keyword = "bearer"

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("invalid Authorization header: expected 'Bearer <token>'")
        raw = header[1].decode("latin-1")
        try:
            return bearer_credential(raw)
        except AuthenticationFailed:
            raise exceptions.AuthenticationFailed("invalid, expired or revoked token") from None

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


def authenticated_user(request: HttpRequest | Request) -> User:
    """The logged-in user of a request that passed authentication (login or token).

    Raises ``PermissionError`` if called for an anonymous request: a view that reaches
    it without authentication is a bug, never a fallback.
    """
    user = request.user
    if not isinstance(user, User) or not user.is_authenticated:
        raise PermissionError("authenticated_user() called for an anonymous request")
    return user


def by_user_credential(request: Request | HttpRequest) -> bool:
    """Whether ``request`` stands on the user's own credential — a logged-in session or a
    user API token — rather than another registered kind (an agent token). Token
    management accepts only these."""
    auth = getattr(request, "auth", None)
    return auth is None or isinstance(auth, ApiToken)


class _UpgradeRequest(HttpRequest):
    """The websocket upgrade request of an ASGI ``scope``, as much of an ``HttpRequest`` as
    Django's origin check reads: the headers in ``META``, the server address, the scheme
    (``ws`` → ``http``, ``wss`` → ``https``)."""

    def __init__(self, scope: Mapping[str, Any]) -> None:
        super().__init__()
        self._scope_scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
        server = scope.get("server") or ("unknown", "0")  # as django.core.handlers.asgi
        self.META["SERVER_NAME"] = str(server[0])
        self.META["SERVER_PORT"] = str(server[1] if server[1] is not None else "0")
        for raw_name, raw_value in scope.get("headers", ()):
            name = "HTTP_" + raw_name.decode("latin-1").upper().replace("-", "_")
            value = raw_value.decode("latin-1")
            self.META[name] = f"{self.META[name]},{value}" if name in self.META else value

    def _get_scheme(self) -> str:
        return self._scope_scheme


def websocket_origin_allowed(scope: Mapping[str, Any]) -> bool:
    """Whether a cookie-authenticated websocket's ``Origin`` is the site's own
    (docs/ws-protocol.md#authentication), decided exactly as Django's CSRF check decides it
    for a REST request: scheme, host **and port** of ``Origin`` equal the request's own
    origin (``ws``→``http``, ``wss``→``https``; its ``Host`` valid under
    ``ALLOWED_HOSTS``, port included in the comparison), or ``Origin`` is one of
    ``CSRF_TRUSTED_ORIGINS`` (wildcard subdomains as Django allows them).

    ``scope``: the ASGI websocket scope. A missing ``Origin`` (or ``null``) is refused:
    browsers always send one on a websocket upgrade, and programs authenticate by token.
    """
    request = _UpgradeRequest(scope)
    origin = request.META.get("HTTP_ORIGIN", "")
    if not origin or origin == "null":
        return False
    # Django's own origin comparison (django.middleware.csrf), so /ws and REST agree.
    csrf: Any = CsrfViewMiddleware(_unused_response)
    return bool(csrf._origin_verified(request))


def _unused_response(request: HttpRequest) -> HttpResponse:
    return HttpResponse()
