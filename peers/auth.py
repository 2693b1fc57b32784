"""Peer authentication (docs/peers.md#authentication): bearer token plus an RFC 9421 message signature.

Every request on a peer route carries ``Authorization: Bearer <token>`` (the token this
instance issued to the peer at pairing) **and** an HTTP message signature (RFC 9421,
Ed25519) by the peer's pinned key over ``@method``, ``@path``, ``@query``,
``authorization``, ``idempotency-key`` (when the request has one), ``content-digest``
(RFC 9530, ``sha-256=:<base64>:``, checked against the body) and a ``created`` time
within ±300 s; ``keyid`` is the sender's fingerprint (``peers.keys.fingerprint_of``).

The sending side is ``sign_request`` (used by ``peers.client.PeerClient``); the
receiving side is ``peer_authenticate`` (async views) / ``peer_authenticate_sync``.
Signing and verifying are done by the ``http_message_signatures`` library; this module
adapts Django and httpx requests to it and applies the policy above.
"""

from __future__ import annotations

import datetime
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any

import httpx
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from channels.db import database_sync_to_async
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.http import HttpRequest, JsonResponse
from http_message_signatures import (
    HTTPMessageSigner,
    HTTPMessageVerifier,
    HTTPSignatureKeyResolver,
    InvalidSignature,
    algorithms,
)
from http_message_signatures.exceptions import HTTPMessageSignaturesException

from core.http import bearer_credentials
from core.openapi import Security
from core.services import token_digest
from peers.keys import FEATURES_HEADER, Identity, features_header_value, features_parse, public_key_from
from peers.models import Peer
from peers.services import links
from peers.services.identity import identity_get

# ±5 minutes on the signature's ``created``.
CLOCK_SKEW = datetime.timedelta(seconds=300)
# Signed application tag: a signature made for another protocol is not one of ours.
SIGNATURE_TAG = "dispatch-peer"
SIGNATURE_LABEL = "dispatch"
# Components every peer request signature covers; ``idempotency-key`` is added when present.
COVERED_COMPONENTS: tuple[str, ...] = ("@method", "@path", "@query", "authorization", "content-digest")

INVALID_TOKEN_CHALLENGE = 'Bearer error="invalid_token"'

# The peer routes in the OpenAPI schema: the token and the signature, and the headers every
# peer POST signs (an Idempotency-Key on every POST but the claim).
PEER_SECURITY = Security(
    ("peerAuth",),
    {
        "peerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": "A linked instance's token plus an RFC 9421 Ed25519 signature (keyid: its fingerprint).",
        }
    },
    body_headers=("Idempotency-Key", "Signature", "Signature-Input", "Content-Digest"),
)


class PeerAuthError(Exception):
    """A refused peer request: ``status`` (401 or 403), an UPPER_SNAKE ``code``, a ``message``.

    ``www_authenticate`` is the ``WWW-Authenticate`` value to send with it (set for every
    401; ``Bearer error="invalid_token"`` when the token itself is missing, unknown or
    revoked).
    """

    def __init__(self, status: int, code: str, message: str, *, www_authenticate: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        if www_authenticate is None and status == 401:
            www_authenticate = "Bearer"
        self.www_authenticate = www_authenticate

    def __repr__(self) -> str:
        return f"PeerAuthError({self.status}, {self.code!r}, {self.message!r})"


def peer_error_response(exc: PeerAuthError) -> JsonResponse:
    """The peer API's error body ``{"error": {code, message, details: {}}}`` with ``exc.status``
    and its ``WWW-Authenticate`` header (docs/peers.md#authentication)."""
    response = JsonResponse({"error": {"code": exc.code, "message": exc.message, "details": {}}}, status=exc.status)
    if exc.www_authenticate:
        response["WWW-Authenticate"] = exc.www_authenticate
    return response


def method_refusal(method: str) -> JsonResponse:
    """405 ``METHOD_NOT_ALLOWED`` in the API's error shape with ``Allow: method``, answered by
    the peer route itself (not Django's bare 405, which the API's error middleware replaces
    and which would lose the route's ``Dispatch-Peer-Features``)."""
    response = JsonResponse(
        {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"use {method} on this route", "details": {}}},
        status=405,
    )
    response["Allow"] = method
    return response


