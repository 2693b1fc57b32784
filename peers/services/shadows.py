"""Shadow agents: local rows mirroring a peer's agents (docs/peers.md#shadow-agents).

A shadow is an ``Agent`` with ``peer`` set and ``peer_agent_id`` = the agent's id on the
peer, owned by the link's local user (``peer.owner``). Shadows take whatever known
status their peer reports: their status is written here directly, bypassing the local
transition table (``agents.services.TRANSITIONS``), and every change is
announced as ``agent.upsert`` on the owner's live-events group after commit.

Frames come from the peer's ``GET /api/v1/peers/events`` (``peers.stream``, applied by
``peers.mirror``): each agent is ``{id, name, type, status, parent_id, launched_by,
updated_at}`` plus, when the peer shares events, ``latest_event: {type, message,
created_at} | null``. A shadow this instance launched is recorded by
``shadow_record_launch``; a forwarded stop or archive settles it (``shadow_settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from agents.models import Agent, AgentEvent
from agents.serializers import agent_data
from agents.services import MAX_EVENT_MESSAGE_LENGTH, MAX_NAME_LENGTH, agent_event_record, publish_on_commit
from peers.models import Peer

logger = logging.getLogger(__name__)

Status = Agent.Status
# The ``system`` notes a shadow gets when its peer's stream drops and when it is back
# (docs/peers.md#shadow-agents), each followed by the peer's label.
LOST_CONTACT = "lost contact with"
CONTACT_RESTORED = "contact restored with"
# The ``system`` note of a delivered message (agents.messages.messages_mark_delivered): this
# instance writes it on a shadow when the peer's receipt for a message arrives, and the peer
# writes its own when it hands the message to the agent, which its stream then mirrors.
MESSAGE_DELIVERED = "message delivered"
# The key of that local note's ``metadata`` that records the peer's own note (its time, the
# peer's clock), once the mirrored note has been folded into it.
DELIVERED_ON_PEER_AT = "delivered_on_peer_at"
# Statuses a shadow keeps when its peer stops listing it or is unlinked.
_AT_REST = (Status.STOPPED, Status.ARCHIVED)


def parse_timestamp(value: Any) -> datetime:
    """An ISO 8601 timestamp as an aware datetime (a naive one is taken as UTC).

    Raises ``ValueError`` for anything that is not a parseable timestamp string.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"not a timestamp: {value!r}")
    parsed = parse_datetime(value)  # ValueError for a well-formed but impossible date
    if parsed is None:
        raise ValueError(f"not a timestamp: {value!r}")
    return parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=UTC)


def _validated_event(latest_event: Mapping[str, Any]) -> tuple[str, str, datetime]:
    if not isinstance(latest_event, Mapping):
        raise ValueError("latest_event must be an object")
    event_type = latest_event.get("type")
    if event_type not in AgentEvent.Type.values:
        raise ValueError(f"unknown event type {event_type!r}")
    message = latest_event.get("message") or ""
    if not isinstance(message, str):
        raise ValueError("latest_event.message must be text")
    message = message.replace("\x00", "")[:MAX_EVENT_MESSAGE_LENGTH]
    return str(event_type), message, parse_timestamp(latest_event.get("created_at"))


def _publish(agent_id: str) -> Agent:
    fresh = Agent.objects.select_related("owner", "peer").get(pk=agent_id)
    publish_on_commit(user_id=fresh.owner_id, event="agent.upsert", data=agent_data(fresh))
    return fresh


