"""MCP event-stream rows and the ``GET /mcp`` response in process
(docs/mcp.md#tool-list-changes): which streams may stay open, the limit, keep-alive
comments, the row deleted when the client goes."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent
from agents.tokens import agent_token_mint
from core.errors import DispatchError
from core.models import ApiToken
from core.services import api_token_create
from dispatch.mcp import app as mcp_app
from dispatch.mcp import events, streams
from dispatch.models import McpStream


@pytest.mark.django_db
def test_a_stream_stays_valid_only_while_its_credential_and_user_do(owner: Any) -> None:
    issued = api_token_create(user=owner)
    by_token = streams.mcp_stream_open(user=owner, raw_token=issued.raw)
    agent = Agent.objects.create(owner=owner, name="a", type="shell", cwd="/", status=Agent.Status.RUNNING)
    by_agent = streams.mcp_stream_open(user=owner, raw_token=agent_token_mint(agent=agent))
    assert streams.mcp_streams_valid(stream_ids=[by_token, by_agent]) == {by_token, by_agent}

    ApiToken.objects.filter(pk=issued.token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert streams.mcp_streams_valid(stream_ids=[by_token, by_agent]) == {by_agent}
    ApiToken.objects.filter(pk=issued.token.pk).update(expires_at=None, revoked_at=timezone.now())
    assert streams.mcp_streams_valid(stream_ids=[by_token, by_agent]) == {by_agent}

    Agent.objects.filter(pk=agent.pk).update(status=Agent.Status.STOPPED)
    assert streams.mcp_streams_valid(stream_ids=[by_agent]) == set()
    Agent.objects.filter(pk=agent.pk).update(status=Agent.Status.RUNNING)
    assert streams.mcp_streams_valid(stream_ids=[by_agent]) == {by_agent}
    owner.is_active = False
    owner.save()
    assert streams.mcp_streams_valid(stream_ids=[by_agent]) == set()
    McpStream.objects.filter(pk=by_agent).delete()  # reaped with its process
    owner.is_active = True
    owner.save()
    assert streams.mcp_streams_valid(stream_ids=[by_agent]) == set()


@pytest.mark.django_db
def test_it_refuses_a_stream_past_the_limit_and_a_token_of_another_user(owner: Any, member: Any) -> None:
    raw = api_token_create(user=owner).raw
    for _ in range(streams.STREAMS_PER_USER):
        streams.mcp_stream_open(user=owner, raw_token=raw)
    with pytest.raises(DispatchError) as refused:
        streams.mcp_stream_open(user=owner, raw_token=raw)
    assert refused.value.code == "RATE_LIMITED" and refused.value.http_status == 429
    with pytest.raises(DispatchError) as foreign:
        streams.mcp_stream_open(user=member, raw_token=raw)
    assert foreign.value.code == "AUTHENTICATION_FAILED"


@pytest.mark.django_db(transaction=True)
async def test_it_sends_keepalive_comments_and_deletes_its_row_when_the_client_goes(
    owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = (await asyncio.to_thread(api_token_create, user=owner)).raw
    monkeypatch.setattr(events, "KEEPALIVE_SECONDS", 0.1)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/mcp",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"accept", b"text/event-stream"),
            (b"authorization", f"Bearer {raw}".encode()),
        ],
    }
    disconnect = asyncio.Event()
    bodies: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    served = asyncio.create_task(mcp_app.mcp_app(scope, receive, send))
    async with asyncio.timeout(10):
        while bodies.count(events.KEEPALIVE) < 2:
            await asyncio.sleep(0.05)
    assert await McpStream.objects.filter(user=owner).acount() == 1
    assert bodies[0].startswith(b"retry: 1000\n\n") and bodies[0].endswith(events.LIST_CHANGED)
    disconnect.set()
    async with asyncio.timeout(5):
        await served
    assert await McpStream.objects.filter(user=owner).acount() == 0
