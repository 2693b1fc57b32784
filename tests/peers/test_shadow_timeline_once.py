"""Each message appears once in a shadow agent's timeline (docs/peers.md "Shadow agents").

A message this instance sends to a shadow gets this instance's own "message delivered"
note when the peer's receipt arrives; the peer writes its own when it hands the message to
its agent, and its events stream mirrors that note here. The mirrored note is folded into
the local one (``metadata.delivered_on_peer_at``) instead of adding a second entry for the
same message; replays of it add nothing; a message the peer's own users sent, which has no
local note, still gets its mirrored entry.

These run the services of the real path: ``peer_message_send`` (the REST enqueue),
``outbox_mark_delivered_many`` (the peer's batch receipt) and ``shadow_apply_frame`` /
``shadows_apply_snapshot`` (the mirror's ``agent.upsert`` and ``snapshot`` frames).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent, AgentEvent
from peers.models import OutboxMessage
from peers.services.outbox import outbox_mark_delivered_many
from peers.services.outgoing import peer_message_send
from peers.services.shadows import shadow_apply_frame, shadow_upsert, shadows_apply_snapshot

pytestmark = pytest.mark.django_db

REMOTE_AGENT = "agt_0123456789ab"
ON_PEER = datetime(2026, 12, 4, 10, 0, 0, 250000, tzinfo=UTC)  # the peer's clock


@pytest.fixture
def shadow(owner: Any, make_peer: Any) -> Agent:
    peer = make_peer(owner, label="Cloud", url="http://cloud.test").peer
    return shadow_upsert(
        peer=peer, peer_agent_id=REMOTE_AGENT, name="far", type="shell", status="running", seen_at=timezone.now()
    )


def send_and_receipt(owner: Any, shadow: Agent, *contents: str) -> list[int]:
    """Send ``contents`` to the shadow and mark them delivered as the peer's receipt does;
    the local message ids, in order."""
    assert shadow.peer is not None
    sent = [
        peer_message_send(user=owner, sender_agent=None, peer=shadow.peer, to_agent_id=REMOTE_AGENT, content=text)
        for text in contents
    ]
    rows = list(OutboxMessage.objects.filter(message__in=sent).order_by("pk"))
    assert len(outbox_mark_delivered_many(rows=rows)) == len(sent)
    return [message.pk for message in sent]


def peer_delivered(shadow: Agent, at: datetime) -> dict[str, Any]:
    """The peer's ``agent.upsert`` frame once it handed a message to its agent at ``at``."""
    return {
        "id": REMOTE_AGENT,
        "name": "far",
        "type": "shell",
        "status": "running",
        "parent_id": None,
        "updated_at": at.isoformat(),
        "latest_event": {"type": "system", "message": "message delivered", "created_at": at.isoformat()},
    }


def delivered_entries(shadow: Agent) -> list[AgentEvent]:
    return list(AgentEvent.objects.filter(agent=shadow, message="message delivered").order_by("created_at", "pk"))


def test_a_message_sent_from_here_appears_once_when_the_peer_reports_its_delivery(owner: Any, shadow: Agent) -> None:
    [message_id] = send_and_receipt(owner, shadow, "echo hello")
    assert len(delivered_entries(shadow)) == 1  # this instance's note, at the receipt

    assert shadow.peer is not None
    shadow_apply_frame(peer=shadow.peer, data=peer_delivered(shadow, ON_PEER), seen_at=timezone.now())

    [entry] = delivered_entries(shadow)
    assert not entry.mirrored and entry.metadata["message_id"] == message_id
    assert entry.metadata["delivered_on_peer_at"] == ON_PEER.isoformat()


def test_a_replayed_delivery_note_adds_nothing(owner: Any, shadow: Agent) -> None:
    send_and_receipt(owner, shadow, "echo hello")
    assert shadow.peer is not None
    frame = peer_delivered(shadow, ON_PEER)
    shadow_apply_frame(peer=shadow.peer, data=frame, seen_at=timezone.now())
    send_and_receipt(owner, shadow, "echo second")  # sent, not yet handed to the agent there

    # The stream drops and comes back: the snapshot reports the same latest event again.
    for _ in range(2):
        shadows_apply_snapshot(peer=shadow.peer, agents=[frame], seen_at=timezone.now())

    entries = delivered_entries(shadow)
    assert len(entries) == 2 and not any(entry.mirrored for entry in entries)
    assert [entry.metadata.get("delivered_on_peer_at") for entry in entries] == [ON_PEER.isoformat(), None]


def test_several_messages_each_appear_once_in_the_order_sent(owner: Any, shadow: Agent) -> None:
    sent = send_and_receipt(owner, shadow, "one", "two", "three")
    assert shadow.peer is not None
    for index in range(3):
        at = ON_PEER + timedelta(seconds=index)
        shadow_apply_frame(peer=shadow.peer, data=peer_delivered(shadow, at), seen_at=timezone.now())

    entries = delivered_entries(shadow)
    assert [entry.metadata["message_id"] for entry in entries] == sent
    assert [entry.metadata["delivered_on_peer_at"] for entry in entries] == [
        (ON_PEER + timedelta(seconds=index)).isoformat() for index in range(3)
    ]
    assert AgentEvent.objects.filter(agent=shadow, mirrored=True).count() == 0


def test_a_message_from_the_peers_own_users_still_gets_its_mirrored_entry(owner: Any, shadow: Agent) -> None:
    assert shadow.peer is not None
    shadow_apply_frame(peer=shadow.peer, data=peer_delivered(shadow, ON_PEER), seen_at=timezone.now())
    shadow_apply_frame(peer=shadow.peer, data=peer_delivered(shadow, ON_PEER), seen_at=timezone.now())  # replayed

    [entry] = delivered_entries(shadow)
    assert entry.mirrored and entry.created_at == ON_PEER

    # A message sent from here afterwards: its note and the peer's fold into one entry.
    send_and_receipt(owner, shadow, "echo later")
    shadow_apply_frame(
        peer=shadow.peer, data=peer_delivered(shadow, ON_PEER + timedelta(minutes=1)), seen_at=timezone.now()
    )
    entries = delivered_entries(shadow)
    assert [entry.mirrored for entry in entries] == [True, False]


def test_other_mirrored_events_are_recorded_as_before(owner: Any, shadow: Agent) -> None:
    send_and_receipt(owner, shadow, "echo hello")
    assert shadow.peer is not None
    frame = peer_delivered(shadow, ON_PEER)
    frame["latest_event"] = {"type": "working", "message": "message delivered", "created_at": ON_PEER.isoformat()}
    shadow_apply_frame(peer=shadow.peer, data=frame, seen_at=timezone.now())

    assert AgentEvent.objects.filter(agent=shadow, mirrored=True, type="working").count() == 1
    local = AgentEvent.objects.get(agent=shadow, mirrored=False, message="message delivered")
    assert "delivered_on_peer_at" not in local.metadata
