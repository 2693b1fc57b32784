"""Ending live connections whose credential ended (docs/ws-protocol.md#authentication,
docs/mcp.md#tool-list-changes).

A websocket or an event stream is authenticated once, when it opens. Revoking or expiring
the API token it opened with, deactivating its user, or ending the Django session of a
cookie login (logout, a password change — ``EndSessionsOnPasswordChange``) must close it
within seconds, whichever process holds it. The state is in rows: every connection row
records its credential (``WsSession.api_token`` / ``session_key``,
``MachineConnection.api_token`` / ``machine_token``), and each process sweeps **its own**
rows every ``SWEEP_INTERVAL`` seconds (``dispatch.background.revocation_loop``, started by ``serve`` beside
the heartbeat). A sweep is one indexed query (``ended_connection_channels``: the rows of
this process, by ``server_process``, joined to their credential by primary key); each
channel it finds gets ``credential.ended`` (``core.protocol.CredentialEndedMessage``) and
its consumer closes with 4401 (``DispatchConsumer.credential_ended``; the remotes a
``/ws`` session served go by its normal close path). The services that revoke ring
``DOORBELL_GROUP`` after commit so the sweep runs at once; the doorbell is only a
doorbell (the layer is at-most-once) — the periodic sweep is the guarantee.

Server-sent-event streams (``/api/v1/events``, ``/api/v1/peers/events``) have no rows:
they register here while open (``stream_opened``/``stream_closed``), and the same sweep
checks their credentials with one more query, only while this process streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import CharField, Exists, OuterRef, Q, QuerySet, Value
from django.db.models.functions import Cast, Concat
from django.utils import timezone

from core import credential_cache
from core.models import ApiToken
from core.presence import current_process_id
from core.protocol import CredentialEndedMessage, CredentialsRingMessage
from core.realtime import layer_send, ring_on_commit

logger = logging.getLogger(__name__)

DOORBELL_GROUP = "dispatch.credentials"
"""Rung after commit by the services that revoke; every process's sweep listens."""
SWEEP_INTERVAL = 2.0  # seconds between two sweeps of a process (the guarantee, doorbell or not)
RETELL_AFTER = 10.0  # seconds before a channel told once is told again (its close may be slow)
MAX_BACKOFF = 30.0  # seconds: the longest pause after repeated sweep failures (``background.revocation_loop``)

_DB_SESSIONS = ("django.contrib.sessions.backends.db", "django.contrib.sessions.backends.cached_db")


@dataclass(frozen=True)
class StreamCredential:
    """What an event stream was opened with: its user, and the API token (``api_token_id``)
    or the agent token (``agent_token_id``) or the Django session (``session_key``) or the
    peer link (``peer_id``) it stands on."""

    user_id: int | None = None
    api_token_id: int | None = None
    session_key: str = ""
    peer_id: int | None = None
    agent_token_id: int | None = None


_streams: dict[str, StreamCredential] = {}  # channel name → credential, this process's open streams
_told: dict[str, float] = {}  # channel name → when it was last told (monotonic seconds)


# --- what the apps register (in their ``AppConfig.ready``) -----------------------------------
# The kernel sweeps rows and credentials it does not know: each app that keeps connection
# rows or credentials registers how to find the ended ones (docs/architecture.md).

EndedConnections = Callable[[str, Any, "Exists | None"], "QuerySet[Any]"]
"""``(process_id, now, session_alive) → values_list("channel_name")`` of that process's
connection rows whose credential ended; ``session_alive`` is the ``EXISTS`` of a live Django
session for the row's ``session_key`` (``None`` when sessions are not in the database)."""

LiveCredentials = Callable[[set[int], Any], "QuerySet[Any]"]
"""``(ids, now) → queryset`` of the rows among ``ids`` that are still live credentials."""

CookieSessionKeys = Callable[[list[int]], "QuerySet[Any]"]
"""``user_ids → values("session_key")`` of the Django sessions the users' cookie sockets stand on."""

_ended_connections: list[EndedConnections] = []
_live_credentials: dict[str, tuple[str, LiveCredentials]] = {}
_cookie_session_keys: list[CookieSessionKeys] = []


