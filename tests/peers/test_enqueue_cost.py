"""What a REST enqueue to a shadow agent costs the server (bench B8): the statements of one
``POST /api/v1/agents/<shadow id>/messages``, through the real view and a bearer token, and
what it still does for them — the message and its outbox row in one transaction, the
``from`` address with this instance's id, the ``message.created`` announcement, a link
unlinked meanwhile refused (docs/peers.md#the-outbox, docs/peers.md#unlinking) — and the message as
the API renders it, the same as ``ModelSerializer`` would.

Counts, not times: a change that adds a statement to every enqueue fails here."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework import serializers

from agents import selectors
from agents.models import Agent, AgentMessage
from agents.serializers import AgentMessageData, message_data
from agents.services import user_events_group
from agents.tokens import agent_token_mint
from core.models import InstanceIdentity
from core.services import instance_identity_get
from peers.models import OutboxMessage, Peer
from peers.services.shadows import shadow_upsert

pytestmark = pytest.mark.django_db(transaction=True)

REMOTE_AGENT = "agt_0123456789ab"
# The shadow with its link (the view's ownership check); BEGIN; one SELECT for the shadow's
# id, its link's owner and revocation and this instance's id; the message's INSERT; the
# outbox row's INSERT; COMMIT. (The bearer token is cached after the first request.)
ENQUEUE_STATEMENTS = 6


@pytest.fixture
def shadow(owner: Any, make_peer: Any) -> Agent:
    peer = make_peer(owner, label="Cloud", url="http://cloud.test").peer
    return shadow_upsert(
        peer=peer, peer_agent_id=REMOTE_AGENT, name="far", type="expert", status="running", seen_at=timezone.now()
    )


def post(token: str, shadow: Agent, content: str) -> Any:
    client = Client(headers={"authorization": f"Bearer {token}"})
    return client.post(f"/api/v1/agents/{shadow.pk}/messages", {"content": content}, content_type="application/json")


def enqueue_with_statements(token: str, shadow: Agent, content: str) -> tuple[Any, list[str]]:
    assert post(token, shadow, "warm").status_code == 201  # the token is now cached
    with CaptureQueriesContext(connection) as captured:
        response = post(token, shadow, content)
    return response, [query["sql"] for query in captured.captured_queries]


def announcements(owner: Any, act: Any) -> list[dict[str, Any]]:
    """The frames sent to ``owner``'s live-events group while ``act()`` runs."""
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    try:
        channel = loop.run_until_complete(layer.new_channel())
        loop.run_until_complete(layer.group_add(user_events_group(owner.pk), channel))
        act()

        async def take() -> list[dict[str, Any]]:
            received = []
            while True:
                try:
                    received.append(await asyncio.wait_for(layer.receive(channel), 0.3))
                except TimeoutError:
                    return received

        return loop.run_until_complete(take())
    finally:
        loop.close()


def test_a_rest_enqueue_to_a_shadow_takes_six_statements_and_queues_it_whole(
    owner: Any, owner_token: str, shadow: Agent
) -> None:
    response, sql = enqueue_with_statements(owner_token, shadow, "hello")
    assert response.status_code == 201, response.content
    assert len(sql) <= ENQUEUE_STATEMENTS, "\n".join(statement[:160] for statement in sql)

    message = AgentMessage.objects.get(pk=response.json()["id"])
    assert response.json() == message_data(message)
    assert (message.recipient_agent_id, message.peer_id, message.sender_user, message.status) == (
        shadow.pk,
        shadow.peer_id,
        owner,
        "queued",
    )
    row = OutboxMessage.objects.get(message=message)
    assert (row.status, row.peer_id, row.to_agent_id, row.idempotency_key) == (
        "queued",
        shadow.peer_id,
        REMOTE_AGENT,
        message.idempotency_key,
    )
    assert row.payload == {
        "to_agent_id": REMOTE_AGENT,
        "content": "hello",
        "from": {"instance_id": instance_identity_get().instance_id, "agent_id": None, "name": "alice"},
    }


