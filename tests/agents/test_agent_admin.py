"""Admin for agents, runs, events and messages: pages render, actions go through services."""

from __future__ import annotations

import pytest

from dispatch.agents.services import agent_event_record, run_claim_next, run_enqueue
from dispatch.models import Agent, AgentMessage, Run

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("model", ["agent", "run", "agentevent", "agentmessage"])
def test_the_admin_lists_each_agent_model(admin_client, owner, make_agent, model):
    agent = make_agent(owner, name="visible-agent")
    run_enqueue(agent=agent, instruction="x")
    agent_event_record(agent=agent, type="working", message="busy")
    AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="hello")

    response = admin_client.get(f"/admin/dispatch/{model}/")

    assert response.status_code == 200
    assert "visible-agent" in response.content.decode()


def test_the_archive_action_archives_through_the_service(admin_client, owner, make_agent):
    agent = make_agent(owner)
    run = run_enqueue(agent=agent, instruction="x")

    admin_client.post("/admin/dispatch/agent/", {"action": "archive", "_selected_action": [agent.pk]})

    assert Agent.objects.get(pk=agent.pk).status == "archived"
    assert Run.objects.get(pk=run.pk).status == "cancelled"  # the service's rule, not a bare update


def test_the_cancel_action_cancels_queued_and_running_runs_only(admin_client, owner, make_agent):
    agent = make_agent(owner)
    running = run_enqueue(agent=agent, instruction="a")
    queued = run_enqueue(agent=agent, instruction="b")
    run_claim_next(process_id="p")
    done = Run.objects.create(agent=agent, input={}, status="succeeded")

    admin_client.post(
        "/admin/dispatch/run/", {"action": "cancel", "_selected_action": [running.pk, queued.pk, done.pk]}
    )

    assert dict(Run.objects.values_list("pk", "status")) == {
        running.pk: "cancelled",
        queued.pk: "cancelled",
        done.pk: "succeeded",
    }
