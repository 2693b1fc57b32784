"""The outbox's hot paths cost a fixed number of queries: a REST enqueue to
a shadow agent, and marking a peer's batch receipt delivered — one transaction for the
whole batch, whatever its size (it was 18 queries a row, the SQLite write lock held
meanwhile, which made every REST enqueue wait). What each marks is checked beside the
count: the rows, their messages, one ``system`` event per message, the recipient's latest
event, and the live announcements after commit."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent, AgentEvent, AgentMessage
from peers.models import OutboxMessage
from peers.services.outbox import outbox_discard, outbox_mark_delivered_many
from peers.services.outgoing import peer_message_send
from peers.services.shadows import shadow_upsert
from tests.peers.test_enqueue_cost import announcements

pytestmark = pytest.mark.django_db(transaction=True)

REMOTE_AGENT = "agt_0123456789ab"
# The batch marking's queries: rows read and updated, messages read and updated, events
# inserted, the recipients' latest event updated and read back (+ savepoint pairs).
MARK_QUERIES = 11
# The enqueue's (its token cached): the agent, BEGIN, the shadow with its link and this
# instance's id, the message, the outbox row, COMMIT.
ENQUEUE_QUERIES = 6


@pytest.fixture
def shadow(owner: Any, make_peer: Any) -> Agent:
    peer = make_peer(owner, label="Cloud", url="http://cloud.test").peer
    return shadow_upsert(
        peer=peer, peer_agent_id=REMOTE_AGENT, name="far", type="expert", status="running", seen_at=timezone.now()
    )


def queue(owner: Any, shadow: Agent, count: int, sender: Agent | None = None) -> list[OutboxMessage]:
    assert shadow.peer is not None
    for index in range(count):
        peer_message_send(
            user=owner, sender_agent=sender, peer=shadow.peer, to_agent_id=REMOTE_AGENT, content=f"m{index}"
        )
    return list(OutboxMessage.objects.filter(status="queued").order_by("pk"))


def marked_with_queries(rows: list[OutboxMessage]) -> tuple[list[int], int, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        marked = outbox_mark_delivered_many(rows=rows)
    return marked, len(captured), [query["sql"] for query in captured.captured_queries]


def test_marking_a_batch_delivered_costs_the_same_queries_for_3_or_50_rows(owner: Any, shadow: Agent) -> None:
    small = queue(owner, shadow, 3)
    marked, small_count, _ = marked_with_queries(small)
    assert marked == [row.pk for row in small]
    large = queue(owner, shadow, 50)
    marked, large_count, sql = marked_with_queries(large)
    assert marked == [row.pk for row in large]
    assert small_count == large_count <= MARK_QUERIES, "\n".join(sql)

    rows = OutboxMessage.objects.filter(pk__in=marked)
    assert {row.status for row in rows} == {"delivered"} and all(row.delivered_at for row in rows)
    messages = AgentMessage.objects.filter(pk__in=[row.message_id for row in rows])
    assert {message.status for message in messages} == {"delivered"} and all(m.delivered_at for m in messages)
    events = AgentEvent.objects.filter(agent=shadow, message="message delivered").order_by("pk")
    assert [event.metadata["message_id"] for event in events] == sorted(
        OutboxMessage.objects.values_list("message_id", flat=True)
    )
    assert all(event.metadata["chars"] == len(AgentMessage.objects.get(pk=event.metadata["message_id"]).content)
               for event in events)  # fmt: skip
    shadow.refresh_from_db()
    assert (shadow.latest_event_type, shadow.latest_event_message) == ("system", "message delivered")


def test_a_row_settled_meanwhile_is_left_as_it_is_and_the_rest_are_marked(owner: Any, shadow: Agent) -> None:
    rows = queue(owner, shadow, 4)
    outbox_discard(user=owner, outbox_id=rows[1].pk)
    assert outbox_mark_delivered_many(rows=rows) == [rows[0].pk, rows[2].pk, rows[3].pk]
    assert OutboxMessage.objects.get(pk=rows[1].pk).status == "discarded"
    assert AgentMessage.objects.get(pk=rows[1].message_id).status != "delivered"
    assert AgentEvent.objects.filter(agent=shadow, metadata__message_id=rows[1].message_id).count() == 0
    assert outbox_mark_delivered_many(rows=rows) == []  # a replayed receipt marks nothing twice
    assert AgentEvent.objects.filter(agent=shadow, message="message delivered").count() == 3


def test_a_marked_batch_is_announced_after_commit_per_message_and_once_per_agent(owner: Any, shadow: Agent) -> None:
    rows = queue(owner, shadow, 3)
    frames = announcements(owner, lambda: outbox_mark_delivered_many(rows=rows))
    names = [frame["event"] for frame in frames]
    assert names.count("agent.event") == 3 and names.count("message.updated") == 3
    assert names.count("agent.upsert") == 1 and names[-1] == "agent.upsert"
    updated = [frame["data"] for frame in frames if frame["event"] == "message.updated"]
    assert [data["id"] for data in updated] == [row.message_id for row in rows]
    assert {data["status"] for data in updated} == {"delivered"}


def test_a_rest_enqueue_to_a_shadow_costs_a_fixed_number_of_queries(
    owner: Any, owner_token: str, shadow: Agent
) -> None:
    client = Client(headers={"authorization": f"Bearer {owner_token}"})
    url = f"/api/v1/agents/{shadow.pk}/messages"
    assert client.post(url, {"content": "warm"}, content_type="application/json").status_code == 201
    with CaptureQueriesContext(connection) as captured:
        response = client.post(url, {"content": "hello"}, content_type="application/json")
    assert response.status_code == 201, response.content
    assert response.json()["status"] == "queued"
    sql = "\n".join(query["sql"][:200] for query in captured.captured_queries)
    assert len(captured) <= ENQUEUE_QUERIES, sql
    assert OutboxMessage.objects.filter(message_id=response.json()["id"], status="queued").count() == 1
