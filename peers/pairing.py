"""Pairing and link management (spec/peers.md §2 pairing, §3 capabilities, §6 labels, §7 unlink).

The TV model: the side being connected to (B) shows a code (``offer_create``); the
connecting side (A) types it, and A's server calls B's open ``POST /api/v1/peers/claim``
(``peer_link`` on A, ``offer_claim`` on B). Each side then holds one ``Peer`` row with
the hash of the token it issued (inbound), the encrypted token it presents (outbound)
and the other side's public key.

Services here are the only writers of ``Peer`` and ``PairingOffer`` rows for pairing,
renaming, capability changes and unlinking.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from limits import parse

from agents.models import AgentMessage
from core import secrets_at_rest
from core.errors import DispatchError, InvalidRequest, NotFound, RateLimited
from core.realtime import PEERS_MIRROR_GROUP, ring_on_commit
from core.services import generate_token, rate_limiter, token_digest
from core.tool_changes import tools_changed_on_commit
from peers.identity import PEER_PROTOCOL_VERSION, Identity, fingerprint_of, public_key_from
from peers.models import OutboxMessage, PairingOffer, Peer, new_idempotency_key
from peers.protocol import MirrorRescanMessage
from peers.selectors import label_taken, live_offers, peer_get_for, peer_resolve_location
from peers.services.identity import identity_get

__all__ = [
    "BAD_CODE",
    "CODE_ALPHABET",
    "IssuedOffer",
    "LinkResult",
    "code_normalize",
    "label_validate",
    "offer_claim",
    "offer_create",
    "peer_capabilities_set",
    "peer_link",
    "peer_mark_unlinked_by_peer",
    "peer_rename",
    "peer_resolve_location",
    "peer_unlink",
]

logger = logging.getLogger(__name__)

CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
CODE_LENGTH = 8
OFFER_LIFETIME = timedelta(minutes=10)
MAX_LIVE_OFFERS = 5
CLAIM_RATE = parse("5 per minute")  # per client address (spec §2 step 3)
WRONG_CODE_LIMIT = parse("5 per 10 minutes")  # per instance: then every live offer is burned
BAD_CODE = "pairing code is unknown, used or expired"
CAPABILITIES = ("allow_launch", "allow_message", "allow_full_access", "allow_events")
DEFAULT_CAPABILITIES = {"allow_launch": True, "allow_message": True, "allow_full_access": False, "allow_events": True}
LABEL_MAX = 64
_LABEL_RE = re.compile(r"[\w .-]{1,64}")  # letters, digits, spaces and ._- (\w adds the underscore)
_LABEL_BAD_CHAR = re.compile(r"[^\w .-]+")
_INSTANCE_ID_RE = re.compile(r"inst_[0-9a-f]{12}")
CLAIM_PATH = "/api/v1/peers/claim"
UNLINK_PATH = "/api/v1/peers/unlink"
CLAIM_TIMEOUT = 30.0  # seconds


def _mirror_rescan() -> None:
    """Ring the mirroring loop (``peers.mirror``, which sits above this module) to rescan the
    links after commit, as ``peers.mirror.mirror_rescan`` does (spec §7)."""
    ring_on_commit(PEERS_MIRROR_GROUP, MirrorRescanMessage())


# --- codes and labels ------------------------------------------------------------------------


def _code_generate() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def code_display(code: str) -> str:
    """``BCDFGHJK`` → ``BCDF-GHJK`` (spec §2 step 1)."""
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


def label_validate(label: Any) -> str:
    """A label as stored (spec §6): 1–64 characters of letters, digits, spaces and ``._-``,
    surrounding spaces removed. ``InvalidRequest`` (400) otherwise (a colon would make
    ``<label>:<agent id>`` ambiguous)."""
    text = label.strip() if isinstance(label, str) else ""
    if not _LABEL_RE.fullmatch(text):
        raise InvalidRequest(
            "a label is 1 to 64 characters: letters, digits, spaces, '.', '_' and '-' (no colon)",
            {"label": label if isinstance(label, str) else None},
        )
    return text


def _label_from_name(name: str) -> str:
    """A valid label derived from a reported name (bad characters become ``-``)."""
    text = _LABEL_BAD_CHAR.sub("-", name or "").strip(" -")[:LABEL_MAX].strip()
    return text or "peer"


def _label_unique(base: str, *, exclude_peer_id: int | None = None) -> str:
    """``base``, or ``base-2``, ``base-3``… — the first free label among live peers (spec §6)."""
    if not label_taken(label=base, exclude_peer_id=exclude_peer_id):
        return base
    n = 2
    while True:
        suffix = f"-{n}"
        candidate = base[: LABEL_MAX - len(suffix)].rstrip() + suffix
        if not label_taken(label=candidate, exclude_peer_id=exclude_peer_id):
            return candidate
        n += 1


def _capabilities(values: dict[str, Any]) -> dict[str, bool]:
    """The four flags of spec §3 from ``values`` (missing ones take their defaults)."""
    flags: dict[str, bool] = {}
    for name in CAPABILITIES:
        value = values.get(name, DEFAULT_CAPABILITIES[name])
        if not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be true or false")
        flags[name] = value
    return flags


def _require_staff(user: User) -> None:
    if not (user.is_active and user.is_staff):
        raise DispatchError("PERMISSION_DENIED", "pairing is for staff users only")


# --- B side: offers and claims ---------------------------------------------------------------


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
    """Make a pairing offer (spec §2 step 1): a code of 8 characters from ``CODE_ALPHABET``,
    stored as its SHA-256, valid 10 minutes, usable once, carrying ``capabilities``
    (``allow_launch`` etc., spec §3 defaults) for the peer that claims it.

    ``user`` must be staff (``PERMISSION_DENIED`` 403); ``link_user`` (default ``user``) is
    the user the link will act as here. A sixth live offer raises ``CONFLICT`` (409).
    Returns the offer with the display code, expiry, this instance's address
    (``DISPATCH_PUBLIC_URL``) and fingerprint.
    """
    _require_staff(user)
    link_user = link_user or user
    if not link_user.is_active:
        raise InvalidRequest(f"user '{link_user.get_username()}' is not active")
    flags = _capabilities(capabilities)
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


@dataclass(frozen=True)
class _Claimant:
    """The validated claim body (spec §2 step 2)."""

    instance_id: str
    name: str
    url: str
    public_key: str
    token_for_you: str
    capabilities: dict[str, bool]


def _text(body: dict[str, Any], key: str, *, max_length: int, required: bool = True) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or len(value) > max_length or (required and not value.strip()):
        raise InvalidRequest(f"{key} must be text of 1 to {max_length} characters")
    return value.strip()


def _peer_fields(body: dict[str, Any], our: Identity) -> _Claimant:
    """Validate the identity fields a claim or a claim answer carries."""
    instance_id = _text(body, "instance_id", max_length=17)
    if not _INSTANCE_ID_RE.fullmatch(instance_id):
        raise InvalidRequest("instance_id must be 'inst_' and 12 lowercase hex digits")
    if instance_id == our.instance_id:
        raise InvalidRequest("an instance cannot be linked to itself")
    name = _text(body, "name", max_length=100, required=False)
    url = _text(body, "url", max_length=2048)
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest("url must start with http:// or https://")
    public_key = _text(body, "public_key", max_length=64)
    try:
        public_key_from(public_key)
    except ValueError:
        raise InvalidRequest("public_key must be a raw Ed25519 public key in base64url") from None
    token = _text(body, "token_for_you", max_length=200)
    granted = body.get("capabilities")
    capabilities = {}
    if isinstance(granted, dict):
        capabilities = {name: granted[name] for name in CAPABILITIES if isinstance(granted.get(name), bool)}
    return _Claimant(
        instance_id=instance_id,
        name=name,
        url=url.rstrip("/"),
        public_key=public_key,
        token_for_you=token,
        capabilities=capabilities,
    )


def _protocol_check(body: dict[str, Any]) -> None:
    version = body.get("protocol_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidRequest(
            f"protocol_version must be an integer (this instance speaks {PEER_PROTOCOL_VERSION})",
            {"protocol_version": PEER_PROTOCOL_VERSION},
        )
    if version != PEER_PROTOCOL_VERSION:
        raise InvalidRequest(
            f"peer speaks protocol {version}, this instance speaks {PEER_PROTOCOL_VERSION}",
            {"protocol_version": PEER_PROTOCOL_VERSION},
        )


def _wrong_code() -> None:
    """Count a wrong code; the fifth within 10 minutes burns every live offer (spec §2 step 3)."""
    limiter = rate_limiter()
    key = (settings.REDIS_PREFIX, "peer-claim-wrong-code")
    limiter.hit(WRONG_CODE_LIMIT, *key)
    if not limiter.test(WRONG_CODE_LIMIT, *key):
        burned = live_offers().update(burned_at=timezone.now())
        if burned:
            logger.warning("5 wrong pairing codes within 10 minutes: burned %d live pairing offers", burned)


def _slot_check(claimant: _Claimant, owner: User | None = None) -> Peer | None:
    """The live peer of ``claimant.instance_id`` (a re-pair), or ``None``; ``CONFLICT`` (409)
    when it is linked under another key — the existing link is left untouched (spec §2) —
    or, with ``owner``, when the link acts for another user here: re-pairing rotates tokens,
    it never hands a user's link (shadows, messages, outbox) to someone else (spec §1)."""
    existing = (
        Peer.objects.select_for_update().filter(instance_id=claimant.instance_id, revoked_at__isnull=True).first()
    )
    if existing is not None and existing.public_key != claimant.public_key:
        raise DispatchError(
            "CONFLICT",
            f"instance {claimant.instance_id} is already linked here with a different key; "
            "unlink it first if that instance was reinstalled",
            {"instance_id": claimant.instance_id, "fingerprint": existing.fingerprint},
        )
    if existing is not None and owner is not None and existing.owner_id != owner.pk:
        raise DispatchError(
            "CONFLICT",
            f"instance {claimant.instance_id} is already linked here for another user; that link must be "
            "unlinked before it can be paired for someone else",
            {"instance_id": claimant.instance_id},
        )
    return existing


