"""Cross-site websocket hijacking: a cookie login on ``/ws`` is accepted only from the
site's own origin — scheme, host and port — as Django's CSRF check decides for REST
(docs/ws-protocol.md#authentication)."""

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

pytestmark = pytest.mark.django_db(transaction=True)


async def session_cookie(user: Any) -> bytes:
    client = Client()
    await database_sync_to_async(client.force_login)(user)
    name = django_settings.SESSION_COOKIE_NAME
    return f"{name}={client.cookies[name].value}".encode()


@asynccontextmanager
async def cookie_socket(user: Any, *, host: str, origin: str, scheme: str = "ws") -> AsyncIterator[WsClient]:
    """A ``/ws`` upgrade with ``user``'s session cookie, ``Host`` and ``Origin``, over ``scheme``."""
    from dispatch.asgi import application

    headers = [(b"cookie", await session_cookie(user)), (b"host", host.encode()), (b"origin", origin.encode())]
    communicator = WebsocketCommunicator(application, "/ws", headers=headers)
    communicator.scope["scheme"] = scheme
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    try:
        yield WsClient(communicator)
    finally:
        await communicator.disconnect()


@pytest.mark.parametrize(
    ("host", "origin", "scheme"),
    [
        ("localhost:8123", "http://localhost:9999", "ws"),  # another local web server
        ("127.0.0.1:8123", "http://127.0.0.1:9999", "ws"),
        ("localhost:8123", "http://localhost", "ws"),  # port missing
        ("localhost:8123", "https://localhost:8123", "ws"),  # https page, plain socket
        ("localhost:8123", "http://localhost:8123", "wss"),  # http page, TLS socket
        ("evil.example:8123", "http://evil.example:8123", "ws"),  # Host outside ALLOWED_HOSTS
    ],
    ids=["other-port", "other-port-ip", "no-port", "https-vs-http", "http-vs-https", "host-not-allowed"],
)
async def test_it_refuses_a_cookie_login_from_another_origin_of_the_same_host(
    owner: Any, count_rows: Any, host: str, origin: str, scheme: str
) -> None:
    async with cookie_socket(owner, host=host, origin=origin, scheme=scheme) as ws:
        refusal = await ws.recv()
        assert "action" not in refusal and refusal["error"] == "origin not allowed"
        assert await ws.closed_with() == 4403
    assert await count_rows(WsSession) == 0


@pytest.mark.parametrize(
    ("host", "origin", "scheme"),
    [
        ("localhost:8123", "http://localhost:8123", "ws"),
        ("127.0.0.1:8123", "http://127.0.0.1:8123", "ws"),
        ("localhost:8443", "https://localhost:8443", "wss"),
        ("localhost:9999", "http://127.0.0.1:8000", "ws"),  # one of CSRF_TRUSTED_ORIGINS (the public URL)
    ],
    ids=["same-origin", "same-origin-ip", "same-origin-tls", "trusted-origin"],
)
async def test_it_accepts_a_cookie_login_from_the_sites_own_origin(
    owner: Any, count_rows: Any, host: str, origin: str, scheme: str
) -> None:
    assert "http://127.0.0.1:8000" in django_settings.CSRF_TRUSTED_ORIGINS
    async with cookie_socket(owner, host=host, origin=origin, scheme=scheme) as ws:
        await ws.send({"action": "ping", "nonce": 1})
        assert await ws.recv() == {"pong": True, "nonce": 1}
        assert await count_rows(WsSession, user=owner, auth_method="cookie") == 1
