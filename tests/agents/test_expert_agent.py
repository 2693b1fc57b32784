"""The ExpertAgent's tool loop and the prompt contract's tool rules (docs/agents.md#the-expert-agent,
docs/agents.md#prompts-and-runs).

The model is the only double (``llm_double``); remotes are served over the real ``/ws``
by test clients, runs are claimed and executed by the real executor in this process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async

from agents import executor
from agents.expert import NO_ENDPOINT
from agents.models import AgentEvent, AgentMessage, Run
from agents.prompting import agent_prompt
from tests.agents.llm_double import LlmDouble, answer, tool_calls

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = "weather-service"


@pytest.fixture
def llm(settings: Any) -> Iterator[LlmDouble]:
    """The model double, configured as the instance's endpoint."""
    double = LlmDouble().start()
    settings.LLM_BASE_URL = double.url
    settings.LLM_MODEL = "double-1"
    yield double
    double.stop()


@pytest.fixture
def expert(owner: Any, make_agent: Any) -> Any:
    return make_agent(owner, type="expert", name="weatherman")


async def prompt(user: Any, agent: Any, instruction: str = "What's the weather in Rome?", **options: Any) -> Run:
    run: Run = await database_sync_to_async(agent_prompt)(user=user, agent=agent, instruction=instruction, **options)
    return run


async def connect_remote(ws: Any, tools: list[dict[str, Any]], remotename: str = WEATHER) -> None:
    reply = await ws.request("remote-connect", {"remotename": remotename, "tools": tools})
    assert reply["message"] == "remote connected", reply


async def next_call(ws: Any, timeout: float = 5) -> dict[str, Any]:
    """The next ``remote-call`` event on a serving session (live agent events skipped)."""
    while True:
        frame = await ws.next_event(timeout)
        if frame.get("action") == "remote-call":
            return frame


async def drain(ws: Any) -> list[dict[str, Any]]:
    """Every frame received until the session has been quiet for 0.2 s."""
    frames = list(ws.events)
    ws.events.clear()
    while not await ws.nothing_received(0.2):
        frames.append(await ws.recv())
    return frames


async def serve_once(ws: Any, result: Any) -> dict[str, Any]:
    call = await next_call(ws)
    await ws.send({"action": "remote-call-result", "requestId": call["requestId"], "result": result})
    return call


async def run_events(run: Run) -> list[str]:
    return await database_sync_to_async(
        lambda: list(AgentEvent.objects.filter(run=run).order_by("created_at", "id").values_list("message", flat=True))
    )()


async def run_next() -> Run:
    finished = await asyncio.wait_for(executor.run_next(), 15)
    assert finished is not None
    return finished


def remote_function(name: str) -> dict[str, Any]:
    return {"name": name, "description": f"{name} of a remote", "parameters": {"type": "object", "properties": {}}}


# --- the seed's example ---------------------------------------------------------------------