def _store_peer(
    *, existing: Peer | None, owner: User, claimant: _Claimant, label: str | None, flags: dict[str, bool]
) -> tuple[Peer, str]:
    """Create or re-pair (rotate in place) the peer row; returns it and the raw inbound token issued."""
    inbound = generate_token()
    now = timezone.now()
    tools_changed_on_commit([owner.pk])  # dispatch_launch_agent lists the linked instances
    fields: dict[str, Any] = {
        "owner": owner,
        "reported_name": claimant.name[:100],
        "url": claimant.url,
        "public_key": claimant.public_key,
        "fingerprint": fingerprint_of(claimant.public_key),
        "inbound_digest": token_digest(inbound),
        "inbound_prefix": inbound[:8],
        "outbound_token_encrypted": secrets_at_rest.encrypt(claimant.token_for_you.encode()),
        "granted_by_peer": claimant.capabilities,
        "protocol_version": PEER_PROTOCOL_VERSION,
        "updated_at": now,
        **flags,
    }
    if existing is not None:
        if label is not None:
            fields["label"] = _label_unique(label, exclude_peer_id=existing.pk)
        for name, value in fields.items():
            setattr(existing, name, value)
        existing.save()
        return existing, inbound
    peer = Peer.objects.create(
        instance_id=claimant.instance_id,
        label=_label_unique(label if label is not None else _label_from_name(claimant.name)),
        created_at=now,
        **fields,
    )
    return peer, inbound


