"""``/mcp/oauth`` as an OAuth protected resource (docs/mcp.md#oauth; RFC 6750, RFC 9728).

``oauth_bearer`` checks a bearer token with django-oauth-toolkit's own validator
(``validate_bearer_token``: the token's checksum looked up, its expiry, its application,
its audience against ``settings.MCP_OAUTH_RESOURCE``) and answers who is calling and what
it may do. ``challenge`` is the ``WWW-Authenticate`` value of a 401: it points clients at the
resource's metadata (RFC 9728 §5.1) and names the scope to ask for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone
from oauth2_provider.models import get_access_token_model
from oauth2_provider.www_authenticate import build_bearer_challenge
from oauthlib.common import Request

from core.errors import DispatchError
from oauth.scopes import ALL
from oauth.validators import DispatchOAuth2Validator

WELL_KNOWN_RESOURCE = "/.well-known/oauth-protected-resource"
LAST_USE_EVERY = 60.0  # seconds: a token's last use is written at most this often (one UPDATE)

_last_written: dict[int, float] = {}  # access token id → when its last use was written (monotonic)


@dataclass(frozen=True)
class OAuthBearer:
    """A valid OAuth access token: its user, its scopes (space-separated in the row), its
    row id (what stream rows and revocation follow), its application's id and (claimed,
    unverified) name."""

    user: User
    scopes: frozenset[str]
    token_id: int
    application_id: int | None
    application_name: str = ""


def metadata_url() -> str:
    """The URL of ``/mcp/oauth``'s protected resource metadata: the RFC 9728 §3.1
    path-suffixed well-known URL at the public origin."""
    return settings.PUBLIC_URL + WELL_KNOWN_RESOURCE + settings.MCP_OAUTH_PATH


def challenge(error: str | None = None, description: str | None = None) -> str:
    """``WWW-Authenticate`` for a 401 of ``/mcp/oauth``: ``Bearer error="…",
    error_description="…", resource_metadata="…", scope="mcp"`` (``error`` only for a token
    that was sent: RFC 6750 §3.1)."""
    details = {"error": error, "error_description": description} if error else {}
    details = {key: value for key, value in details.items() if value}
    value = build_bearer_challenge(None, oauth2_error=details, resource_metadata_url=metadata_url())
    return f'{value},scope="{ALL}"'


def oauth_bearer(raw_token: str) -> OAuthBearer:
    """The caller of an OAuth access token presented to ``/mcp/oauth`` (sync: database).

    Raises ``DispatchError`` ``AUTHENTICATION_FAILED`` (401) for a token that is unknown,
    revoked, expired, issued for another resource, of an inactive user, or not bound to any
    resource.
    """
    request = Request(settings.MCP_OAUTH_RESOURCE)
    validator = DispatchOAuth2Validator()
    if not validator.validate_bearer_token(raw_token, [], request):
        raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token, or one for another resource")
    token = request.access_token
    user = token.user
    if not token.resource or user is None or not user.is_active:
        raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token, or one for another resource")
    _note_use(int(token.pk))
    application = token.application
    return OAuthBearer(
        user=user,
        scopes=frozenset(token.scopes),
        token_id=int(token.pk),
        application_id=token.application_id,
        application_name=str(application.name) if application is not None else "",
    )


def _note_use(token_id: int) -> None:
    """Write the token's last use (``updated``, shown on the connected applications page)
    at most every ``LAST_USE_EVERY`` seconds per token and process."""
    now = time.monotonic()
    if now - _last_written.get(token_id, -LAST_USE_EVERY) < LAST_USE_EVERY:
        return
    if len(_last_written) > 10_000:  # tokens come and go: keep the memo bounded
        _last_written.clear()
    _last_written[token_id] = now
    get_access_token_model().objects.filter(pk=token_id).update(updated=timezone.now())
