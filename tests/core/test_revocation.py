"""Ending a credential closes what stands on it (core.revocation; docs/ws-protocol.md#authentication).

In-memory layer, one process: the sweep is called directly (``revocation_sweep_once``);
tests/integration/test_revocation_serve.py shows the same over a real ``serve``.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core import revocation
from core.models import ApiToken
from core.revocation import StreamCredential, ended_connection_channels, revocation_sweep_once
from core.services import api_token_revoke
from machines.models import MachineConnection
from remotes.models import Remote, WsSession
from tests.conftest import WEATHER_TOOLS
from tests.machines.conftest import frame, hello_payload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_streams() -> Any:
    revocation._streams.clear()
    revocation._told.clear()
    yield
    revocation._streams.clear()
    revocation._told.clear()


def _token_id(raw: str) -> int:
    from core.services import token_digest

    return int(ApiToken.objects.get(digest=token_digest(raw)).pk)


async def _revoke(user: Any, raw: str) -> None:
    token_id = await database_sync_to_async(_token_id)(raw)
    await database_sync_to_async(api_token_revoke)(user=user, token_id=token_id)


async def _expire(raw: str) -> None:
    token_id = await database_sync_to_async(_token_id)(raw)
    past = timezone.now() - timedelta(seconds=1)
    await database_sync_to_async(ApiToken.objects.filter(pk=token_id).update)(expires_at=past)


async def _deactivate(user: Any) -> None:
    await database_sync_to_async(get_user_model().objects.filter(pk=user.pk).update)(is_active=False)


async def test_it_closes_a_header_token_session_4401_when_the_token_is_revoked(
    ws_connect: Any, owner: Any, owner_token: str, count_rows: Any
) -> None:
    async with ws_connect(token=owner_token) as ws:
        reply = await ws.request("remote-connect", {"remotename": "weather", "tools": WEATHER_TOOLS})
        assert reply["remotename"] == "weather"
        await _revoke(owner, owner_token)
        assert await revocation_sweep_once() == 1
        assert await ws.closed_with() == 4401
    assert await count_rows(WsSession) == 0
    assert await count_rows(Remote) == 0  # the remote it served is disconnected


async def test_it_closes_a_first_frame_token_session_when_the_token_expires(
    ws_connect: Any, owner: Any, owner_token: str
) -> None:
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert (await ws.recv())["ok"] is True
        await _expire(owner_token)
        await revocation_sweep_once()
        assert await ws.closed_with() == 4401


async def test_it_closes_a_password_session_when_the_user_is_deactivated(ws_connect: Any, owner: Any) -> None:
    async with ws_connect() as ws:
        await ws.send({"username": "alice", "password": "correct horse battery"})
        assert (await ws.recv())["ok"] is True
        await _deactivate(owner)
        await revocation_sweep_once()
        assert await ws.closed_with() == 4401


async def test_it_leaves_sessions_whose_credential_is_live_open(
    ws_connect: Any, owner: Any, owner_token: str, member_token: str
) -> None:
    async with ws_connect(token=owner_token) as alice, ws_connect(token=member_token) as bob:
        await _revoke(owner, owner_token)
        assert await revocation_sweep_once() == 1
        assert await alice.closed_with() == 4401
        assert await bob.nothing_received()
        assert (await bob.request("ping"))["pong"] is True


async def _cookie_socket(user: Any) -> tuple[WebsocketCommunicator, Client]:
    from dispatch.asgi import application

    client = Client()
    await database_sync_to_async(client.force_login)(user)
    name = django_settings.SESSION_COOKIE_NAME
    headers = [
        (b"cookie", f"{name}={client.cookies[name].value}".encode()),
        (b"host", b"127.0.0.1:8000"),
        (b"origin", b"http://127.0.0.1:8000"),
    ]
    communicator = WebsocketCommunicator(application, "/ws", headers=headers)
    assert (await communicator.connect(timeout=5))[0]
    await communicator.send_to(text_data=json.dumps({"action": "ping", "nonce": 1}))
    assert json.loads((await communicator.receive_output(3))["text"])["pong"] is True
    return communicator, client


async def test_it_closes_a_cookie_session_when_the_user_logs_out(owner: Any) -> None:
    communicator, client = await _cookie_socket(owner)
    await database_sync_to_async(client.logout)()
    await revocation_sweep_once()
    assert (await communicator.receive_output(3)) == {"type": "websocket.close", "code": 4401}
    await communicator.disconnect()


async def test_it_closes_a_cookie_session_when_the_password_changes(owner: Any) -> None:
    communicator, _client = await _cookie_socket(owner)

    def change_password() -> None:
        user = get_user_model().objects.get(pk=owner.pk)
        user.set_password("a new horse battery staple")
        user.save()

    await database_sync_to_async(change_password)()
    await revocation_sweep_once()
    assert (await communicator.receive_output(3)) == {"type": "websocket.close", "code": 4401}
    await communicator.disconnect()


async def test_it_closes_a_shim_on_a_user_token_when_the_token_is_revoked(owner: Any, owner_token: str) -> None:
    from dispatch.asgi import application

    shim = WebsocketCommunicator(
        application, "/ws/shim/", headers=[(b"authorization", f"Bearer {owner_token}".encode())]
    )
    assert (await shim.connect(timeout=5))[0]
    await shim.send_to(text_data=json.dumps(frame("HELLO", hello_payload())))
    assert json.loads((await shim.receive_output(3))["text"])["type"] == "HELLO_ACK"
    assert await database_sync_to_async(MachineConnection.objects.filter(api_token__isnull=False).count)() == 1
    await _revoke(owner, owner_token)
    await revocation_sweep_once()
    while (message := await shim.receive_output(3))["type"] != "websocket.close":
        pass
    assert message["code"] == 4401
    await shim.disconnect()


async def test_a_sweep_is_one_query_however_many_connections(ws_connect: Any, owner: Any, token_for: Any) -> None:
    tokens = [await database_sync_to_async(token_for)(owner) for _ in range(3)]
    async with ws_connect(token=tokens[0]), ws_connect(token=tokens[1]), ws_connect(token=tokens[2]):
        await _revoke(owner, tokens[1])

        def sweep_query() -> tuple[list[str], int]:
            with CaptureQueriesContext(connection) as queries:
                channels = ended_connection_channels()
            return channels, len(queries)

        channels, queries = await database_sync_to_async(sweep_query)()
        assert len(channels) == 1 and queries == 1


def test_it_finds_event_streams_whose_credential_ended(owner: Any, member: Any, token_for: Any) -> None:
    live, revoked = token_for(owner), token_for(owner)
    api_token_revoke(user=owner, token_id=_token_id(revoked))
    revocation.stream_opened("live", StreamCredential(user_id=owner.pk, api_token_id=_token_id(live)))
    revocation.stream_opened("revoked", StreamCredential(user_id=owner.pk, api_token_id=_token_id(revoked)))
    revocation.stream_opened("gone-session", StreamCredential(user_id=owner.pk, session_key="x" * 32))
    revocation.stream_opened("inactive", StreamCredential(user_id=member.pk, api_token_id=_token_id(token_for(member))))
    get_user_model().objects.filter(pk=member.pk).update(is_active=False)
    with CaptureQueriesContext(connection) as queries:
        ended = revocation.ended_stream_channels(dict(revocation._streams))
    assert sorted(ended) == ["gone-session", "inactive", "revoked"]
    assert len(queries) == 1


def test_an_event_stream_on_an_agent_token_ends_when_the_agent_stops(owner: Any, tmp_path: Any) -> None:
    from agents.services import agent_create
    from agents.tokens import agent_token_id, agent_token_mint, agent_tokens_revoke

    running = agent_create(owner=owner, type="expert", name="a", cwd=str(tmp_path))
    stopped = agent_create(owner=owner, type="expert", name="b", cwd=str(tmp_path))
    live_id = agent_token_id(agent_token_mint(agent=running))
    revoked_id = agent_token_id(agent_token_mint(agent=stopped))
    assert live_id is not None and revoked_id is not None
    revocation._streams.clear()
    revocation.stream_opened("agent-live", StreamCredential(user_id=owner.pk, agent_token_id=live_id))
    revocation.stream_opened("agent-revoked", StreamCredential(user_id=owner.pk, agent_token_id=revoked_id))
    agent_tokens_revoke(agent=stopped)
    try:
        assert revocation.ended_stream_channels(dict(revocation._streams)) == ["agent-revoked"]
    finally:
        revocation._streams.clear()
