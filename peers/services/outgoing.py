"""Messages this instance sends to agents on a linked peer (docs/peers.md#the-outbox): the local
``AgentMessage`` and its ``OutboxMessage``, written in one transaction; the drain
(``peers.outbox_drain``) delivers it. Also who on this instance launches or sends, as a peer
sees it (``launcher_address``: ``launched_by`` / ``from``, docs/peers.md#launch).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Subquery

from agents import services as agent_services
from agents.messages import MAX_MESSAGE_LENGTH
from agents.models import Agent, AgentMessage
from agents.protocol import UserEventMessage
from agents.selectors import AGENT_ID
from agents.serializers import message_data
from core.errors import InvalidRequest, NotFound
from core.models import InstanceIdentity
from core.realtime import ring_on_commit
from core.services import instance_identity_get
from peers.models import Peer, new_idempotency_key
from peers.services.outbox import outbox_enqueue


def launcher_address(*, user: User, caller_agent: Agent | None) -> dict[str, Any]:
    """``{instance_id, agent_id | null, name}``: who on this instance launches or sends
    (``launched_by`` / ``from``): ``caller_agent``, else the person ``user``."""
    # The instance id alone: one SELECT, not identity_get()'s locked read and key decryption.
    return _address(instance_identity_get().instance_id, user=user, caller_agent=caller_agent)


def _address(instance_id: str, *, user: User, caller_agent: Agent | None) -> dict[str, Any]:
    if caller_agent is not None:
        return {"instance_id": instance_id, "agent_id": caller_agent.pk, "name": caller_agent.name}
    return {"instance_id": instance_id, "agent_id": None, "name": user.get_username()}


def _live_peer(peer: Peer, user: User) -> Peer:
    """``peer`` read again: ``user``'s and not revoked, else ``NotFound``."""
    live = Peer.objects.filter(pk=peer.pk, owner=user, revoked_at__isnull=True).first()
    if live is None:
        raise NotFound(f"no linked instance '{peer.label}'")
    return live


def _shadow_for(peer: Peer, agent_id: str) -> Agent:
    """The shadow of ``peer``'s agent ``agent_id`` — given as its id there, or as the
    shadow's own local id. ``NotFound`` (listing what is known) for an agent the mirror has
    not reported: a message to an id nobody knows would only be dead-lettered later."""
    shadow = (
        Agent.objects.filter(peer=peer, peer_agent_id=agent_id).order_by("created_at").first()
        or Agent.objects.filter(peer=peer, pk=agent_id).first()
    )
    if shadow is not None:
        return shadow
    known = list(
        Agent.objects.filter(peer=peer)
        .exclude(status=Agent.Status.ARCHIVED)
        .order_by("-updated_at")
        .values_list("name", "peer_agent_id")[:10]
    )
    listing = ", ".join(f"{name} ({remote_id})" for name, remote_id in known) or "none yet"
    raise NotFound(
        f"{peer.label} has no agent '{agent_id}' that this instance knows of; address an agent there by its id "
        f"on {peer.label} (a shadow's peer_agent_id). Known agents of {peer.label}: {listing}",
        {"peer": peer.label, "agent_id": agent_id},
    )


@transaction.atomic
def peer_message_send(
    *, user: User, sender_agent: Agent | None, peer: Peer, to_agent_id: str, content: str
) -> AgentMessage:
    """Send ``content`` to agent ``to_agent_id`` on ``peer`` and return the local message.

    Writes, in one transaction, the ``AgentMessage`` (``queued``; recipient = the shadow
    of ``(peer, to_agent_id)`` — ``to_agent_id`` may also be the shadow's local id;
    ``peer`` and a fresh ``idempotency_key``) and
    its ``OutboxMessage`` (payload ``{to_agent_id, content, from: {instance_id, agent_id |
    null, name}}``); the drain doorbell rings after commit (delivery is attempted at once
    by the drain loop). ``sender_agent`` ``None``: ``user`` sends it.

    Raises ``NotFound`` (a peer of another user or a revoked one, a sender of another
    user, an agent the mirror has not reported), ``InvalidRequest`` (content empty or
    over 200,000 characters or with a NUL, a malformed agent id).
    """
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequest("content must be a non-empty string")
    if len(content) > MAX_MESSAGE_LENGTH:
        raise InvalidRequest(f"content must be at most {MAX_MESSAGE_LENGTH} characters")
    agent_services.storable_text(content, "content")
    if not AGENT_ID.match(to_agent_id or ""):
        raise InvalidRequest(f"'{to_agent_id}' is not an agent id (agt_ and 12 hex digits)")
    # The usual case in one query, read inside the transaction so that an unlink committed
    # first is seen (an unlink makes the link's queued rows dead in its own transaction; a
    # row written after it would stay queued: docs/peers.md#unlinking): the shadow's id by
    # its id there, whether its link is ``user``'s and live, and this instance's id for the
    # ``from`` address. Only those columns: the caller holds the rows already.
    found = (
        Agent.objects.filter(peer_id=peer.pk, peer_agent_id=to_agent_id)
        .order_by("created_at")
        .annotate(our_instance_id=Subquery(InstanceIdentity.objects.filter(pk=1).values("instance_id")[:1]))
        .values_list("pk", "peer__owner_id", "peer__revoked_at", "our_instance_id")
        .first()
    )
    known = found is not None and found[1] == user.pk and found[2] is None
    live = peer if known else _live_peer(peer, user)
    if sender_agent is not None and sender_agent.owner_id != user.pk:
        raise NotFound(f"no agent '{sender_agent.pk}'")
    if found is not None and known:
        shadow_id, instance_id = found[0], found[3]
    else:  # the shadow named by its local id, or not known: read as the mirror left it
        shadow = _shadow_for(live, to_agent_id)
        shadow_id, to_agent_id, instance_id = shadow.pk, shadow.peer_agent_id, None
    key = new_idempotency_key()
    message = AgentMessage.objects.create(
        sender_agent=sender_agent,
        sender_user=None if sender_agent is not None else user,
        recipient_agent_id=shadow_id,
        content=content,
        peer=live,
        idempotency_key=key,
    )
    sender = _address(instance_id or instance_identity_get().instance_id, user=user, caller_agent=sender_agent)
    outbox_enqueue(
        message=message,
        peer=live,
        to_agent_id=to_agent_id,
        payload={"to_agent_id": to_agent_id, "content": content, "from": sender},
    )
    # Announced after commit; the database thread does not wait for the send.
    ring_on_commit(
        agent_services.user_events_group(user.pk), UserEventMessage(event="message.created", data=message_data(message))
    )
    return message