def offer_claim(*, body: dict[str, Any], client_address: str) -> dict[str, Any]:
    """Serve ``POST /api/v1/peers/claim`` on B (spec §2 step 3), checking in this order:

    1. rate limit, 5 claims a minute per ``client_address`` → ``RATE_LIMITED`` (429);
    2. ``protocol_version`` ≠ 2 → ``INVALID_REQUEST`` (400) "peer speaks protocol 1, this
       instance speaks 2" (then the body's fields are validated, 400);
    3. the code: unknown, used or expired → ``AUTHENTICATION_FAILED`` (401), one message;
       the fifth wrong code within 10 minutes burns every live offer;
    4. slot takeover: the ``instance_id`` linked (live) under another key → ``CONFLICT`` (409).

    Then stores the claimant as a peer acting as the offer's ``link_user`` with the offer's
    capabilities — or, for the same id and key, rotates both tokens in place — marks the
    offer used, and returns ``{protocol_version, instance_id, name, url, public_key,
    token_for_you, capabilities}`` (this instance, and the token it issued to the peer).
    """
    if not rate_limiter().hit(CLAIM_RATE, settings.REDIS_PREFIX, "peer-claim", client_address or "-"):
        raise RateLimited("too many pairing claims from this address; try again in a minute")
    _protocol_check(body)
    identity = identity_get()
    claimant = _peer_fields(body, identity)
    code = code_normalize(body.get("code"))
    with transaction.atomic():
        offer = None
        if code is not None:
            offer = (
                live_offers()
                .select_for_update()
                .select_related("link_user")
                .filter(code_digest=_code_digest(code))
                .first()
            )
        if offer is not None:
            existing = _slot_check(claimant, offer.link_user)
            flags = {name: getattr(offer, name) for name in CAPABILITIES}
            peer, inbound = _store_peer(
                existing=existing, owner=offer.link_user, claimant=claimant, label=None, flags=flags
            )
            offer.used_at = timezone.now()
            offer.peer = peer
            offer.save(update_fields=["used_at", "peer"])
            _mirror_rescan()  # after commit: subscribe to the new peer now, not at the next rescan
            logger.info("paired with %s (%s) as %s", peer.label, peer.instance_id, offer.link_user.get_username())
            return {
                "protocol_version": PEER_PROTOCOL_VERSION,
                "instance_id": identity.instance_id,
                "name": identity.name,
                "url": identity.url,
                "public_key": identity.public_key,
                "token_for_you": inbound,
                "capabilities": flags,
            }
    _wrong_code()
    raise DispatchError("AUTHENTICATION_FAILED", BAD_CODE)


