"""Which middleware a ``/ws`` upgrade goes through (``dispatch.routing.by_credential``):
one carrying an ``Authorization: Bearer`` header skips Channels' cookie, session and user
lookups, since the header wins over any cookie (docs/ws-protocol.md#authentication);
every other upgrade still goes through them, so cookie logins (origin-checked) and
first-frame logins work as before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.test import Client

from remotes.models import WsSession
from tests.conftest import WsClient
from tests.machines.test_hello_cost import thread_hops
from tests.machines.test_op_path_costs import every_query

pytestmark = pytest.mark.django_db(transaction=True)

SITE = [(b"host", b"localhost:8123"), (b"origin", b"http://localhost:8123")]


async def session_cookie(user: Any) -> tuple[bytes, bytes]:
    client = Client()
    await database_sync_to_async(client.force_login)(user)
    name = django_settings.SESSION_COOKIE_NAME
    return (b"cookie", f"{name}={client.cookies[name].value}".encode())


@asynccontextmanager
async def upgrade(headers: list[tuple[bytes, bytes]]) -> AsyncIterator[WsClient]:
    from dispatch.asgi import application

    communicator = WebsocketCommunicator(application, "/ws", headers=headers)
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    try:
        yield WsClient(communicator)
    finally:
        await communicator.disconnect(timeout=10)


async def sessions() -> list[tuple[str, str]]:
    return await database_sync_to_async(lambda: list(WsSession.objects.values_list("user__username", "auth_method")))()


async def test_a_header_client_costs_no_session_lookup_even_with_a_cookie(
    owner: Any, member: Any, owner_token: str
) -> None:
    cookie = await session_cookie(member)
    headers = [(b"authorization", f"Bearer {owner_token}".encode()), cookie, *SITE]
    with every_query() as seen, thread_hops() as hops:
        async with upgrade(headers) as ws:
            assert (await ws.request("ping"))["pong"] is True
            assert await sessions() == [(owner.username, "header")]
    assert not [sql for sql in seen if "django_session" in sql], seen
    assert "get_user" not in hops and "load" not in hops, hops


async def test_a_bad_header_token_is_refused_though_a_valid_cookie_comes_with_it(member: Any) -> None:
    headers = [(b"authorization", b"Bearer not-a-token"), await session_cookie(member), *SITE]
    async with upgrade(headers) as ws:
        assert (await ws.recv())["error"] == "authentication failed"
        assert await ws.closed_with() == 4401
    assert await sessions() == []


async def test_a_cookie_client_still_authenticates_from_the_sites_own_origin(member: Any) -> None:
    async with upgrade([await session_cookie(member), *SITE]) as ws:
        assert (await ws.request("ping"))["pong"] is True
        assert await sessions() == [(member.username, "cookie")]


async def test_a_cookie_client_beside_another_authorization_scheme_is_still_a_cookie_login(member: Any) -> None:
    headers = [(b"authorization", b"Basic dXNlcjpwdw=="), await session_cookie(member), *SITE]
    async with upgrade(headers) as ws:
        assert (await ws.request("ping"))["pong"] is True
        assert await sessions() == [(member.username, "cookie")]


async def test_a_cookie_client_from_a_foreign_origin_is_still_refused(member: Any) -> None:
    headers = [await session_cookie(member), (b"host", b"localhost:8123"), (b"origin", b"http://evil.example")]
    async with upgrade(headers) as ws:
        assert (await ws.recv())["error"] == "origin not allowed"
        assert await ws.closed_with() == 4403
    assert await sessions() == []


async def test_first_frame_logins_still_work_without_a_header(owner: Any, owner_token: str) -> None:
    async with upgrade([]) as ws:
        await ws.send({"token": owner_token})
        assert await ws.recv() == {"ok": True, "user": owner.username}
        assert (await ws.request("ping"))["pong"] is True
    async with upgrade([]) as ws:
        await ws.send({"username": owner.username, "password": "not-the-password"})
        assert (await ws.recv())["error"]
        assert await ws.closed_with() == 4401


async def test_a_token_deleted_within_the_cache_second_is_refused_not_an_internal_error(
    owner: Any, owner_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bearer cache still knows the token for up to a second after its row is deleted
    (revoking empties it; an admin's delete does not): the session's row then fails its
    foreign key, which is an authentication failure (4401), not an internal error (1011)."""
    from core import credential_cache
    from core.authentication import api_token_cached
    from core.models import ApiToken

    monkeypatch.setattr(credential_cache, "BEARER_CACHE_SECONDS", 60.0)  # however slow the machine
    headers = [(b"authorization", f"Bearer {owner_token}".encode()), *SITE]
    async with upgrade(headers) as ws:  # looked up, and cached
        assert (await ws.request("ping"))["pong"] is True
    await database_sync_to_async(lambda: ApiToken.objects.filter(user=owner).delete())()
    assert api_token_cached(owner_token) is not None  # still known here: the session's INSERT fails
    async with upgrade(headers) as ws:
        assert (await ws.recv())["error"] == "authentication failed"
        assert await ws.closed_with() == 4401
    assert await sessions() == []