@transaction.atomic
def shadow_upsert(
    *,
    peer: Peer,
    peer_agent_id: str,
    name: str,
    type: str,
    status: str,
    latest_event: Mapping[str, Any] | None = None,
    parent_peer_agent_id: str | None = None,
    seen_at: datetime,
) -> Agent:
    """Create or update the shadow of the peer's agent ``peer_agent_id``.

    The shadow is matched by ``(peer, peer_agent_id)`` and owned by ``peer.owner``.
    ``status`` is any ``Agent.Status`` value (taken as is, no transition check);
    ``latest_event`` ``{type, message, created_at}`` is appended to the shadow's timeline
    with its original timestamp as a mirrored event (a replay adds nothing); ``None``
    leaves the shadow's events alone. ``parent_peer_agent_id`` links a new shadow (or one
    without a parent) to the shadow of its parent when that exists. Any frame clears
    ``stale`` (the stream is connected), with the ``system`` event "contact restored with
    <peer label>" (``shadows_clear_stale``). ``seen_at`` is when the frame arrived; it
    becomes ``updated_at`` when something changed. Writes and announces ``agent.upsert``
    only when something changed.

    Raises ``ValueError`` (nothing written) for an unknown status, an unknown event type,
    an unparseable event timestamp or an empty id.
    """
    if status not in Status.values:
        raise ValueError(f"unknown status {status!r}")
    if not isinstance(peer_agent_id, str) or not peer_agent_id or len(peer_agent_id) > 64:
        raise ValueError(f"bad agent id {peer_agent_id!r}")
    event = _validated_event(latest_event) if latest_event is not None else None
    name = (name if isinstance(name, str) else "").replace("\x00", "").strip()[:MAX_NAME_LENGTH] or peer_agent_id
    type = (type if isinstance(type, str) else "").replace("\x00", "")[:40] or "unknown"
    parent = None
    if parent_peer_agent_id:
        parent = Agent.objects.filter(peer=peer, peer_agent_id=parent_peer_agent_id).order_by("created_at").first()
    shadow = (
        Agent.objects.select_for_update().filter(peer=peer, peer_agent_id=peer_agent_id).order_by("created_at").first()
    )
    if shadow is None:
        shadow = Agent.objects.create(
            owner_id=peer.owner_id,
            name=name,
            type=type,
            status=status,
            cwd="",
            host="",
            parent=parent,
            peer=peer,
            peer_agent_id=peer_agent_id,
            created_at=seen_at,
            updated_at=seen_at,
        )
        changed = True
    else:
        was_stale = shadow.stale
        fields = []
        for field, value in (("name", name), ("type", type), ("status", status), ("stale", False)):
            if getattr(shadow, field) != value:
                setattr(shadow, field, value)
                fields.append(field)
        if parent is not None and shadow.parent_id is None and parent.pk != shadow.pk:
            shadow.parent = parent
            fields.append("parent")
        changed = bool(fields)
        if changed:
            shadow.updated_at = seen_at
            shadow.save(update_fields=[*fields, "updated_at"])
        if was_stale:
            _contact_restored_note(shadow, peer)
    recorded = None
    if event is not None and not _folded_into_local_delivery(shadow, *event):
        event_type, message, created_at = event
        recorded = agent_event_record(
            agent=shadow, type=event_type, message=message, created_at=created_at, mirrored=True
        )
    if changed and recorded is None:  # agent_event_record announced the agent already
        return _publish(shadow.pk)
    shadow.refresh_from_db()
    return shadow


def _folded_into_local_delivery(shadow: Agent, event_type: str, message: str, created_at: datetime) -> bool:
    """Whether the peer's mirrored "message delivered" note (``created_at``, the peer's
    clock) belongs to a message this instance sent, whose own "message delivered" note the
    shadow already has: then that note records it (``metadata.delivered_on_peer_at``, ISO
    8601) and no second timeline entry is added for the same message
    (docs/peers.md#shadow-agents: each message appears once).

    Messages reach the peer's agent in the order they were sent (one outbox, drained in
    order), so the oldest local note not yet matched is the one; a note the peer reports
    again (a snapshot after a reconnect) matches the one it was folded into. A note with no
    local one to match (a message from the peer's own users) is not folded: it is mirrored
    as its own entry. Call inside the upsert's transaction.
    """
    if event_type != AgentEvent.Type.SYSTEM or message != MESSAGE_DELIVERED:
        return False
    mirrored = AgentEvent.objects.filter(agent=shadow, mirrored=True, type=event_type, created_at=created_at)
    if mirrored.exists():
        return False  # recorded as its own entry before: a replay (agent_event_record adds nothing)
    reported_at = created_at.isoformat()
    local = AgentEvent.objects.filter(agent=shadow, mirrored=False, type=event_type, message=MESSAGE_DELIVERED)
    if local.filter(**{f"metadata__{DELIVERED_ON_PEER_AT}": reported_at}).exists():
        return True  # folded before: a replay
    unmatched = (
        local.select_for_update().exclude(metadata__has_key=DELIVERED_ON_PEER_AT).order_by("created_at", "pk").first()
    )
    if unmatched is None:
        return False
    unmatched.metadata = {**unmatched.metadata, DELIVERED_ON_PEER_AT: reported_at}
    unmatched.save(update_fields=["metadata"])
    return True


