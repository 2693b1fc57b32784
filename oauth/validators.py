"""django-oauth-toolkit's validator, bound to Dispatch's one protected resource
(docs/mcp.md#oauth).

RFC 8707: a token is for the resource its client named. Dispatch has one OAuth resource,
``/mcp/oauth`` at the public URL (``settings.MCP_OAUTH_RESOURCE``): a token request naming
nothing gets that resource (so no token is ever unrestricted), and one naming anything
else is refused ``invalid_target`` before a token exists. ``/mcp`` and the REST API never
accept these tokens at all (they look up API and agent tokens only).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.utils import timezone
from oauth2_provider import cimd
from oauth2_provider.models import get_application_model, get_refresh_token_model
from oauth2_provider.oauth2_validators import OAuth2Validator
from oauth2_provider.settings import oauth2_settings
from oauthlib.common import generate_token
from oauthlib.oauth2.rfc6749 import errors

from oauth.models import UsedCode
from oauth.services import registered_client_over_cap, registered_client_undo

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset(["localhost", "127.0.0.1", "::1"])


_refused_family: ContextVar[Any] = ContextVar("dispatch_oauth_refused_family", default=None)


@contextmanager
def family_refused() -> Iterator[None]:
    """Around a token request: revoke the token family ``_third_use_refused`` refused, after the
    request's transaction rolled back (a revocation inside it would roll back too)."""
    marker = _refused_family.set(None)
    try:
        yield
    finally:
        family = _refused_family.get()
        _refused_family.reset(marker)
        if family is not None:
            get_refresh_token_model().revoke_family(family)