# --- A side: linking with a code ---------------------------------------------------------------


@dataclass(frozen=True)
class LinkResult:
    """A link just made on A: the peer row and both fingerprints (spec §2, ui.md card 3)."""

    peer: Peer
    our_fingerprint: str
    their_fingerprint: str


def _link_prepare(*, user: User, as_user: User | str | None, label: str | None) -> tuple[User, Identity]:
    _require_staff(user)
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


@transaction.atomic
def _link_store(
    *, owner: User, answer: _Claimant, url: str, inbound: str, label: str | None, flags: dict[str, bool]
) -> Peer:
    existing = _slot_check(answer, owner)
    claimant = _Claimant(
        instance_id=answer.instance_id,
        name=answer.name,
        url=url,  # the address the person typed: proven to reach the peer
        public_key=answer.public_key,
        token_for_you=answer.token_for_you,
        capabilities=answer.capabilities,
    )
    peer, _ = _store_peer(existing=existing, owner=owner, claimant=claimant, label=label, flags=flags)
    # The token B now holds is the one A sent in the claim, not the one _store_peer drew.
    peer.inbound_digest = token_digest(inbound)
    peer.inbound_prefix = inbound[:8]
    peer.save(update_fields=["inbound_digest", "inbound_prefix"])
    _mirror_rescan()  # after commit: subscribe to the new peer now, not at the next rescan
    return peer


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
    """Link this instance (A) to the instance at ``url`` (B) with B's pairing ``code`` (spec §2 steps 2 and 4).

    ``user`` must be staff (403). The link acts here as ``as_user`` (a user or a username;
    default ``user``); ``label`` (spec §6, validated; a collision gets ``-2``, ``-3``…)
    defaults to B's name; ``capabilities`` are what B may do here (spec §3 defaults).
    Issues a fresh token for B, posts the unsigned claim to ``<url>/api/v1/peers/claim``
    (``timeout`` seconds), then stores B — or rotates the tokens of an existing link with
    the same id and key. Errors: a malformed code or label → 400 before any call; B
    unreachable → ``REMOTE_ERROR`` (502); B's refusal → its code and message (a wrong code
    → 400); a malformed answer → ``INVALID_RESPONSE`` (502); B linked here under another
    key → ``CONFLICT`` (409).
    """
    address = (url or "").strip().rstrip("/")
    if not address.startswith(("http://", "https://")) or len(address) > 2048:
        raise InvalidRequest("the address must be a URL starting with http:// or https://")
    normalized = code_normalize(code)
    if normalized is None:
        raise InvalidRequest("a pairing code is 8 letters, shown as XXXX-XXXX")
    flags = _capabilities(capabilities)
    link_user, identity = await database_sync_to_async(_link_prepare)(user=user, as_user=as_user, label=label)
    label = label_validate(label) if label is not None else None
    # Refuse before the claim (which rotates B's side) when this address is already linked
    # for another user here; _link_store checks again by instance id after the answer.
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
        answer = _peer_fields(answer_body, identity)
    except (ValueError, DispatchError) as exc:
        raise DispatchError("INVALID_RESPONSE", f"{address} gave an unusable pairing answer: {exc}") from None
    peer = await database_sync_to_async(_link_store)(
        owner=link_user, answer=answer, url=address, inbound=inbound, label=label, flags=flags
    )
    logger.info("linked to %s (%s) as %s", peer.label, peer.instance_id, link_user.get_username())
    return LinkResult(peer=peer, our_fingerprint=identity.fingerprint, their_fingerprint=peer.fingerprint)


