"""The signed peer client (docs/peers.md#authentication): what it sends verifies on the other side.

Two identities in one test database are awkward, so the "other side" here is this same
instance looking at itself: a ``Peer`` row whose pinned public key is our own identity's,
whose inbound digest is the digest of the outbound token it stores. The client signs
with ``identity_get()`` and presents that outbound token; an ``httpx.MockTransport``
handler turns each request into a Django request and runs ``peer_authenticate`` on it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.test import RequestFactory

from core import secrets_at_rest
from core.services import generate_token, token_digest
from peers.auth import PeerAuthError, peer_authenticate
from peers.client import PeerClient, PeerUnreachable
from peers.models import Peer
from peers.services.identity import identity_get
from tests.peers.conftest import new_key_pair

pytestmark = pytest.mark.django_db(transaction=True)

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def _ourselves_as_a_peer(url: str = "http://peer.test/", public_key: str | None = None) -> Peer:
    identity = identity_get()
    token = generate_token()
    owner = get_user_model().objects.create_user("linker")
    from peers.keys import fingerprint_of

    key = public_key or identity.public_key
    return Peer.objects.create(
        owner=owner,
        instance_id=identity.instance_id,
        label="Self",
        url=url,
        public_key=key,
        fingerprint=fingerprint_of(key),
        inbound_digest=token_digest(token),
        inbound_prefix=token[:8],
        outbound_token_encrypted=secrets_at_rest.encrypt(token.encode()),
    )


ourselves_as_a_peer = database_sync_to_async(_ourselves_as_a_peer)


async def as_django(request: httpx.Request) -> Any:
    """The Django request the other side's view would get for ``request``."""
    content = await request.aread()
    headers = {
        name: value
        for name, value in request.headers.items()
        if name.lower() not in ("host", "content-length", "content-type")
    }
    return RequestFactory().generic(
        request.method,
        request.url.raw_path.decode("ascii"),
        data=content,
        content_type=request.headers.get("content-type", "application/octet-stream"),
        headers=headers,
    )


def authenticating(respond: Callable[[Peer, httpx.Request], httpx.Response]) -> httpx.MockTransport:
    """A transport whose far end authenticates every request like a peer route does."""

    async def handler(request: httpx.Request) -> httpx.Response:
        try:
            peer = await peer_authenticate(await as_django(request))
        except PeerAuthError as exc:
            return httpx.Response(exc.status, json={"error": {"code": exc.code, "message": exc.message}})
        return respond(peer, request)

    return httpx.MockTransport(handler)


async def test_a_post_is_signed_and_verifies_on_the_other_side() -> None:
    peer = await ourselves_as_a_peer()

    def respond(authenticated: Peer, request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            201,
            json={
                "peer": authenticated.pk,
                "key": request.headers["idempotency-key"],
                "body": json.loads(request.content),
                "url": str(request.url),
            },
        )

    client = PeerClient(peer, transport=authenticating(respond))
    body = {"name": "worker", "prompt": "héllo ✓", "cwd": "~/src"}
    response = await client.post("/api/v1/peers/launch", body, idempotency_key="key-1")
    assert response.status_code == 201, response.text
    answer = response.json()
    assert answer == {"peer": peer.pk, "key": "key-1", "body": body, "url": "http://peer.test/api/v1/peers/launch"}


async def test_a_post_without_a_key_gets_a_fresh_idempotency_key_each_time() -> None:
    peer = await ourselves_as_a_peer()
    seen: list[str] = []

    def respond(authenticated: Peer, request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["idempotency-key"])
        return httpx.Response(200, json={})

    client = PeerClient(peer, transport=authenticating(respond))
    for _ in range(2):
        assert (await client.post("/api/v1/peers/unlink", {})).status_code == 200
    assert len(seen) == 2 and seen[0] != seen[1] and all(len(key) == 36 for key in seen)


