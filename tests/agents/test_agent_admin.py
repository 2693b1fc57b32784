"""Admin for agents, runs, events and messages: pages render, actions go through services."""

from __future__ import annotations

import pytest

from agents.models import Agent, AgentMessage, AgentToken, Run
from agents.services import agent_event_record, run_claim_next, run_enqueue
from agents.tokens import agent_token_authenticate, agent_token_mint

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("model", ["agent", "run", "agentevent", "agentmessage"])
def test_the_admin_lists_each_agent_model(admin_client, owner, make_agent, model):
    agent = make_agent(owner, name="visible-agent")
    run_enqueue(agent=agent, instruction="x")
    agent_event_record(agent=agent, type="working", message="busy")
    AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="hello")

    response = admin_client.get(f"/admin/agents/{model}/")

    assert response.status_code == 200
    assert "visible-agent" in response.content.decode()


def test_the_archive_action_archives_through_the_service(admin_client, owner, make_agent):
    agent = make_agent(owner)
    run = run_enqueue(agent=agent, instruction="x")

    admin_client.post("/admin/agents/agent/", {"action": "archive", "_selected_action": [agent.pk]})

    assert Agent.objects.get(pk=agent.pk).status == "archived"
    assert Run.objects.get(pk=run.pk).status == "cancelled"  # the service's rule, not a bare update


def test_the_cancel_action_cancels_queued_and_running_runs_only(admin_client, owner, make_agent):
    agent = make_agent(owner)
    running = run_enqueue(agent=agent, instruction="a")
    queued = run_enqueue(agent=agent, instruction="b")
    run_claim_next(process_id="p")
    done = Run.objects.create(agent=agent, input={}, status="succeeded")

    admin_client.post("/admin/agents/run/", {"action": "cancel", "_selected_action": [running.pk, queued.pk, done.pk]})

    assert dict(Run.objects.values_list("pk", "status")) == {
        running.pk: "cancelled",
        queued.pk: "cancelled",
        done.pk: "succeeded",
    }


def test_the_stop_action_stops_through_the_service(admin_client, owner, make_agent):
    agent = make_agent(owner)
    run = run_enqueue(agent=agent, instruction="x")

    admin_client.post("/admin/agents/agent/", {"action": "stop", "_selected_action": [agent.pk]})

    assert Agent.objects.get(pk=agent.pk).status == "stopped"
    assert Run.objects.get(pk=run.pk).status == "cancelled"


def test_agent_tokens_show_prefixes_never_digests_and_revoke_through_the_service(admin_client, owner, make_agent):
    agent = make_agent(owner, type="shell", name="tokened")
    raw = agent_token_mint(agent=agent)
    token = AgentToken.objects.get(agent=agent)

    listing = admin_client.get("/admin/agents/agenttoken/").content.decode()
    detail = admin_client.get(f"/admin/agents/agenttoken/{token.pk}/change/").content.decode()

    assert token.prefix in listing and "tokened" in listing
    assert token.digest not in listing + detail and raw not in listing + detail
    assert admin_client.get("/admin/agents/agenttoken/add/").status_code == 403
    admin_client.post("/admin/agents/agenttoken/", {"action": "revoke", "_selected_action": [token.pk]})
    assert AgentToken.objects.get(pk=token.pk).revoked_at is not None
    assert agent_token_authenticate(raw) is None


def test_messages_are_searchable_and_filterable(admin_client, owner, make_agent):
    agent = make_agent(owner)
    AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="needle in a haystack")
    AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="other", status="failed")

    found = admin_client.get("/admin/agents/agentmessage/", {"q": "needle"}).content.decode()
    failed = admin_client.get("/admin/agents/agentmessage/", {"status__exact": "failed"}).content.decode()

    assert "needle in a haystack" in found and ">other<" not in found
    assert ">other<" in failed and "needle" not in failed
