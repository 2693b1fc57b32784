"""Making and ending links (docs/peers.md#pairing, docs/peers.md#unlinking): pairing offers and their
codes, the ``Peer`` row a claim or a claim's answer stores, and revocation.

The TV model: the side being connected to (B) makes an offer (``offer_create``) and shows
its code; the other side's claim redeems it (``offer_redeem``, called by
``peers.pairing_exchange.offer_claim``, which validates the claim body). The connecting side (A)
stores B from B's answer (``peer_link_store``, called by ``peers.pairing_exchange.peer_link``, which
makes the HTTP exchange). Unlinking revokes the link here (``peer_revoke``); telling the
peer is HTTP, so it is the caller's (``on_revoked``, run after commit:
``peers.pairing_exchange.peer_unlink``). The label and capability rules are
``peers.services.links``'.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from limits import parse

from agents.models import AgentMessage
from core import secrets_at_rest
from core.errors import DispatchError, InvalidRequest
from core.realtime import PEERS_MIRROR_GROUP, ring_on_commit
from core.services import generate_token, rate_limiter, token_digest
from core.tool_changes import tools_changed_on_commit
from peers.keys import PEER_PROTOCOL_VERSION, fingerprint_of
from peers.models import OutboxMessage, PairingOffer, Peer
from peers.protocol import MirrorRescanMessage
from peers.selectors import live_offers, peer_get_for
from peers.services.identity import identity_get, staff_require
from peers.services.links import CAPABILITIES, capabilities_validate, label_for_link, label_is_own_name
from peers.services.shadows import shadows_stop_for_unlink

logger = logging.getLogger(__name__)

CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
CODE_LENGTH = 8
OFFER_LIFETIME = timedelta(minutes=10)
MAX_LIVE_OFFERS = 5
WRONG_CODE_LIMIT = parse("5 per 10 minutes")  # per instance: then every live offer is burned


def _mirror_rescan() -> None:
    """Ring the mirroring loop (``peers.mirror``, which sits above this module) to rescan the
    links after commit, as ``peers.mirror.mirror_rescan`` does."""
    ring_on_commit(PEERS_MIRROR_GROUP, MirrorRescanMessage())


# --- codes -----------------------------------------------------------------------------------------


def _code_generate() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def code_display(code: str) -> str:
    """``BCDFGHJK`` → ``BCDF-GHJK``, the form people read and type."""
    return f"{code[:4]}-{code[4:]}"


def code_normalize(text: Any) -> str | None:
    """A typed pairing code in its stored form (8 upper-case letters of ``CODE_ALPHABET``), or
    ``None`` when it cannot be one. Accepts lower case, a dash and surrounding spaces."""
    if not isinstance(text, str) or len(text) > 20:
        return None
    code = text.strip().replace("-", "").replace(" ", "").upper()
    if len(code) != CODE_LENGTH or any(char not in CODE_ALPHABET for char in code):
        return None
    return code


def _code_digest(code: str) -> str:
    return hashlib.sha256(code.encode("ascii")).hexdigest()


# --- B side: offers and claims ---------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedOffer:
    """A pairing offer just made: ``code`` (``XXXX-XXXX``) is shown once and never stored."""

    offer: PairingOffer
    code: str
    expires_at: datetime
    address: str
    fingerprint: str

    def as_dict(self) -> dict[str, Any]:
        """``{code, expires_at, address, fingerprint}`` for the API and commands."""
        return {
            "code": self.code,
            "expires_at": self.expires_at.isoformat(),
            "address": self.address,
            "fingerprint": self.fingerprint,
        }


@transaction.atomic
def offer_create(*, user: User, link_user: User | None = None, **capabilities: bool) -> IssuedOffer:
    """Make a pairing offer (docs/peers.md#pairing): a code of 8 characters from ``CODE_ALPHABET``,
    stored as its SHA-256, valid 10 minutes, usable once, carrying ``capabilities``
    (``allow_launch`` etc., missing ones at their defaults) for the peer that claims it.

    ``user`` must be staff (``PERMISSION_DENIED`` 403); ``link_user`` (default ``user``) is
    the user the link will act as here. A sixth live offer raises ``CONFLICT`` (409).
    Returns the offer with the display code, expiry, this instance's address
    (``DISPATCH_PUBLIC_URL``) and fingerprint.
    """
    staff_require(user=user)
    link_user = link_user or user
    if not link_user.is_active:
        raise InvalidRequest(f"user '{link_user.get_username()}' is not active")
    flags = capabilities_validate(capabilities)
    list(live_offers().select_for_update())  # serialise concurrent offers on the live rows
    if live_offers().count() >= MAX_LIVE_OFFERS:
        raise DispatchError(
            "CONFLICT",
            f"at most {MAX_LIVE_OFFERS} pairing codes can be live at once; wait for one to be used or to expire",
        )
    identity = identity_get()
    while True:
        code = _code_generate()
        if not PairingOffer.objects.filter(code_digest=_code_digest(code)).exists():
            break
    now = timezone.now()
    offer = PairingOffer.objects.create(
        code_digest=_code_digest(code),
        created_by=user,
        link_user=link_user,
        created_at=now,
        expires_at=now + OFFER_LIFETIME,
        **flags,
    )
    return IssuedOffer(
        offer=offer,
        code=code_display(code),
        expires_at=offer.expires_at,
        address=identity.url,
        fingerprint=identity.fingerprint,
    )


def offer_wrong_code_record() -> int:
    """Count a wrong pairing code (per instance, in the rate limiter's storage); the fifth
    within 10 minutes burns every live offer (docs/peers.md#claim). Returns how many offers were
    burned (0 before the fifth)."""
    limiter = rate_limiter()
    key = (settings.REDIS_PREFIX, "peer-claim-wrong-code")
    limiter.hit(WRONG_CODE_LIMIT, *key)
    if limiter.test(WRONG_CODE_LIMIT, *key):
        return 0
    burned = live_offers().update(burned_at=timezone.now())
    if burned:
        logger.warning("5 wrong pairing codes within 10 minutes: burned %d live pairing offers", burned)
    return burned


def _slot_check(*, instance_id: str, public_key: str, owner: User | None = None) -> Peer | None:
    """The live peer of ``instance_id`` (a re-pair), locked, or ``None``; ``CONFLICT`` (409)
    when it is linked under another key — the existing link is left untouched —
    or, with ``owner``, when the link acts for another user here: re-pairing rotates tokens,
    it never hands a user's link (shadows, messages, outbox) to someone else (docs/peers.md#who-a-link-acts-as)."""
    existing = Peer.objects.select_for_update().filter(instance_id=instance_id, revoked_at__isnull=True).first()
    if existing is not None and existing.public_key != public_key:
        raise DispatchError(
            "CONFLICT",
            f"instance {instance_id} is already linked here with a different key; "
            "unlink it first if that instance was reinstalled",
            {"instance_id": instance_id, "fingerprint": existing.fingerprint},
        )
    if existing is not None and owner is not None and existing.owner_id != owner.pk:
        raise DispatchError(
            "CONFLICT",
            f"instance {instance_id} is already linked here for another user; that link must be "
            "unlinked before it can be paired for someone else",
            {"instance_id": instance_id},
        )
    return existing


def _peer_store(
    *,
    existing: Peer | None,
    owner: User,
    inbound: str,
    instance_id: str,
    name: str,
    url: str,
    public_key: str,
    token_for_you: str,
    granted_by_peer: dict[str, bool],
    features: list[str],
    label: str | None,
    flags: dict[str, bool],
) -> Peer:
    """Create the peer row, or re-pair ``existing`` (rotate its tokens in place): ``inbound``
    is the raw token the peer presents here (stored as its hash), ``token_for_you`` the one
    this instance presents there (stored encrypted). The label is ``links.label_for_link``'s:
    ``label`` or the peer's ``name``, never this instance's own name (then one naming the
    peer's ``url``), unique among live peers."""
    now = timezone.now()
    tools_changed_on_commit([owner.pk])  # dispatch_launch_agent lists the linked instances
    fields: dict[str, Any] = {
        "owner": owner,
        "reported_name": name[:100],
        "url": url,
        "public_key": public_key,
        "fingerprint": fingerprint_of(public_key),
        "inbound_digest": token_digest(inbound),
        "inbound_prefix": inbound[:8],
        "outbound_token_encrypted": secrets_at_rest.encrypt(token_for_you.encode()),
        "granted_by_peer": granted_by_peer,
        "features": features,
        "protocol_version": PEER_PROTOCOL_VERSION,
        "updated_at": now,
        **flags,
    }
    if existing is not None:
        if label is not None or label_is_own_name(existing.label):
            # A re-pair keeps the label unless one is given — or the old one is this
            # instance's own name (a link made before labels were kept apart from it): it gets a distinct one.
            fields["label"] = label_for_link(
                label=label if label is not None else existing.label, name=name, url=url, exclude_peer_id=existing.pk
            )
        for field, value in fields.items():
            setattr(existing, field, value)
        existing.save()
        return existing
    return Peer.objects.create(
        instance_id=instance_id,
        label=label_for_link(label=label, name=name, url=url),
        created_at=now,
        **fields,
    )


@dataclass(frozen=True)
class ClaimAccepted:
    """A redeemed offer: the peer stored on B, the raw token B issued to it (answered as
    ``token_for_you``; only its hash is kept) and the offer's capabilities."""

    peer: Peer
    token_for_you: str
    capabilities: dict[str, bool]


@transaction.atomic
def offer_redeem(
    *,
    code: str,
    instance_id: str,
    name: str,
    url: str,
    public_key: str,
    token_for_you: str,
    granted_by_peer: dict[str, bool],
    features: list[str] | None = None,
) -> ClaimAccepted | None:
    """Redeem the live offer of ``code`` (normalized, ``code_normalize``) for the claiming
    instance (docs/peers.md#claim, after the rate limit and the body's validation), in one
    transaction: check the slot, store the claimant as a peer acting as the offer's
    ``link_user`` with the offer's capabilities — or, for the same id and key, rotate both
    tokens in place — issue a fresh inbound token, mark the offer used and ring the
    mirror's rescan after commit.

    ``name``, ``url``, ``public_key``, ``token_for_you`` (encrypted at rest) and
    ``granted_by_peer`` (what the claimant lets this instance do there) and ``features``
    (what it announced, ``peers.keys.PEER_FEATURES`` names; none by default) are the claim's;
    the claimant's label is its ``name`` — or, when that is this instance's own name, one
    naming its ``url`` (``links.label_for_link``).
    Returns ``None`` (nothing written) when no live offer has that code — unknown, used,
    expired or burned. Raises ``CONFLICT`` (409) when ``instance_id`` is linked here under
    another key or for another user.
    """
    offer = live_offers().select_for_update().select_related("link_user").filter(code_digest=_code_digest(code)).first()
    if offer is None:
        return None
    existing = _slot_check(instance_id=instance_id, public_key=public_key, owner=offer.link_user)
    flags = {name: getattr(offer, name) for name in CAPABILITIES}
    inbound = generate_token()
    peer = _peer_store(
        existing=existing,
        owner=offer.link_user,
        inbound=inbound,
        instance_id=instance_id,
        name=name,
        url=url,
        public_key=public_key,
        token_for_you=token_for_you,
        granted_by_peer=granted_by_peer,
        features=features or [],
        label=None,
        flags=flags,
    )
    offer.used_at = timezone.now()
    offer.peer = peer
    offer.save(update_fields=["used_at", "peer"])
    _mirror_rescan()  # after commit: subscribe to the new peer now, not at the next rescan
    return ClaimAccepted(peer=peer, token_for_you=inbound, capabilities=flags)


# --- A side: storing the peer that answered the claim -----------------------------------------------


@transaction.atomic
def peer_link_store(
    *,
    owner: User,
    inbound: str,
    instance_id: str,
    name: str,
    url: str,
    public_key: str,
    token_for_you: str,
    granted_by_peer: dict[str, bool],
    label: str | None,
    flags: dict[str, bool],
    features: list[str] | None = None,
) -> Peer:
    """Store the instance that answered this instance's claim, acting here
    as ``owner``: a new peer, or — same id and key — the existing link with both tokens
    rotated in place. Then ring the mirror's rescan after commit.

    ``inbound``: the raw token this instance sent in the claim (the peer presents it here;
    its hash is kept). ``url``: the address the person typed (proven to reach the peer).
    ``name``, ``public_key``, ``token_for_you``, ``granted_by_peer`` and ``features`` (none
    by default) are the answer's;
    ``label`` (validated, ``links.label_validate``; a collision gets ``-2``, ``-3``…)
    defaults to the peer's name — but is never this instance's own name: then it names the
    peer's address (``links.label_for_link``); ``flags`` are what the peer may do here. Raises
    ``CONFLICT`` (409) when ``instance_id`` is linked here under another key or for another
    user.
    """
    existing = _slot_check(instance_id=instance_id, public_key=public_key, owner=owner)
    peer = _peer_store(
        existing=existing,
        owner=owner,
        inbound=inbound,
        instance_id=instance_id,
        name=name,
        url=url,
        public_key=public_key,
        token_for_you=token_for_you,
        granted_by_peer=granted_by_peer,
        features=features or [],
        label=label,
        flags=flags,
    )
    _mirror_rescan()  # after commit: subscribe to the new peer now, not at the next rescan
    return peer


# --- unlinking -------------------------------------------------------------------------------------


def _revoke_locally(peer: Peer, *, reason: str, by_peer: bool) -> Peer:
    """The local effects of an unlink (docs/peers.md#unlinking), inside the caller's transaction."""
    now = timezone.now()
    peer.revoked_at = now
    peer.revoked_reason = reason[:200]
    peer.unlinked_by_peer = by_peer
    peer.updated_at = now
    peer.save(update_fields=["revoked_at", "revoked_reason", "unlinked_by_peer", "updated_at"])
    tools_changed_on_commit([peer.owner_id])
    queued = OutboxMessage.objects.select_for_update().filter(peer=peer, status=OutboxMessage.Status.QUEUED)
    message_ids = list(queued.values_list("message_id", flat=True))
    queued.update(status=OutboxMessage.Status.DEAD, last_error="peer revoked", dead_at=now)
    AgentMessage.objects.filter(pk__in=message_ids, status=AgentMessage.Status.QUEUED).update(
        status=AgentMessage.Status.DEAD, error="peer revoked"
    )
    shadows_stop_for_unlink(peer=peer)
    _mirror_rescan()  # after commit: the peer's subscriber stops
    return peer


@transaction.atomic
def peer_revoke(*, user: User, peer_id: int, on_revoked: Callable[[Peer], None] | None = None) -> Peer:
    """Unlink one of ``user``'s peers here, in one transaction: its credentials
    are revoked (``revoked_at``: neither token works any more), its queued outbox rows
    closed (``dead``, "peer revoked") with their messages marked ``dead``, its running
    shadows ``stopped`` with a ``system`` event. ``on_revoked(peer)`` runs after commit (the
    caller's best-effort notice to the peer, ``peers.pairing_exchange.peer_unlink``). ``NotFound``
    (404) for a peer that is not the user's live peer."""
    peer = Peer.objects.select_for_update().get(pk=peer_get_for(user=user, peer_id=peer_id).pk)
    _revoke_locally(peer, reason=f"unlinked by {user.get_username()}", by_peer=False)
    if on_revoked is not None:
        transaction.on_commit(lambda: on_revoked(peer))
    return peer


@transaction.atomic
def peer_revoke_as_admin(*, peer: Peer, actor: User, on_revoked: Callable[[Peer], None] | None = None) -> Peer:
    """Unlink any live peer as an administrator (the admin's "revoke peer" action): like
    ``peer_revoke`` but not limited to the actor's own links. A peer already revoked is
    returned as it is (``on_revoked`` is not called)."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    if row.revoked_at is not None:
        return row
    _revoke_locally(row, reason=f"revoked by {actor.get_username()} (admin)", by_peer=False)
    if on_revoked is not None:
        transaction.on_commit(lambda: on_revoked(row))
    return row


@transaction.atomic
def peer_mark_unlinked_by_peer(*, peer: Peer) -> Peer:
    """The peer told us it unlinked us (``POST /api/v1/peers/unlink``) or no
    longer accepts our token: the same local effects as ``peer_revoke`` — without notifying
    back — and ``unlinked_by_peer`` set so the UI shows "unlinked by the other side".
    Idempotent for a revoked peer."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    if row.revoked_at is not None:
        return row
    return _revoke_locally(row, reason="unlinked by the other side", by_peer=True)
