"""The OAuth parts of ``/settings/`` (docs/mcp.md#oauth-connected-applications): the
applications a user connected to ``/mcp/oauth``, their revocation, and, for admins, every
user's connections and the ``OAuthPolicy`` switches (docs/mcp.md#oauth-admin).

A *connection* is a (user, application) pair with at least one access token row: access
tokens are deleted when revoked, and an expired one stays until its refresh token is used
(rotation replaces it) or ``cleartokens`` runs, so a row means the application can still act,
now or after a refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Min
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_POST
from oauth2_provider.models import (
    get_access_token_model,
    get_application_model,
    get_grant_model,
    get_refresh_token_model,
)

from core.authentication import authenticated_user
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
    def source_label(self) -> str:
        Application = get_application_model()
        return {
            Application.RegistrationSource.DCR: "registered itself (DCR)",
            Application.RegistrationSource.CIMD: "metadata document",
            Application.RegistrationSource.MANUAL: "registered by an admin",
        }.get(self.application.registration_source, str(self.application.registration_source))


def connections(*, user: User | None) -> list[Connection]:
    """The connections of ``user`` (``None``: every user's — for admins only), most recently
    used first; at most ``CONNECTIONS_SHOWN``."""
    AccessToken = get_access_token_model()
    tokens = AccessToken.objects.filter(application__isnull=False, user__isnull=False).select_related(
        "application", "user"
    )
    if user is not None:
        tokens = tokens.filter(user=user)
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


@transaction.atomic
def connection_revoke(*, user: User, application_id: int) -> int:
    """Disconnect ``application_id`` from ``user``: revoke every live refresh token
    (RFC 7009 §2.1: revoking one revokes its access token), delete every access token left, and every
    pending authorization code. Open ``/mcp/oauth`` streams of those tokens end: their
    ``McpStream`` rows go with the tokens (``on_delete=CASCADE``) and each process's
    watchdog closes a stream whose row is gone. Returns how many access tokens were revoked."""
    AccessToken = get_access_token_model()
    RefreshToken = get_refresh_token_model()
    access_tokens = AccessToken.objects.filter(user=user, application_id=application_id)
    revoked = access_tokens.count()
    for refresh_token in RefreshToken.objects.filter(user=user, application_id=application_id, revoked__isnull=True):
        refresh_token.revoke()
    for access_token in access_tokens:
        access_token.revoke()
    get_grant_model().objects.filter(user=user, application_id=application_id).delete()
    return revoked


@transaction.atomic
def policy_update(*, actor: User, dcr_enabled: bool, cimd_enabled: bool, cimd_private_addresses: bool) -> OAuthPolicy:
    """Save the admin's OAuth switches (``OAuthPolicy``, read per request by registration and
    the metadata view); ``actor`` must be staff, else ``PermissionDenied``."""
    if not actor.is_staff:
        raise PermissionDenied("only admins change the OAuth policy")
    policy = OAuthPolicy.current()
    policy.dcr_enabled = dcr_enabled
    policy.cimd_enabled = cimd_enabled
    policy.cimd_private_addresses = cimd_private_addresses
    policy.updated_by = actor
    policy.updated_at = timezone.now()
    policy.save()
    return policy


def settings_context(*, user: User) -> dict[str, Any]:
    """What the settings page's OAuth section shows ``user``: ``connections``; for staff also
    ``all_connections`` and ``policy``."""
    context: dict[str, Any] = {"connections": connections(user=user), "is_admin": user.is_staff}
    if user.is_staff:
        context["all_connections"] = connections(user=None)
        context["policy"] = OAuthPolicy.current()
    return context


# --- views ---------------------------------------------------------------------------------


@require_POST
def connection_revoke_view(request: HttpRequest, application_id: int, user_id: int | None = None) -> HttpResponse:
    """``POST /settings/oauth/<application_id>/revoke/``: disconnect one of your applications;
    ``…/users/<user_id>/<application_id>/revoke/``: an admin disconnects another user's (403
    for anyone else)."""
    actor = authenticated_user(request)
    target = actor
    if user_id is not None and user_id != actor.pk:
        if not actor.is_staff:
            raise PermissionDenied("only admins revoke other users' applications")
        found = User.objects.filter(pk=user_id).first()
        if found is None:
            messages.error(request, "No such user.")
            return redirect("settings")
        target = found
    application = get_application_model().objects.filter(pk=application_id).first()
    name = (application.name if application else "") or "the application"
    revoked = connection_revoke(user=target, application_id=application_id)
    if revoked or application is not None:
        whose = "" if target == actor else f" for {target.get_username()}"
        messages.success(request, f"Disconnected {name}{whose}: its access is revoked.")
    else:
        messages.error(request, "No such application.")
    return redirect("settings")


@require_POST
def policy_view(request: HttpRequest) -> HttpResponse:
    """``POST /settings/oauth/policy/``: save the switches (checkboxes ``dcr_enabled``,
    ``cimd_enabled``, ``cimd_private_addresses``; absent means off). Staff only: 403 otherwise."""
    policy_update(
        actor=authenticated_user(request),
        dcr_enabled="dcr_enabled" in request.POST,
        cimd_enabled="cimd_enabled" in request.POST,
        cimd_private_addresses="cimd_private_addresses" in request.POST,
    )
    messages.success(request, "OAuth policy saved.")
    return redirect("settings")
