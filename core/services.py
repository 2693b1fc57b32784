"""Every write of the core app: API tokens, password checks, server-process presence.

Docs: docs/ws-protocol.md#authentication (tokens, password throttling),
docs/deployment.md#what-runs-where (presence).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth import authenticate
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from limits import parse
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from core import wire
from core.errors import DispatchError, NotFound, RateLimited
from core.models import STOPPED_MARKER_SECONDS, ApiToken, InstanceIdentity, ServerProcess
from core.presence import HOSTNAME, PID, current_process_id, local_channel_names, pid_absent, presence_group
from core.protocol import PresencePingMessage, PresencePingReply
from core.realtime import layer_request
from core.revocation import credentials_ended_on_commit

logger = logging.getLogger(__name__)

TOKEN_PREFIX_LENGTH = 8
LAST_USED_RESOLUTION = timedelta(minutes=1)  # last_used_at is written at most once a minute
TOO_MANY_ATTEMPTS = "too many failed attempts; try again later"


class AuthenticationFailed(DispatchError):
    """Unknown user, wrong password, or an unknown/revoked/expired token: one answer for all."""

    def __init__(self) -> None:
        super().__init__("AUTHENTICATION_FAILED", "authentication failed")


# --- API tokens ------------------------------------------------------------------------


def token_digest(raw_token: str) -> str:
    """SHA-256 hex digest of a token, the only form in which tokens are stored (text that
    is not valid UTF-8 digests to a value no token has)."""
    return hashlib.sha256(raw_token.encode("utf-8", "surrogatepass")).hexdigest()


def generate_token() -> str:
    """A new 256-bit secret from ``secrets.token_urlsafe(32)`` (43 characters).

    Tokens starting with ``-`` are drawn again: command lines would read them as options
    (``--token -x…``). That removes 1/64 of the space, under 0.03 bits of 256.
    """
    while True:
        raw = secrets.token_urlsafe(32)
        if not raw.startswith("-"):
            return raw


@dataclass(frozen=True)
class IssuedToken:
    """A freshly created token: ``raw`` is shown once and never stored."""

    token: ApiToken
    raw: str


@transaction.atomic
def api_token_create(*, user: User, name: str = "", expires_at: datetime | None = None) -> IssuedToken:
    """Create an API token for ``user``.

    ``name`` is at most 100 characters (``InvalidRequest`` otherwise); ``expires_at`` is
    optional and must lie in the future. Returns the row and the raw 43-character token
    (256 bits from ``secrets.token_urlsafe(32)``), which is not recoverable later.
    """
    from core.errors import InvalidRequest

    name = name.strip()
    if len(name) > 100:
        raise InvalidRequest("name must be at most 100 characters")
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidRequest("expires_at must be in the future")
    raw = generate_token()
    token = ApiToken.objects.create(
        user=user, name=name, prefix=raw[:TOKEN_PREFIX_LENGTH], digest=token_digest(raw), expires_at=expires_at
    )
    return IssuedToken(token=token, raw=raw)


@transaction.atomic
def api_token_revoke(*, user: User, token_id: int) -> ApiToken:
    """Revoke one of ``user``'s tokens (idempotent). ``NotFound`` for another user's token.

    Live connections opened with it close 4401 (``core.revocation``; its doorbell is
    rung after commit)."""
    token = ApiToken.objects.select_for_update().filter(user=user, pk=token_id).first()
    if token is None:
        raise NotFound(f"no token {token_id}")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        # Sockets and streams opened with it close within seconds, on every process.
        credentials_ended_on_commit()
    return token


def api_token_authenticate(raw_token: str) -> ApiToken:
    """The active token whose digest matches ``raw_token``, with its user loaded.

    Raises ``AuthenticationFailed`` for an unknown, revoked or expired token or an inactive
    user. Touches ``last_used_at`` at most once a minute (a conditional UPDATE).
    """
    if not raw_token or len(raw_token) > 200:
        raise AuthenticationFailed()
    digest = token_digest(raw_token)
    token = ApiToken.objects.select_related("user").filter(digest=digest).first()
    if token is None or not hmac.compare_digest(token.digest, digest):
        raise AuthenticationFailed()
    if not token.is_active or not token.user.is_active:
        raise AuthenticationFailed()
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).exclude(last_used_at__gt=now - LAST_USED_RESOLUTION).update(
            last_used_at=now
        )
        token.last_used_at = now
    return token


# --- passwords -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def rate_limiter() -> MovingWindowRateLimiter:
    """The process's moving-window limiter on the shared storage (Redis when configured).

    Used for counts that must hold across processes: password failures, wrong device
    codes. Keys start with ``DISPATCH_REDIS_PREFIX`` (``<prefix>:limits:…``) so instances
    sharing a Redis differ, and a reset clears this instance's counts only.
    """
    url = settings.RATELIMIT_STORAGE_URL
    if url.startswith(("redis://", "rediss://")):
        from core.channel_layer import sync_redis_pool

        storage = storage_from_string(
            url, connection_pool=sync_redis_pool(url), key_prefix=f"{settings.REDIS_PREFIX}:limits"
        )
        return MovingWindowRateLimiter(storage)
    return MovingWindowRateLimiter(storage_from_string(url))


def _failure_keys(username: str, client_address: str | None) -> list[tuple[str, ...]]:
    keys: list[tuple[str, ...]] = [(settings.REDIS_PREFIX, "password-failures", "user", username.strip().lower())]
    if client_address:
        keys.append((settings.REDIS_PREFIX, "password-failures", "addr", client_address))
    return keys


def password_authenticate(*, username: str, password: str, client_address: str | None) -> User:
    """Check a username and password, throttled (docs/ws-protocol.md#authentication).

    After ``DISPATCH_LOGIN_FAILURE_LIMIT`` (5) failures for one username or from one client
    address within ``DISPATCH_LOGIN_FAILURE_WINDOW`` (600 s) further attempts raise
    ``RateLimited`` without checking the password. A wrong password or unknown user raises
    ``AuthenticationFailed``. Used by ``/ws``, the login page and ``POST /api/v1/auth/token``.
    """
    limit = parse(f"{settings.LOGIN_FAILURE_LIMIT} per {settings.LOGIN_FAILURE_WINDOW} seconds")
    limiter = rate_limiter()
    keys = _failure_keys(username.encode("utf-8", "backslashreplace").decode(), client_address)
    if not all(limiter.test(limit, *key) for key in keys):
        raise RateLimited(TOO_MANY_ATTEMPTS)
    readable = wire.encodable(username) and wire.encodable(password)
    user = authenticate(username=username, password=password) if readable else None
    if user is None:
        for key in keys:
            limiter.hit(limit, *key)
        raise AuthenticationFailed()
    return user


def password_throttle_reset() -> None:
    """Forget every failure this instance recorded in the shared limiter (tests and
    operators); other instances on the same Redis keep theirs."""
    rate_limiter().storage.reset()


# --- instance identity -----------------------------------------------------------------


def instance_identity_get() -> InstanceIdentity:
    """The instance's identity row (created by migration 0001; recreated if deleted)."""
    identity, _ = InstanceIdentity.objects.get_or_create(pk=1)
    return identity


# --- presence --------------------------------------------------------------------------


def server_process_register(*, kind: str) -> ServerProcess:
    """Create or refresh this process's ``ServerProcess`` row and return it."""
    process, _ = ServerProcess.objects.update_or_create(
        id=current_process_id(),
        defaults={"kind": kind, "hostname": HOSTNAME, "pid": PID, "heartbeat_at": timezone.now(), "stopped_at": None},
    )
    return process


def server_process_ensure(*, kind: str = ServerProcess.Kind.SERVE) -> str:
    """Make sure this process has a row (one query when it does); returns its id.

    Connections call this before recording themselves, so a consumer used without
    ``serve`` (tests, a custom ASGI server) still has a process to belong to.
    """
    if not ServerProcess.objects.filter(pk=current_process_id(), stopped_at__isnull=True).exists():
        server_process_register(kind=kind)
    return current_process_id()


def server_process_heartbeat(*, kind: str) -> bool:
    """Stamp this process's heartbeat. Returns False when the row had been reaped.

    A reaped process has lost every connection row: the caller must close its sockets so
    their clients reconnect and register again (the row is recreated here).
    """
    updated = ServerProcess.objects.filter(pk=current_process_id(), stopped_at__isnull=True).update(
        heartbeat_at=timezone.now()
    )
    if updated:
        return True
    logger.warning("this process (%s) was reaped by another process; re-registering", current_process_id())
    server_process_register(kind=kind)
    return False


# Functions called with the ids of server processes about to be deleted (reaped or
# unregistered), in the deleting transaction, before their connection rows go by cascade:
# each app above the core closes its connections of those processes as a clean disconnect
# does (machines: the machine's status; remotes: the owners' tool lists). Registered in the apps' ``AppConfig.ready``.
PROCESSES_GONE_HOOKS: list[Callable[[list[str]], None]] = []


def processes_gone_hook_register(hook: Callable[[list[str]], None]) -> None:
    """Add ``hook`` to ``PROCESSES_GONE_HOOKS`` (idempotent; from an ``AppConfig.ready``)."""
    if hook not in PROCESSES_GONE_HOOKS:
        PROCESSES_GONE_HOOKS.append(hook)


def _processes_gone(process_ids: list[str]) -> None:
    for hook in PROCESSES_GONE_HOOKS:
        hook(process_ids)


@transaction.atomic
def server_process_reap() -> list[str]:
    """Delete every process whose heartbeat is older than ``DISPATCH_PROCESS_TTL``.

    The ``PROCESSES_GONE_HOOKS`` close what each held as a clean disconnect would
    (a machine shows ``disconnected``); deleting a process then cascades to its
    connection rows (ws sessions, remotes, ...), so nothing it held stays visible;
    callers waiting on those connections notice the missing row on their next liveness
    check. Returns the reaped process ids.
    """
    cutoff = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
    # Locked: a process that heartbeats meanwhile waits, and is not half-reaped.
    dead = list(
        ServerProcess.objects.select_for_update()
        .filter(heartbeat_at__lt=cutoff, stopped_at__isnull=True)
        .exclude(pk=current_process_id())
        .values_list("pk", flat=True)
    )
    if dead:
        _processes_gone(dead)
        ServerProcess.objects.filter(pk__in=dead).delete()
        logger.info("reaped dead server processes: %s", ", ".join(dead))
    # Stopped markers (server_process_unregister) past their time hold nothing: they just go.
    ServerProcess.objects.filter(stopped_at__lt=timezone.now() - timedelta(seconds=STOPPED_MARKER_SECONDS)).delete()
    return dead


STOPPED_HEARTBEAT = datetime(2000, 1, 1, tzinfo=UTC)
"""The heartbeat of a stopped marker: older than any cutoff, so no check counts it alive."""


@transaction.atomic
def server_process_unregister(*, process_id: str | None = None, leave_marker: bool = True) -> None:
    """Clean shutdown of this process (or ``process_id``, for tests): close what it held (the
    ``PROCESSES_GONE_HOOKS``), delete its row and by cascade every connection row, and with
    ``leave_marker`` leave a *stopped marker* in their place: the row again, holding
    nothing, with ``stopped_at`` set and ``heartbeat_at`` = ``STOPPED_HEARTBEAT``, for
    ``STOPPED_MARKER_SECONDS``.

    ``leave_marker`` only once the process answered every call it had forwarded (``serve``
    fails them as "server shutting down" and waits for its sockets to close): the marker
    tells a caller whose route still names this process that its unanswered call never ran
    (``remotes.services._serving_state``).
    """
    process_id = process_id or current_process_id()
    _processes_gone([process_id])
    row = ServerProcess.objects.filter(pk=process_id).values("kind", "hostname", "pid", "started_at").first()
    ServerProcess.objects.filter(pk=process_id).delete()
    if row is not None and leave_marker:
        ServerProcess.objects.create(id=process_id, **row, heartbeat_at=STOPPED_HEARTBEAT, stopped_at=timezone.now())


# --- takeover checks (docs/operating.md#a-client-of-a-dead-process-registering-again) ---

PRESENCE_PING_TIMEOUT = 1.0
"""Seconds a process has to answer ``presence.ping`` before a takeover may treat it as gone."""
MISSED_HEARTBEATS = 2
"""A process whose heartbeat is older than this many ``DISPATCH_HEARTBEAT_INTERVAL``s has
missed heartbeats: a takeover may check it at once (and reap it if it does not answer)."""


def missed_heartbeats_cutoff() -> datetime:
    """The instant before which a heartbeat means ``MISSED_HEARTBEATS`` were missed."""
    return timezone.now() - timedelta(seconds=MISSED_HEARTBEATS * settings.PROCESS_HEARTBEAT_INTERVAL)


@dataclass(frozen=True)
class ProcessLiveness:
    """What ``server_process_liveness`` found about a process holding a connection.

    ``answered``: it answered the presence ping (it lives; ``holding`` are the asked
    channel names that are its open connections). Otherwise ``stale`` says whether its
    heartbeat is older than ``MISSED_HEARTBEATS`` intervals (or its row is gone) — only
    then may ``server_process_takeover_reap`` remove it; ``absent`` says whether this host
    knows its pid no longer exists (then no ping was sent).
    """

    answered: bool
    holding: frozenset[str] = frozenset()
    stale: bool = False
    absent: bool = False


def _process_presence(process_id: str) -> tuple[str, int, bool] | None:
    """``(hostname, pid, missed heartbeats)`` of a process's row, or ``None`` without one."""
    row = ServerProcess.objects.filter(pk=process_id).values_list("hostname", "pid", "heartbeat_at").first()
    if row is None:
        return None
    hostname, pid, heartbeat_at = row
    return hostname, pid, heartbeat_at < missed_heartbeats_cutoff()


async def server_process_liveness(*, process_id: str, channel_names: Sequence[str] = ()) -> ProcessLiveness:
    """Check at once whether server process ``process_id`` lives, across hosts.

    This process answers for itself from its own open connections. Another is sent a
    ``presence.ping`` on its presence group (``core.presence.presence_group``), answered by
    its presence loop within ``PRESENCE_PING_TIMEOUT`` (1 s) while its event loop and
    channel layer work; asking about ``channel_names`` tells which of them are its open
    connections. A process that has missed two heartbeats and whose pid this host knows to
    be gone (same hostname, ``kill(pid, 0)`` → no such process) is not pinged. Waits on the
    channel layer, never on the database thread (two short queries). Raises what the
    layer raises while it is unreachable.
    """
    if process_id == current_process_id():
        return ProcessLiveness(answered=True, holding=frozenset(channel_names) & frozenset(local_channel_names()))
    presence = await database_sync_to_async(_process_presence)(process_id)
    if presence is None:
        return ProcessLiveness(answered=False, stale=True, absent=True)
    hostname, pid, stale = presence
    if stale and pid_absent(hostname=hostname, pid=pid):
        return ProcessLiveness(answered=False, stale=True, absent=True)
    ping = PresencePingMessage(channel_names=list(channel_names))
    answer = await layer_request(
        presence_group(process_id), ping, reply=PresencePingReply, timeout=PRESENCE_PING_TIMEOUT, group=True
    )
    if answer is not None and answer.process_id == process_id:
        return ProcessLiveness(answered=True, holding=frozenset(answer.holding) & frozenset(channel_names))
    # Silent for a second: judge by the heartbeat as it is now, not before the ping.
    presence = await database_sync_to_async(_process_presence)(process_id)
    return ProcessLiveness(answered=False, stale=presence is None or presence[2])


@transaction.atomic
def server_process_takeover_reap(*, process_id: str) -> bool:
    """Reap one process found gone by ``server_process_liveness`` (not answering, missed two
    heartbeats), so that a connect can take over a name it held.

    As ``server_process_reap`` does for one process, under a row lock and only while its
    heartbeat is still older than ``MISSED_HEARTBEATS`` intervals (a process that
    heartbeats meanwhile keeps everything): the ``PROCESSES_GONE_HOOKS`` close what it
    held, and its connection rows go by cascade. Returns True when the process has no row
    any more (reaped now, or already), False when it lives on. Never reaps this process.
    """
    if process_id == current_process_id():
        return False
    stale = (
        ServerProcess.objects.select_for_update()
        .filter(pk=process_id, heartbeat_at__lt=missed_heartbeats_cutoff())
        .values_list("pk", flat=True)
        .first()
    )
    if stale is None:
        return not ServerProcess.objects.filter(pk=process_id).exists()
    _processes_gone([process_id])
    ServerProcess.objects.filter(pk=process_id).delete()
    logger.warning("server process %s missed its heartbeats and did not answer a ping: reaped it", process_id)
    return True
