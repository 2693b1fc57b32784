"""Announcing that a user's tool list changed (docs/mcp.md#tool-list-changes).

A user's MCP tools are their machines and their remotes, and ``dispatch_launch_agent``'s
description lists their linked instances. The services that attach or detach a machine,
connect or disconnect a remote, close a ws session, reap a dead process, or link, relabel,
re-permission or unlink a peer call ``tools_changed_on_commit(user_ids)``; after commit
each user's channel-layer group ``mcp-tools.<user id>`` is rung
(``core.protocol.ToolsChangedMessage``), and the MCP endpoint's event streams in any
process (``GET /mcp`` for 2025-11-25, ``subscriptions/listen`` for 2026-07-28;
``dispatch.mcp.relay``) send ``notifications/tools/list_changed``. A doorbell
only: a lost ring costs a client a stale list until its next ``tools/list`` (a ``GET /mcp``
reconnect always brings one).
"""

from __future__ import annotations

from collections.abc import Iterable

from core.protocol import ToolsChangedMessage
from core.realtime import ring, ring_on_commit


def tools_group(user_id: int) -> str:
    """The channel-layer group announcing changes of ``user_id``'s tool list."""
    return f"mcp-tools.{int(user_id)}"


async def tools_changed(user_id: int) -> None:
    """Ring ``user_id``'s group now (async code, outside a transaction); never raises
    (``core.realtime.ring``)."""
    await ring(tools_group(user_id), ToolsChangedMessage())


def tools_changed_on_commit(user_ids: Iterable[int | None]) -> None:
    """Ring each user's group once the current transaction commits (sync code).

    ``None`` entries are ignored. A failure to ring is logged, never raised: the change
    itself has happened (``core.realtime.ring_on_commit``).
    """
    for user_id in sorted({int(user_id) for user_id in user_ids if user_id is not None}):
        ring_on_commit(tools_group(user_id), ToolsChangedMessage())
