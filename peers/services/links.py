"""A link once made (docs/peers.md#permissions, docs/peers.md#labels): its label, its capabilities, the
credential it presents, its liveness (``last_seen_at``, stamped when the peer is seen) and
what its stream reconnecting sets going.

Making and ending links is ``peers.services.pairing``.
"""

from __future__ import annotations

import datetime
import re
from typing import Any
from urllib.parse import urlsplit

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core import secrets_at_rest
from core.errors import DispatchError, InvalidRequest
from core.services import instance_identity_get
from core.tool_changes import tools_changed_on_commit
from peers.models import Peer
from peers.selectors import label_taken, peer_get_for
from peers.services.outbox import outbox_backoff_reset

# ``last_seen_at`` is stamped at most once per this interval (docs/peers.md#authentication).
LAST_SEEN_RESOLUTION = datetime.timedelta(seconds=60)
CAPABILITIES = ("allow_launch", "allow_message", "allow_full_access", "allow_events")
DEFAULT_CAPABILITIES = {"allow_launch": True, "allow_message": True, "allow_full_access": False, "allow_events": True}
LABEL_MAX = 64
_LABEL_RE = re.compile(r"[\w .-]{1,64}")  # letters, digits, spaces and ._- (\w adds the underscore)
_LABEL_BAD_CHAR = re.compile(r"[^\w .-]+")


# --- labels and capabilities -------------------------------------------------------------------


def label_validate(label: Any) -> str:
    """A label as stored (docs/peers.md#labels): 1–64 characters of letters, digits, spaces and ``._-``,
    surrounding spaces removed. ``InvalidRequest`` (400) otherwise (a colon would make
    ``<label>:<agent id>`` ambiguous)."""
    text = label.strip() if isinstance(label, str) else ""
    if not _LABEL_RE.fullmatch(text):
        raise InvalidRequest(
            "a label is 1 to 64 characters: letters, digits, spaces, '.', '_' and '-' (no colon)",
            {"label": label if isinstance(label, str) else None},
        )
    return text


def label_from_name(name: str) -> str:
    """A valid label derived from a reported name (bad characters become ``-``; ``peer`` when
    nothing is left)."""
    text = _LABEL_BAD_CHAR.sub("-", name or "").strip(" -")[:LABEL_MAX].strip()
    return text or "peer"


def label_unique(base: str, *, exclude_peer_id: int | None = None) -> str:
    """``base``, or ``base-2``, ``base-3``… — the first free label among live peers."""
    if not label_taken(label=base, exclude_peer_id=exclude_peer_id):
        return base
    n = 2
    while True:
        suffix = f"-{n}"
        candidate = base[: LABEL_MAX - len(suffix)].rstrip() + suffix
        if not label_taken(label=candidate, exclude_peer_id=exclude_peer_id):
            return candidate
        n += 1


def _own_names() -> set[str]:
    """This instance's display name as typed and as a label would hold it, case-folded."""
    own = instance_identity_get().display_name.strip()
    return {own.casefold(), label_from_name(own).casefold()}


def label_is_own_name(label: str) -> bool:
    """Whether ``label`` is this instance's own display name, ignoring case: a peer called
    that here would badge the peer's agents with this instance's name."""
    return label.strip().casefold() in _own_names()


def label_distinct_from_own(label: str, *, url: str) -> str:
    """``label``, or — when it is this instance's own name (``label_is_own_name``; two
    instances both named after the host they run on) — ``"<label> at <host> port <port>"``
    from the peer's ``url`` (``"<label> at <host>"`` without an explicit port), within
    ``LABEL_MAX`` characters and the labels' alphabet (no colon). Not made unique: the caller
    passes the result to ``label_unique``."""
    if not label_is_own_name(label):
        return label
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    where = label_from_name(parts.hostname or "") if parts.hostname else "another address"
    suffix = f" at {where}" + (f" port {port}" if port else "")
    if len(suffix) > LABEL_MAX - 8:  # a very long host name: keep some of the label
        suffix = suffix[: LABEL_MAX - 8].rstrip(" .-")
    return label[: LABEL_MAX - len(suffix)].rstrip() + suffix


def label_for_link(*, label: str | None, name: str, url: str, exclude_peer_id: int | None = None) -> str:
    """The label a link gets when it is made: ``label`` as given (validated by
    the caller) or, without one, one derived from the peer's reported ``name``; never this
    instance's own name (``label_distinct_from_own``, with the peer's ``url``: both sides of
    a pairing must not show the same name for each other); then the first free one among
    live peers (``label_unique``: ``-2``, ``-3``…)."""
    base = label if label is not None else label_from_name(name)
    return label_unique(label_distinct_from_own(base, url=url), exclude_peer_id=exclude_peer_id)


