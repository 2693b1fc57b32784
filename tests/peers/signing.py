"""Requests as a peer would send them, for the tests of peer routes (docs/peers.md#authentication).

``signed_headers(fake_peer, method, path, body)`` returns the headers a ``FakePeer``
(tests/peers/conftest.py) sends: its bearer token (the one we issued to it), the
``Content-Digest`` of ``body`` and an RFC 9421 signature by its private key, made with
the same code the real client uses (``peers.auth.sign_request_with_key``). Pass them to
``django.test.Client`` / ``AsyncClient`` as ``headers=``; ``path`` may carry a query.
``peer_post`` / ``peer_get`` (sync client) and ``apeer_post`` / ``apeer_get`` (async
client) do the whole request.

Tampering knobs: ``created`` (a datetime), ``keyid`` (another fingerprint), ``token``
(another bearer token, or ``""`` to leave Authorization out).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peers.auth import sign_request_with_key
from peers.models import new_idempotency_key
from tests.peers.conftest import FakePeer

TEST_HOST = "testserver"
SIGNED_HEADERS = ("Authorization", "Idempotency-Key", "Content-Digest", "Signature-Input", "Signature")


def signed_headers(
    fake_peer: FakePeer,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    idempotency_key: str | None = None,
    created: datetime.datetime | None = None,
    keyid: str | None = None,
    token: str | None = None,
    private_key: Ed25519PrivateKey | None = None,
) -> dict[str, str]:
    """The headers ``fake_peer`` sends with ``method path`` and ``body`` (bytes as sent).

    ``token`` defaults to ``fake_peer.inbound_token``; ``""`` omits Authorization (the
    signature then covers an empty header, which the receiver refuses first anyway).
    ``private_key``/``keyid`` default to the fake peer's own.
    """
    headers: dict[str, str] = {}
    presented = fake_peer.inbound_token if token is None else token
    headers["Authorization"] = f"Bearer {presented}" if presented else ""
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    request = httpx.Request(method.upper(), f"http://{TEST_HOST}{path}", content=body, headers=headers)
    sign_request_with_key(
        request,
        private_key=private_key or fake_peer.private_key,
        keyid=keyid or fake_peer.fingerprint,
        created=created,
    )
    out = {name: request.headers[name] for name in SIGNED_HEADERS if name in request.headers}
    if not presented:
        out.pop("Authorization", None)
    return out


def json_body(body: dict[str, Any]) -> bytes:
    """``body`` as the compact JSON bytes the client sends."""
    return json.dumps(body, separators=(",", ":")).encode()


def peer_post(
    client: Any, fake_peer: FakePeer, path: str, body: dict[str, Any], *, idempotency_key: str | None = None
) -> Any:
    """POST ``body`` as ``fake_peer`` with ``django.test.Client`` (a fresh Idempotency-Key by default)."""
    content = json_body(body)
    key = idempotency_key or new_idempotency_key()
    headers = signed_headers(fake_peer, "POST", path, content, idempotency_key=key)
    return client.post(path, data=content, content_type="application/json", headers=headers)


def peer_get(client: Any, fake_peer: FakePeer, path: str) -> Any:
    """GET ``path`` (query included) as ``fake_peer`` with ``django.test.Client``."""
    return client.get(path, headers=signed_headers(fake_peer, "GET", path))


async def apeer_post(
    client: Any, fake_peer: FakePeer, path: str, body: dict[str, Any], *, idempotency_key: str | None = None
) -> Any:
    """POST ``body`` as ``fake_peer`` with ``django.test.AsyncClient``.

    Signing reads nothing from the database, so this is safe in async tests.
    """
    content = json_body(body)
    key = idempotency_key or new_idempotency_key()
    headers = signed_headers(fake_peer, "POST", path, content, idempotency_key=key)
    return await client.post(path, data=content, content_type="application/json", headers=headers)


async def apeer_get(client: Any, fake_peer: FakePeer, path: str) -> Any:
    """GET ``path`` as ``fake_peer`` with ``django.test.AsyncClient``."""
    return await client.get(path, headers=signed_headers(fake_peer, "GET", path))