def redirect_uri_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be a redirect URI, or ``None`` (docs/mcp.md#oauth-clients): an
    absolute https URI; http on a loopback host, any port (RFC 8252 §7.3); or a native app's
    private-use scheme named in ``settings.OAUTH_PRIVATE_USE_SCHEMES`` (RFC 8252 §7.1, e.g.
    Cursor's ``cursor://anysphere.cursor-mcp/oauth/callback``). Never a fragment
    (RFC 6749 §3.1.2), never ``javascript:``, ``data:`` or another web scheme."""
    if any(char == "\\" or char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in uri):
        # Browsers read "https://a.example\\@b.example/" as a.example, Python as b.example.
        return f"redirect URI {uri[:200]!r} holds a backslash, a space or a control character"
    try:
        parts = urlsplit(uri)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:
        return f"redirect URI {uri[:200]!r} is not a URI"
    if "@" in parts.netloc:
        return f"redirect URI {uri[:200]!r} names a user (userinfo): the host a reader sees is not where it goes"
    if parts.fragment or "#" in uri:
        return f"redirect URI {uri[:200]!r} has a fragment"
    if parts.scheme == "https" and host:
        return None
    if parts.scheme == "http" and host in LOOPBACK_HOSTS:
        return None
    if parts.scheme in settings.OAUTH_PRIVATE_USE_SCHEMES and (host or parts.path):
        return None
    return (
        f"redirect URI {uri[:200]!r} must be https, http on a loopback address (127.0.0.1, [::1], localhost), "
        f"or a native app's scheme ({', '.join(settings.OAUTH_PRIVATE_USE_SCHEMES)})"
    )


def has_nul(value: Any, depth: int = 0) -> bool:
    """Whether a string in ``value`` (a JSON value; depth-capped) holds a NUL: PostgreSQL's
    text columns refuse one with an error, so a lookup or an insert with it would be a 500
    (SQLite takes it)."""
    if isinstance(value, str):
        return "\x00" in value
    if depth > 64:
        return False
    if isinstance(value, dict):
        return any(has_nul(key, depth + 1) or has_nul(item, depth + 1) for key, item in value.items())
    if isinstance(value, list):
        return any(has_nul(item, depth + 1) for item in value)
    return False


def resources() -> frozenset[str]:
    """The resource identifiers this authorization server issues tokens for."""
    return frozenset([settings.MCP_OAUTH_RESOURCE])


class DispatchOAuth2Validator(OAuth2Validator):
    """``OAuth2Validator`` whose tokens are always bound to a Dispatch resource."""

    def _check_and_set_request_resource(self, request: Any) -> None:
        super()._check_and_set_request_resource(request)
        if not request.resource:
            request.resource = [settings.MCP_OAUTH_RESOURCE]
        unknown = [resource for resource in request.resource if resource not in resources()]
        if unknown:
            raise errors.CustomOAuth2Error(
                error="invalid_target",
                description=f"unknown resource {unknown[0][:200]!r}: this server issues tokens for "
                f"{settings.MCP_OAUTH_RESOURCE} only",
                request=request,
            )

    def _load_application(self, client_id: str, request: Any) -> Any:
        """The library's lookup, which stores a metadata-document client on first sight; one
        stored past ``DISPATCH_OAUTH_DCR_MAX_CLIENTS`` (the look before its fetch found room,
        and others filled it meanwhile) is deleted again, and the client is unknown."""
        if has_nul(client_id):
            return None  # no client is named so; PostgreSQL would refuse the lookup
        first_sight = cimd.is_cimd_client_id(client_id) and not (
            get_application_model().objects.filter(client_id=client_id).exists()
        )
        client = super()._load_application(client_id, request)
        if client is not None and first_sight and registered_client_over_cap():
            logger.warning("CIMD client %r refused: the cap on registered clients is reached", client_id[:200])
            registered_client_undo(client_id)
            request.client = None
            return None
        return client

    def validate_redirect_uri(self, client_id: str, redirect_uri: str, request: Any, *args: Any, **kwargs: Any) -> bool:
        """The library's exact-match check (loopback: any port), and whatever registered the
        client (an admin, DCR, a metadata document), only https or a loopback address."""
        if redirect_uri_problem(redirect_uri) is not None:
            return False
        return bool(super().validate_redirect_uri(client_id, redirect_uri, request, *args, **kwargs))

    def _create_refresh_token(self, request: Any, refresh_token_code: str, access_token: Any, previous: Any) -> Any:
        refresh_token = super()._create_refresh_token(request, refresh_token_code, access_token, previous)
        request.dispatch_token_family = refresh_token.token_family  # what invalidate_authorization_code records
        return refresh_token

    def invalidate_authorization_code(self, client_id: str, code: str, request: Any, *args: Any, **kwargs: Any) -> None:
        """The library deletes the code; its checksum is kept with the token family it
        started (``UsedCode``), so that a replay can revoke that family (``validate_code``)."""
        super().invalidate_authorization_code(client_id, code, request, *args, **kwargs)
        UsedCode.objects.create(
            code_checksum=hashlib.sha256(code.encode("utf-8")).hexdigest(),
            application=request.client,
            token_family=getattr(request, "dispatch_token_family", None),
        )

    def validate_code(self, client_id: str, code: str, client: Any, request: Any, *args: Any, **kwargs: Any) -> bool:
        """The library's check; a code already exchanged (RFC 6749 §4.1.2: the server SHOULD
        revoke the tokens it issued) revokes the family its first use started, and is refused."""
        if has_nul(code):
            return False
        if super().validate_code(client_id, code, client, request, *args, **kwargs):
            return True
        checksum = hashlib.sha256(code.encode("utf-8")).hexdigest()
        for used in UsedCode.objects.filter(code_checksum=checksum, application=client).exclude(token_family=None):
            get_refresh_token_model().revoke_family(used.token_family)
        return False

    def validate_refresh_token(self, refresh_token: str, client: Any, request: Any, *args: Any, **kwargs: Any) -> bool:
        """The library's check, and one bound on its grace window: a refresh token rotated
        away refreshes once more within it (one second pair, ``_sibling_pair``), never twice —
        a third use is taken for theft and revokes the family, as after the window."""
        if has_nul(refresh_token) or not super().validate_refresh_token(
            refresh_token, client, request, *args, **kwargs
        ):
            return False
        presented = request.refresh_token_instance
        if presented.user is None or not presented.user.is_active:
            return False  # a deactivated user's sign-in ends: no new tokens, now or on reactivation
        if presented.revoked is None or presented.token_family is None:
            return True
        RefreshToken = get_refresh_token_model()
        successors = RefreshToken.objects.filter(token_family=presented.token_family, created__gte=presented.revoked)
        if successors.count() >= 2:
            RefreshToken.revoke_family(presented.token_family)
            return False
        return True

    def _save_bearer_token(self, token: dict[str, Any], request: Any, *args: Any, **kwargs: Any) -> None:
        """The library's, and one case it cannot answer with tokens hashed at rest: a refresh
        token presented again within ``REFRESH_TOKEN_GRACE_PERIOD_SECONDS`` of its rotation (a
        client that refreshed twice at once) gets the pair minted the first time — whose raw
        values are no longer known, so the library hands out empty tokens (and its view then
        fails). Such a request gets a new pair of the same family instead: a later replay of
        the old token still revokes them all."""
        presented = getattr(request, "refresh_token_instance", None)
        if request.grant_type == "refresh_token" and presented is not None:
            self._third_use_refused(presented)
        super()._save_bearer_token(token, request, *args, **kwargs)
        if token.get("refresh_token") is not None and not token.get("access_token"):
            self._sibling_pair(token, request)

    def _third_use_refused(self, presented: Any) -> None:
        """Under a lock on the presented refresh token's row (in the library's transaction):
        refreshes sent together all pass ``validate_refresh_token`` before any is saved, and
        come here one at a time. Raises ``InvalidGrantError`` when the token's family was
        revoked meanwhile (a theft detected, the user disconnected it), or when two pairs
        were made from it already: a third use, whose family is revoked once this
        transaction has rolled back (``family_refused``)."""
        RefreshToken = get_refresh_token_model()
        locked = RefreshToken.objects.select_for_update().filter(pk=presented.pk).first()
        if locked is None or locked.revoked is None or locked.token_family is None:
            return
        family = RefreshToken.objects.filter(token_family=locked.token_family)
        if not family.filter(revoked__isnull=True).exists():
            raise errors.InvalidGrantError(description="this sign-in was revoked")
        if family.filter(created__gte=locked.revoked).count() >= 2:
            _refused_family.set(locked.token_family)
            raise errors.InvalidGrantError(description="this refresh token was used already")

    def _sibling_pair(self, token: dict[str, Any], request: Any) -> None:
        """Mint the second pair of a rotated refresh token (``_third_use_refused`` let it)."""
        RefreshToken = get_refresh_token_model()
        presented = (
            RefreshToken.objects.filter(
                token_checksum=hashlib.sha256(str(request.refresh_token).encode("utf-8")).hexdigest()
            )
            .order_by("-revoked")
            .first()
        )
        seconds = token.get("expires_in", oauth2_settings.ACCESS_TOKEN_EXPIRE_SECONDS)
        token["access_token"] = generate_token()
        token["refresh_token"] = generate_token()
        access_token = self._create_access_token(timezone.now() + timedelta(seconds=seconds), request, token)
        self._create_refresh_token(request, token["refresh_token"], access_token, presented)
