"""Input no database can store, or ids that cannot name a row, get clear errors, never a
crash (runs on PostgreSQL too, which refuses NUL in text and jsonb)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from dispatch.agents.selectors import encode_cursor
from dispatch.agents.services import agent_create, agent_event_record, run_enqueue
from dispatch.errors import DispatchError
from dispatch.models import Agent, AgentEvent, Run
from tests.agents.conftest import error_of

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
