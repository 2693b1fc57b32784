"""Pairing's exchanges between two instances (docs/peers.md#pairing, docs/peers.md#unlinking).

The TV model: the side being connected to (B) shows a code
(``peers.services.pairing.offer_create``); the connecting side (A) types it, and A's
server calls B's open ``POST /api/v1/peers/claim`` (``peer_link`` on A, ``offer_claim`` on
B). Each side then holds one ``Peer`` row with the hash of the token it issued (inbound),
the encrypted token it presents (outbound) and the other side's public key. Unlinking
tells the peer with a best-effort ``POST /api/v1/peers/unlink`` (``peer_unlink``).

The claim and its answer are validated by their models (``peers.pairing_protocol.ClaimBody``, at
the claim route after ``claim_throttle``; ``ClaimAnswer``, here); this module counts claims,
checks the code and makes the HTTP calls; every write —
offers, the ``Peer`` rows, revocation — is ``peers.services.pairing``'s, and a link's
label, capabilities and credentials are ``peers.services.links``'.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

import httpx
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from limits import parse

from core.errors import DispatchError, InvalidRequest, NotFound, RateLimited
from core.services import generate_token, rate_limiter
from core.validation import parse_plain
from peers.client import PeerClient, PeerUnreachable
from peers.keys import PEER_FEATURES, PEER_PROTOCOL_VERSION, Identity
from peers.models import Peer, new_idempotency_key
from peers.pairing_protocol import OUR_INSTANCE_ID, ClaimAnswer, ClaimBody
from peers.services.identity import identity_get, staff_require
from peers.services.links import capabilities_validate, label_validate
from peers.services.pairing import (
    code_display,
    code_normalize,
    offer_redeem,
    offer_wrong_code_record,
    peer_link_store,
    peer_revoke,
    peer_revoke_as_admin,
)

__all__ = [
    "BAD_CODE",
    "LinkResult",
    "claim_throttle",
    "offer_claim",
    "peer_link",
    "peer_revoke_admin",
    "peer_unlink",
]

logger = logging.getLogger("peers.pairing")  # the name operators and log filters know it by

CLAIM_RATE = parse("5 per minute")  # per client address (docs/peers.md#claim)
BAD_CODE = "pairing code is unknown, used or expired"
CLAIM_PATH = "/api/v1/peers/claim"
UNLINK_PATH = "/api/v1/peers/unlink"
CLAIM_TIMEOUT = 30.0  # seconds


# --- B side: the claim ---------------------------------------------------------------------------


def claim_throttle(*, client_address: str) -> None:
    """Count a claim from ``client_address``; ``RATE_LIMITED`` (429) past 5 a minute from it.
    The first check of a claim, before its body."""
    if not rate_limiter().hit(CLAIM_RATE, settings.REDIS_PREFIX, "peer-claim", client_address or "-"):
        raise RateLimited("too many pairing claims from this address; try again in a minute")


def offer_claim(*, claim: ClaimBody) -> dict[str, Any]:
    """Serve ``POST /api/v1/peers/claim`` on B (docs/peers.md#claim) for a ``claim`` already past
    the first checks at the edge (``claim_throttle``, 429; ``ClaimBody``, 400: the protocol
    version first, then the fields), checking in this order:

    1. the code: unknown, used or expired → ``AUTHENTICATION_FAILED`` (401), one message;
       the fifth wrong code within 10 minutes burns every live offer;
    2. slot takeover: the ``instance_id`` linked (live) under another key → ``CONFLICT`` (409).

    Then stores the claimant as a peer acting as the offer's ``link_user`` with the offer's
    capabilities — or, for the same id and key, rotates both tokens in place — marks the
    offer used (``peers.services.pairing.offer_redeem``), and returns ``{protocol_version,
    instance_id, name, url, public_key, token_for_you, capabilities}`` (this instance, and
    the token it issued to the peer).
    """
    identity = identity_get()
    code = code_normalize(claim.code)
    accepted = None
    if code is not None:
        accepted = offer_redeem(
            code=code,
            instance_id=claim.instance_id,
            name=claim.name,
            url=claim.url,
            public_key=claim.public_key,
            token_for_you=claim.token_for_you,
            granted_by_peer=claim.capabilities or {},
            features=claim.features,
        )
    if accepted is None:
        offer_wrong_code_record()
        raise DispatchError("AUTHENTICATION_FAILED", BAD_CODE)
    peer = accepted.peer
    logger.info("paired with %s (%s) as %s", peer.label, peer.instance_id, peer.owner.get_username())
    return {
        "protocol_version": PEER_PROTOCOL_VERSION,
        "instance_id": identity.instance_id,
        "name": identity.name,
        "url": identity.url,
        "public_key": identity.public_key,
        "token_for_you": accepted.token_for_you,
        "capabilities": accepted.capabilities,
        "features": list(PEER_FEATURES),
    }


# --- A side: linking with a code ---------------------------------------------------------------


@dataclass(frozen=True)
class LinkResult:
    """A link just made on A: the peer row and both fingerprints, shown to compare."""

    peer: Peer
    our_fingerprint: str
    their_fingerprint: str


def _link_prepare(*, user: User, as_user: User | str | None, label: str | None) -> tuple[User, Identity]:
    staff_require(user=user)
    if isinstance(as_user, str) and as_user:
        found = User.objects.filter(username=as_user).first()
        if found is None:
            raise NotFound(f"no user '{as_user}'")
        as_user = found
    link_user = as_user if isinstance(as_user, User) else user
    if not link_user.is_active:
        raise InvalidRequest(f"user '{link_user.get_username()}' is not active")
    if label is not None:
        label_validate(label)
    return link_user, identity_get()


def _address_free_for(*, address: str, owner: User) -> None:
    """``CONFLICT`` when a live link to ``address`` acts for another user here."""
    taken = Peer.objects.filter(url=address, revoked_at__isnull=True).exclude(owner=owner).first()
    if taken is not None:
        raise DispatchError(
            "CONFLICT",
            f"{address} is already linked here for another user (as '{taken.label}'); that link must be "
            "unlinked before it can be paired for someone else",
            {"label": taken.label},
        )


def _peer_error(response: httpx.Response, url: str) -> DispatchError:
    """B's refusal as our error: its message, its code (a wrong code is bad input here, 400)."""
    try:
        error = response.json().get("error") or {}
        code, message = str(error.get("code") or ""), str(error.get("message") or "")
    except (ValueError, AttributeError):
        code, message = "", ""
    message = message or f"{url} answered HTTP {response.status_code}"
    if response.status_code == 401 or not code:
        code = "INVALID_REQUEST" if response.status_code < 500 else "REMOTE_ERROR"
    return DispatchError(code, f"the other instance refused the pairing: {message}", {"status": response.status_code})


async def peer_link(
    *,
    user: User,
    url: str,
    code: str,
    label: str | None = None,
    as_user: User | str | None = None,
    timeout: float = CLAIM_TIMEOUT,
    **capabilities: bool,
) -> LinkResult:
    """Link this instance (A) to the instance at ``url`` (B) with B's pairing ``code`` (docs/peers.md#pairing).

    ``user`` must be staff (403). The link acts here as ``as_user`` (a user or a username;
    default ``user``); ``label`` (docs/peers.md#labels, validated; a collision gets ``-2``, ``-3``…)
    defaults to B's name; ``capabilities`` are what B may do here (missing flags take their defaults).
    Issues a fresh token for B, posts the unsigned claim to ``<url>/api/v1/peers/claim``
    (``timeout`` seconds), then stores B — or rotates the tokens of an existing link with
    the same id and key (``peers.services.pairing.peer_link_store``). Errors: a malformed
    code or label → 400 before any call; B unreachable → ``REMOTE_ERROR`` (502); B's
    refusal → its code and message (a wrong code → 400); a malformed answer →
    ``INVALID_RESPONSE`` (502); B linked here under another key → ``CONFLICT`` (409).
    """
    address = (url or "").strip().rstrip("/")
    if not address.startswith(("http://", "https://")) or len(address) > 2048:
        raise InvalidRequest("the address must be a URL starting with http:// or https://")
    normalized = code_normalize(code)
    if normalized is None:
        raise InvalidRequest("a pairing code is 8 letters, shown as XXXX-XXXX")
    flags = capabilities_validate(capabilities)
    link_user, identity = await database_sync_to_async(_link_prepare)(user=user, as_user=as_user, label=label)
    label = label_validate(label) if label is not None else None
    # Refuse before the claim (which rotates B's side) when this address is already linked
    # for another user here; peer_link_store checks again by instance id after the answer.
    await database_sync_to_async(_address_free_for)(address=address, owner=link_user)
    inbound = generate_token()
    claim = {
        "code": code_display(normalized),
        "protocol_version": PEER_PROTOCOL_VERSION,
        "instance_id": identity.instance_id,
        "name": identity.name,
        "url": identity.url,
        "public_key": identity.public_key,
        "token_for_you": inbound,
        "capabilities": flags,
        "features": list(PEER_FEATURES),
    }
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.post(address + CLAIM_PATH, json=claim)
    except httpx.HTTPError as exc:
        raise DispatchError("REMOTE_ERROR", f"could not reach {address}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise _peer_error(response, address)
    try:
        answer_body = response.json()
        if not isinstance(answer_body, dict):
            raise ValueError("not an object")
        if answer_body.get("protocol_version") != PEER_PROTOCOL_VERSION:
            raise ValueError(f"protocol {answer_body.get('protocol_version')}")
        answer = parse_plain(ClaimAnswer, answer_body, context={OUR_INSTANCE_ID: identity.instance_id})
    except (ValueError, DispatchError) as exc:
        raise DispatchError("INVALID_RESPONSE", f"{address} gave an unusable pairing answer: {exc}") from None
    peer = await database_sync_to_async(peer_link_store)(
        owner=link_user,
        inbound=inbound,
        instance_id=answer.instance_id,
        name=answer.name,
        url=address,  # the address the person typed: proven to reach the peer
        public_key=answer.public_key,
        token_for_you=answer.token_for_you,
        granted_by_peer=answer.capabilities,
        features=answer.features,
        label=label,
        flags=flags,
    )
    logger.info("linked to %s (%s) as %s", peer.label, peer.instance_id, link_user.get_username())
    return LinkResult(peer=peer, our_fingerprint=identity.fingerprint, their_fingerprint=peer.fingerprint)


# --- unlinking: telling the peer --------------------------------------------------------------------


def _notify_unlinked(peer: Peer) -> None:
    """Best-effort ``POST /api/v1/peers/unlink`` from a thread of its own, so no
    caller — and never the shared sync thread — waits on the peer."""

    async def notify() -> None:
        try:
            response = await PeerClient(peer, timeout=10.0, identity=identity).post(
                UNLINK_PATH, {"instance_id": identity.instance_id}, idempotency_key=new_idempotency_key()
            )
            logger.info("told %s it was unlinked: HTTP %s", peer.label, response.status_code)
        except PeerUnreachable as exc:
            logger.info("could not tell %s it was unlinked: %s", peer.label, exc)
        except Exception:
            logger.exception("could not tell %s it was unlinked", peer.label)

    identity = identity_get()
    threading.Thread(target=asyncio.run, args=(notify(),), name=f"peer-unlink-{peer.pk}", daemon=True).start()


def peer_unlink(*, user: User, peer_id: int, notify: bool = True) -> Peer:
    """Unlink one of ``user``'s peers (docs/peers.md#unlinking): revoke it here in one transaction
    (``peers.services.pairing.peer_revoke``: credentials, queued outbox rows, running
    shadows), then, after commit, tell the peer with a best-effort ``POST
    /api/v1/peers/unlink`` (``notify``) from a thread of its own. ``NotFound`` (404) for a
    peer that is not the user's live peer."""
    return peer_revoke(user=user, peer_id=peer_id, on_revoked=_notify_unlinked if notify else None)


def peer_revoke_admin(*, peer: Peer, actor: User) -> Peer:
    """Unlink any live peer as an administrator (the admin's "revoke peer" action): like
    ``peer_unlink`` but not limited to the actor's own links
    (``peers.services.pairing.peer_revoke_as_admin``); the peer is told after commit."""
    return peer_revoke_as_admin(peer=peer, actor=actor, on_revoked=_notify_unlinked)
