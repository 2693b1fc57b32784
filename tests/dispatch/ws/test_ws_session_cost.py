"""What opening and closing a ``/ws`` session costs the server (bench B6): the statements
and the hops to a thread of a header-token session, and the caches that save them — the
token (``core.credential_cache``, shared with REST, still refused at once when revoked
here) and this process's ``ServerProcess`` row (``core.presence.process_row_trusted``,
re-created when reaped), as a shim's HELLO does (tests/machines/test_hello_cost.py).

Counts, not times: a change that adds a statement or a hop to every session fails here."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from channels.db import database_sync_to_async

from core import presence
from core.models import ServerProcess
from core.services import api_token_create, api_token_revoke
from remotes.models import Remote, WsSession
from tests.conftest import WsClient
from tests.dispatch.ws.test_ws_header_path import upgrade
from tests.machines.test_hello_cost import fresh_caches, thread_hops  # noqa: F401  (autouse fixture)
from tests.machines.test_op_path_costs import every_query

pytestmark = pytest.mark.django_db(transaction=True)

# The session's INSERT; at close, the remotes' DELETE … RETURNING and the session's DELETE.
SESSION_STATEMENTS = 3


@asynccontextmanager
async def header_session(token: str) -> AsyncIterator[WsClient]:
    """A ``/ws`` client authenticated by header (``upgrade``: its close waits for the
    server's cleanup)."""
    async with upgrade([(b"authorization", f"Bearer {token}".encode())]) as ws:
        yield ws


async def open_ping_close(token: str) -> None:
    async with header_session(token) as ws:
        assert (await ws.request("ping"))["pong"] is True


async def test_a_header_session_with_a_known_token_takes_three_statements_and_two_hops(
    owner: Any, owner_token: str
) -> None:
    await open_ping_close(owner_token)  # the token and the process row are now known
    with every_query() as seen, thread_hops() as hops:
        await open_ping_close(owner_token)
    # No cookie, session or user lookup, no token lookup, no process row read: recording
    # the session, then forgetting it.
    assert hops == ["ws_session_open", "ws_session_close"]
    assert len(seen) <= SESSION_STATEMENTS, "\n".join(sql[:120] for sql in seen)
    assert not [sql for sql in seen if "dispatch_serverprocess" in sql or "apitoken" in sql]
    assert await database_sync_to_async(WsSession.objects.count)() == 0


async def test_a_first_session_reads_the_token_and_the_process_row_once(owner: Any, owner_token: str) -> None:
    with thread_hops() as hops:
        await open_ping_close(owner_token)
    assert hops == ["api_token_credential", "ws_session_open", "ws_session_close"]


async def test_closing_a_session_still_deletes_the_remotes_it_served(
    owner: Any, owner_token: str, weather_tools: list[dict[str, Any]]
) -> None:
    async with header_session(owner_token) as ws:
        reply = await ws.request("remote-connect", {"remotename": "weather", "tools": weather_tools})
        assert reply.get("message") == "remote connected", reply
        assert await database_sync_to_async(Remote.objects.filter(name="weather").count)() == 1
    assert await database_sync_to_async(Remote.objects.count)() == 0
    assert await database_sync_to_async(WsSession.objects.count)() == 0
    async with header_session(owner_token) as ws:  # the name is free again
        reply = await ws.request("remote-connect", {"remotename": "weather", "tools": weather_tools})
        assert reply.get("message") == "remote connected", reply


async def test_a_token_revoked_here_is_refused_at_once_though_it_was_cached(owner: Any) -> None:
    issued = await database_sync_to_async(api_token_create)(user=owner)
    await open_ping_close(issued.raw)
    await database_sync_to_async(api_token_revoke)(user=owner, token_id=issued.token.pk)
    async with header_session(issued.raw) as ws:
        assert (await ws.recv())["error"] == "authentication failed"
        assert await ws.closed_with() == 4401
    assert await database_sync_to_async(WsSession.objects.count)() == 0


async def test_the_process_row_is_re_created_when_reaped_while_trusted(owner: Any, owner_token: str) -> None:
    await open_ping_close(owner_token)
    # Reaped by another process while this one still trusts its memo.
    await database_sync_to_async(lambda: ServerProcess.objects.filter(pk=presence.current_process_id()).delete())()
    assert presence.process_row_trusted()
    async with header_session(owner_token) as ws:
        assert (await ws.request("ping"))["pong"] is True
        held_by = await database_sync_to_async(
            lambda: list(WsSession.objects.values_list("server_process__stopped_at", "server_process_id"))
        )()
        assert held_by == [(None, presence.current_process_id())]


async def test_a_text_frame_is_measured_in_utf8_bytes(owner_token: str, settings: Any) -> None:
    settings.WS_MAX_MESSAGE_BYTES = 100
    async with header_session(owner_token) as ws:
        # 71 characters, 111 bytes: within the limit in characters, over it in bytes.
        await ws.send(json.dumps({"action": "ping", "nonce": "é" * 40}, ensure_ascii=False))
        assert await ws.closed_with() == 1009
    async with header_session(owner_token) as ws:
        # 51 characters, 91 bytes (4 x 51 is over the limit: the length alone cannot tell).
        nonce = "€" * 20
        await ws.send(json.dumps({"action": "ping", "nonce": nonce}, ensure_ascii=False))
        assert (await ws.reply(nonce))["pong"] is True
