"""The agents REST API (docs/agents.md#the-rest-api): routes, fields, paging, errors, scoping."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent, AgentEvent, AgentMessage, Run
from agents.services import agent_create, agent_event_record, run_claim_next, run_enqueue
from agents.types import parse_agent_types
from tests.agents.conftest import error_of

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

AGENT_FIELDS = {
    "id",
    "owner",
    "name",
    "type",
    "status",
    "cwd",
    "parent",
    "launched_by",
    "launched_by_peer",
    "host",
    "full_access",
    "latest_event_type",
    "latest_event_message",
    "latest_event_at",
    "peer",
    "peer_agent_id",
    "stale",
    "last_error",
    "created_at",
    "updated_at",
}


# --- launch ------------------------------------------------------------------------------


def test_it_launches_an_expert_agent_running(api, owner, workdir):
    response = api.post("/api/v1/agents", {"type": "expert", "name": "researcher", "cwd": workdir})

    assert response.status_code == 201, response.content
    body = response.json()
    assert set(body) == AGENT_FIELDS
    assert (body["type"], body["name"], body["status"], body["cwd"]) == ("expert", "researcher", "running", workdir)
    assert body["owner"] == "alice"
    assert Agent.objects.get(pk=body["id"]).owner == owner


def test_a_launch_prompt_becomes_the_first_run(api, workdir):
    body = api.post("/api/v1/agents", {"type": "expert", "name": "r", "cwd": workdir, "prompt": "summarise"}).json()

    run = Run.objects.get(agent_id=body["id"])
    assert run.input == {"instruction": "summarise", "input": None}
    assert run.status == "queued"


def test_it_refuses_a_type_whose_program_is_missing_listing_the_available_ones(api, workdir, settings):
    settings.AGENT_TYPES = parse_agent_types(
        {"ghost": {"argv": ["no-such-program-here"], "kind": "llm"}, "shell": {"argv": ["bash"], "kind": "shell"}}
    )

    response = api.post("/api/v1/agents", {"type": "ghost", "name": "build", "cwd": workdir, "prompt": "make"})

    assert response.status_code == 400
    error = error_of(response)
    assert error["message"] == "agent type 'ghost' is unavailable here: its program is not on PATH"
    assert error["details"] == {"available_types": ["shell"]}  # expert: no model endpoint here
    assert not Agent.objects.exists()


def test_it_refuses_an_unknown_type(api, workdir):
    response = api.post("/api/v1/agents", {"type": "nope", "name": "build", "cwd": workdir})

    assert response.status_code == 400
    assert error_of(response)["message"].startswith("unknown agent type 'nope'; known types: expert, ")
    assert not Agent.objects.exists()


def test_agent_types_lists_every_type_with_its_kind_and_availability(api, settings):
    settings.AGENT_TYPES = parse_agent_types(
        {"ghost": {"argv": ["no-such-program-here"], "kind": "llm"}, "shell": {"argv": ["bash"], "kind": "shell"}}
    )
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"

    response = api.get("/api/v1/agent-types")

    assert response.status_code == 200
    assert response.json() == {
        "types": [
            {"type": "expert", "kind": "expert", "available": True, "reason": ""},
            {
                "type": "ghost",
                "kind": "llm",
                "available": False,
                "reason": "not installed here: no-such-program-here not on PATH",
            },
            {"type": "shell", "kind": "shell", "available": True, "reason": ""},
        ],
        "default": "expert",
    }


def test_without_a_model_endpoint_expert_is_listed_unavailable_with_why_and_there_is_no_default(api, settings):
    settings.AGENT_TYPES = parse_agent_types({"shell": {"argv": ["bash"], "kind": "shell"}})
    settings.LLM_BASE_URL = ""

    body = api.get("/api/v1/agent-types").json()

    assert body["types"][0] == {
        "type": "expert",
        "kind": "expert",
        "available": False,
        "reason": "no model endpoint configured (set DISPATCH_LLM_BASE_URL)",
    }
    assert body["default"] is None  # never the shell


def test_a_launch_without_a_type_gets_the_first_installed_llm_cli(api, workdir, settings, monkeypatch):
    launched: dict[str, object] = {}
    settings.AGENT_TYPES = parse_agent_types(
        {"shell": {"argv": ["bash"], "kind": "shell"}, "fake-llm": {"argv": ["true"], "kind": "llm"}}
    )
    settings.LLM_BASE_URL = ""

    def launch(**kwargs: Any) -> Agent:  # no tmux here: which type the launch asked for is the point
        launched.update(kwargs)
        return agent_create(owner=kwargs["owner"], type=kwargs["type"], name=kwargs["name"], cwd=workdir)

    monkeypatch.setattr("agents.cli.agent_launch", launch)

    response = api.post("/api/v1/agents", {"name": "helper", "cwd": workdir, "prompt": "summarise"})

    assert response.status_code == 201, response.content
    assert response.json()["type"] == launched["type"] == "fake-llm"


def test_a_launch_without_a_type_is_expert_when_a_model_endpoint_is_configured(api, workdir, settings):
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"

    response = api.post("/api/v1/agents", {"name": "helper", "cwd": workdir})

    assert response.status_code == 201, response.content
    assert response.json()["type"] == "expert"


def test_without_a_default_a_launch_must_name_its_type_and_is_told_the_available_ones(api, workdir, settings):
    settings.AGENT_TYPES = parse_agent_types(
        {"ghost": {"argv": ["no-such-program-here"], "kind": "llm"}, "shell": {"argv": ["bash"], "kind": "shell"}}
    )
    settings.LLM_BASE_URL = ""

    response = api.post("/api/v1/agents", {"name": "helper", "cwd": workdir, "prompt": "summarise the repo"})

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "INVALID_REQUEST"
    assert error["message"].startswith("type is required") and error["message"].endswith("available types: shell")
    assert error["details"] == {"available_types": ["shell"]}
    assert not Agent.objects.exists()


def test_agent_types_needs_authentication(client):
    assert client.get("/api/v1/agent-types").status_code == 401


def test_without_cwd_an_agent_works_in_the_default_cwd(api, tmp_path, settings):
    settings.DEFAULT_CWD = str(tmp_path)

    response = api.post("/api/v1/agents", {"type": "expert", "name": "homebody"})

    assert response.status_code == 201
    assert response.json()["cwd"] == str(tmp_path)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"type": "expert", "cwd": "/tmp"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a", "cwd": 3}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": 5, "cwd": "/tmp"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a", "cwd": "/tmp", "prompt": 5}, 400, "VALIDATION_ERROR"),
        ({"type": 1, "name": "a", "cwd": "/tmp"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "", "cwd": "/tmp"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a" * 101, "cwd": "/tmp"}, 400, "INVALID_REQUEST"),
        ({"type": "expert", "name": "a", "cwd": "relative"}, 400, "INVALID_REQUEST"),
        ({"type": "expert", "name": "a", "cwd": "/no/such/dir"}, 400, "INVALID_REQUEST"),
        ({"type": "expert", "name": "a", "cwd": "/tmp", "full_access": "maybe"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a", "cwd": "/tmp", "full_access": "yes"}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a", "cwd": "/tmp", "child": 1}, 400, "VALIDATION_ERROR"),
        ({"type": "expert", "name": "a", "cwd": "/tmp", "location": "lab"}, 400, "INVALID_REQUEST"),
        ({"type": ["expert"], "name": "a", "cwd": "/tmp"}, 400, "VALIDATION_ERROR"),
    ],
)
def test_it_refuses_a_bad_launch(api, body, status, code):
    response = api.post("/api/v1/agents", body)

    assert response.status_code == status
    assert error_of(response)["code"] == code
    assert not Agent.objects.exists()


def test_it_refuses_a_launch_body_that_is_not_json(api):
    response = api.client.post("/api/v1/agents", "{not json", content_type="application/json", headers=api.headers)

    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"


def test_it_requires_authentication(client):
    response = client.get("/api/v1/agents")

    assert response.status_code == 401
    assert error_of(response)["code"] == "NOT_AUTHENTICATED"


# --- reading -----------------------------------------------------------------------------


def test_it_shows_every_field_of_an_agent(api, owner, make_agent):
    parent = make_agent(owner, name="lead")
    agent = make_agent(owner, name="helper: 2", parent=parent, launched_by=parent)
    agent_event_record(agent=agent, type="waiting_user", message="which branch?")

    body = api.get(f"/api/v1/agents/{agent.pk}").json()

    assert set(body) == AGENT_FIELDS
    assert (body["parent"], body["launched_by"], body["name"]) == (parent.pk, parent.pk, "helper: 2")
    assert (body["latest_event_type"], body["latest_event_message"]) == ("waiting_user", "which branch?")
    assert body["launched_by_peer"] is None


def test_the_list_carries_the_same_fields_newest_first(api, owner, member, make_agent):
    older, newer = make_agent(owner, name="older"), make_agent(owner, name="newer")
    make_agent(member, name="bobs")

    body = api.get("/api/v1/agents").json()

    assert set(body) == {"agents", "next"}
    assert [a["id"] for a in body["agents"]] == [newer.pk, older.pk]
    assert all(set(a) == AGENT_FIELDS for a in body["agents"])
    assert body["next"] is None


def test_the_list_filters_by_status_and_type_and_hides_archived(api, owner, make_agent):
    expert = make_agent(owner, name="e")
    shell = make_agent(owner, type="shell", name="s")
    gone = make_agent(owner, name="gone")
    api.delete(f"/api/v1/agents/{gone.pk}")

    def ids(**params):
        return {a["id"] for a in api.get("/api/v1/agents", **params).json()["agents"]}

    assert ids() == {expert.pk, shell.pk}
    assert ids(type="shell") == {shell.pk}
    assert ids(status="running") == {expert.pk}
    assert ids(status="archived") == {gone.pk}


def test_it_refuses_an_unknown_status_filter(api):
    response = api.get("/api/v1/agents", status="asleep")

    assert response.status_code == 400
    assert "unknown status 'asleep'" in error_of(response)["message"]


def test_the_list_pages_by_100(api, owner, workdir):
    start = timezone.now() - timedelta(hours=1)
    Agent.objects.bulk_create(
        Agent(
            owner=owner,
            name=f"a{n}",
            type="expert",
            status="running",
            cwd=workdir,
            created_at=start + timedelta(seconds=n),
        )
        for n in range(105)
    )

    first = api.get("/api/v1/agents").json()
    second = api.get("/api/v1/agents", before=first["next"]).json()

    assert len(first["agents"]) == 100
    assert first["agents"][0]["name"] == "a104"
    assert [a["name"] for a in second["agents"]] == ["a4", "a3", "a2", "a1", "a0"]
    assert second["next"] is None


def test_events_are_paged_newest_first_with_a_cursor(api, owner, make_agent):
    agent = make_agent(owner)
    start = timezone.now() - timedelta(minutes=10)
    for n in range(5):
        agent_event_record(agent=agent, type="working", message=f"step {n}", created_at=start + timedelta(seconds=n))

    first = api.get(f"/api/v1/agents/{agent.pk}/events", limit=3).json()
    second = api.get(f"/api/v1/agents/{agent.pk}/events", limit=3, before=first["next"]).json()

    assert [e["message"] for e in first["events"]] == ["step 4", "step 3", "step 2"]
    assert [e["message"] for e in second["events"]] == ["step 1", "step 0"]
    assert second["next"] is None
    assert set(first["events"][0]) == {
        "id",
        "agent_id",
        "run_id",
        "type",
        "message",
        "metadata",
        "created_at",
        "mirrored",
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"limit": "0"}, "limit must be an integer from 1 to 500"),
        ({"limit": "501"}, "limit must be an integer from 1 to 500"),
        ({"limit": "ten"}, "limit must be an integer from 1 to 500"),
        ({"before": "not-a-cursor"}, "invalid cursor"),
    ],
)
def test_it_refuses_bad_event_paging_parameters(api, owner, make_agent, params, message):
    agent = make_agent(owner)

    response = api.get(f"/api/v1/agents/{agent.pk}/events", **params)

    assert response.status_code == 400
    assert error_of(response) == {"code": "INVALID_REQUEST", "message": message, "details": {}}


def test_runs_are_listed_and_shown(api, owner, make_agent):
    agent = make_agent(owner)
    first = run_enqueue(agent=agent, instruction="one")
    second = run_enqueue(agent=agent, instruction="two", remotes=["weather-service"])

    listing = api.get(f"/api/v1/agents/{agent.pk}/runs").json()
    shown = api.get(f"/api/v1/runs/{second.pk}").json()

    assert [r["id"] for r in listing["runs"]] == [second.pk, first.pk]
    assert listing["next"] is None
    assert shown["input"] == {"instruction": "two", "input": None, "remotes": ["weather-service"]}
    assert (shown["agent_id"], shown["status"]) == (agent.pk, "queued")


# --- changes -----------------------------------------------------------------------------


def test_delete_archives_the_agent_and_cancels_its_runs(api, owner, make_agent):
    agent = make_agent(owner)
    run = run_enqueue(agent=agent, instruction="x")

    response = api.delete(f"/api/v1/agents/{agent.pk}")

    assert response.status_code == 200
    assert response.json()["status"] == "archived"
    assert Agent.objects.get(pk=agent.pk).status == "archived"
    assert Run.objects.get(pk=run.pk).status == "cancelled"
    assert api.delete(f"/api/v1/agents/{agent.pk}").status_code == 200  # idempotent


def test_cancel_cancels_a_queued_or_running_run_and_refuses_a_finished_one(api, owner, make_agent):
    agent = make_agent(owner)
    running = run_enqueue(agent=agent, instruction="a")
    queued = run_enqueue(agent=agent, instruction="b")
    run_claim_next(process_id="p")

    assert api.post(f"/api/v1/runs/{running.pk}/cancel").json()["status"] == "cancelled"
    assert api.post(f"/api/v1/runs/{queued.pk}/cancel").json()["status"] == "cancelled"
    again = api.post(f"/api/v1/runs/{queued.pk}/cancel")

    assert again.status_code == 409
    assert error_of(again)["code"] == "CONFLICT"


def test_unknown_ids_are_404(api):
    for response in (
        api.get("/api/v1/agents/agt_000000000000"),
        api.get("/api/v1/runs/run_000000000000"),
        api.post("/api/v1/runs/run_000000000000/cancel"),
    ):
        assert response.status_code == 404
        assert error_of(response)["code"] == "NOT_FOUND"


# --- scoping -----------------------------------------------------------------------------


def test_another_users_agent_is_404_on_every_route(outsider_api, owner, make_agent):
    agent = make_agent(owner)
    agent_event_record(agent=agent, type="working", message="secret work")
    running = run_enqueue(agent=agent, instruction="a")
    queued = run_enqueue(agent=agent, instruction="b")
    run_claim_next(process_id="p")
    message = AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="secret message")

    responses = {
        "show": outsider_api.get(f"/api/v1/agents/{agent.pk}"),
        "archive": outsider_api.delete(f"/api/v1/agents/{agent.pk}"),
        "events": outsider_api.get(f"/api/v1/agents/{agent.pk}/events"),
        "runs": outsider_api.get(f"/api/v1/agents/{agent.pk}/runs"),
        "run": outsider_api.get(f"/api/v1/runs/{running.pk}"),
        "cancel running": outsider_api.post(f"/api/v1/runs/{running.pk}/cancel"),
        "cancel queued": outsider_api.post(f"/api/v1/runs/{queued.pk}/cancel"),
        "stop": outsider_api.post(f"/api/v1/agents/{agent.pk}/stop"),
        "start": outsider_api.post(f"/api/v1/agents/{agent.pk}/start"),
        "prompt": outsider_api.post(f"/api/v1/agents/{agent.pk}/prompt", {"instruction": "secret?"}),
        "send message": outsider_api.post(f"/api/v1/agents/{agent.pk}/messages", {"content": "hi"}),
        "messages": outsider_api.get(f"/api/v1/agents/{agent.pk}/messages"),
        "message": outsider_api.get(f"/api/v1/messages/{message.pk}"),
    }

    for route, response in responses.items():
        assert response.status_code == 404, route
        error = error_of(response)
        assert error["code"] == "NOT_FOUND", route
        assert "secret" not in response.content.decode(), route
    assert outsider_api.get("/api/v1/agents").json()["agents"] == []
    assert Agent.objects.get(pk=agent.pk).status == "running"
    assert dict(Run.objects.values_list("pk", "status")) == {running.pk: "running", queued.pk: "queued"}
    assert AgentEvent.objects.filter(agent=agent).count() == 1
    assert list(AgentMessage.objects.values_list("pk", flat=True)) == [message.pk]


@pytest.mark.django_db(transaction=True)
def test_another_users_agent_is_refused_as_a_pane_before_streaming(outsider_api, owner, make_agent):
    agent = make_agent(owner, type="shell")

    response = outsider_api.get("/api/v1/events", pane=agent.pk)

    assert response.status_code == 404
    assert error_of(response) == {"code": "NOT_FOUND", "message": f"no agent '{agent.pk}'", "details": {}}
