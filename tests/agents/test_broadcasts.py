"""Every change is announced to the owner's live-events group, only after commit
(docs/agents.md#status-changes): a listener never hears of a change that is rolled back."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from agents.services import (
    agent_archive,
    agent_event_record,
    agent_set_status,
    run_cancel,
    run_claim_next,
    run_enqueue,
    run_finish,
    user_events_group,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


def test_the_group_of_a_user_is_named_after_the_user():
    assert user_events_group(42) == "user.42"


def test_nothing_is_announced_before_commit(owner, make_agent, live_events):
    events = live_events(owner)

    with transaction.atomic():
        agent = make_agent(owner)
        agent_event_record(agent=agent, type="working", message="busy")
        assert events.drain() == []

    names = events.names()
    assert names[0] == "agent.upsert"
    assert "agent.event" in names


def test_nothing_is_announced_when_the_transaction_rolls_back(owner, make_agent, live_events):
    events = live_events(owner)

    with pytest.raises(RuntimeError), transaction.atomic():
        make_agent(owner)
        raise RuntimeError("abort")

    assert events.drain() == []


def test_a_status_change_announces_the_agent_with_its_new_status(owner, make_agent, live_events):
    agent = make_agent(owner, type="shell")
    events = live_events(owner)

    agent_set_status(agent=agent, status="running")

    (message,) = events.drain()
    assert message["type"] == "user.event"
    assert message["event"] == "agent.upsert"
    assert message["data"]["id"] == agent.pk
    assert message["data"]["status"] == "running"
    json.dumps(message)  # JSON-safe all the way down


def test_run_changes_are_announced_as_run_updated(owner, make_agent, live_events):
    agent = make_agent(owner)
    events = live_events(owner)

    run = run_enqueue(agent=agent, instruction="hi", remotes=["weather-service"])
    run_claim_next(process_id="p")
    run_finish(run=run, status="succeeded", output="hello")
    second = run_enqueue(agent=agent, instruction="again")
    run_cancel(user=owner, run_id=second.pk)

    updates = [(m["data"]["id"], m["data"]["status"]) for m in events.drain() if m["event"] == "run.updated"]
    assert updates == [
        (run.pk, "queued"),
        (run.pk, "running"),
        (run.pk, "succeeded"),
        (second.pk, "queued"),
        (second.pk, "cancelled"),
    ]


def test_an_event_is_announced_with_its_agent_and_run(owner, make_agent, live_events):
    agent = make_agent(owner)
    run = run_enqueue(agent=agent, instruction="x")
    events = live_events(owner)

    agent_event_record(agent=agent, type="system", message="tool call", metadata={"tool": "get_forecast"}, run=run)

    (event,) = [m["data"] for m in events.drain() if m["event"] == "agent.event"]
    assert (event["agent_id"], event["run_id"], event["message"]) == (agent.pk, run.pk, "tool call")
    assert event["metadata"] == {"tool": "get_forecast"}


def test_archive_announces_the_agent_deleted(owner, make_agent, live_events):
    agent = make_agent(owner)
    events = live_events(owner)

    agent_archive(agent=agent)

    messages = events.drain()
    assert {"event": "agent.deleted", "data": {"id": agent.pk}, "type": "user.event"} in messages


def test_another_user_hears_nothing(owner, outsider, make_agent, live_events):
    events = live_events(outsider)

    agent = make_agent(owner)
    agent_event_record(agent=agent, type="working", message="private")

    assert events.drain() == []
