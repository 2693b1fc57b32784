"""Pairing routes (docs/peers.md#pairing) and the staff-only peer management API.

- ``POST /api/v1/peers/claim`` — open (no user, no CSRF: another instance's server calls
  it), rate-limited; body and answer as docs/peers.md#claim.
- ``POST /api/v1/peers/offers`` → ``{code, expires_at, address, fingerprint}``
- ``POST /api/v1/peers/link`` ``{url, code, label?, allow_*?, as_user?}`` →
  ``{peer, our_fingerprint, their_fingerprint}``
- ``GET /api/v1/peers`` → ``{"peers": [...]}`` (the caller's live links)
- ``PATCH /api/v1/peers/{id}`` ``{label?, allow_*?}`` → the peer
- ``DELETE /api/v1/peers/{id}`` → the peer, revoked

The user-facing routes take an API token or a session (+ CSRF) and answer 403 to
non-staff users. Errors use the one shape ``{"error": {code, message, details}}``. The
bodies are the models of ``peers.protocol`` (``ClaimBody``, after the claim rate limit;
``OfferBody``, ``LinkBody``, ``PeerUpdateBody``), validated here, which also describe them
in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from agents.tokens import agent_scope_forbid, calling_agent
from core.errors import DispatchError
from core.http import error_response, json_api, json_object
from core.openapi import OPEN, Operation, documented
from core.validation import parse_plain
from peers import pairing_exchange
from peers.auth import announce_features, method_refusal
from peers.models import Peer
from peers.pairing_protocol import (
    OUR_INSTANCE_ID,
    ClaimAnswer,
    ClaimBody,
    LinkAnswer,
    LinkBody,
    OfferAnswer,
    OfferBody,
    PeerAnswer,
    PeerListAnswer,
    PeerUpdateBody,
)
from peers.selectors import outbox_counts, peer_get_for, peers_for
from peers.services import links
from peers.services.identity import identity_get
from peers.services.pairing import offer_create


def peer_data(peer: Peer, outbox: dict[str, int] | None = None) -> dict[str, Any]:
    """A peer as the API shows it (never a token: the inbound token's prefix only)."""
    return {
        "id": peer.pk,
        "label": peer.label,
        "reported_name": peer.reported_name,
        "instance_id": peer.instance_id,
        "url": peer.url,
        "fingerprint": peer.fingerprint,
        "owner": peer.owner.get_username(),
        "capabilities": {name: getattr(peer, name) for name in links.CAPABILITIES},
        "granted_by_peer": peer.granted_by_peer,
        "inbound_prefix": peer.inbound_prefix,
        "created_at": peer.created_at.isoformat(),
        "last_seen_at": peer.last_seen_at.isoformat() if peer.last_seen_at else None,
        "revoked_at": peer.revoked_at.isoformat() if peer.revoked_at else None,
        "unlinked_by_peer": peer.unlinked_by_peer,
        "outbox": outbox if outbox is not None else {"queued": 0, "dead": 0},
    }


def _client_address(request: HttpRequest) -> str:
    return str(request.META.get("REMOTE_ADDR") or "")


def _claim(body: dict[str, Any], client_address: str) -> dict[str, Any]:
    # The claim's order (docs/peers.md#claim): the rate limit, the body (protocol version first), then the code.
    pairing_exchange.claim_throttle(client_address=client_address)
    claim = parse_plain(ClaimBody, body, context={OUR_INSTANCE_ID: identity_get().instance_id})
    return pairing_exchange.offer_claim(claim=claim)


@documented(
    Operation(
        "post",
        "Pairing: claim an offer with its code (open, 5 a minute per address; 401 for any bad code)",
        "peers",
        ClaimBody,
        ClaimAnswer,
        security=OPEN,
    ),
    rate_limited=True,
)
@announce_features
@csrf_exempt
@login_not_required
async def claim_api(request: HttpRequest) -> HttpResponse:
    """``POST /api/v1/peers/claim`` (docs/peers.md#claim): open, for another instance's server.

    200 ``{protocol_version, instance_id, name, url, public_key, token_for_you,
    capabilities}``; 429 rate limit, 400 protocol or body (``ClaimBody``), 401 bad code,
    409 slot taken.
    """
    if request.method != "POST":
        return method_refusal("POST")
    try:
        body = json_object(request)
        answer = await database_sync_to_async(_claim)(body, _client_address(request))
    except DispatchError as exc:
        response = JsonResponse(exc.as_dict(), status=exc.http_status)
        if exc.http_status == 429:
            response["Retry-After"] = "60"
        return response
    return JsonResponse(answer)


def _staff(request: HttpRequest, user: User) -> None:
    agent_scope_forbid(calling_agent(request), "pair, link, relabel or unlink instances")
    if not user.is_staff:
        raise DispatchError("PERMISSION_DENIED", "pairing is for staff users only")


def _offer_for(user: User, body: OfferBody) -> dict[str, Any]:
    link_user = None
    if body.as_user is not None:
        link_user = User.objects.filter(username=body.as_user).first()
        if link_user is None:
            raise DispatchError("NOT_FOUND", f"no user '{body.as_user}'")
    return offer_create(user=user, link_user=link_user, **body.flags()).as_dict()


@documented(
    Operation(
        "post",
        "Make a pairing offer (staff): its code, valid 10 minutes, usable once",
        "peers",
        OfferBody,
        OfferAnswer,
    )
)
@require_POST
@json_api
async def offers_api(request: HttpRequest, user: User) -> dict[str, Any]:
    """``POST /api/v1/peers/offers`` ``{allow_*?, as_user?}`` → 200 ``{code, expires_at,
    address, fingerprint}``. 403 non-staff, 409 a sixth live offer."""
    _staff(request, user)
    return await database_sync_to_async(_offer_for)(user, parse_plain(OfferBody, json_object(request)))


@documented(Operation("post", "Link with another instance's pairing code (staff)", "peers", LinkBody, LinkAnswer))
@require_POST
@json_api
async def link_api(request: HttpRequest, user: User) -> dict[str, Any]:
    """``POST /api/v1/peers/link`` ``{url, code, label?, allow_*?, as_user?}`` → 200
    ``{peer, our_fingerprint, their_fingerprint}``."""
    _staff(request, user)
    body = parse_plain(LinkBody, json_object(request))
    result = await pairing_exchange.peer_link(
        user=user, url=body.url, code=body.code, label=body.label, as_user=body.as_user, **body.flags()
    )
    data = await database_sync_to_async(peer_data)(result.peer)
    return {"peer": data, "our_fingerprint": result.our_fingerprint, "their_fingerprint": result.their_fingerprint}


def _list(user: User) -> dict[str, Any]:
    peers = list(peers_for(user=user))
    counts = outbox_counts(peer_ids=[peer.pk for peer in peers])
    return {"peers": [peer_data(peer, counts[peer.pk]) for peer in peers]}


@documented(Operation("get", "Your linked instances", "peers", answer=PeerListAnswer))
@require_http_methods(["GET"])
@json_api
async def peers_api(request: HttpRequest, user: User) -> dict[str, Any]:
    """``GET /api/v1/peers`` → ``{"peers": [...]}``: the caller's live links with outbox counts."""
    _staff(request, user)
    return await database_sync_to_async(_list)(user)


def _update(user: User, peer_id: int, body: PeerUpdateBody) -> dict[str, Any]:
    from django.db import transaction

    with transaction.atomic():
        if "label" in body.model_fields_set:
            links.peer_rename(user=user, peer_id=peer_id, label=body.label)
        flags = body.flags()
        if flags:
            links.peer_capabilities_set(user=user, peer_id=peer_id, **flags)
    peer = peer_get_for(user=user, peer_id=peer_id)
    return peer_data(peer, outbox_counts(peer_ids=[peer.pk])[peer.pk])


def _delete(user: User, peer_id: int) -> dict[str, Any]:
    return peer_data(pairing_exchange.peer_unlink(user=user, peer_id=peer_id))


@documented(
    Operation("patch", "Rename a link or change what it may do here", "peers", PeerUpdateBody, PeerAnswer),
    Operation("delete", "Unlink (revokes both directions)", "peers", answer=PeerAnswer),
)
@require_http_methods(["PATCH", "DELETE"])
@json_api
async def peer_api(request: HttpRequest, user: User, peer_id: int) -> dict[str, Any] | HttpResponse:
    """``PATCH /api/v1/peers/{id}`` ``{label?, allow_*?}`` → the peer (409 a taken label);
    ``DELETE /api/v1/peers/{id}`` → the peer, revoked (docs/peers.md#unlinking). 404 not the caller's."""
    _staff(request, user)
    try:
        if request.method == "DELETE":
            return await database_sync_to_async(_delete)(user, peer_id)
        return await database_sync_to_async(_update)(user, peer_id, parse_plain(PeerUpdateBody, json_object(request)))
    except DispatchError as exc:
        return error_response(exc)


api_urlpatterns: list[URLPattern] = [
    path("peers/claim", claim_api, name="api-peers-claim"),
    path("peers/offers", offers_api, name="api-peers-offers"),
    path("peers/link", link_api, name="api-peers-link"),
    path("peers", peers_api, name="api-peers"),
    path("peers/<int:peer_id>", peer_api, name="api-peer"),
]