def shadow_apply_frame(*, peer: Peer, data: Mapping[str, Any], seen_at: datetime) -> Agent:
    """Apply one agent of a peer's events stream (a snapshot item or an ``agent.upsert``).

    ``data`` is the scoped shape of ``peers.stream.peer_agent_data``; a missing
    ``latest_event`` key leaves the shadow's event alone, ``null`` means "no event yet".
    Raises ``ValueError`` for a malformed frame (see ``shadow_upsert``; also an
    unparseable ``updated_at``).
    """
    if not isinstance(data, Mapping):
        raise ValueError("an agent frame must be an object")
    if data.get("updated_at") is not None:
        parse_timestamp(data.get("updated_at"))
    parent_id = data.get("parent_id")
    return shadow_upsert(
        peer=peer,
        peer_agent_id=data.get("id"),  # type: ignore[arg-type]  # checked by shadow_upsert
        name=data.get("name", ""),
        type=data.get("type", ""),
        status=data.get("status", ""),
        latest_event=data.get("latest_event"),
        parent_peer_agent_id=parent_id if isinstance(parent_id, str) else None,
        seen_at=seen_at,
    )


def shadows_apply_snapshot(*, peer: Peer, agents: Iterable[Any], seen_at: datetime) -> dict[str, int]:
    """Apply a ``snapshot`` frame's ``agents``: clear ``stale`` on every shadow of the peer
    (contact is back: ``shadows_clear_stale`` notes it on each), upsert each agent, reap the
    shadows it no longer lists.

    A malformed item is logged and skipped (its shadow, if any, is not reaped). Returns
    ``{"applied", "rejected", "reaped"}`` counts.
    """
    # First, so a shadow's timeline reads "contact restored", then what the peer reports.
    shadows_clear_stale(peer=peer)
    listed: set[str] = set()
    applied = rejected = 0
    for item in agents:
        if isinstance(item, Mapping) and isinstance(item.get("id"), str):
            listed.add(item["id"])
        try:
            shadow_apply_frame(peer=peer, data=item, seen_at=seen_at)
            applied += 1
        except ValueError as exc:
            rejected += 1
            logger.warning("peer %s: agent frame rejected: %s", peer.label, exc)
    reaped = shadows_reap_missing(peer=peer, listed_ids=listed)
    return {"applied": applied, "rejected": rejected, "reaped": reaped}


def _set_status(shadow: Agent, status: str, note: str) -> None:
    Agent.objects.filter(pk=shadow.pk).update(status=status, updated_at=timezone.now())
    shadow.status = status
    agent_event_record(agent=shadow, type=AgentEvent.Type.SYSTEM, message=note, metadata={"to": status})


@transaction.atomic
def shadows_reap_missing(*, peer: Peer, listed_ids: Iterable[str]) -> int:
    """Stop the peer's shadows that a snapshot no longer lists.

    Each one not already stopped or archived becomes ``stopped`` with a ``system`` event
    "no longer reported by <peer label>". Returns how many were reaped.
    """
    listed = set(listed_ids)
    missing = [
        shadow
        for shadow in Agent.objects.select_for_update().filter(peer=peer).exclude(status__in=_AT_REST)
        if shadow.peer_agent_id not in listed
    ]
    for shadow in missing:
        _set_status(shadow, Status.STOPPED, f"no longer reported by {peer.label}")
    return len(missing)


@transaction.atomic
def shadows_mark_stale(*, peer: Peer) -> int:
    """The peer's stream dropped: mark its shadows ``stale``.

    Only shadows not already stale (and not archived) change, each with one ``system``
    event "lost contact with <peer label>": calling this again before the next snapshot
    adds nothing. Returns how many were marked.
    """
    shadows = list(Agent.objects.select_for_update().filter(peer=peer, stale=False).exclude(status=Status.ARCHIVED))
    for shadow in shadows:
        Agent.objects.filter(pk=shadow.pk).update(stale=True, updated_at=timezone.now())
        agent_event_record(agent=shadow, type=AgentEvent.Type.SYSTEM, message=f"{LOST_CONTACT} {peer.label}")
    return len(shadows)