# --- managing a link -----------------------------------------------------------------------------


@transaction.atomic
def peer_rename(*, user: User, peer_id: int, label: str) -> Peer:
    """Give one of ``user``'s peers a new label (spec §6). ``reported_name`` is untouched.

    Raises ``NotFound`` (404), ``InvalidRequest`` (400) for an invalid label, and
    ``CONFLICT`` (409) when another live peer has it, ignoring case.
    """
    return _rename(peer_get_for(user=user, peer_id=peer_id), label)


def _rename(peer: Peer, label: Any) -> Peer:
    text = label_validate(label)
    if label_taken(label=text, exclude_peer_id=peer.pk):
        raise DispatchError(
            "CONFLICT",
            f"the label '{text}' is already used by another linked instance (labels ignore case)",
            {"label": text},
        )
    peer.label = text
    peer.updated_at = timezone.now()
    peer.save(update_fields=["label", "updated_at"])
    tools_changed_on_commit([peer.owner_id])
    return peer


@transaction.atomic
def peer_capabilities_set(*, user: User, peer_id: int, **capabilities: bool) -> Peer:
    """Change what one of ``user``'s peers may do here (spec §3: ``allow_launch``,
    ``allow_message``, ``allow_full_access``, ``allow_events``; unnamed flags keep their
    value). Takes effect on the peer's next request. ``InvalidRequest`` for an unknown flag
    or a non-boolean; ``NotFound`` for a peer that is not the user's."""
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise InvalidRequest(f"unknown capability {', '.join(unknown)}; known: {', '.join(CAPABILITIES)}")
    peer = peer_get_for(user=user, peer_id=peer_id)
    for name, value in capabilities.items():
        if not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be true or false")
        setattr(peer, name, value)
    peer.updated_at = timezone.now()
    peer.save(update_fields=[*capabilities, "updated_at"])
    tools_changed_on_commit([peer.owner_id])
    return peer


def _revoke_locally(peer: Peer, *, reason: str, by_peer: bool) -> Peer:
    """The local effects of an unlink (spec §7), inside the caller's transaction."""
    from peers.services.shadows import shadows_stop_for_unlink

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


def _notify_unlinked(peer: Peer) -> None:
    """Best-effort ``POST /api/v1/peers/unlink`` (spec §7) from a thread of its own, so no
    caller — and never the shared sync thread — waits on the peer."""

    async def notify() -> None:
        try:
            from peers.client import PeerClient, PeerUnreachable  # helper PA's module
        except ImportError:
            logger.warning("peers.client is missing: %s is not told it was unlinked", peer.label)
            return
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


