"""Open MCP event streams: their rows, their limit, their end (docs/mcp.md#tool-list-changes).

Every event stream — ``GET /mcp`` (2025-11-25) and ``subscriptions/listen`` (2026-07-28) —
has an ``McpStream`` row while it is open, naming its user, its process and the
credential that opened it. The rows count a user's streams across every process (at most
``STREAMS_PER_USER``, more is ``RATE_LIMITED``, 429); a killed process's rows go with its
``ServerProcess`` row when it is reaped.

A stream ends when:

- its credential is revoked, expired or deleted, or its user deactivated: the process's
  watchdog checks all of its open streams in one query every ``CHECK_INTERVAL`` seconds
  (so within about 2 s, whichever process revoked it);
- its row is gone (its process was reaped as dead): the client reconnects and gets a new one;
- the process shuts down (``close_all``, called by ``serve`` on SIGTERM), so clients move
  to another process at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from oauth2_provider.models import get_access_token_model

from agents.models import AgentToken
from agents.tokens import ACTIVE_STATUSES
from core import services
from core.errors import DispatchError
from core.models import ApiToken
from core.services import token_digest
from dispatch.models import McpStream

logger = logging.getLogger(__name__)

STREAMS_PER_USER = 64  # open event streams of one user, across every process (docs/mcp.md#tool-list-changes)
CHECK_INTERVAL = 2.0  # seconds between two checks of this process's open streams


# --- rows (sync: run through database_sync_to_async) -------------------------------------


@transaction.atomic
def mcp_stream_open(*, user: User, raw_token: str, oauth_token_id: int | None = None) -> int:
    """Record a new open stream of ``user`` opened with ``raw_token`` — or, on ``/mcp/oauth``,
    with the OAuth access token of row ``oauth_token_id`` (its row is what a revocation
    deletes, and the stream's row with it); returns the row id.

    The user's row is locked (PostgreSQL) while the streams are counted, so two processes
    cannot both take the last slot. Raises ``DispatchError`` ``RATE_LIMITED`` (429) when the
    user already has ``STREAMS_PER_USER`` open streams, ``AUTHENTICATION_FAILED`` when the
    token is neither a user API token nor an agent token of ``user``.
    """
    process_id = services.server_process_ensure()
    User.objects.select_for_update().filter(pk=user.pk).first()
    if McpStream.objects.filter(user=user).count() >= STREAMS_PER_USER:
        raise DispatchError(
            "RATE_LIMITED", f"too many open MCP event streams: at most {STREAMS_PER_USER} per user; close one"
        )
    if oauth_token_id is not None:
        oauth_token = get_access_token_model().objects.filter(pk=oauth_token_id, user=user).first()
        if oauth_token is None:
            raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token")
        stream = McpStream.objects.create(user=user, server_process_id=process_id, oauth_token=oauth_token)
        return int(stream.pk)
    digest = token_digest(raw_token)
    api_token = ApiToken.objects.filter(digest=digest, user=user).first()
    agent_token = None if api_token else AgentToken.objects.filter(digest=digest, agent__owner=user).first()
    if api_token is None and agent_token is None:
        raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token")
    stream = McpStream.objects.create(
        user=user, server_process_id=process_id, api_token=api_token, agent_token=agent_token
    )
    return int(stream.pk)


def mcp_stream_close(*, stream_id: int) -> None:
    """Delete the row of a stream that ended (nothing if it is already gone)."""
    McpStream.objects.filter(pk=stream_id).delete()


def mcp_streams_valid(*, stream_ids: Iterable[int]) -> set[int]:
    """Which of ``stream_ids`` may stay open: the row exists, its user is active and its
    credential is an unrevoked, unexpired API token, an unrevoked token of an agent
    that is up (``ACTIVE_STATUSES``) or an unexpired OAuth access token (a revoked one is
    deleted, and the stream's row with it). One query."""
    wanted = list(stream_ids)
    if not wanted:
        return set()
    now = timezone.now()
    api_token_valid = Q(
        api_token__isnull=False,
        api_token__revoked_at__isnull=True,
    ) & (Q(api_token__expires_at__isnull=True) | Q(api_token__expires_at__gt=now))
    agent_token_valid = Q(
        agent_token__isnull=False,
        agent_token__revoked_at__isnull=True,
        agent_token__agent__status__in=list(ACTIVE_STATUSES),
    )
    oauth_token_valid = Q(oauth_token__isnull=False, oauth_token__expires__gt=now)
    return set(
        McpStream.objects.filter(pk__in=wanted, user__is_active=True)
        .filter(api_token_valid | agent_token_valid | oauth_token_valid)
        .values_list("pk", flat=True)
    )


# --- this process's open streams -----------------------------------------------------------


@dataclass(eq=False)
class OpenStream:
    """A stream held by this process: ``ended`` is set when it must end (``reason`` says why)."""

    stream_id: int
    user_id: int
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()


_open: dict[int, OpenStream] = {}
_watchdog: asyncio.Task[None] | None = None


async def stream_open(*, user: User, raw_token: str, oauth_token_id: int | None = None) -> OpenStream:
    """Record a new stream (``mcp_stream_open``) and watch it; raises as ``mcp_stream_open``."""
    global _watchdog
    stream_id = await database_sync_to_async(mcp_stream_open)(
        user=user, raw_token=raw_token, oauth_token_id=oauth_token_id
    )
    stream = _open[stream_id] = OpenStream(stream_id=stream_id, user_id=int(user.pk))
    if _watchdog is None or _watchdog.done() or _watchdog.get_loop() is not asyncio.get_running_loop():
        _watchdog = asyncio.get_running_loop().create_task(_watch())
    return stream


async def stream_close(stream: OpenStream) -> None:
    """Forget a stream that ended and delete its row (safe to call from a cancelled task)."""
    _open.pop(stream.stream_id, None)
    try:
        await asyncio.shield(database_sync_to_async(mcp_stream_close)(stream_id=stream.stream_id))
    except Exception:
        logger.warning("could not delete MCP stream row %s; the reaper will", stream.stream_id, exc_info=True)


def close_all(reason: str = "the server is shutting down") -> int:
    """End every stream of this process at once (``serve``'s SIGTERM); returns how many."""
    streams = list(_open.values())
    for stream in streams:
        stream.end(reason)
    return len(streams)


async def _watch() -> None:
    """End the streams whose row is gone or whose credential stopped being valid, every
    ``CHECK_INTERVAL`` seconds, while this process holds any."""
    while _open:
        await asyncio.sleep(CHECK_INTERVAL)
        ids = list(_open)
        try:
            valid = await database_sync_to_async(mcp_streams_valid)(stream_ids=ids)
        except Exception:
            logger.warning("could not check the open MCP streams; trying again", exc_info=True)
            continue
        for stream_id in ids:
            stream = _open.get(stream_id)
            if stream is not None and stream_id not in valid:
                stream.end("the credential was revoked or expired, or the user deactivated")
