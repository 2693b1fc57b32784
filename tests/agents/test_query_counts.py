"""Query counts of the agent reads (events, agents, runs, messages; the agents and agent
pages) do not grow with the data: a user with many agents must not make every page slower.

Each test measures a request with little data, adds many more rows (agents with parents,
runs and events tied to runs, so a serializer or template that followed a relation per
row would show up), measures the same request again and asserts the two counts are equal.
The responses are checked too, so a count cannot stay flat because a page came back empty.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent, AgentEvent, Run

pytestmark = pytest.mark.django_db

_SMALL_AGENTS, _LARGE_AGENTS = 3, 150
_SMALL_EVENTS, _LARGE_EVENTS = 5, 600


def add_agents(owner: Any, count: int, *, start: int = 0) -> list[Agent]:
    """``count`` agents of ``owner`` (bulk), every other one the child of the previous one,
    each with a latest event and distinct ``created_at`` (one second apart)."""
    base = timezone.now() - timedelta(days=1)
    agents: list[Agent] = []
    for index in range(start, start + count):
        agents.append(
            Agent(
                id=f"agt_{index:012x}",
                owner=owner,
                name=f"agent-{index}",
                type="expert" if index % 2 else "shell",
                status=Agent.Status.RUNNING if index % 3 else Agent.Status.STOPPED,
                cwd="/tmp",
                latest_event_type="working",
                latest_event_message=f"step {index}",
                latest_event_at=base + timedelta(seconds=index),
                created_at=base + timedelta(seconds=index),
            )
        )
    Agent.objects.bulk_create(agents)
    children = agents[1::2]
    for child in children:
        child.parent_id = f"agt_{int(child.pk[4:], 16) - 1:012x}"
        child.launched_by_id = child.parent_id
    Agent.objects.bulk_update(children, ["parent", "launched_by"])
    return agents


def add_events(agent: Agent, count: int, *, start: int = 0) -> None:
    """``count`` events of ``agent`` (bulk) tied to a few runs, distinct ``created_at``."""
    base = timezone.now() - timedelta(hours=1)
    runs = [
        Run(id=f"run_{start + index:012x}", agent=agent, input={"instruction": f"task {index}"}, created_at=base)
        for index in range(max(1, count // 100))
    ]
    Run.objects.bulk_create(runs)
    AgentEvent.objects.bulk_create(
        AgentEvent(
            agent=agent,
            run=runs[index % len(runs)],
            type="working" if index % 2 else "system",
            message=f"event {index}",
            metadata={"n": index},
            created_at=base + timedelta(milliseconds=index),
        )
        for index in range(start, start + count)
    )


def count_queries(request: Callable[[], Any]) -> tuple[int, Any, list[str]]:
    """Run ``request`` twice and return (number of queries, response, SQL) of the second.

    The first run warms up what happens once per client whatever the data (the token's
    ``last_used_at`` stamp, a session's first save), so only the read itself is compared.
    """
    request()
    with CaptureQueriesContext(connection) as captured:
        response = request()
    return len(captured), response, [query["sql"] for query in captured.captured_queries]


def assert_same_count(small: tuple[int, Any, list[str]], large: tuple[int, Any, list[str]]) -> None:
    sql = "\n".join(large[2])
    assert small[0] == large[0], f"{small[0]} queries with little data, {large[0]} with more:\n{sql}"


@pytest.fixture
def api_client(owner_token: str) -> Client:
    return Client(headers={"authorization": f"Bearer {owner_token}"})


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def test_the_events_first_page_costs_the_same_with_5_or_600_events(owner, api_client):
    agent = add_agents(owner, 1)[0]
    add_events(agent, _SMALL_EVENTS)
    url = f"/api/v1/agents/{agent.pk}/events"
    small = count_queries(lambda: api_client.get(url))
    assert small[1].status_code == 200 and len(small[1].json()["events"]) == _SMALL_EVENTS
    assert small[1].json()["next"] is None

    add_events(agent, _LARGE_EVENTS - _SMALL_EVENTS, start=_SMALL_EVENTS)
    large = count_queries(lambda: api_client.get(url))
    body = large[1].json()
    assert large[1].status_code == 200 and len(body["events"]) == 200 and body["next"]
    assert body["events"][0]["message"] == f"event {_LARGE_EVENTS - 1}"
    assert_same_count(small, large)


def test_an_events_cursor_page_costs_the_same_with_5_or_600_events(owner, api_client):
    agent = add_agents(owner, 1)[0]
    add_events(agent, _SMALL_EVENTS)
    url = f"/api/v1/agents/{agent.pk}/events"
    cursor = api_client.get(url, {"limit": 2}).json()["next"]
    small = count_queries(lambda: api_client.get(url, {"limit": 2, "before": cursor}))
    assert [event["message"] for event in small[1].json()["events"]] == ["event 2", "event 1"]

    add_events(agent, _LARGE_EVENTS - _SMALL_EVENTS, start=_SMALL_EVENTS)
    # Deep in the history with the default limit: the third page of 200 (the last one).
    first = api_client.get(url).json()
    second = api_client.get(url, {"before": first["next"]}).json()
    large = count_queries(lambda: api_client.get(url, {"before": second["next"]}))
    body = large[1].json()
    assert len(body["events"]) == 200 and body["next"] is None
    assert body["events"][-1]["message"] == "event 0"
    assert_same_count(small, large)


def test_the_agent_list_api_costs_the_same_with_3_or_150_agents(owner, member, api_client):
    add_agents(owner, _SMALL_AGENTS)
    small = count_queries(lambda: api_client.get("/api/v1/agents"))
    assert small[1].status_code == 200 and len(small[1].json()["agents"]) == _SMALL_AGENTS

    add_agents(owner, _LARGE_AGENTS - _SMALL_AGENTS, start=_SMALL_AGENTS)
    add_agents(member, 50, start=1000)  # someone else's: never listed, never counted
    large = count_queries(lambda: api_client.get("/api/v1/agents"))
    body = large[1].json()
    assert len(body["agents"]) == 100 and body["next"]
    assert any(agent["parent"] for agent in body["agents"])
    assert_same_count(small, large)

    cursor_page = count_queries(lambda: api_client.get("/api/v1/agents", {"before": body["next"]}))
    assert len(cursor_page[1].json()["agents"]) == _LARGE_AGENTS - 100
    assert_same_count(small, cursor_page)


def test_the_agents_page_costs_the_same_with_3_or_150_agents(owner, browser):
    add_agents(owner, _SMALL_AGENTS)
    small = count_queries(lambda: browser.get("/"))
    assert small[1].status_code == 200 and small[1].content.decode().count("data-agent=") == _SMALL_AGENTS

    add_agents(owner, _LARGE_AGENTS - _SMALL_AGENTS, start=_SMALL_AGENTS)
    large = count_queries(lambda: browser.get("/"))
    page = large[1].content.decode()
    assert large[1].status_code == 200 and page.count("data-agent=") == 100 and "child of agt_" in page
    assert_same_count(small, large)


def test_the_agent_page_costs_the_same_with_5_or_600_events(owner, browser):
    agent = add_agents(owner, 1)[0]
    add_events(agent, _SMALL_EVENTS)
    url = f"/agents/{agent.pk}/"
    small = count_queries(lambda: browser.get(url))
    assert small[1].status_code == 200 and "event 4" in small[1].content.decode()

    add_events(agent, _LARGE_EVENTS - _SMALL_EVENTS, start=_SMALL_EVENTS)
    large = count_queries(lambda: browser.get(url))
    page = large[1].content.decode()
    assert large[1].status_code == 200 and f"event {_LARGE_EVENTS - 1}" in page
    assert_same_count(small, large)


def test_the_runs_list_costs_the_same_with_1_or_151_runs(owner, api_client):
    agent = add_agents(owner, 1)[0]
    add_events(agent, 100)  # one run
    url = f"/api/v1/agents/{agent.pk}/runs"
    small = count_queries(lambda: api_client.get(url))
    assert small[1].status_code == 200 and len(small[1].json()["runs"]) == 1

    add_events(agent, 15_000, start=1000)  # 150 more runs
    large = count_queries(lambda: api_client.get(url))
    body = large[1].json()
    assert len(body["runs"]) == 100 and body["next"]
    assert_same_count(small, large)


def test_the_messages_list_costs_the_same_with_5_or_300_messages(owner, api_client):
    from agents.models import AgentMessage

    recipient, sender = add_agents(owner, 2)

    def add_messages(count: int, start: int) -> None:
        base = timezone.now() - timedelta(hours=1)
        AgentMessage.objects.bulk_create(
            AgentMessage(
                recipient_agent=recipient,
                sender_agent=sender if index % 2 else None,
                sender_user=None if index % 2 else owner,
                content=f"message {index}",
                created_at=base + timedelta(milliseconds=index),
            )
            for index in range(start, start + count)
        )

    add_messages(5, 0)
    url = f"/api/v1/agents/{recipient.pk}/messages"
    small = count_queries(lambda: api_client.get(url))
    assert small[1].status_code == 200 and len(small[1].json()["messages"]) == 5

    add_messages(295, 5)
    large = count_queries(lambda: api_client.get(url, {"limit": 200}))
    body = large[1].json()
    assert len(body["messages"]) == 200 and {m["sender_user"] for m in body["messages"]} == {"alice", None}
    assert_same_count(small, large)