def _contact_restored_note(shadow: Agent, peer: Peer) -> bool:
    """Record the ``system`` event "contact restored with <peer label>" (which announces the
    shadow) on a shadow that was stale; not on an archived one, which never got "lost
    contact" either. Returns whether it was recorded."""
    if shadow.status == Status.ARCHIVED:
        return False
    agent_event_record(agent=shadow, type=AgentEvent.Type.SYSTEM, message=f"{CONTACT_RESTORED} {peer.label}")
    return True


@transaction.atomic
def shadows_clear_stale(*, peer: Peer) -> int:
    """The peer's stream is back (a snapshot arrived): clear ``stale`` on every shadow of the
    peer, each not archived with one ``system`` event "contact restored with <peer label>" —
    the counterpart of ``shadows_mark_stale``'s "lost contact", so only a shadow that lost
    contact gets it, once per drop. Announces each. Returns the count."""
    shadows = list(Agent.objects.select_for_update().filter(peer=peer, stale=True))
    Agent.objects.filter(pk__in=[shadow.pk for shadow in shadows]).update(stale=False, updated_at=timezone.now())
    for shadow in shadows:
        shadow.stale = False
        if not _contact_restored_note(shadow, peer):
            _publish(shadow.pk)
    return len(shadows)


@transaction.atomic
def shadows_stop_for_unlink(*, peer: Peer) -> int:
    """The link was revoked: every shadow of the peer not stopped or archived becomes
    ``stopped`` with a ``system`` event saying why. Returns the count."""
    shadows = list(Agent.objects.select_for_update().filter(peer=peer).exclude(status__in=_AT_REST))
    for shadow in shadows:
        _set_status(shadow, Status.STOPPED, f"the link to {peer.label} was removed; this agent is no longer mirrored")
    return len(shadows)


# --- a shadow this instance launched or forwarded to its peer ------------------------------------


@transaction.atomic
def shadow_record_launch(
    *,
    peer: Peer,
    peer_agent_id: str,
    name: str,
    type: str,
    status: str,
    cwd: str,
    launched_by: Agent | None,
    child: bool,
) -> Agent:
    """The shadow of an agent just launched on ``peer`` (docs/peers.md#using-a-link): created with the status of
    the launch answer (``shadow_upsert``), or — when the mirror created it
    first — left at the mirror's status; either way ``cwd``, ``launched_by`` (always) and
    ``parent`` (= the launcher when ``child``) are set. Owned by ``peer.owner``.
    Raises ``ValueError`` for an unknown status or a bad id (nothing written).
    """
    existing = Agent.objects.select_for_update().filter(peer=peer, peer_agent_id=peer_agent_id).first()
    if existing is None:
        existing = shadow_upsert(
            peer=peer, peer_agent_id=peer_agent_id, name=name, type=type, status=status, seen_at=timezone.now()
        )
    existing.cwd = cwd[:4096]
    existing.launched_by = launched_by
    fields = ["cwd", "launched_by", "updated_at"]
    if child and launched_by is not None:
        existing.parent = launched_by
        fields.append("parent")
    if type and existing.type in ("", "unknown"):
        existing.type = type[:40]
        fields.append("type")
    existing.updated_at = timezone.now()
    existing.save(update_fields=fields)
    agent_event_record(
        agent=existing,
        type=AgentEvent.Type.SYSTEM,
        message=f"launched on {peer.label} as {peer_agent_id}",
        metadata={"peer": peer.label, "peer_agent_id": peer_agent_id},
    )
    return Agent.objects.select_related("owner", "peer").get(pk=existing.pk)


@transaction.atomic
def shadow_settle(*, agent_id: str, status: str, note: str) -> Agent:
    """Set a shadow's status directly (shadows take what their peer reports; no transition
    table) with a ``system`` event ``note``; archiving also announces ``agent.deleted``."""
    shadow = Agent.objects.select_for_update().get(pk=agent_id)
    if shadow.status != status:
        shadow.status = status
        shadow.updated_at = timezone.now()
        shadow.save(update_fields=["status", "updated_at"])
    agent_event_record(agent=shadow, type=AgentEvent.Type.SYSTEM, message=note)
    if status == Agent.Status.ARCHIVED:
        publish_on_commit(user_id=shadow.owner_id, event="agent.deleted", data={"id": shadow.pk})
    return Agent.objects.select_related("owner", "peer").get(pk=agent_id)