def announce_features(view: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a peer route (sync or async view) so that every answer it gives — success,
    error, 405 — carries this instance's ``Dispatch-Peer-Features`` header
    (``peers.keys.features_header_value``, docs/peers.md#features): the calling peer
    learns what it may ask for from any exchange. Apply it outside the view's other
    decorators (inside ``documented``)."""
    if iscoroutinefunction(view):

        @wraps(view)
        async def announcing(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            response = await view(request, *args, **kwargs)
            response[FEATURES_HEADER] = features_header_value()
            return response

        return markcoroutinefunction(announcing)

    @wraps(view)
    def announcing_sync(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        response = view(request, *args, **kwargs)
        response[FEATURES_HEADER] = features_header_value()
        return response

    return announcing_sync


# --- signing (the sending side) ---------------------------------------------------------------


class _SigningKeyResolver(HTTPSignatureKeyResolver):
    def __init__(self, key_id: str, private_key: Ed25519PrivateKey) -> None:
        self.key_id = key_id
        self.private_key = private_key

    def resolve_private_key(self, key_id: str) -> Ed25519PrivateKey:
        if key_id != self.key_id:
            raise KeyError(key_id)
        return self.private_key

    def resolve_public_key(self, key_id: str) -> Ed25519PublicKey | None:
        return self.private_key.public_key() if key_id == self.key_id else None


def sign_request_with_key(
    request: httpx.Request,
    *,
    private_key: Ed25519PrivateKey,
    keyid: str,
    created: datetime.datetime | None = None,
) -> None:
    """Sign ``request`` in place with ``private_key`` under ``keyid`` (docs/peers.md#authentication).

    Adds ``Content-Digest`` (sha-256 of the request's content, even when empty) and the
    ``Signature-Input`` / ``Signature`` pair (label ``dispatch``, tag ``dispatch-peer``,
    ``alg="ed25519"``) covering ``COVERED_COMPONENTS`` plus ``idempotency-key`` when the
    request has that header. ``created`` defaults to now. Any existing ``Content-Digest``
    is replaced. The request's content must already be in memory (``httpx.Request`` built
    with ``content=``/``json=``). Raises ``HTTPMessageSignaturesException`` for a request
    that cannot be signed (no ``Authorization`` header, non-ASCII header values).
    """
    body = request.read()
    if "content-digest" in request.headers:
        del request.headers["content-digest"]
    covered = list(COVERED_COMPONENTS)
    if "idempotency-key" in request.headers:
        covered.append("idempotency-key")
    signer = HTTPMessageSigner(
        signature_algorithm=algorithms.ED25519, key_resolver=_SigningKeyResolver(keyid, private_key)
    )
    signer.sign(
        request,
        key_id=keyid,
        created=created or datetime.datetime.now(datetime.UTC),
        label=SIGNATURE_LABEL,
        tag=SIGNATURE_TAG,
        covered_component_ids=covered,
        body=body,
    )


def sign_request(request: httpx.Request, *, identity: Identity | None = None) -> None:
    """Sign an outgoing peer request in place as this instance.

    ``identity`` defaults to ``identity_get()`` (a database read: call it from sync code,
    or pass the identity in from async code). ``keyid`` is the identity's fingerprint.
    See ``sign_request_with_key`` for the headers added and the errors raised.
    """
    identity = identity or identity_get()
    sign_request_with_key(request, private_key=identity.private_key, keyid=identity.fingerprint)


# --- verifying (the receiving side) -----------------------------------------------------------


@dataclass
class _DjangoRequestView:
    """What the signature library reads from a request: ``method``, an absolute encoded
    ``url`` (path and query exactly as received) and ``headers`` (lower-cased names)."""

    method: str
    url: str
    headers: dict[str, str]


def _request_view(request: HttpRequest) -> _DjangoRequestView:
    # get_full_path() re-encodes the decoded path (iri_to_uri rules) and appends the raw
    # QUERY_STRING, which is how the sender's httpx URL encodes its path and query.
    host = request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME") or "localhost"
    headers = {name.lower(): value for name, value in request.headers.items()}
    return _DjangoRequestView(
        method=(request.method or "GET").upper(),
        url=f"{request.scheme}://{host}{request.get_full_path()}",
        headers=headers,
    )


class _PinnedKeyResolver(HTTPSignatureKeyResolver):
    """Resolves exactly one keyid: the token's peer's fingerprint; remembers any other."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.foreign_keyid: str | None = None

    def resolve_public_key(self, key_id: str) -> Ed25519PublicKey | None:
        if not hmac.compare_digest(key_id.encode(), self.peer.fingerprint.encode()):
            self.foreign_keyid = key_id
            return None
        return public_key_from(self.peer.public_key)

    def resolve_private_key(self, key_id: str) -> Any:
        raise KeyError("a verifier holds no private keys")


class _PeerVerifier(HTTPMessageVerifier):
    max_clock_skew = CLOCK_SKEW
    require_created = True


def _signature_keyid(view: _DjangoRequestView) -> str | None:
    """The ``keyid`` of the request's one signature, if its Signature-Input can be read."""
    value = view.headers.get("signature-input")
    if not value:
        return None
    try:
        parsed = HTTPMessageVerifier._parse_signature_dictionary(value)
    except Exception:
        return None
    for member in parsed.values():
        keyid = getattr(member, "params", {}).get("keyid")
        if isinstance(keyid, str):
            return keyid
    return None


def _peer_for_token(request: HttpRequest) -> Peer:
    raw = bearer_credentials(request.headers.get("Authorization", ""))
    if not raw:
        raise PeerAuthError(
            401,
            "NOT_AUTHENTICATED",
            "peer credential required: send 'Authorization: Bearer <token>'",
            www_authenticate=INVALID_TOKEN_CHALLENGE,
        )
    if len(raw) > 200:
        raise PeerAuthError(
            401, "AUTHENTICATION_FAILED", "unknown or revoked peer credential", www_authenticate=INVALID_TOKEN_CHALLENGE
        )
    digest = token_digest(raw)
    peer = Peer.objects.select_related("owner").filter(inbound_digest=digest).first()
    if peer is None or not hmac.compare_digest(peer.inbound_digest, digest) or peer.revoked_at is not None:
        raise PeerAuthError(
            401, "AUTHENTICATION_FAILED", "unknown or revoked peer credential", www_authenticate=INVALID_TOKEN_CHALLENGE
        )
    return peer


def _verify_signature(request: HttpRequest, peer: Peer) -> None:
    view = _request_view(request)
    if "signature-input" not in view.headers or "signature" not in view.headers:
        raise PeerAuthError(401, "AUTHENTICATION_FAILED", "missing HTTP message signature (RFC 9421)")
    keyid = _signature_keyid(view)
    if keyid is not None and not hmac.compare_digest(keyid.encode(), peer.fingerprint.encode()):
        raise PeerAuthError(403, "PERMISSION_DENIED", "the signature's keyid is not the pinned key of this peer")
    required = list(COVERED_COMPONENTS)
    if "idempotency-key" in view.headers:
        required.append("idempotency-key")
    resolver = _PinnedKeyResolver(peer)
    verifier = _PeerVerifier(signature_algorithm=algorithms.ED25519, key_resolver=resolver)
    try:
        verifier.verify(
            view,
            max_age=datetime.timedelta(0),  # with the ±300 s skew: created no older than 5 minutes
            expect_tag=SIGNATURE_TAG,
            require_components=required,
            body=request.body,
        )
    except (InvalidSignature, HTTPMessageSignaturesException) as exc:
        if resolver.foreign_keyid is not None:
            raise PeerAuthError(
                403, "PERMISSION_DENIED", "the signature's keyid is not the pinned key of this peer"
            ) from None
        raise PeerAuthError(401, "AUTHENTICATION_FAILED", f"invalid HTTP message signature: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "maximum allowable age" in text:
        return "created more than 5 minutes ago"
    if "in the future" in text:
        return "created more than 5 minutes in the future"
    return text or "it does not verify with the peer's pinned key"


def peer_authenticate_sync(request: HttpRequest) -> Peer:
    """The live ``Peer`` a peer-route request comes from, for sync views.

    Checks, in order: ``Authorization: Bearer <token>`` names a live peer (token looked
    up by its SHA-256, compared in constant time; revoked = unknown); the request carries
    a ``dispatch-peer`` signature whose ``keyid`` is that peer's fingerprint; the
    signature verifies with the peer's pinned Ed25519 key, covers ``COVERED_COMPONENTS``
    (and ``idempotency-key`` when sent), has a ``created`` within ±300 s, and its
    ``Content-Digest`` matches the body. On success stamps ``last_seen_at`` (at most once
    a minute, ``links.peer_seen``), keeps the features its ``Dispatch-Peer-Features``
    header announces (``links.peer_features_record``; none without the header) and returns
    the peer with ``owner`` loaded.

    Raises ``PeerAuthError``: 401 ``NOT_AUTHENTICATED`` / ``AUTHENTICATION_FAILED`` with
    ``WWW-Authenticate: Bearer error="invalid_token"`` for a missing, unknown or revoked
    token; 401 ``AUTHENTICATION_FAILED`` for a missing or bad signature, a stale or
    future ``created``, a digest mismatch; 403 ``PERMISSION_DENIED`` for a ``keyid``
    other than the token's peer's fingerprint.
    """
    peer = _peer_for_token(request)
    _verify_signature(request, peer)
    links.peer_seen(peer=peer)
    links.peer_features_record(peer=peer, features=features_parse(request.headers.get(FEATURES_HEADER)))
    return peer


async def peer_authenticate(request: HttpRequest) -> Peer:
    """``peer_authenticate_sync`` for async views: same checks, result and errors.

    The database work (one lookup, at most one UPDATE) runs through
    ``database_sync_to_async``; nothing waits there.
    """
    return await database_sync_to_async(peer_authenticate_sync)(request)
