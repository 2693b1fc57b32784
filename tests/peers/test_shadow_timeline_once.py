"""Each message appears once in a shadow agent's timeline (docs/peers.md#shadow-agents).

A message this instance sends to a shadow gets this instance's own "message delivered"
note when the peer's receipt arrives; the peer writes its own when it hands the message to
its agent, and its events stream mirrors that note here. The mirrored note is folded into
the local one (``metadata.delivered_on_peer_at``) instead of adding a second entry for the
same message; replays of it add nothing; a message the peer's own users sent, which has no
local note, still gets its mirrored entry.

Most tests run the services of the real path: ``peer_message_send`` (the REST enqueue),
``outbox_mark_delivered_many`` (the peer's batch receipt) and ``shadow_apply_frame`` /
``shadows_apply_snapshot`` (the mirror's ``agent.upsert`` and ``snapshot`` frames). The
last one links two real instances (``manage.py serve`` each, as
tests/integration/test_two_instances.py does) and sends a message to a shell agent on B
from A's shadow of it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent, AgentEvent
from peers.models import OutboxMessage
from peers.services.outbox import outbox_mark_delivered_many
from peers.services.outgoing import peer_message_send
from peers.services.shadows import shadow_apply_frame, shadow_upsert, shadows_apply_snapshot
from tests.backends import free_port
from tests.infra import instance, wait_until
from tests.integration.test_two_instances import Api, serve_at

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


@pytest.mark.django_db
def test_a_message_sent_from_here_appears_once_when_the_peer_reports_its_delivery(owner: Any, shadow: Agent) -> None:
    [message_id] = send_and_receipt(owner, shadow, "echo hello")
    assert len(delivered_entries(shadow)) == 1  # this instance's note, at the receipt

    assert shadow.peer is not None
    shadow_apply_frame(peer=shadow.peer, data=peer_delivered(shadow, ON_PEER), seen_at=timezone.now())

    [entry] = delivered_entries(shadow)
    assert not entry.mirrored and entry.metadata["message_id"] == message_id
    assert entry.metadata["delivered_on_peer_at"] == ON_PEER.isoformat()


@pytest.mark.django_db
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


@pytest.mark.django_db
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


@pytest.mark.django_db
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


@pytest.mark.django_db
def test_other_mirrored_events_are_recorded_as_before(owner: Any, shadow: Agent) -> None:
    send_and_receipt(owner, shadow, "echo hello")
    assert shadow.peer is not None
    frame = peer_delivered(shadow, ON_PEER)
    frame["latest_event"] = {"type": "working", "message": "message delivered", "created_at": ON_PEER.isoformat()}
    shadow_apply_frame(peer=shadow.peer, data=frame, seen_at=timezone.now())

    assert AgentEvent.objects.filter(agent=shadow, mirrored=True, type="working").count() == 1
    local = AgentEvent.objects.get(agent=shadow, mirrored=False, message="message delivered")
    assert "delivered_on_peer_at" not in local.metadata


# --- two real instances ------------------------------------------------------------------


@pytest.fixture
def tmux_sockets() -> Iterator[tuple[str, str]]:
    sockets = (f"dispatch-once-a-{uuid.uuid4().hex[:8]}", f"dispatch-once-b-{uuid.uuid4().hex[:8]}")
    try:
        yield sockets
    finally:
        for socket in sockets:
            subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_two_linked_instances_show_a_message_once_on_the_shadow(tmp_path: Path, tmux_sockets: tuple[str, str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    port_a, port_b = free_port(), free_port()
    common: dict[str, Any] = {"DISPATCH_CLI_SUPERVISE_INTERVAL": "0.3", "DISPATCH_PEER_BACKOFF_SCALE": "0.05"}
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}", DISPATCH_TMUX_SOCKET=tmux_sockets[0], **common) as a,
        instance(
            DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}",
            DISPATCH_TMUX_SOCKET=tmux_sockets[1],
            DISPATCH_REPO_ROOTS=str(tmp_path),
            **common,
        ) as b,
    ):
        server_b = serve_at(b, port_b)
        offer = b.manage("peer_offer").stdout
        code = re.search(r"code: (\S+)", offer)
        assert code is not None, offer
        assert "linked: Bee" in a.manage("peer_link", server_b.url, code.group(1), "--label", "Bee").stdout
        server_a = serve_at(a, port_a)
        api_a, api_b = Api(server_a.url, a.admin_token), Api(server_b.url, b.admin_token)
        details = lambda: f"--- A ---\n{server_a.log()[-4000:]}\n--- B ---\n{server_b.log()[-4000:]}"  # noqa: E731

        # No prompt: a prompt is a message too, and would be a second one to count.
        shadow = api_a.post("/api/v1/agents", {"type": "shell", "name": "far", "cwd": str(repo), "location": "bee"})
        remote_id = shadow["peer_agent_id"]
        wait_until(
            lambda: (
                api_b.get(f"/api/v1/agents/{remote_id}")["status"] == "running"
                and api_a.get(f"/api/v1/agents/{shadow['id']}")["status"] == "running"
            ),
            timeout=40,
            what="B's agent running, and its shadow on A",
            details=details,
        )

        message = api_a.post(f"/api/v1/agents/{shadow['id']}/messages", {"content": "echo once-$((6*7))"})

        def delivered_entries() -> list[dict[str, Any]]:
            events = api_a.get(f"/api/v1/agents/{shadow['id']}/events")["events"]
            return [event for event in events if event["message"] == "message delivered"]

        def peer_note_seen() -> bool:
            # B's own note has reached A: as a mirrored entry, or folded into A's own.
            return any(
                event["mirrored"] or "delivered_on_peer_at" in event["metadata"] for event in delivered_entries()
            )

        wait_until(
            lambda: api_a.get(f"/api/v1/messages/{message['id']}")["status"] == "delivered",
            timeout=60,
            what="the message delivered to B",
            details=details,
        )
        [received] = [
            m for m in api_b.get(f"/api/v1/agents/{remote_id}/messages")["messages"] if "once-" in m["content"]
        ]
        wait_until(
            lambda: api_b.get(f"/api/v1/messages/{received['id']}")["status"] == "delivered",
            timeout=60,
            what="B's supervisor pasting the message",
            details=details,
        )
        wait_until(peer_note_seen, timeout=60, what="B's 'message delivered' mirrored to A", details=details)

        entries = delivered_entries()
        assert len(entries) == 1, entries
        assert entries[0]["metadata"]["message_id"] == message["id"]
