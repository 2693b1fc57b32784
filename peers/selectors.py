"""Reads of the peers app (docs/architecture.md#the-layers): always for a caller, never a bare ``.get``.

A link acts as one user per side and no other user sees it (docs/peers.md#who-a-link-acts-as);
a location is a label or an instance id, case-insensitive (docs/peers.md#labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Count, Min, Q, QuerySet
from django.db.models.functions import Lower
from django.utils import timezone

from agents.models import AgentMessage
from core.errors import InvalidRequest, NotFound
from peers.models import OutboxMessage, PairingOffer, Peer


def peers_for(*, user: User) -> QuerySet[Peer]:
    """The live peers whose link acts as ``user``, by label (case-insensitive)."""
    return Peer.objects.filter(owner=user, revoked_at__isnull=True).select_related("owner").order_by("label", "id")


def peers_by_label_for(*, user: User) -> QuerySet[Peer]:
    """The live peers whose link acts as ``user``, ordered by ``Lower(label)`` (the launch
    form's locations on the agents page)."""
    return Peer.objects.filter(owner=user, revoked_at__isnull=True).order_by(Lower("label"))


def peer_get_for(*, user: User, peer_id: int) -> Peer:
    """One of ``user``'s live peers; ``NotFound`` (404) for another user's, a revoked or an unknown one."""
    peer = peers_for(user=user).filter(pk=peer_id).first()
    if peer is None:
        raise NotFound(f"no linked instance {peer_id}")
    return peer


def peer_resolve_location(*, user: User, location: str) -> Peer:
    """The peer a ``location`` names: a label or an instance id, case-insensitive,
    among ``user``'s live peers.

    Raises ``NotFound`` (404) listing the user's labels when nothing matches, and
    ``InvalidRequest`` (400) listing the matches when the text names two peers (one's
    label is another's instance id).
    """
    text = (location or "").strip()
    candidates = peers_for(user=user)
    matches = list(candidates.filter(Q(label__iexact=text) | Q(instance_id__iexact=text)))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        labels = [peer.label for peer in candidates]
        known = ", ".join(labels) if labels else "none"
        raise NotFound(f"no linked instance '{text}'; your linked instances: {known}", {"labels": labels})
    named = [f"{peer.label} ({peer.instance_id})" for peer in matches]
    raise InvalidRequest(
        f"location '{text}' is ambiguous: it matches {', '.join(named)}; use the instance id",
        {"matches": [{"label": peer.label, "instance_id": peer.instance_id} for peer in matches]},
    )


def label_taken(*, label: str, exclude_peer_id: int | None = None) -> bool:
    """Whether a live peer (any user's: labels are unique per instance) has ``label``, ignoring case."""
    taken = Peer.objects.filter(revoked_at__isnull=True, label__iexact=label)
    if exclude_peer_id is not None:
        taken = taken.exclude(pk=exclude_peer_id)
    return taken.exists()


def live_offers() -> QuerySet[PairingOffer]:
    """Pairing offers still usable: not used, not burned, not expired."""
    return PairingOffer.objects.filter(used_at__isnull=True, burned_at__isnull=True, expires_at__gt=timezone.now())


def outbox_counts(*, peer_ids: list[int]) -> dict[int, dict[str, int]]:
    """``{peer_id: {"queued": n, "dead": n}}`` for the given peers (what operators see,
    docs/peers.md#the-outbox); a peer without rows gets zeros."""
    counts: dict[int, dict[str, int]] = {peer_id: {"queued": 0, "dead": 0} for peer_id in peer_ids}
    rows = (
        OutboxMessage.objects.filter(
            peer_id__in=peer_ids, status__in=[OutboxMessage.Status.QUEUED, OutboxMessage.Status.DEAD]
        )
        .values("peer_id", "status")
        .annotate(n=Count("id"))
    )
    for row in rows:
        counts[row["peer_id"]][row["status"]] = row["n"]
    return counts


def outbox_rows_for(*, user: User, peer_id: int) -> QuerySet[OutboxMessage]:
    """The queued and dead outbox rows of one of ``user``'s peers, oldest first (``NotFound`` otherwise)."""
    peer = peer_get_for(user=user, peer_id=peer_id)
    return OutboxMessage.objects.filter(
        peer=peer, status__in=[OutboxMessage.Status.QUEUED, OutboxMessage.Status.DEAD]
    ).order_by("created_at", "id")


@dataclass(frozen=True)
class OutboxBacklog:
    """One peer's outbox as ``/metrics`` shows it: queued rows (``depth``), the age of the
    oldest queued row in seconds (0 when none waits), and dead-lettered rows."""

    peer_id: int
    label: str
    depth: int
    oldest_age_seconds: float
    dead: int


def outbox_backlog(*, now: datetime | None = None) -> list[OutboxBacklog]:
    """The outbox of every live peer, and of any revoked peer that still has queued or dead
    rows, by peer id (docs/peers.md#the-outbox); ages are measured at
    ``now`` (default: now). Two queries whatever the number of rows."""
    now = now or timezone.now()
    rows = (
        OutboxMessage.objects.filter(status__in=[OutboxMessage.Status.QUEUED, OutboxMessage.Status.DEAD])
        .values("peer_id", "status")
        .annotate(n=Count("id"), oldest=Min("created_at"))
    )
    depth: dict[int, int] = {}
    oldest: dict[int, datetime] = {}
    dead: dict[int, int] = {}
    for row in rows:
        if row["status"] == OutboxMessage.Status.QUEUED:
            depth[row["peer_id"]], oldest[row["peer_id"]] = row["n"], row["oldest"]
        else:
            dead[row["peer_id"]] = row["n"]
    peers = Peer.objects.filter(Q(revoked_at__isnull=True) | Q(pk__in=[*depth, *dead])).order_by("pk")
    return [
        OutboxBacklog(
            peer_id=peer_id,
            label=label,
            depth=depth.get(peer_id, 0),
            oldest_age_seconds=max(0.0, (now - oldest[peer_id]).total_seconds()) if peer_id in oldest else 0.0,
            dead=dead.get(peer_id, 0),
        )
        for peer_id, label in peers.values_list("pk", "label")
    ]


def outbox_delivery_for(*, message: AgentMessage) -> dict[str, Any] | None:
    """The outbox state of a message this instance sent to an agent on a peer (docs/peers.md#using-a-link,
    ``message_status``): ``{peer, remote_agent_id, attempts, next_attempt_at (null once
    it left the queue), error}``; ``None`` for any other message."""
    if message.peer_id is None or message.sender_peer_id is not None:
        return None
    outbox = OutboxMessage.objects.filter(message=message).select_related("peer").first()
    if outbox is None:
        return None
    return {
        "peer": outbox.peer.label,
        "remote_agent_id": outbox.to_agent_id,
        "attempts": outbox.attempts,
        "next_attempt_at": outbox.next_attempt_at.isoformat() if outbox.status == "queued" else None,
        "error": message.error or outbox.last_error or None,
    }