def ended_connections_register(finder: EndedConnections) -> None:
    """Sweep the connection rows ``finder`` finds (idempotent)."""
    if finder not in _ended_connections:
        _ended_connections.append(finder)


def live_credentials_register(key: str, attribute: str, finder: LiveCredentials) -> None:
    """Check the ``StreamCredential`` field ``attribute`` of each open stream against the
    live rows ``finder`` lists (``key``: a short tag, unique per credential kind)."""
    _live_credentials[key] = (attribute, finder)


def cookie_session_keys_register(finder: CookieSessionKeys) -> None:
    """End the Django sessions ``finder`` lists when their user's password changes."""
    if finder not in _cookie_session_keys:
        _cookie_session_keys.append(finder)


# --- rows ----------------------------------------------------------------------------------


def token_ended(prefix: str, now: Any) -> Q:
    """``Q`` of a token (reached by ``prefix``, e.g. ``"api_token__"``) revoked or expired at ``now``."""
    return Q(**{f"{prefix}revoked_at__isnull": False}) | Q(**{f"{prefix}expires_at__lte": now})


def _session_alive(now: Any) -> Exists | None:
    """``EXISTS`` a live Django session row for ``session_key`` (``None`` when sessions are
    not kept in the database: cookie sockets are then only closed with their user)."""
    if settings.SESSION_ENGINE not in _DB_SESSIONS:
        return None
    from django.contrib.sessions.models import Session

    return Exists(Session.objects.filter(session_key=OuterRef("session_key"), expire_date__gt=now))


def ended_connection_channels(*, process_id: str | None = None) -> list[str]:
    """The channel names of this process's connection rows whose credential ended.

    One query: the union of what each registered finder lists (``/ws`` sessions: header or
    token logins whose ``ApiToken`` is revoked, expired or deleted, cookie logins whose
    Django session is gone or expired; machine connections: machine token revoked, API
    token revoked or expired; and, for both, an inactive user) — each filtered by
    ``server_process`` (indexed) and joined by primary keys. ``process_id`` defaults to
    this process.
    """
    if not _ended_connections:
        return []
    now = timezone.now()
    process_id = process_id or current_process_id()
    alive = _session_alive(now)
    first, *rest = [finder(process_id, now, alive) for finder in _ended_connections]
    return [channel for (channel,) in first.union(*rest)]


# --- event streams -------------------------------------------------------------------------


def stream_opened(channel_name: str, credential: StreamCredential) -> None:
    """Register an open event stream of this process (its channel gets ``CredentialEndedMessage``)."""
    _streams[channel_name] = credential


def stream_closed(channel_name: str) -> None:
    """Forget a stream registered with ``stream_opened`` (idempotent)."""
    _streams.pop(channel_name, None)
    _told.pop(channel_name, None)


def _keyed(queryset: QuerySet[Any], prefix: str, field: str) -> QuerySet[Any]:
    # No ORDER BY in the parts of a UNION (SQLite refuses it; ApiToken has a default ordering).
    keyed = queryset.order_by().annotate(ended_key=Concat(Value(prefix), Cast(field, CharField())))
    return keyed.values_list("ended_key")