@transaction.atomic
def peer_unlink(*, user: User, peer_id: int, notify: bool = True) -> Peer:
    """Unlink one of ``user``'s peers (spec §7), in one transaction: its credentials are
    revoked (``revoked_at``: neither token works any more), its queued outbox rows closed
    (``dead``, "peer revoked") with their messages marked ``dead``, its running shadows
    ``stopped`` with a ``system`` event. After commit the peer is told with a best-effort
    ``POST /api/v1/peers/unlink`` (``notify``). ``NotFound`` (404) for a peer that is not
    the user's live peer."""
    peer = Peer.objects.select_for_update().get(pk=peer_get_for(user=user, peer_id=peer_id).pk)
    _revoke_locally(peer, reason=f"unlinked by {user.get_username()}", by_peer=False)
    if notify:
        transaction.on_commit(lambda: _notify_unlinked(peer))
    return peer


@transaction.atomic
def peer_mark_unlinked_by_peer(*, peer: Peer) -> Peer:
    """The peer told us it unlinked us (``POST /api/v1/peers/unlink``, spec §5, §7): the same
    local effects as ``peer_unlink`` — without notifying back — and ``unlinked_by_peer``
    set so the UI shows "unlinked by the other side". Idempotent for a revoked peer."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    if row.revoked_at is not None:
        return row
    return _revoke_locally(row, reason="unlinked by the other side", by_peer=True)


def peer_revoke_admin(*, peer: Peer, actor: User) -> Peer:
    """Unlink any live peer as an administrator (the admin's "revoke peer" action): like
    ``peer_unlink`` but not limited to the actor's own links."""
    with transaction.atomic():
        row = Peer.objects.select_for_update().get(pk=peer.pk)
        if row.revoked_at is not None:
            return row
        _revoke_locally(row, reason=f"revoked by {actor.get_username()} (admin)", by_peer=False)
        transaction.on_commit(lambda: _notify_unlinked(row))
    return row


@transaction.atomic
def peer_admin_update(*, peer: Peer, label: str, **capabilities: bool) -> Peer:
    """The admin's edit of any peer: its label (spec §6 rules, 409 when taken) and the
    capability flags (spec §3), in one transaction; nothing is kept if either is refused."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    if label != row.label:
        row = _rename(row, label)
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise InvalidRequest(f"unknown capability {', '.join(unknown)}")
    for name, value in _capabilities({**{n: getattr(row, n) for n in CAPABILITIES}, **capabilities}).items():
        setattr(row, name, value)
    row.updated_at = timezone.now()
    row.save(update_fields=[*CAPABILITIES, "updated_at"])
    return row


@transaction.atomic
def peer_credentials_rotate(*, peer: Peer) -> Peer:
    """Re-encrypt the token this instance presents to ``peer`` under the newest
    ``DISPATCH_ENCRYPTION_KEYS`` key (the admin's "rotate credentials", spec §1: keys can
    be rotated without breaking links). The tokens themselves change only by re-pairing
    (spec §2 step 4). ``SecretUnreadable`` if no configured key opens the stored token."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    row.outbound_token_encrypted = secrets_at_rest.rotate(row.outbound_token_encrypted)
    row.updated_at = timezone.now()
    row.save(update_fields=["outbound_token_encrypted", "updated_at"])
    return row


@transaction.atomic
def instance_rename(*, user: User, name: str) -> str:
    """Set this instance's display name (spec §1: editable; it seeds the label peers give
    this instance). Staff only (403); 1–100 characters (400). Returns the stored name."""
    from core.models import InstanceIdentity
    from core.services import instance_identity_get

    _require_staff(user)
    text = name.strip() if isinstance(name, str) else ""
    if not 1 <= len(text) <= 100:
        raise InvalidRequest("the instance name is 1 to 100 characters")
    row = InstanceIdentity.objects.select_for_update().get(pk=instance_identity_get().pk)
    row.display_name = text
    row.save(update_fields=["display_name"])
    return text
