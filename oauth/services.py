"""Writes of the OAuth app (docs/mcp.md#oauth-connected-applications, docs/mcp.md#oauth-admin,
docs/mcp.md#oauth-clients): disconnecting an application, the admin's switches, and the
cleanup of registered clients nobody used."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from oauth2_provider.models import (
    get_access_token_model,
    get_application_model,
    get_grant_model,
    get_refresh_token_model,
)

from oauth.models import USED_CODE_SECONDS, OAuthPolicy, UsedCode
from oauth.selectors import registered_clients, unused_registered_clients


@transaction.atomic
def connection_revoke(*, user: User, application_id: int) -> int:
    """Disconnect ``application_id`` from ``user``: revoke every live refresh token
    (RFC 7009 §2.1: revoking one revokes its access token), delete every access token left, and every
    pending authorization code. Open ``/mcp/oauth`` streams of those tokens end: their
    ``McpStream`` rows go with the tokens (``on_delete=CASCADE``) and each process's
    watchdog closes a stream whose row is gone. Returns how many tokens and codes were
    revoked (0: ``user`` had no connection to it)."""
    AccessToken = get_access_token_model()
    RefreshToken = get_refresh_token_model()
    access_tokens = AccessToken.objects.filter(user=user, application_id=application_id)
    revoked = access_tokens.count()
    for refresh_token in RefreshToken.objects.filter(user=user, application_id=application_id, revoked__isnull=True):
        refresh_token.revoke()
        revoked += 1
    for access_token in access_tokens:
        access_token.revoke()
    deleted, _by_model = get_grant_model().objects.filter(user=user, application_id=application_id).delete()
    return revoked + int(deleted)


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


def registered_clients_cleanup() -> int:
    """Delete the unused registered clients (``unused_registered_clients``); returns how many."""
    deleted, _by_model = unused_registered_clients().delete()
    return int(deleted)


def used_codes_expired_delete() -> int:
    """Forget the exchanged codes older than ``USED_CODE_SECONDS`` (a replay after that is
    refused as an unknown code, without the revocation); returns how many went."""
    cutoff = timezone.now() - timedelta(seconds=USED_CODE_SECONDS)
    deleted, _by_model = UsedCode.objects.filter(used_at__lt=cutoff).delete()
    return int(deleted)


def registered_clients_at_cap() -> bool:
    """Whether the registered clients (DCR and metadata documents) fill
    ``DISPATCH_OAUTH_DCR_MAX_CLIENTS`` even after the unused ones are deleted: the first
    look before a registration (``registered_client_over_cap`` decides after the insert)."""
    if registered_clients().count() < settings.OAUTH_DCR_MAX_CLIENTS:
        return False
    registered_clients_cleanup()
    return bool(registered_clients().count() >= settings.OAUTH_DCR_MAX_CLIENTS)


def registered_client_over_cap() -> bool:
    """After a registration's insert: whether the registered clients now exceed
    ``DISPATCH_OAUTH_DCR_MAX_CLIENTS``. The policy row's lock orders the registrations that
    got here together, and the count runs once it is held, so it sees the rows of every
    registration that committed before it (PostgreSQL's read committed; SQLite has one
    writer at a time). Inside a transaction the lock is held to its commit (no hashing or
    network then); outside one the count still follows the caller's committed insert, so
    two racing registrations may both find the cap passed, never both find room."""
    OAuthPolicy.current()
    OAuthPolicy.objects.filter(pk=1).update(updated_at=F("updated_at"))  # the row's write lock
    return registered_clients().count() > settings.OAUTH_DCR_MAX_CLIENTS


def registered_client_undo(client_id: str) -> None:
    """Delete a metadata-document client inserted past the cap (its fetch and insert are
    the library's, outside any transaction of ours)."""
    Application = get_application_model()
    Application.objects.filter(client_id=client_id, registration_source=Application.RegistrationSource.CIMD).delete()
