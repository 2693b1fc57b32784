"""Input no database can store, or ids that cannot name a row, get clear errors, never a
crash (runs on PostgreSQL too, which refuses NUL in text and jsonb)."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from agents.models import Agent, AgentEvent, AgentMessage, Run
from agents.selectors import encode_cursor
from agents.services import agent_create, agent_event_record, run_enqueue
from core.errors import DispatchError
from tests.agents.conftest import error_of, force_status

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]


@pytest.mark.parametrize("name", ["nul\x00name", "lone \ud800 surrogate"])
def test_it_refuses_a_name_no_database_can_store(owner, workdir, name):
    with pytest.raises(DispatchError, match="NUL character or a lone surrogate"):
        agent_create(owner=owner, type="expert", name=name, cwd=workdir)
    assert not Agent.objects.exists()


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"message": "a\x00b"}, "message holds"),
        ({"metadata": {"k": "a\x00b"}}, "metadata holds a NUL"),
        ({"metadata": {"a\x00": 1}}, "metadata holds a NUL"),
        ({"metadata": {"k": "\udc00"}}, "metadata holds"),
    ],
)
def test_it_refuses_an_event_no_database_can_store(owner, make_agent, kwargs, complaint):
    agent = make_agent(owner)

    with pytest.raises(DispatchError, match=complaint):
        agent_event_record(agent=agent, **{"type": "working", "message": "m", **kwargs})
    assert not AgentEvent.objects.exists()


def test_a_backslash_u0000_that_is_text_is_kept(owner, make_agent):
    agent = make_agent(owner)

    event = agent_event_record(agent=agent, type="system", message="\\u0000", metadata={"k": "\\u0000 and \\\\"})

    assert AgentEvent.objects.get(pk=event.pk).metadata == {"k": "\\u0000 and \\\\"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"instruction": "run\x00this"},
        {"instruction": "x", "input": {"file": "\x00"}},
        {"instruction": "x", "remotes": ["\x00"]},
        {"instruction": "\ud800"},
    ],
)
def test_it_refuses_a_prompt_no_database_can_store(owner, make_agent, kwargs):
    agent = make_agent(owner)

    with pytest.raises(DispatchError) as refused:
        run_enqueue(agent=agent, **kwargs)
    assert refused.value.code == "INVALID_REQUEST"
    assert not Run.objects.exists()


@pytest.mark.parametrize("agent_id", ["agt_%00", "agt_%ED%A0%80", "a" * 65, "agt_%20x", "%F0%9F%98%80"])
def test_an_impossible_agent_id_is_404_on_every_route(api, agent_id):
    for response in (
        api.get(f"/api/v1/agents/{agent_id}"),
        api.get(f"/api/v1/agents/{agent_id}/events"),
        api.get(f"/api/v1/agents/{agent_id}/runs"),
        api.delete(f"/api/v1/agents/{agent_id}"),
        api.get(f"/api/v1/runs/{agent_id}"),
        api.post(f"/api/v1/runs/{agent_id}/cancel"),
        api.post(f"/api/v1/agents/{agent_id}/stop"),
        api.post(f"/api/v1/agents/{agent_id}/start"),
        api.post(f"/api/v1/agents/{agent_id}/prompt", {"instruction": "x"}),
        api.get(f"/api/v1/agents/{agent_id}/messages"),
        api.post(f"/api/v1/agents/{agent_id}/messages", {"content": "x"}),
    ):
        assert response.status_code == 404, response.content
        assert error_of(response)["code"] == "NOT_FOUND"


def test_a_cursor_naming_an_impossible_id_is_refused(api):
    response = api.get("/api/v1/agents", before=encode_cursor(timezone.now(), "agt_\x00"))

    assert response.status_code == 400
    assert error_of(response)["message"] == "invalid cursor"


@pytest.mark.parametrize("type_filter", ["she\x00ll", "x" * 65])
def test_it_refuses_an_impossible_type_filter(api, type_filter):
    response = api.get("/api/v1/agents", type=type_filter)

    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"


@pytest.mark.parametrize("field", ["name", "cwd", "prompt"])
def test_the_launch_route_refuses_nul_in_text(api, workdir, field):
    body = {"type": "expert", "name": "a", "cwd": workdir, "prompt": "p", field: "x\x00y"}

    response = api.post("/api/v1/agents", body)

    assert response.status_code == 400
    assert not Agent.objects.exists()


# --- messages routes (docs/agents.md#the-rest-api) ---------------------------------------


@pytest.fixture
def shell(owner, make_agent):
    return force_status(make_agent(owner, type="shell"), Agent.Status.RUNNING)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"content": None},
        {"content": 5},
        {"content": ["x"]},
        {"content": {"text": "x"}},
        {"content": ""},
        {"content": "   "},
        {"content": "a\x00b"},
        {"content": "lone \ud800"},
        {"content": "x" * 200_001},
        [],
        "just text",
    ],
)
def test_a_bad_message_body_is_400_and_nothing_is_stored(api, shell, body):
    response = api.client.post(
        f"/api/v1/agents/{shell.pk}/messages", json.dumps(body), content_type="application/json", headers=api.headers
    )

    assert response.status_code == 400, response.content
    assert error_of(response)["code"] in {"INVALID_REQUEST", "VALIDATION_ERROR"}
    assert not AgentMessage.objects.exists()


def test_a_message_body_that_is_not_json_is_400(api, shell):
    response = api.client.post(
        f"/api/v1/agents/{shell.pk}/messages", "{nope", content_type="application/json", headers=api.headers
    )

    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"


def test_a_message_of_exactly_the_maximum_length_is_accepted(api, shell):
    response = api.post(f"/api/v1/agents/{shell.pk}/messages", {"content": "x" * 200_000})

    assert response.status_code == 201
    assert len(AgentMessage.objects.get().content) == 200_000


@pytest.mark.parametrize(
    "message_id", ["abc", "-1", "0", "1.5", "99999999999999999999999", "9223372036854775808", "%00", "1e3", " 1"]
)
def test_a_malformed_or_unknown_message_id_is_404(api, owner, shell, message_id):
    AgentMessage.objects.create(recipient_agent=shell, sender_user=owner, content="there is one")

    response = api.get(f"/api/v1/messages/{message_id}")

    assert response.status_code == 404, (message_id, response.content)
    assert error_of(response)["code"] == "NOT_FOUND"


def test_another_users_message_is_404(outsider_api, owner, shell):
    message = AgentMessage.objects.create(recipient_agent=shell, sender_user=owner, content="private")

    response = outsider_api.get(f"/api/v1/messages/{message.pk}")

    assert response.status_code == 404 and "private" not in response.content.decode()


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"limit": "abc"}, "limit must be an integer from 1 to 200"),
        ({"limit": "0"}, "limit must be an integer from 1 to 200"),
        ({"limit": "-1"}, "limit must be an integer from 1 to 200"),
        ({"limit": "201"}, "limit must be an integer from 1 to 200"),
        ({"limit": "99999999999999999999999"}, "limit must be an integer from 1 to 200"),
        ({"before": "garbage"}, "invalid cursor"),
        ({"before": encode_cursor(timezone.now(), "agt_notanint")}, "invalid cursor"),
    ],
)
def test_bad_message_paging_parameters_are_400(api, shell, params, says):
    response = api.get(f"/api/v1/agents/{shell.pk}/messages", **params)

    assert response.status_code == 400
    assert error_of(response)["message"] == says


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("pane", "status"),
    [("agt_ffffffffffff", 404), ("x\x00y", 404), ("a" * 65, 404)],
)
def test_a_pane_naming_no_agent_of_the_caller_is_refused_before_streaming(api, pane, status):
    response = api.get("/api/v1/events", pane=pane)

    assert response.status_code == status
    assert error_of(response)["code"] == "NOT_FOUND"


@pytest.mark.django_db(transaction=True)
def test_a_pane_of_an_agent_without_a_local_terminal_is_400(api, owner, make_agent, shell):
    expert = make_agent(owner)
    Agent.objects.filter(pk=shell.pk).update(host="some-other-host")

    for agent in (expert, shell):
        response = api.get("/api/v1/events", pane=agent.pk)
        assert response.status_code == 400
        assert error_of(response)["code"] == "INVALID_REQUEST"
