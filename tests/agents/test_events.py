"""Agent events: recording, the denormalised latest event, mirrored dedupe, and paging
cursors (docs/agents.md#the-timeline)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent, AgentEvent
from agents.selectors import encode_cursor, events_page
from agents.services import agent_event_record, run_enqueue
from core.errors import DispatchError

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]


def record_many(agent, count, start=None):
    start = start or timezone.now() - timedelta(hours=1)
    return [
        agent_event_record(agent=agent, type="working", message=f"step {n}", created_at=start + timedelta(seconds=n))
        for n in range(count)
    ]


# --- recording ---------------------------------------------------------------------------


def test_an_event_updates_the_agents_latest_event(owner, make_agent):
    agent = make_agent(owner)

    event = agent_event_record(agent=agent, type="blocked", message="waiting for review", metadata={"pr": 12})

    stored = Agent.objects.get(pk=agent.pk)
    assert (stored.latest_event_type, stored.latest_event_message) == ("blocked", "waiting for review")
    assert stored.latest_event_at == event.created_at
    assert event.metadata == {"pr": 12}


def test_an_older_event_does_not_replace_the_latest_one(owner, make_agent):
    agent = make_agent(owner)
    now = timezone.now()
    agent_event_record(agent=agent, type="done", message="finished", created_at=now)

    agent_event_record(agent=agent, type="working", message="earlier", created_at=now - timedelta(minutes=5))

    stored = Agent.objects.get(pk=agent.pk)
    assert (stored.latest_event_type, stored.latest_event_message) == ("done", "finished")


def test_an_event_can_belong_to_a_run_of_its_agent_only(owner, make_agent):
    agent, other = make_agent(owner, name="a"), make_agent(owner, name="b")
    run = run_enqueue(agent=agent, instruction="x")

    assert agent_event_record(agent=agent, type="system", message="tool call", run=run).run_id == run.pk
    with pytest.raises(DispatchError, match="not a run of agent"):
        agent_event_record(agent=other, type="system", message="tool call", run=run)


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"type": "sleeping"}, "unknown event type"),
        ({"message": "x" * 50_001}, "at most 50000"),
        ({"metadata": ["not", "an", "object"]}, "metadata must be a JSON object"),
        ({"metadata": {"when": object()}}, "JSON-serialisable"),
        ({"metadata": {"ratio": float("nan")}}, "JSON-serialisable"),
    ],
)
def test_it_refuses_a_malformed_event(owner, make_agent, kwargs, complaint):
    agent = make_agent(owner)

    with pytest.raises(DispatchError, match=complaint):
        agent_event_record(agent=agent, **{"type": "working", "message": "m", **kwargs})
    assert not AgentEvent.objects.exists()


# --- mirrored dedupe ---------------------------------------------------------------------


def test_a_replayed_mirrored_event_adds_nothing(owner, make_agent):
    agent = make_agent(owner)
    at = timezone.now() - timedelta(minutes=1)

    first = agent_event_record(agent=agent, type="working", message="from peer", created_at=at, mirrored=True)
    replay = agent_event_record(agent=agent, type="working", message="from peer", created_at=at, mirrored=True)

    assert first is not None
    assert replay is None
    assert AgentEvent.objects.filter(agent=agent).count() == 1


def test_mirrored_events_differing_in_type_or_time_are_all_kept(owner, make_agent):
    agent = make_agent(owner)
    at = timezone.now() - timedelta(minutes=1)

    agent_event_record(agent=agent, type="working", message="a", created_at=at, mirrored=True)
    agent_event_record(agent=agent, type="done", message="b", created_at=at, mirrored=True)
    agent_event_record(
        agent=agent, type="working", message="c", created_at=at + timedelta(microseconds=1), mirrored=True
    )

    assert AgentEvent.objects.filter(agent=agent).count() == 3


def test_local_events_are_never_deduplicated(owner, make_agent):
    agent = make_agent(owner)
    at = timezone.now()

    agent_event_record(agent=agent, type="working", message="same", created_at=at)
    agent_event_record(agent=agent, type="working", message="same", created_at=at)
    agent_event_record(agent=agent, type="working", message="same", created_at=at, mirrored=True)

    assert AgentEvent.objects.filter(agent=agent).count() == 3


# --- paging ------------------------------------------------------------------------------


def test_pages_are_newest_first_and_cover_every_event_once(owner, make_agent):
    agent = make_agent(owner)
    events = record_many(agent, 7)

    seen, cursor, pages = [], None, 0
    while True:
        page = events_page(agent=agent, limit=3, before=cursor)
        seen += [event.pk for event in page.items]
        pages += 1
        cursor = page.next
        if cursor is None:
            break

    assert pages == 3
    assert seen == [event.pk for event in reversed(events)]


def test_a_cursor_stays_valid_when_newer_events_arrive(owner, make_agent):
    agent = make_agent(owner)
    events = record_many(agent, 4)
    first = events_page(agent=agent, limit=2)

    agent_event_record(agent=agent, type="done", message="newer")
    second = events_page(agent=agent, limit=2, before=first.next)

    assert [e.pk for e in second.items] == [events[1].pk, events[0].pk]
    assert second.next is None


def test_events_with_the_same_time_page_by_id_without_gaps(owner, make_agent):
    agent = make_agent(owner)
    at = timezone.now()
    events = [agent_event_record(agent=agent, type="system", message=str(n), created_at=at) for n in range(5)]

    first = events_page(agent=agent, limit=2)
    second = events_page(agent=agent, limit=2, before=first.next)
    third = events_page(agent=agent, limit=2, before=second.next)

    paged = [e.pk for page in (first, second, third) for e in page.items]
    assert paged == sorted((e.pk for e in events), reverse=True)
    assert third.next is None


def test_an_exact_page_has_no_next_cursor(owner, make_agent):
    agent = make_agent(owner)
    record_many(agent, 3)

    assert events_page(agent=agent, limit=3).next is None


@pytest.mark.parametrize("limit", [0, -1, 501, "many"])
def test_it_refuses_a_limit_outside_1_to_500(owner, make_agent, limit):
    with pytest.raises(DispatchError, match="limit must be an integer from 1 to 500"):
        events_page(agent=make_agent(owner), limit=limit)


def test_the_default_page_is_200_and_the_largest_500(owner, make_agent):
    agent = make_agent(owner)
    start = timezone.now() - timedelta(hours=1)
    AgentEvent.objects.bulk_create(
        AgentEvent(agent=agent, type="working", message=str(n), created_at=start + timedelta(seconds=n))
        for n in range(501)
    )

    assert len(events_page(agent=agent).items) == 200
    assert len(events_page(agent=agent, limit=500).items) == 500


# The ids are named: a cursor of timezone.now() made at import differs in each xdist
# worker, and xdist runs a test only when every worker collected the same ids.
@pytest.mark.parametrize(
    "cursor",
    [
        pytest.param("garbage", id="garbage"),
        pytest.param("!!!!", id="not-base64"),
        pytest.param(encode_cursor(timezone.now(), "not-an-int"), id="id-not-an-int"),
        pytest.param("W10", id="empty-list"),
        pytest.param("x" * 300, id="too-long"),
    ],
)
def test_it_refuses_a_bad_cursor(owner, make_agent, cursor):
    with pytest.raises(DispatchError) as refused:
        events_page(agent=make_agent(owner), before=cursor)

    assert (refused.value.code, refused.value.message) == ("INVALID_REQUEST", "invalid cursor")


def test_a_page_costs_the_same_queries_whatever_the_number_of_events(owner, make_agent):
    small, large = make_agent(owner, name="small"), make_agent(owner, name="large")
    record_many(small, 3)
    start = timezone.now() - timedelta(hours=2)
    AgentEvent.objects.bulk_create(
        AgentEvent(agent=large, type="working", message=str(n), created_at=start + timedelta(seconds=n))
        for n in range(600)
    )

    counts = []
    for agent in (small, large):
        with CaptureQueriesContext(connection) as queries:
            page = events_page(agent=agent, limit=500)
            [e.run_id for e in page.items]
        counts.append(len(queries))

    assert counts[0] == counts[1] == 1
