"""Messages to agents (docs/agents.md#messages-and-their-status,
docs/agents.md#how-a-message-reaches-the-pane).

A message to an **expert** agent is a prompt: it queues a run whose instruction is the
message and is ``delivered`` at once. A message to a **CLI** agent is ``queued`` until
the supervisor on the agent's host pastes it into the pane (``message_mark_delivered``)
or gives up (``message_mark_failed``). Rows are the truth; each new message is announced
after commit as ``message.created`` and each later change as ``message.updated`` to the
owner's live-events group.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents import services
from agents.models import Agent, AgentEvent, AgentMessage
from agents.protocol import CliDoorbellMessage, UserEventMessage
from agents.selectors import is_shadow
from agents.serializers import agent_data, event_data, message_data
from core.errors import DispatchError, InvalidRequest, NotFound
from core.realtime import ring, ring_on_commit

if TYPE_CHECKING:
    from agents.hooks import Link

logger = logging.getLogger(__name__)

MAX_MESSAGE_LENGTH = 200_000
# A CLI agent accepts messages while its session is (or is about to be) up.
CLI_ACCEPTING = frozenset({Agent.Status.CREATING, Agent.Status.RUNNING})

Status = AgentMessage.Status


def _publish(message: AgentMessage, event: str) -> None:
    owner_id = Agent.objects.values_list("owner_id", flat=True).get(pk=message.recipient_agent_id)
    services.publish_on_commit(user_id=owner_id, event=event, data=message_data(message))


def doorbell_group(host: str) -> str:
    """The channel-layer group the CLI supervisor of ``host`` listens on for new messages.

    ``cli-supervisor.<sanitised host>.<8 hex of its SHA-256>``: only ``[A-Za-z0-9._-]``,
    under 100 characters, and distinct for hosts that sanitise alike.
    """
    safe = re.sub(r"[^A-Za-z0-9.-]", "-", host)[:60]
    return f"cli-supervisor.{safe}.{hashlib.sha256(host.encode()).hexdigest()[:8]}"


def doorbell_ring(host: str) -> None:
    """Wake the CLI supervisor of ``host`` (``{"type": "cli.doorbell"}`` to its group) once
    the current transaction commits, at once outside one (``core.realtime.ring_on_commit``).

    At most once and best effort: a lost ring only delays delivery to the next poll.
    Call from sync code; never raises.
    """
    ring_on_commit(doorbell_group(host), CliDoorbellMessage())


def message_content(content: Any) -> str:
    """``content`` checked for a message: a non-blank string of at most
    ``MAX_MESSAGE_LENGTH`` characters, made storable; else ``InvalidRequest`` saying which."""
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequest("content must be a non-empty string")
    if len(content) > MAX_MESSAGE_LENGTH:
        raise InvalidRequest(f"content must be at most {MAX_MESSAGE_LENGTH} characters")
    return services.storable_text(content, "content")


@transaction.atomic
def message_send(
    *,
    recipient: Agent,
    content: str,
    sender_user: User | None = None,
    sender_agent: Agent | None = None,
    sender_peer: Link | None = None,
    sender_address: dict[str, Any] | None = None,
    idempotency_key: str = "",
) -> AgentMessage:
    """Record a message to ``recipient`` from a user, one of the same user's agents, or a
    linked instance (``sender_peer``, acting for its link user, with the ``sender_address``
    ``{instance_id, agent_id | null, name}`` there and its ``idempotency_key``; docs/peers.md#messages).

    Expert recipient: a run is queued with ``instruction = content`` (``run_enqueue``) and
    the message is ``delivered``. CLI recipient: the message is ``queued`` for the
    supervisor to paste (docs/agents.md#how-a-message-reaches-the-pane), whose doorbell (``doorbell_ring``) is rung
    after commit. ``content``: 1–200,000 characters, no NUL.
    Raises ``InvalidRequest`` (bad content, no sender or two, a shadow agent — those go
    through the peer's outbox), ``NotFound`` (a recipient of another user) or ``CONFLICT``
    (the recipient is archived or not running).
    """
    senders = [sender for sender in (sender_user, sender_agent, sender_peer) if sender is not None]
    if len(senders) != 1:
        raise InvalidRequest("a message has exactly one sender: a user, an agent or a linked instance")
    text = message_content(content)
    current = Agent.objects.select_for_update().get(pk=recipient.pk)
    owner_id = sender_user.pk if sender_user is not None else senders[0].owner_id  # type: ignore[union-attr]
    origin: dict[str, Any] = {"sender_user": sender_user, "sender_agent": sender_agent}
    if sender_peer is not None:
        origin.update(
            sender_peer=sender_peer, sender_address=sender_address, peer=sender_peer, idempotency_key=idempotency_key
        )
    if current.owner_id != owner_id:
        raise NotFound(f"no agent '{recipient.pk}'")
    if current.status == Agent.Status.ARCHIVED:  # visible (GET answers it), but gone: like start, 409
        raise DispatchError("CONFLICT", f"agent '{current.pk}' is archived", {"status": current.status})
    if is_shadow(current):
        raise InvalidRequest(f"agent '{current.pk}' is a shadow agent: it is messaged through its peer")
    if current.type == services.EXPERT:
        services.run_enqueue(agent=current, instruction=text)  # CONFLICT when not running
        message = AgentMessage.objects.create(
            **origin, recipient_agent=current, content=text, status=Status.DELIVERED, delivered_at=timezone.now()
        )
    else:
        if current.status not in CLI_ACCEPTING:
            raise DispatchError(
                "CONFLICT",
                f"agent '{current.pk}' is not running (status {current.status})",
                {"status": current.status},
            )
        message = AgentMessage.objects.create(**origin, recipient_agent=current, content=text)
        doorbell_ring(current.host)  # after commit
    _publish(message, "message.created")
    return message


def messages_pending(*, agent: Agent) -> list[AgentMessage]:
    """``agent``'s queued messages, oldest first (what the supervisor pastes next)."""
    return list(AgentMessage.objects.filter(recipient_agent=agent, status=Status.QUEUED).order_by("created_at", "pk"))


def message_mark_delivered(*, message: AgentMessage, metadata: dict[str, Any] | None = None) -> bool:
    """``queued`` → ``delivered`` (pasted into the pane); a ``system`` event on the recipient,
    ``metadata`` (JSON-safe; e.g. ``{"neutralised": true, ...}`` when the supervisor changed
    the start of the text, docs/agents.md) added to the event's own.

    A conditional UPDATE: returns False (and records nothing) if the message was no
    longer queued. ``messages_mark_delivered`` for one message.
    """
    extra = {message.pk: metadata} if metadata else None
    if not messages_mark_delivered(message_ids=[message.pk], metadata=extra):
        return False
    message.refresh_from_db()
    return True


@transaction.atomic
def messages_mark_delivered(
    *, message_ids: Sequence[int], metadata: Mapping[int, dict[str, Any]] | None = None
) -> list[int]:
    """``queued`` → ``delivered`` for each of ``message_ids`` (AgentMessage primary keys)
    that is still queued, in one transaction and a fixed number of queries whatever their
    number (a peer's batch receipt marks up to 50 at once): one ``system``
    event "message delivered" (``metadata {message_id, chars}``) on each recipient, each
    recipient's ``latest_event_*`` moved to it, then after commit, in one hop to the channel
    layer, ``agent.event`` and ``message.updated`` per message and ``agent.upsert`` once per
    recipient. ``metadata`` maps a message id to more keys for its event's metadata.
    Returns the ids marked, in the order given; a message no longer queued
    (delivered, failed, unknown) is left as it is and not returned.
    """
    wanted = list(dict.fromkeys(message_ids))
    if not wanted:
        return []
    now = timezone.now()
    found = {
        message.pk: message
        for message in AgentMessage.objects.select_for_update(of=("self",))
        .select_related("sender_user", "recipient_agent")
        .filter(pk__in=wanted, status=Status.QUEUED)
    }
    marked = [found[pk] for pk in wanted if pk in found]
    if not marked:
        return []
    AgentMessage.objects.filter(pk__in=[message.pk for message in marked]).update(
        status=Status.DELIVERED, delivered_at=now
    )
    events = AgentEvent.objects.bulk_create(
        AgentEvent(
            agent_id=message.recipient_agent_id,
            type=AgentEvent.Type.SYSTEM,
            message="message delivered",
            metadata={
                **((metadata or {}).get(message.pk) or {}),
                "message_id": message.pk,
                "chars": len(message.content),
            },
            created_at=now,
        )
        for message in marked
    )
    recipients = list(dict.fromkeys(message.recipient_agent_id for message in marked))
    Agent.objects.filter(pk__in=recipients).filter(
        Q(latest_event_at__isnull=True) | Q(latest_event_at__lte=now)
    ).update(
        latest_event_type=AgentEvent.Type.SYSTEM,
        latest_event_message="message delivered",
        latest_event_at=now,
        updated_at=timezone.now(),
    )
    fresh = {agent.pk: agent for agent in Agent.objects.select_related("owner", "peer").filter(pk__in=recipients)}
    announcements: list[tuple[int, str, dict[str, Any]]] = []
    for message, event in zip(marked, events, strict=True):
        message.status = Status.DELIVERED
        message.delivered_at = now
        owner_id = message.recipient_agent.owner_id
        announcements.append((owner_id, "agent.event", event_data(event)))
        announcements.append((owner_id, "message.updated", message_data(message)))
    for agent in fresh.values():
        announcements.append((agent.owner_id, "agent.upsert", agent_data(agent)))
    transaction.on_commit(lambda: _announce_now(announcements))
    return [message.pk for message in marked]


def _announce_now(announcements: list[tuple[int, str, dict[str, Any]]]) -> None:
    """Send each ``(user_id, event, data)`` to that user's live-events group, in order, in one
    hop to the channel layer (``async_to_sync`` once, not once per frame). Never raises:
    ``core.realtime.ring`` logs each failure, readers reload from the rows."""

    async def send_all() -> None:
        for user_id, event, data in announcements:
            await ring(services.user_events_group(user_id), UserEventMessage(event=event, data=data))

    try:
        async_to_sync(send_all)()
    except Exception:  # never let an announcement fail a committed write
        logger.exception("announcing %d delivered messages failed", len(announcements))


def message_mark_pasted(*, message: AgentMessage) -> bool:
    """Record that a ``queued`` message is being pasted into its pane (``pasted_at``).

    It stays ``queued``: for a CLI with hooks ``delivered`` waits for its
    ``UserPromptSubmit`` hook to carry the text (``agents.cli_hooks``), and the supervisor
    fails it when that does not come in time (docs/agents.md#hooks); for other types the
    supervisor marks it ``delivered`` right after the paste, and a successor finding the
    mark without ``delivered`` checks the pane (docs/agents.md#how-a-message-reaches-the-pane).
    A conditional UPDATE: False (nothing changed)
    if it was no longer queued or already pasted. Announced as ``message.updated``.
    """
    now = timezone.now()
    if not AgentMessage.objects.filter(pk=message.pk, status=Status.QUEUED, pasted_at__isnull=True).update(
        pasted_at=now
    ):
        return False
    message.refresh_from_db()
    _publish(message, "message.updated")
    return True


def messages_pasted_unconfirmed(*, agent: Agent) -> list[AgentMessage]:
    """``agent``'s messages pasted but not yet confirmed by its CLI, oldest paste first."""
    return list(
        AgentMessage.objects.filter(recipient_agent=agent, status=Status.QUEUED, pasted_at__isnull=False).order_by(
            "pasted_at", "pk"
        )
    )


@transaction.atomic
def message_mark_failed(*, message: AgentMessage, error: str, dead: bool = False) -> bool:
    """``queued`` → ``failed`` (or ``dead`` when it can never be delivered) with ``error``.

    Returns False if the message was no longer queued.
    """
    status = Status.DEAD if dead else Status.FAILED
    if not AgentMessage.objects.filter(pk=message.pk, status=Status.QUEUED).update(status=status, error=error[:2000]):
        return False
    message.refresh_from_db()
    _publish(message, "message.updated")
    return True


def messages_fail_pending(*, agent: Agent, error: str) -> int:
    """Fail every queued message of ``agent`` (it stopped before they were pasted)."""
    failed = 0
    for message in messages_pending(agent=agent):
        failed += message_mark_failed(message=message, error=error)
    return failed


def message_get(*, user: User, message_id: Any) -> AgentMessage:
    """One of ``user``'s messages (sent to one of their agents, or by one of them).

    Raises ``NotFound`` for an unknown id or another user's message (never tells them
    apart).
    """
    try:
        pk = int(message_id)
    except (TypeError, ValueError):
        raise NotFound("no such message") from None
    if not 0 < pk < 2**63:
        raise NotFound("no such message")
    message = AgentMessage.objects.filter(pk=pk, recipient_agent__owner=user).first()
    if message is None:
        raise NotFound(f"no message {pk}")
    return message
