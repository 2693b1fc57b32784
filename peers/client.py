"""The signed HTTP client this instance uses to call a peer's API (docs/peers.md#the-peer-api).

``PeerClient(peer)`` presents the outbound token (the one the peer issued to us, stored
encrypted on the ``Peer`` row) as ``Authorization: Bearer …`` and signs every request
with this instance's Ed25519 key (``peers.auth.sign_request``). All calls are async
(httpx.AsyncClient); connection failures and timeouts raise ``PeerUnreachable``. An
HTTP error status is *not* an exception: callers read the ``httpx.Response`` (the
outbox tells 409 from 503: docs/peers.md#the-outbox). Every request announces this instance's features
(``Dispatch-Peer-Features``), and what every answer announces is kept on the ``Peer`` row
(``links.peer_features_record``, a write only when it changed).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any

import httpx
import httpx_sse
from channels.db import database_sync_to_async

from core import secrets_at_rest
from peers.auth import sign_request
from peers.keys import FEATURES_HEADER, Identity, features_header_value, features_parse
from peers.models import Peer, new_idempotency_key
from peers.services.identity import identity_get
from peers.services.links import peer_features_record

# Read timeout on the event stream: the peer writes a keep-alive every 20 s
# (docs/peers.md#events), so 45 s of silence means it vanished without closing the connection.
STREAM_READ_TIMEOUT = 45.0


class PeerUnreachable(Exception):
    """The peer could not be reached: connection refused, DNS, TLS, or a timeout.

    ``message`` says what happened, naming the peer's label and URL (never a token).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context (with the CA bundle loaded) for every peer client of the process:
    building one costs about 20 ms of CPU."""
    return httpx.create_ssl_context()


class PeerClient:
    """Signed requests to one peer (``peer.url`` + path).

    ``timeout`` (seconds) bounds connect, read, write and pool waits of ``post``/``get``.
    ``identity`` defaults to this instance's (``identity_get()``, read once per client);
    ``transport`` replaces httpx's network transport (tests pass ``httpx.MockTransport``).
    Raises ``secrets_at_rest.SecretUnreadable`` from any call when the outbound token
    cannot be decrypted with ``DISPATCH_ENCRYPTION_KEYS``.
    """

    def __init__(
        self,
        peer: Peer,
        *,
        timeout: float = 30.0,
        identity: Identity | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.peer = peer
        self.timeout = timeout
        self._identity = identity
        self._transport = transport
        self._shared: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def session(self) -> AsyncIterator[PeerClient]:
        """Keep one keep-alive connection pool for every ``post``/``get`` inside the block
        (the outbox sends a peer's rows over it: a new client per request costs a TLS
        context and a TCP connection each)."""
        async with self._client(httpx.Timeout(self.timeout)) as client:
            self._shared = client
            try:
                yield self
            finally:
                self._shared = None

    def url_for(self, path: str) -> str:
        """``peer.url`` without its trailing ``/`` followed by ``path`` (``/api/v1/peers/…``)."""
        return self.peer.url.rstrip("/") + path

    async def _our_identity(self) -> Identity:
        if self._identity is None:
            self._identity = await database_sync_to_async(identity_get)()
        return self._identity

    def _client(self, timeout: httpx.Timeout) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=timeout, transport=self._transport, follow_redirects=False, verify=_ssl_context()
        )

    async def _send(self, build: Any) -> httpx.Response:
        """Build (``build(client)``), sign and send one request, on the session's client if
        one is open, else on a client of its own."""
        if self._shared is not None:
            return await self._send_on(self._shared, build)
        async with self._client(httpx.Timeout(self.timeout)) as client:
            return await self._send_on(client, build)

    async def _send_on(self, client: httpx.AsyncClient, build: Any) -> httpx.Response:
        request = build(client)
        await self._signed(request)
        try:
            response = await client.send(request)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        await self._note_features(response)
        return response

    async def _note_features(self, response: httpx.Response) -> None:
        """Keep what the peer announced in its answer's ``Dispatch-Peer-Features`` header
        (``links.peer_features_record``: a write only when it changed). A peer that vanished
        from the database meanwhile (a test's row, an unlink) is left alone."""
        features = features_parse(response.headers.get(FEATURES_HEADER))
        if self.peer.pk is not None and features != self.peer.features:
            await database_sync_to_async(peer_features_record)(peer=self.peer, features=features)

    def _authorization(self) -> str:
        token = secrets_at_rest.decrypt(self.peer.outbound_token_encrypted).decode("utf-8")
        return f"Bearer {token}"

    def _unreachable(self, exc: httpx.HTTPError) -> PeerUnreachable:
        kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "could not be reached"
        detail = str(exc) or type(exc).__name__
        return PeerUnreachable(f"peer {self.peer.label} at {self.peer.url} {kind}: {detail}")

    async def _signed(self, request: httpx.Request) -> httpx.Request:
        request.headers["Authorization"] = self._authorization()
        request.headers[FEATURES_HEADER] = features_header_value()
        sign_request(request, identity=await self._our_identity())
        return request

    async def post(self, path: str, body: dict[str, Any], *, idempotency_key: str | None = None) -> httpx.Response:
        """POST ``body`` as JSON to ``path`` with an ``Idempotency-Key`` (a fresh UUID when
        ``idempotency_key`` is ``None``; every POST but the claim carries one,
        docs/peers.md#authentication).

        Returns the peer's response whatever its status. Raises ``PeerUnreachable`` on a
        connection failure or after ``timeout`` seconds.
        """
        content = json.dumps(body, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Idempotency-Key": idempotency_key or new_idempotency_key(),
        }
        return await self._send(
            lambda client: client.build_request("POST", self.url_for(path), content=content, headers=headers)
        )

    async def get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        """GET ``path`` with query ``params``; the query is covered by the signature.

        Returns the peer's response whatever its status. Raises ``PeerUnreachable`` on a
        connection failure or after ``timeout`` seconds.
        """
        return await self._send(
            lambda client: client.build_request(
                "GET", self.url_for(path), params=params, headers={"Accept": "application/json"}
            )
        )

    @asynccontextmanager
    async def stream_events(
        self, path: str = "/api/v1/peers/events", *, read_timeout: float = STREAM_READ_TIMEOUT
    ) -> AsyncIterator[httpx_sse.EventSource]:
        """Open the peer's server-sent event stream (docs/peers.md#events).

        ``async with client.stream_events() as events: async for sse in events.aiter_sse()``.
        The response is not checked: read ``events.response.status_code`` first (a 401/403
        answer is JSON; ``aiter_sse`` raises ``httpx_sse.SSEError`` on a non-event-stream
        body). A keep-alive comment arrives as an event with empty ``data``: skip those.
        Connecting uses ``timeout``; each read waits at most ``read_timeout`` seconds.
        Raises ``PeerUnreachable`` for connection failures and timeouts, both when
        connecting and while reading inside the block.
        """
        timeout = httpx.Timeout(self.timeout, read=read_timeout)
        async with self._client(timeout) as client:
            request = client.build_request(
                "GET", self.url_for(path), headers={"Accept": "text/event-stream", "Cache-Control": "no-store"}
            )
            await self._signed(request)
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
            try:
                await self._note_features(response)
                yield httpx_sse.EventSource(response)
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from exc
            finally:
                await response.aclose()

    # The shared notes also call it ``stream``.
    stream = stream_events
