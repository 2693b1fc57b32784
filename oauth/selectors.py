"""Reads of the OAuth app (docs/mcp.md#oauth-connected-applications): a user's connected
applications, what the settings page shows, and the registered clients nobody used
(docs/mcp.md#oauth-clients).

A *connection* is a (user, application) pair with at least one access token row: access
tokens are deleted when revoked, and an expired one stays until its refresh token is used
(rotation replaces it) or ``cleartokens`` runs, so a row means the application can still act,
now or after a refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Exists, Min, OuterRef
from django.utils import timezone
from oauth2_provider.models import (
    get_access_token_model,
    get_application_model,
    get_grant_model,
    get_refresh_token_model,
)
from oauth2_provider.settings import oauth2_settings

from oauth.models import OAuthPolicy
from oauth.scopes import ALL, NARROW

CONNECTIONS_SHOWN = 500  # admin table: at most this many rows (most recently used first)


@dataclass
class Connection:
    """One user's connection to one application: ``scopes`` the union of its live access
    tokens' scopes (in the consent page's order), ``connected_at`` the oldest of those tokens
    and of the refresh tokens of their families (the first sign-in of the session, which
    rotation does not hide), ``last_used_at`` the newest token ``updated`` (``oauth.resource``
    writes it on use, at most once a minute)."""

    user: User
    application: Any
    scopes: list[str] = field(default_factory=list)
    connected_at: datetime | None = None
    last_used_at: datetime | None = None

    @property
    def redirect_hosts(self) -> list[str]:
        """Where the application's sign-ins return: the hosts of its redirect URIs (with the
        port for a non-loopback one, a custom scheme as ``scheme:``), what tells two
        applications of one name apart."""
        hosts: list[str] = []
        for uri in str(self.application.redirect_uris or "").split():
            try:
                parts = urlsplit(uri)
                port = parts.port
            except ValueError:  # registered before such URIs were refused
                continue
            host = parts.hostname or f"{parts.scheme}:"
            if parts.hostname and ":" in parts.hostname:
                host = f"[{host}]"  # IPv6
            if port and host not in ("127.0.0.1", "localhost", "[::1]"):
                host = f"{host}:{port}"
            if host not in hosts:
                hosts.append(host)
        return hosts

    @property
    def source_label(self) -> str:
        Application = get_application_model()
        return {
            Application.RegistrationSource.DCR: "registered itself (DCR)",
            Application.RegistrationSource.CIMD: "metadata document",
            Application.RegistrationSource.MANUAL: "registered by an admin",
        }.get(self.application.registration_source, str(self.application.registration_source))


def connections(*, user: User | None, excluding: User | None = None) -> list[Connection]:
    """The connections of ``user`` (``None``: every user's but ``excluding``'s — for admins
    only), most recently used first; at most ``CONNECTIONS_SHOWN``."""
    AccessToken = get_access_token_model()
    tokens = AccessToken.objects.filter(application__isnull=False, user__isnull=False).select_related(
        "application", "user"
    )
    if user is not None:
        tokens = tokens.filter(user=user)
    if excluding is not None:
        tokens = tokens.exclude(user=excluding)
    by_pair: dict[tuple[int, int], Connection] = {}
    scope_sets: dict[tuple[int, int], set[str]] = {}
    for token in tokens.order_by("-updated")[: CONNECTIONS_SHOWN * 10]:
        key = (token.user_id, token.application_id)
        found = by_pair.get(key)
        if found is None:
            found = by_pair[key] = Connection(user=token.user, application=token.application)
            scope_sets[key] = set()
        scope_sets[key].update(token.scope.split())
        found.connected_at = min(filter(None, [found.connected_at, token.created]))
        found.last_used_at = max(filter(None, [found.last_used_at, token.updated]))
    families = (
        get_refresh_token_model()
        .objects.filter(access_token__in=tokens)
        .values("token_family")
        .exclude(token_family__isnull=True)
    )
    firsts = (
        get_refresh_token_model()
        .objects.filter(token_family__in=families)
        .values("user_id", "application_id")
        .annotate(first=Min("created"))
    )
    for row in firsts:
        found = by_pair.get((row["user_id"], row["application_id"]))
        if found is not None and found.connected_at is not None:
            found.connected_at = min(found.connected_at, row["first"])
    order = (ALL, *NARROW)
    for key, found in by_pair.items():
        found.scopes = sorted(scope_sets[key], key=lambda scope: order.index(scope) if scope in order else len(order))
    result = sorted(by_pair.values(), key=lambda found: found.last_used_at or timezone.now(), reverse=True)
    return result[:CONNECTIONS_SHOWN]


def settings_context(*, user: User) -> dict[str, Any]:
    """What the settings page's OAuth section shows ``user``: ``connections``; for staff also
    ``other_connections`` (every other user's) and ``policy``."""
    context: dict[str, Any] = {"connections": connections(user=user), "is_admin": user.is_staff}
    if user.is_staff:
        context["other_connections"] = connections(user=None, excluding=user)
        context["policy"] = OAuthPolicy.current()
    return context


def registered_clients() -> Any:
    """The applications registered by DCR or known from a metadata document: what
    ``DISPATCH_OAUTH_DCR_MAX_CLIENTS`` caps."""
    Application = get_application_model()
    sources = [Application.RegistrationSource.DCR, Application.RegistrationSource.CIMD]
    return Application.objects.filter(registration_source__in=sources)


def unused_registered_clients(now: Any = None) -> Any:
    """The applications registered by DCR or known from a metadata document, older than
    ``DISPATCH_OAUTH_DCR_UNUSED_SECONDS``, that never got a grant or a token: what a stranger
    registered or named and walked away from. The RFC 7592
    registration access token every registration gets is an access token row too, so it does
    not count as use."""
    now = now or timezone.now()
    Application = get_application_model()
    cutoff = now - timedelta(seconds=settings.OAUTH_DCR_UNUSED_SECONDS)
    issued = get_access_token_model().objects.filter(application=OuterRef("pk"))
    return (
        Application.objects.filter(
            registration_source__in=[Application.RegistrationSource.DCR, Application.RegistrationSource.CIMD],
            created__lt=cutoff,
        )
        .exclude(Exists(get_grant_model().objects.filter(application=OuterRef("pk"))))
        .exclude(Exists(issued.exclude(scope=oauth2_settings.DCR_REGISTRATION_SCOPE)))
        .exclude(Exists(get_refresh_token_model().objects.filter(application=OuterRef("pk"))))
    )
