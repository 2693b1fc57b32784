"""Prompting an agent over /ws and REST (docs/agents.md#prompts-and-runs): the run it creates, the
refusals, and the progress frames every ws session of the user receives."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import channel_layers
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from agents import executor
from agents.models import Run
from agents.prompting import agent_prompt
from core.errors import DispatchError
from tests.agents.conftest import error_of, force_status
from tests.agents.llm_double import LlmDouble, answer, tool_calls

WEATHER = "weather-service"


@pytest.fixture
def llm(settings: Any) -> Iterator[LlmDouble]:
    double = LlmDouble().start()
    settings.LLM_BASE_URL = double.url
    yield double
    double.stop()


@pytest.fixture
def expert(owner: Any, make_agent: Any) -> Any:
    return make_agent(owner, type="expert", name="weatherman")


async def frames_until_run_finished(ws: Any, timeout: float = 10) -> list[dict[str, Any]]:
    """Every frame up to and including ``run-finished`` (remote calls answered on the way)."""
    received = []
    while True:
        frame = await ws.next_event(timeout)
        received.append(frame)
        if frame.get("action") == "remote-call":
            await ws.send({"action": "remote-call-result", "requestId": frame["requestId"], "result": "sunny"})
        if frame.get("action") == "run-finished":
            return received


# --- /ws: send-agent-prompt -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_send_agent_prompt_queues_a_run_and_every_session_of_the_user_sees_its_progress(
    llm, expert, owner, owner_token, ws_connect, weather_tools
):
    llm.script = [tool_calls(("get_forecast", {"city": "Rome"})), answer("Sunny in Rome.")]
    async with ws_connect(token=owner_token) as ws, ws_connect(token=owner_token) as other:
        assert (await ws.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}))["message"]
        body = {
            "agentId": expert.pk,
            "instruction": "What's the weather in Rome? Use your tools.",
            "options": {"remotes": [WEATHER]},
        }
        await ws.send({"action": "send-agent-prompt", "nonce": "p1", "body": body})
        reply = await ws.reply("p1")
        run_id = reply["runId"]
        assert reply == {"message": "prompt accepted", "agentId": expert.pk, "runId": run_id, "nonce": "p1"}

        _, frames, other_frames = await asyncio.gather(
            executor.run_next(), frames_until_run_finished(ws), frames_until_run_finished(other)
        )

    stored = await database_sync_to_async(Run.objects.get)(pk=run_id)
    assert stored.input == {"instruction": body["instruction"], "input": None, "remotes": [WEATHER]}
    assert frames[-1] == {
        "action": "run-finished",
        "agentId": expert.pk,
        "runId": run_id,
        "status": "succeeded",
        "output": "Sunny in Rome.",
    }
    events = [frame for frame in frames if frame["action"] == "agent-event"]
    assert events and all(set(frame) == {"action", "agentId", "runId", "event"} for frame in events)
    assert all(frame["runId"] == run_id and frame["agentId"] == expert.pk for frame in events)
    assert set(events[0]["event"]) == {"type", "message", "metadata", "created_at"}
    messages = [frame["event"]["message"] for frame in events]
    assert "tool call get_forecast" in messages and "tool result get_forecast" in messages
    assert other_frames[-1] == frames[-1]
    assert not any("nonce" in frame for frame in frames + other_frames)


@pytest.mark.django_db(transaction=True)
async def test_a_failed_run_finishes_with_its_error_on_ws(llm, expert, owner_token, ws_connect, settings):
    settings.LLM_BASE_URL = ""
    async with ws_connect(token=owner_token) as ws:
        reply = await ws.request("send-agent-prompt", {"agentId": expert.pk, "instruction": "hi"})
        _, frames = await asyncio.gather(executor.run_next(), frames_until_run_finished(ws))

    assert frames[-1] == {
        "action": "run-finished",
        "agentId": expert.pk,
        "runId": reply["runId"],
        "status": "failed",
        "error": "no model endpoint configured (set DISPATCH_LLM_BASE_URL)",
    }


@pytest.mark.django_db(transaction=True)
async def test_another_user_sees_no_progress_of_my_runs(llm, expert, owner_token, outsider_token, ws_connect):
    llm.script = [answer("done")]
    async with ws_connect(token=owner_token) as ws, ws_connect(token=outsider_token) as carols:
        await ws.request("send-agent-prompt", {"agentId": expert.pk, "instruction": "hi"})
        await asyncio.gather(executor.run_next(), frames_until_run_finished(ws))
        assert await carols.nothing_received(0.2)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "body, error",
    [
        ({"agentId": "agt_000000000000", "instruction": "hi"}, "no agent 'agt_000000000000'"),
        ({"instruction": "hi"}, "no such agent"),
        ("text", "body must be a JSON object with agentId and instruction"),
        ({"agentId": "{agent}", "instruction": ""}, "instruction must be a non-empty string"),
        ({"agentId": "{agent}", "instruction": 5}, "instruction must be a non-empty string"),
        ({"agentId": "{agent}", "instruction": "hi", "options": []}, "options must be a JSON object"),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"instruction": "x"}},
            "options may not use the reserved key 'instruction'",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"input": 1}},
            "options may not use the reserved key 'input'",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"remotes": "weather-service"}},
            "options.remotes must be a list of remote names or {name, prefix} objects",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"remotes": [{"name": "w", "prefix": "w.x"}]}},
            "options.remotes[0]: prefix must match [A-Za-z0-9_-]{0,16}",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"remotes": [{"name": "w", "prefix": "p" * 17}]}},
            "options.remotes[0]: prefix must match [A-Za-z0-9_-]{0,16}",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"remotes": [{"prefix": "w_"}]}},
            "options.remotes[0]: name must be a non-empty string",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"remotes": [{"name": "w", "alias": "v"}]}},
            "options.remotes[0]: unknown key 'alias' (allowed: name, prefix)",
        ),
        (
            {"agentId": "{agent}", "instruction": "hi", "options": {"tools": "list_agents"}},
            "options.tools must be a list of native tool names",
        ),
    ],
)
async def test_send_agent_prompt_refuses_bad_requests_and_queues_nothing(
    expert, owner_token, ws_connect, count_rows, body, error
):
    if isinstance(body, dict) and body.get("agentId") == "{agent}":
        body = {**body, "agentId": expert.pk}
    async with ws_connect(token=owner_token) as ws:
        reply = await ws.request("send-agent-prompt", body)

    assert reply == {"error": error, "nonce": reply["nonce"]}
    assert await count_rows(Run) == 0


@pytest.mark.django_db(transaction=True)
async def test_send_agent_prompt_answers_no_agent_for_another_users_agent(
    expert, outsider_token, ws_connect, count_rows
):
    async with ws_connect(token=outsider_token) as ws:
        reply = await ws.request("send-agent-prompt", {"agentId": expert.pk, "instruction": "hi"})

    assert reply["error"] == f"no agent '{expert.pk}'"
    assert await count_rows(Run) == 0


@pytest.mark.django_db(transaction=True)
async def test_send_agent_prompt_refuses_a_stopped_agent(expert, owner_token, ws_connect, count_rows):
    await database_sync_to_async(force_status)(expert, "stopped")
    async with ws_connect(token=owner_token) as ws:
        reply = await ws.request("send-agent-prompt", {"agentId": expert.pk, "instruction": "hi"})

    assert reply["error"] == f"agent '{expert.pk}' is not running"
    assert await count_rows(Run) == 0


# --- the service ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_agent_prompt_stores_every_option_in_the_run_input(expert, owner):
    run = agent_prompt(
        user=owner,
        agent=expert,
        instruction="go",
        input={"n": 1},
        remotes=["weather-service", {"name": "code-repo-indexer", "prefix": "repo_"}],
        temperature=0.2,
    )

    assert run.input == {
        "instruction": "go",
        "input": {"n": 1},
        "remotes": ["weather-service", {"name": "code-repo-indexer", "prefix": "repo_"}],
        "temperature": 0.2,
    }
    assert run.status == "queued"


@pytest.mark.django_db
def test_prompting_a_cli_agent_is_refused_clearly_for_now(owner, make_agent):
    shell = make_agent(owner, type="shell")

    with pytest.raises(DispatchError, match="prompting CLI agents is not available yet"):
        agent_prompt(user=owner, agent=shell, instruction="ls")


@pytest.mark.django_db
def test_agent_prompt_refuses_another_users_agent(expert, outsider):
    with pytest.raises(DispatchError) as refused:
        agent_prompt(user=outsider, agent=expert, instruction="hi")

    assert refused.value.code == "NOT_FOUND"
    assert Run.objects.count() == 0


# --- REST: POST /api/v1/agents/{id}/prompt ---------------------------------------------------


@pytest.mark.django_db
def test_post_prompt_answers_202_with_the_run_id(api, expert):
    response = api.post(
        f"/api/v1/agents/{expert.pk}/prompt",
        {
            "instruction": "What's the weather?",
            "input": [1, 2],
            "options": {"remotes": [{"name": "w", "prefix": "w_"}]},
        },
    )

    assert response.status_code == 202, response.content
    run = Run.objects.get(pk=response.json()["run_id"])
    assert response.json() == {"run_id": run.pk}
    assert run.input == {
        "instruction": "What's the weather?",
        "input": [1, 2],
        "remotes": [{"name": "w", "prefix": "w_"}],
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, code, message",
    [
        ({}, "VALIDATION_ERROR", None),
        ({"instruction": "hi", "options": ["remotes"]}, "VALIDATION_ERROR", None),
        (
            {"instruction": "hi", "options": {"input": 1}},
            "INVALID_REQUEST",
            "options may not use the reserved key 'input'",
        ),
        (
            {"instruction": "hi", "options": {"remotes": [{"name": "w", "prefix": "bad prefix"}]}},
            "INVALID_REQUEST",
            "options.remotes[0]: prefix must match [A-Za-z0-9_-]{0,16}",
        ),
    ],
)
def test_post_prompt_refuses_bad_bodies(api, expert, body, code, message):
    response = api.post(f"/api/v1/agents/{expert.pk}/prompt", body)

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == code
    if message:
        assert error["message"] == message
    assert Run.objects.count() == 0


@pytest.mark.django_db
def test_post_prompt_is_404_for_another_users_agent(outsider_api, expert):
    response = outsider_api.post(f"/api/v1/agents/{expert.pk}/prompt", {"instruction": "hi"})

    assert response.status_code == 404
    assert error_of(response)["message"] == f"no agent '{expert.pk}'"
    assert Run.objects.count() == 0


@pytest.mark.django_db
def test_post_prompt_refuses_a_stopped_agent(api, expert):
    force_status(expert, "stopped")

    response = api.post(f"/api/v1/agents/{expert.pk}/prompt", {"instruction": "hi"})

    assert response.status_code == 409  # CONFLICT, like a message to a stopped agent
    assert error_of(response)["code"] == "CONFLICT"
    assert error_of(response)["message"] == f"agent '{expert.pk}' is not running"


# --- generated bodies: bad input at any entry point is an error reply, never a crash -----------

# No lone surrogates: the envelope refuses those before any action sees them
# (tests/dispatch/ws/test_ws_properties.py).
texts = st.text(max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)
remote_items = (
    st.sampled_from(["weather-service", "", "x" * 300])
    | st.fixed_dictionaries({}, optional={"name": st.just("w") | json_values, "prefix": st.just("w_") | json_values})
    | json_values
)
prompt_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "agentId": st.sampled_from(["{agent}", "agt_000000000000", ""]) | json_values,
            "instruction": st.just("hi") | json_values,
            "input": json_values,
            "options": st.fixed_dictionaries(
                {},
                optional={
                    "remotes": st.lists(remote_items, max_size=3) | json_values,
                    "tools": st.lists(st.just("list_agents") | json_values, max_size=3) | json_values,
                    "instruction": json_values,
                    "temperature": json_values,
                },
            )
            | json_values,
        },
    )
    | json_values
)


def with_agent(value: Any, agent_id: str) -> Any:
    if isinstance(value, dict) and value.get("agentId") == "{agent}":
        return {**value, "agentId": agent_id}
    return value


@pytest.mark.django_db(transaction=True)
@hypothesis_settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=prompt_bodies)
async def test_send_agent_prompt_answers_every_generated_body_with_a_reply_or_a_clear_error(
    expert, owner_token, ws_connect, body
):
    async def example() -> None:
        channel_layers.backends.clear()
        async with ws_connect(token=owner_token) as ws:
            sent = with_agent(body, expert.pk)
            reply = await ws.request("send-agent-prompt", sent)
            if "error" in reply:
                assert isinstance(reply["error"], str) and reply["error"] != "internal error", reply
                assert set(reply) == {"error", "nonce"}
            else:
                assert reply["message"] == "prompt accepted" and reply["agentId"] == expert.pk
                run = await database_sync_to_async(Run.objects.get)(pk=reply["runId"])
                assert run.input["instruction"] == sent["instruction"]
            assert await ws.nothing_received(0.01)

    await asyncio.wait_for(example(), 10)