def capabilities_validate(values: dict[str, Any]) -> dict[str, bool]:
    """The four ``allow_*`` flags (docs/peers.md#permissions) from ``values`` (missing ones take their defaults,
    ``DEFAULT_CAPABILITIES``). ``InvalidRequest`` (400) for a value that is not a boolean;
    other keys are ignored."""
    flags: dict[str, bool] = {}
    for name in CAPABILITIES:
        value = values.get(name, DEFAULT_CAPABILITIES[name])
        if not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be true or false")
        flags[name] = value
    return flags


# --- managing a link -----------------------------------------------------------------------------


@transaction.atomic
def peer_rename(*, user: User, peer_id: int, label: str) -> Peer:
    """Give one of ``user``'s peers a new label. ``reported_name`` is untouched.

    Raises ``NotFound`` (404), ``InvalidRequest`` (400) for an invalid label, and
    ``CONFLICT`` (409) when another live peer has it, or when it is this instance's own
    name (``label_is_own_name``), ignoring case.
    """
    return _rename(peer_get_for(user=user, peer_id=peer_id), label)


def _rename(peer: Peer, label: Any) -> Peer:
    text = label_validate(label)
    if label_is_own_name(text):
        raise DispatchError(
            "CONFLICT",
            f"'{text}' is this instance's own name; give the linked instance a label of its own",
            {"label": text},
        )
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
    """Change what one of ``user``'s peers may do here (``allow_launch``,
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


@transaction.atomic
def peer_admin_update(*, peer: Peer, label: str, **capabilities: bool) -> Peer:
    """The admin's edit of any peer: its label (409 when taken) and the
    capability flags, in one transaction; nothing is kept if either is refused."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    if label != row.label:
        row = _rename(row, label)
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise InvalidRequest(f"unknown capability {', '.join(unknown)}")
    for name, value in capabilities_validate({**{n: getattr(row, n) for n in CAPABILITIES}, **capabilities}).items():
        setattr(row, name, value)
    row.updated_at = timezone.now()
    row.save(update_fields=[*CAPABILITIES, "updated_at"])
    return row


@transaction.atomic
def peer_credentials_rotate(*, peer: Peer) -> Peer:
    """Re-encrypt the token this instance presents to ``peer`` under the newest
    ``DISPATCH_ENCRYPTION_KEYS`` key (the admin's "rotate credentials": keys can
    be rotated without breaking links). The tokens themselves change only by re-pairing
    (docs/peers.md#pairing). ``SecretUnreadable`` if no configured key opens the stored token."""
    row = Peer.objects.select_for_update().get(pk=peer.pk)
    row.outbound_token_encrypted = secrets_at_rest.rotate(row.outbound_token_encrypted)
    row.updated_at = timezone.now()
    row.save(update_fields=["outbound_token_encrypted", "updated_at"])
    return row


# --- liveness ------------------------------------------------------------------------------------


def peer_seen(*, peer: Peer) -> None:
    """``peer`` just authenticated a request: stamp its ``last_seen_at`` now, at most once per
    ``LAST_SEEN_RESOLUTION`` (a conditional UPDATE, so concurrent requests stamp once); the
    object passed in is updated too."""
    now = timezone.now()
    if peer.last_seen_at is not None and now - peer.last_seen_at < LAST_SEEN_RESOLUTION:
        return
    Peer.objects.filter(pk=peer.pk).filter(
        Q(last_seen_at__isnull=True) | Q(last_seen_at__lte=now - LAST_SEEN_RESOLUTION)
    ).update(last_seen_at=now)
    peer.last_seen_at = now


def peer_features_record(*, peer: Peer, features: list[str]) -> bool:
    """Keep what ``peer`` just announced (``features``: ``peers.keys.features_parse`` of
    a ``Dispatch-Peer-Features`` header or of a claim): one UPDATE, only when it differs from
    what ``peer`` (the object passed in, updated too) holds — every peer request and answer
    carries the header, so an unchanged announcement costs nothing. An absent header is an
    instance that announces nothing (an older one, or a downgrade): ``[]``. Returns whether
    it wrote."""
    if peer.features == features:
        return False
    Peer.objects.filter(pk=peer.pk).update(features=features)
    peer.features = features
    return True


def peer_seen_stamp(*, peer_id: int) -> None:
    """Stamp peer ``peer_id``'s ``last_seen_at`` now, unconditionally: its events stream is
    connected, which proves the peer alive. The mirroring subscriber
    throttles its own calls (``peers.mirror.LAST_SEEN_INTERVAL``)."""
    Peer.objects.filter(pk=peer_id).update(last_seen_at=timezone.now())


@transaction.atomic
def peer_reconnected(*, peer: Peer) -> None:
    """``peer``'s events stream (re)connected (its first snapshot arrived): stamp
    ``last_seen_at``, make its queued outbox rows due now with their backoff forgotten and
    ring the drain doorbell after commit (``outbox_backoff_reset``; docs/peers.md#the-outbox)."""
    peer_seen_stamp(peer_id=peer.pk)
    outbox_backoff_reset(peer=peer)