def test_an_agent_token_sends_from_its_agent_in_as_many_statements(owner: Any, shadow: Agent) -> None:
    sender = Agent.objects.create(owner=owner, name="near", type="expert", status="running", cwd="/")
    token = agent_token_mint(agent=sender)
    response, sql = enqueue_with_statements(token, shadow, "from an agent")
    assert response.status_code == 201, response.content
    assert len(sql) <= ENQUEUE_STATEMENTS, "\n".join(statement[:160] for statement in sql)
    assert response.json()["sender_agent_id"] == sender.pk and response.json()["sender_user"] is None
    row = OutboxMessage.objects.get(message_id=response.json()["id"])
    assert row.payload["from"] == {
        "instance_id": instance_identity_get().instance_id,
        "agent_id": sender.pk,
        "name": "near",
    }


def test_the_enqueue_announces_the_message_after_commit(owner: Any, owner_token: str, shadow: Agent) -> None:
    responses: list[Any] = []
    frames = announcements(owner, lambda: responses.append(post(owner_token, shadow, "seen live")))
    assert responses[0].status_code == 201
    created = [frame["data"] for frame in frames if frame["event"] == "message.created"]
    assert created == [responses[0].json()]


def test_a_link_unlinked_after_the_agent_was_read_is_refused(
    owner: Any, owner_token: str, shadow: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = selectors.agent_get_for

    def read_then_unlink(**kwargs: Any) -> Agent:
        agent = read(**kwargs)  # its link still live in what the view holds
        assert agent.peer_id is not None
        Peer.objects.filter(pk=agent.peer_id).update(revoked_at=timezone.now())
        return agent

    monkeypatch.setattr(selectors, "agent_get_for", read_then_unlink)
    response = post(owner_token, shadow, "too late")
    assert response.status_code == 404, response.content
    assert "no linked instance 'Cloud'" in response.json()["error"]["message"]
    assert not AgentMessage.objects.exists() and not OutboxMessage.objects.exists()


def test_a_recreated_identity_row_gives_its_new_instance_id(owner: Any, owner_token: str, shadow: Agent) -> None:
    before = instance_identity_get().instance_id
    InstanceIdentity.objects.all().delete()
    response = post(owner_token, shadow, "after a reset")
    assert response.status_code == 201, response.content
    instance_id = OutboxMessage.objects.get(message_id=response.json()["id"]).payload["from"]["instance_id"]
    assert instance_id == InstanceIdentity.objects.get(pk=1).instance_id != before


def test_another_users_shadow_is_not_found_and_nothing_is_queued(member_token: str, shadow: Agent) -> None:
    response = post(member_token, shadow, "not mine")
    assert response.status_code == 404, response.content
    assert not AgentMessage.objects.exists() and not OutboxMessage.objects.exists()


class AgentMessageSerializer(serializers.ModelSerializer):
    """The DRF rendering the message shape came from: the oracle ``message_data`` must match."""

    sender_agent_id = serializers.CharField(allow_null=True, read_only=True)
    sender_user = serializers.CharField(source="sender_user.get_username", allow_null=True, read_only=True)
    recipient_agent_id = serializers.CharField(read_only=True)

    class Meta:
        model = AgentMessage
        fields = list(AgentMessageData.model_fields)


@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris"])
def test_a_message_renders_as_its_model_serializer_would(owner: Any, member: Any, shadow: Agent, zone: str) -> None:
    sender = Agent.objects.create(owner=owner, name="near", type="expert", status="running", cwd="/")
    now = timezone.now()
    rows = [
        AgentMessage.objects.create(recipient_agent=shadow, sender_user=owner, content="queued"),
        AgentMessage.objects.create(
            recipient_agent=shadow,
            sender_agent=sender,
            content="done",
            status=AgentMessage.Status.DELIVERED,
            pasted_at=now - timedelta(seconds=3),
            delivered_at=now,
        ),
        AgentMessage.objects.create(recipient_agent=shadow, content="dead", status="dead", error="peer revoked"),
        AgentMessage.objects.create(recipient_agent=shadow, sender_user=member, content="from bob"),
    ]
    rows[3].sender_user_id = 10_000  # a sender row gone: rendered null
    with timezone.override(zone):
        for message in [*rows, *AgentMessage.objects.select_related("sender_user").order_by("pk")]:
            assert message_data(message) == dict(AgentMessageSerializer(message).data)