def ended_stream_channels(streams: dict[str, StreamCredential]) -> list[str]:
    """The channels of ``streams`` whose credential ended: a revoked, expired or deleted
    token, a revoked agent token or a stopped agent, an inactive user, a gone or expired
    Django session, a revoked or deleted peer link. One query (a union of primary-key lookups) for all of them."""
    if not streams:
        return []
    now = timezone.now()
    token_ids = {c.api_token_id for c in streams.values() if c.api_token_id is not None}
    user_ids = {c.user_id for c in streams.values() if c.user_id is not None}
    session_keys = {c.session_key for c in streams.values() if c.session_key}
    # Live credentials are listed, so a deleted row counts as ended too.
    parts = [
        _keyed(
            ApiToken.objects.filter(pk__in=token_ids, revoked_at__isnull=True, user__is_active=True).exclude(
                expires_at__lte=now
            ),
            "t:",
            "pk",
        ),
        _keyed(User.objects.filter(pk__in=user_ids, is_active=True), "u:", "pk"),
    ]
    for key, (attribute, finder) in _live_credentials.items():
        ids = {getattr(c, attribute) for c in streams.values() if getattr(c, attribute) is not None}
        parts.append(_keyed(finder(ids, now), f"{key}:", "pk"))
    if settings.SESSION_ENGINE in _DB_SESSIONS:
        from django.contrib.sessions.models import Session

        parts.append(_keyed(Session.objects.filter(pk__in=session_keys, expire_date__gt=now), "s:", "pk"))
    first, *rest = parts
    live = {key for (key,) in first.union(*rest, all=True)}
    ended = []
    for channel, credential in streams.items():
        needed = [f"u:{credential.user_id}"] if credential.user_id is not None else []
        if credential.api_token_id is not None:
            needed.append(f"t:{credential.api_token_id}")
        for key, (attribute, _finder) in _live_credentials.items():
            value = getattr(credential, attribute)
            if value is not None:
                needed.append(f"{key}:{value}")
        if credential.session_key and settings.SESSION_ENGINE in _DB_SESSIONS:
            needed.append(f"s:{credential.session_key}")
        if not all(key in live for key in needed):
            ended.append(channel)
    return ended


# --- the sweep -----------------------------------------------------------------------------


def _ended_channels(streams: dict[str, StreamCredential]) -> list[str]:
    return ended_connection_channels() + ended_stream_channels(streams)


async def revocation_sweep_once() -> int:
    """Find this process's connections and streams whose credential ended and send each
    ``CredentialEndedMessage`` (again after ``RETELL_AFTER`` seconds if it is still there).
    Returns how many were told. Raises what the database or the layer raises."""
    credential_cache.clear()  # the bearer tokens this process looked up are looked up again
    streams = dict(_streams)
    channels = await sync_to_async(_ended_channels, thread_sensitive=True)(streams)
    now = time.monotonic()
    for channel in list(_told):
        if channel not in channels:
            del _told[channel]
    told = 0
    for channel in channels:
        if now - _told.get(channel, -RETELL_AFTER) < RETELL_AFTER:
            continue
        _told[channel] = now
        try:
            await layer_send(channel, CredentialEndedMessage())
            told += 1
        except Exception:  # one full channel must not keep the others open
            logger.warning("could not tell %s that its credential ended", channel, exc_info=True)
    if told:
        logger.info("closing %d connection(s) whose credential ended", told)
    return told


# --- the doorbell ----------------------------------------------------------------------------


def credentials_ended_on_commit() -> None:
    """Ring every process's sweep once the current transaction commits (sync code: the
    services that revoke a token, deactivate a user or end sessions). A failure to ring is
    logged, never raised: the periodic sweep still runs within ``SWEEP_INTERVAL``
    (``core.realtime.ring_on_commit``). This process's cached bearer lookups are dropped now
    and on commit (``core.credential_cache``)."""
    credential_cache.clear()
    transaction.on_commit(credential_cache.clear)  # a lookup meanwhile, by another thread, saw it valid
    ring_on_commit(DOORBELL_GROUP, CredentialsRingMessage())


def sessions_end_for(user_ids: Iterable[int]) -> None:
    """End the Django sessions that this instance's cookie websockets of ``user_ids`` stand
    on (their rows hold the keys), and ring the sweep. Called when a password changes."""
    if settings.SESSION_ENGINE not in _DB_SESSIONS:
        return
    from django.contrib.sessions.models import Session

    users = list(user_ids)
    for finder in _cookie_session_keys:
        Session.objects.filter(session_key__in=finder(users)).delete()
    credentials_ended_on_commit()


class EndSessionsOnPasswordChange:
    """A password validator whose only job is Django's ``password_changed`` hook: a new
    password ends the Django sessions behind the user's open cookie websockets, so they
    close (Django itself only refuses those sessions at their next HTTP request). Listed
    in ``AUTH_PASSWORD_VALIDATORS``; validates nothing."""

    def validate(self, password: str, user: Any = None) -> None:
        return None

    def password_changed(self, password: str, user: Any = None) -> None:
        if user is not None and getattr(user, "pk", None) is not None:
            sessions_end_for([user.pk])

    def get_help_text(self) -> str:
        return ""
