"""The agent status transition table (docs/agents.md#status-changes): every allowed change works,
every other one is refused with CONFLICT and changes nothing."""

from __future__ import annotations

import itertools

import pytest

from agents.models import Agent, AgentEvent
from agents.services import agent_archive, agent_set_status
from core.errors import DispatchError
from tests.agents.conftest import force_status

pytestmark = pytest.mark.django_db

STATUSES = ["creating", "running", "stopping", "stopped", "error", "archived"]

# Written out from docs/agents.md#status-changes, not imported: the test must fail if the code drifts.
ALLOWED = {
    ("creating", "running"),
    ("creating", "error"),
    ("creating", "stopped"),
    ("running", "stopping"),
    ("running", "stopped"),
    ("running", "error"),
    ("stopping", "stopped"),
    ("stopping", "error"),
    ("stopped", "creating"),
    ("error", "creating"),
    ("stopped", "archived"),
    ("error", "archived"),
    ("creating", "archived"),
    ("running", "archived"),
    ("stopping", "archived"),
}
REFUSED = sorted(set(itertools.product(STATUSES, STATUSES)) - ALLOWED)


@pytest.mark.parametrize(("before", "after"), sorted(ALLOWED))
def test_it_allows_each_transition_of_the_table(owner, make_agent, before, after):
    agent = force_status(make_agent(owner, type="shell"), before)

    agent_set_status(agent=agent, status=after)

    assert Agent.objects.get(pk=agent.pk).status == after
    assert agent.status == after


@pytest.mark.parametrize(("before", "after"), REFUSED)
def test_it_refuses_every_transition_outside_the_table(owner, make_agent, before, after):
    agent = force_status(make_agent(owner, type="shell"), before)

    with pytest.raises(DispatchError) as refused:
        agent_set_status(agent=agent, status=after)

    assert refused.value.code == "CONFLICT"
    assert refused.value.http_status == 409
    assert f"from {before} to {after}" in refused.value.message
    assert Agent.objects.get(pk=agent.pk).status == before


def test_the_table_covers_every_status_pair():
    assert len(ALLOWED) + len(REFUSED) == len(STATUSES) ** 2 == 36


def test_it_refuses_an_unknown_status(owner, make_agent):
    agent = make_agent(owner)

    with pytest.raises(DispatchError) as refused:
        agent_set_status(agent=agent, status="sleeping")

    assert refused.value.code == "INVALID_REQUEST"
    assert Agent.objects.get(pk=agent.pk).status == "running"


def test_it_judges_a_transition_by_the_stored_status_not_a_stale_object(owner, make_agent):
    agent = make_agent(owner, type="shell")
    stale_copy = Agent.objects.get(pk=agent.pk)
    agent_set_status(agent=agent, status="stopped")

    with pytest.raises(DispatchError):
        agent_set_status(agent=stale_copy, status="running")  # creating → running, but it is stopped now

    assert Agent.objects.get(pk=agent.pk).status == "stopped"


def test_a_note_becomes_a_system_event_and_an_error_note_the_last_error(owner, make_agent):
    agent = make_agent(owner, type="shell")

    agent_set_status(agent=agent, status="error", note="exit status 3: make: *** [all] Error 3")

    stored = Agent.objects.get(pk=agent.pk)
    assert stored.last_error == "exit status 3: make: *** [all] Error 3"
    assert stored.latest_event_type == "system"
    event = AgentEvent.objects.get(agent=agent)
    assert event.message == "exit status 3: make: *** [all] Error 3"
    assert event.metadata == {"from": "creating", "to": "error"}


def test_archive_is_idempotent_and_a_status_change_after_it_is_refused(owner, make_agent):
    agent = make_agent(owner)

    agent_archive(agent=agent)
    agent_archive(agent=agent)

    assert Agent.objects.get(pk=agent.pk).status == "archived"
    with pytest.raises(DispatchError):
        agent_set_status(agent=agent, status="creating")