async def test_a_get_signs_its_query() -> None:
    peer = await ourselves_as_a_peer()

    def respond(authenticated: Peer, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"query": request.url.query.decode()})

    client = PeerClient(peer, transport=authenticating(respond))
    response = await client.get("/api/v1/peers/repos", params={"q": "a b/c", "n": 2})
    assert response.status_code == 200, response.text
    assert response.json() == {"query": "q=a+b%2Fc&n=2"}


async def test_the_other_side_refuses_a_client_whose_key_it_did_not_pin() -> None:
    _, someone_else = new_key_pair()
    peer = await ourselves_as_a_peer(public_key=someone_else)
    client = PeerClient(peer, transport=authenticating(lambda p, r: httpx.Response(200, json={})))
    response = await client.post("/api/v1/peers/messages", {"content": "x"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "PERMISSION_DENIED"


async def test_an_error_status_is_returned_not_raised() -> None:
    peer = await ourselves_as_a_peer()

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"code": "CONFLICT", "message": "agent is gone"}})

    response = await PeerClient(peer, transport=httpx.MockTransport(handler)).post("/api/v1/peers/messages", {})
    assert response.status_code == 409


async def test_the_event_stream_is_signed_and_yields_server_sent_events() -> None:
    peer = await ourselves_as_a_peer()
    frames = (
        b'id: 1\nevent: snapshot\ndata: {"agents": []}\n\n'
        b": keep-alive\n\n"
        b'id: 2\nevent: agent.upsert\ndata: {"id": "a1", "status": "running"}\n\n'
    )

    def respond(authenticated: Peer, request: httpx.Request) -> httpx.Response:
        assert request.headers["accept"] == "text/event-stream"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=frames)

    client = PeerClient(peer, transport=authenticating(respond))
    async with client.stream_events("/api/v1/peers/events") as events:
        assert events.response.status_code == 200
        # httpx-sse hands the keep-alive over as an event with no data (and the last id).
        received = [(sse.id, sse.event, sse.json()) async for sse in events.aiter_sse() if sse.data]
    assert received == [
        ("1", "snapshot", {"agents": []}),
        ("2", "agent.upsert", {"id": "a1", "status": "running"}),
    ]


async def test_a_refused_event_stream_shows_its_status() -> None:
    peer = await ourselves_as_a_peer()
    await database_sync_to_async(Peer.objects.filter(pk=peer.pk).update)(inbound_digest="0" * 64)
    client = PeerClient(peer, transport=authenticating(lambda p, r: httpx.Response(200)))
    async with client.stream_events() as events:
        assert events.response.status_code == 401


async def test_a_closed_port_is_peer_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = await ourselves_as_a_peer(url=f"http://127.0.0.1:{port}")
    client = PeerClient(peer, timeout=5)
    with pytest.raises(PeerUnreachable) as caught:
        await client.post("/api/v1/peers/messages", {})
    assert "Self" in caught.value.message and f"127.0.0.1:{port}" in caught.value.message
    with pytest.raises(PeerUnreachable):
        await client.get("/api/v1/peers/repos")
    with pytest.raises(PeerUnreachable):
        async with client.stream_events():
            pass


async def test_a_peer_that_never_answers_is_peer_unreachable() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # hold the connection open, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        peer = await ourselves_as_a_peer(url=f"http://127.0.0.1:{port}")
        with pytest.raises(PeerUnreachable) as caught:
            await PeerClient(peer, timeout=0.3).post("/api/v1/peers/messages", {})
        assert "timed out" in caught.value.message
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


class _StallingStream(httpx.AsyncByteStream):
    """One event, then the read times out (a peer that vanished without closing)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'id: 1\nevent: snapshot\ndata: {"agents": []}\n\n'
        raise httpx.ReadTimeout("no data within the read timeout")


async def test_a_stream_that_goes_silent_raises_peer_unreachable_inside_the_block() -> None:
    peer = await ourselves_as_a_peer()

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_StallingStream())

    received = []
    with pytest.raises(PeerUnreachable) as caught:
        async with PeerClient(peer, transport=httpx.MockTransport(handler)).stream_events() as events:
            async for sse in events.aiter_sse():
                received.append(sse.event)
    assert received == ["snapshot"]
    assert "timed out" in caught.value.message