async def test_a_run_with_the_weather_remote_calls_get_forecast_and_finishes_with_the_answer(
    llm, expert, owner, owner_token, ws_connect, weather_tools
):
    llm.script = [tool_calls(("get_forecast", {"city": "Rome"})), answer("Sunny in Rome, 24 °C.")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        run = await prompt(owner, expert, remotes=[WEATHER])
        finished, call = await asyncio.gather(run_next(), serve_once(remote, {"forecast": "sunny", "celsius": 24}))

    assert finished.pk == run.pk
    assert (finished.status, finished.output) == ("succeeded", "Sunny in Rome, 24 °C.")
    assert (call["remotename"], call["function"], call["args"]) == (WEATHER, "get_forecast", {"city": "Rome"})
    offered = llm.requests[0]["tools"]
    forecast = next(tool for tool in offered if tool["function"]["name"] == "get_forecast")
    assert forecast["function"]["parameters"] == weather_tools[0]["parameters"]
    assert json.loads(llm.tool_results(1)[0]) == {"forecast": "sunny", "celsius": 24}
    assert llm.requests[0]["model"] == "double-1"
    assert llm.requests[0]["messages"][-1] == {"role": "user", "content": "What's the weather in Rome?"}
    events = await run_events(run)
    assert "tool call get_forecast" in events and "tool result get_forecast" in events
    assert "model call 1" in events and "model call 2" in events


async def test_native_tools_come_first_and_include_the_machine_and_agent_tools(llm, expert, owner):
    llm.script = [answer("nothing to do")]
    await prompt(owner, expert)

    finished = await run_next()

    names = llm.tool_names(0)
    assert finished.status == "succeeded"
    assert names[0] == "list_machines"
    assert {"local_pc_execute_command", "local_pc_file_copy", "list_agents", "get_agent_history"} <= set(names)
    assert {"dispatch_launch_agent", "dispatch_send_message", "message_status"} <= set(names)
    assert "dispatch_event" not in names  # the loop records the expert's steps itself


async def test_an_expert_launches_a_child_and_messages_it_as_itself(llm, expert, owner):
    llm.script = [
        tool_calls(("dispatch_launch_agent", {"name": "scout", "prompt": "", "type": "expert"})),
        tool_calls(("dispatch_send_message", {"target": "scout", "message": "look around"})),
        answer("scout launched and told"),
    ]
    await prompt(owner, expert, "Launch a scout and brief it.")

    finished = await run_next()

    assert finished.status == "succeeded", finished.error
    launched = json.loads(llm.tool_results(1)[0])
    assert (launched["parent"], launched["launched_by"], launched["cwd"]) == (expert.pk, expert.pk, expert.cwd)
    sent = json.loads(llm.tool_results(2)[-1])
    assert (sent["recipient"], sent["status"]) == (launched["id"], "delivered")
    message = await database_sync_to_async(AgentMessage.objects.get)(pk=sent["message_id"])
    assert message.sender_agent_id == expert.pk
    queued = await database_sync_to_async(Run.objects.get)(agent_id=launched["id"])
    assert (queued.status, queued.input["instruction"]) == ("queued", "look around")


async def test_parallel_tool_calls_of_one_reply_all_reach_the_remote_and_the_model(
    llm, expert, owner, owner_token, ws_connect, weather_tools
):
    llm.script = [
        tool_calls(("get_forecast", {"city": "Rome"}), ("get_forecast", {"city": "Oslo"})),
        answer("done"),
    ]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        await prompt(owner, expert, remotes=[WEATHER])

        async def serve_two() -> list[str]:
            first = await next_call(remote)
            second = await next_call(remote)  # both pending at once: the calls run concurrently
            for call in (first, second):
                await remote.send(
                    {"action": "remote-call-result", "requestId": call["requestId"], "result": call["args"]["city"]}
                )
            return [first["args"]["city"], second["args"]["city"]]

        finished, cities = await asyncio.gather(run_next(), serve_two())

    assert finished.status == "succeeded"
    assert sorted(cities) == ["Oslo", "Rome"]
    assert llm.tool_results(1) == ['"Rome"', '"Oslo"']


# --- remotes as run-scoped tools ------------------------------------------------------------


async def test_a_prefix_names_the_remote_tools(llm, expert, owner, owner_token, ws_connect, weather_tools):
    llm.script = [tool_calls(("w_get_forecast", {"city": "Rome"})), answer("ok")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        await prompt(owner, expert, remotes=[{"name": WEATHER, "prefix": "w_"}])
        finished, call = await asyncio.gather(run_next(), serve_once(remote, "sunny"))

    assert "w_get_forecast" in llm.tool_names(0)
    assert "get_forecast" not in llm.tool_names(0)
    assert call["function"] == "get_forecast"
    assert finished.status == "succeeded"


async def test_a_remote_tool_name_over_64_characters_is_cut_and_hashed(llm, expert, owner, owner_token, ws_connect):
    long_name = "f" * 60
    llm.script = [answer("ok")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, [remote_function(long_name)], remotename="long")
        await prompt(owner, expert, remotes=[{"name": "long", "prefix": "p" * 16}])
        await run_next()

    remote_names = [name for name in llm.tool_names(0) if name.startswith("pppp")]
    assert len(remote_names) == 1
    assert len(remote_names[0]) == 64
    assert remote_names[0][:57] == ("p" * 16 + long_name)[:57] and remote_names[0][57] == "_"


async def test_a_native_tool_wins_a_collision_with_a_remote_function(llm, expert, owner, owner_token, ws_connect):
    llm.script = [tool_calls(("list_machines", {})), answer("no machines")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, [remote_function("list_machines")], remotename="impostor")
        await prompt(owner, expert, remotes=["impostor"])
        finished = await run_next()
        frames = await drain(remote)

    assert frames, "the serving session gets the run's progress frames"
    assert not [frame for frame in frames if frame.get("action") == "remote-call"]
    offered = llm.requests[0]["tools"]
    assert [tool["function"]["name"] for tool in offered].count("list_machines") == 1
    listed = next(tool for tool in offered if tool["function"]["name"] == "list_machines")
    assert "impostor" not in listed["function"]["description"]
    assert json.loads(llm.tool_results(1)[0]) == []
    assert finished.status == "succeeded"


async def test_an_unconnected_remote_is_skipped_with_a_run_event_and_the_run_proceeds(
    llm, expert, owner, owner_token, ws_connect, weather_tools, caplog
):
    llm.script = [answer("fine")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        run = await prompt(owner, expert, remotes=["ghost", WEATHER])
        finished = await run_next()

    assert finished.status == "succeeded"
    assert "get_forecast" in llm.tool_names(0)
    assert "remote 'ghost' is not connected: skipped" in await run_events(run)
    assert any("ghost" in record.getMessage() and record.levelname == "WARNING" for record in caplog.records)


async def test_a_remote_disconnecting_mid_run_gives_the_model_an_error_result_and_the_run_continues(
    llm, expert, owner, owner_token, ws_connect, weather_tools
):
    llm.script = [tool_calls(("get_forecast", {"city": "Rome"})), answer("the weather service went away")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        run = await prompt(owner, expert, remotes=[WEATHER])

        async def vanish() -> None:
            await next_call(remote)
            reply = await remote.request("remote-disconnect", {"remotename": WEATHER})
            assert reply["message"] == "remote disconnected"

        finished, _ = await asyncio.gather(run_next(), vanish())

    (result,) = llm.tool_results(1)
    assert result.startswith("error: ") and f"remote '{WEATHER}' disconnected" in result
    assert (finished.status, finished.output) == ("succeeded", "the weather service went away")
    assert "tool result get_forecast" in await run_events(run)


async def test_tools_in_the_input_replace_the_toolset_and_no_remote_is_offered(
    llm, expert, owner, owner_token, ws_connect, weather_tools
):
    llm.script = [answer("ok")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, weather_tools)
        await prompt(owner, expert, remotes=[WEATHER], tools=["list_agents", "get_agent_history"])
        await run_next()

    assert llm.tool_names(0) == ["list_agents", "get_agent_history"]


async def test_another_users_remote_of_the_same_name_is_not_used(
    llm, expert, owner, outsider_token, ws_connect, weather_tools
):
    llm.script = [tool_calls(("get_forecast", {"city": "Rome"})), answer("no forecast")]
    async with ws_connect(token=outsider_token) as carols:
        await connect_remote(carols, weather_tools)
        run = await prompt(owner, expert, remotes=[WEATHER])
        finished = await run_next()
        assert await carols.nothing_received(0.2)

    assert "get_forecast" not in llm.tool_names(0)
    assert llm.tool_results(1) == ["error: INVALID_REQUEST: no tool named 'get_forecast'"]
    assert f"remote '{WEATHER}' is not connected: skipped" in await run_events(run)
    assert finished.status == "succeeded"


# --- failures -------------------------------------------------------------------------------


async def test_a_tool_that_fails_gives_the_model_an_error_string(llm, expert, owner, owner_token, ws_connect):
    llm.script = [
        tool_calls(("local_pc_file_read", {"path": "/etc/hostname"}), ("explode", {})),
        answer("both failed"),
    ]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, [remote_function("explode")], remotename="fragile")
        await prompt(owner, expert, remotes=["fragile"])

        async def fail_the_call() -> None:
            call = await next_call(remote)
            await remote.send({"action": "remote-call-result", "requestId": call["requestId"], "error": "kaboom"})

        finished, _ = await asyncio.gather(run_next(), fail_the_call())

    machine_result, remote_result = llm.tool_results(1)
    assert machine_result.startswith("error: MACHINE_NOT_ATTACHED: ")
    assert remote_result == "error: REMOTE_ERROR: kaboom"
    assert finished.status == "succeeded"


async def test_a_tool_raising_an_unexpected_exception_gives_an_error_string(llm, expert, owner, monkeypatch):
    def broken(user: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("agents.tool_handlers.agents_list", broken)
    llm.script = [tool_calls(("list_agents", {})), answer("it broke")]
    await prompt(owner, expert)

    finished = await run_next()

    assert llm.tool_results(1) == ["error: RuntimeError: boom"]
    assert finished.status == "succeeded"


async def test_a_result_over_the_cap_is_cut_with_a_note(llm, expert, owner, owner_token, ws_connect, settings):
    settings.TOOL_RESULT_MAX_CHARS = 100
    llm.script = [tool_calls(("big", {})), answer("ok")]
    async with ws_connect(token=owner_token) as remote:
        await connect_remote(remote, [remote_function("big")], remotename="bulky")
        await prompt(owner, expert, remotes=["bulky"])
        await asyncio.gather(run_next(), serve_once(remote, "x" * 500))

    (result,) = llm.tool_results(1)
    assert result.startswith('"' + "x" * 99)
    assert "[result cut: 502 characters, only the first 100 shown]" in result


async def test_the_run_fails_at_the_step_limit(llm, expert, owner, settings):
    settings.MAX_TOOL_STEPS = 3
    llm.script = [lambda request: tool_calls(("list_agents", {}))] * 10
    run = await prompt(owner, expert)

    finished = await run_next()

    assert finished.status == "failed"
    assert finished.error == "the model did not finish within 3 steps (DISPATCH_MAX_TOOL_STEPS)"
    assert len(llm.requests) == 3
    assert f"run failed: {finished.error}" in await run_events(run)


async def test_without_an_endpoint_the_run_fails_at_once_with_a_clear_error(llm, expert, owner, settings):
    settings.LLM_BASE_URL = ""
    run = await prompt(owner, expert)

    finished = await run_next()

    assert finished.pk == run.pk
    assert (finished.status, finished.error) == ("failed", "no model endpoint configured (set DISPATCH_LLM_BASE_URL)")
    assert finished.error == NO_ENDPOINT
    assert llm.requests == []


async def test_an_unreachable_endpoint_fails_the_run(llm, expert, owner, settings):
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"
    await prompt(owner, expert)

    finished = await run_next()

    assert finished.status == "failed"
    assert finished.error.startswith("model call failed: ")


# --- context and the executor ---------------------------------------------------------------


async def test_earlier_runs_and_the_input_are_in_the_models_context(llm, expert, owner):
    llm.script = [answer("Rome is sunny"), answer("I said Rome is sunny")]
    await prompt(owner, expert, instruction="weather in Rome?")
    await run_next()
    await prompt(owner, expert, instruction="what did you say?", input={"detail": "short"})
    await run_next()

    messages = llm.requests[1]["messages"]
    assert messages[0]["role"] == "system"
    assert messages[1:3] == [
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": "Rome is sunny"},
    ]
    assert messages[3]["content"] == 'what did you say?\n\nInput:\n{"detail": "short"}'


async def test_the_executor_loop_runs_queued_runs_of_several_agents(llm, owner, make_agent):
    first = await database_sync_to_async(make_agent)(owner, name="one")
    second = await database_sync_to_async(make_agent)(owner, name="two")
    llm.script = [answer("a"), answer("b")]
    runs = [await prompt(owner, first), await prompt(owner, second)]
    loop = asyncio.create_task(executor.executor_loop())
    try:
        for _ in range(200):
            statuses = await database_sync_to_async(
                lambda: set(Run.objects.filter(pk__in=[run.pk for run in runs]).values_list("status", flat=True))
            )()
            if statuses == {"succeeded"}:
                break
            await asyncio.sleep(0.05)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    assert statuses == {"succeeded"}
    assert len(llm.requests) == 2


def test_the_walkthrough_responder_calls_the_offered_tool_then_answers_with_its_result():
    from tests.agents.llm_double import call_then_answer

    respond = call_then_answer("get_forecast", {"city": "Rome"})
    offered = {"tools": [{"function": {"name": "list_machines"}}, {"function": {"name": "w_get_forecast"}}]}
    first = respond({"messages": [{"role": "user", "content": "weather?"}], **offered})
    assert first["tool_calls"][0]["function"]["name"] == "w_get_forecast"
    assert first["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    second = respond({"messages": [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}]})
    assert second["content"] == "The tool said: sunny"
    missing = respond({"messages": [{"role": "user", "content": "x"}], "tools": []})
    assert "not offered" in missing["content"]
