"""The agent tools shared by the expert agent and MCP (agents/tools.py,
docs/agents.md#agent-tools), called in process the way both edges call them:
``await tool(arguments)`` (schema check, then the handler). Hostile arguments included.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from agents import cli, services, supervisor
from agents.launching import default_launch_type
from agents.models import Agent, AgentEvent, AgentMessage, Run
from agents.tool_handlers import AGENT_HISTORY_BUDGET
from agents.tools import agent_tools
from agents.types import parse_agent_types
from core.errors import DispatchError
from tests.agents.conftest import force_status

pytestmark = pytest.mark.django_db(transaction=True)

USER_TOOLS = [
    "list_agents",
    "get_agent_history",
    "dispatch_launch_agent",
    "dispatch_send_message",
    "message_status",
    "list_approvals",  # docs/agents.md#approvals
    "answer_approval",
]


async def atools_of(user: Any, caller: Agent | None = None, **kwargs: Any) -> dict[str, Any]:
    return {tool.name: tool for tool in await agent_tools(user=user, caller_agent=caller, **kwargs)}


def tools_of(user: Any, caller: Agent | None = None, **kwargs: Any) -> dict[str, Any]:
    return async_to_sync(atools_of)(user, caller, **kwargs)


async def call(user: Any, name: str, arguments: Any, caller: Agent | None = None) -> Any:
    return await (await atools_of(user, caller))[name](arguments)


async def fails(user: Any, name: str, arguments: Any, caller: Agent | None = None) -> DispatchError:
    with pytest.raises(DispatchError) as raised:
        await call(user, name, arguments, caller)
    return raised.value


def make(owner: Any, workdir: str, name: str = "helper", type: str = "expert", **kwargs: Any) -> Agent:
    return services.agent_create(owner=owner, type=type, name=name, cwd=workdir, **kwargs)


amake = database_sync_to_async(make)


# --- the toolsets -------------------------------------------------------------------------


def test_a_user_gets_the_agent_tools_without_dispatch_event(owner):
    assert list(tools_of(owner)) == USER_TOOLS


def test_an_agent_caller_also_gets_dispatch_event_unless_left_out(owner, workdir):
    agent = make(owner, workdir)
    assert list(tools_of(owner, agent)) == [*USER_TOOLS, "dispatch_event"]
    assert list(tools_of(owner, agent, event_tool=False)) == USER_TOOLS


SHELL_AND_GHOST = {"shell": {"argv": ["bash"], "kind": "shell"}, "ghost": {"argv": ["no-such-program-x"]}}


def test_the_launch_description_lists_the_types_available_here_and_why_the_others_are_not(owner, settings):
    settings.AGENT_TYPES = parse_agent_types(json.dumps(SHELL_AND_GHOST))
    settings.LLM_BASE_URL = ""
    tool = tools_of(owner)["dispatch_launch_agent"]
    assert "Types available now: shell." in tool.description
    assert (
        "Unavailable here: expert (no model endpoint configured (set DISPATCH_LLM_BASE_URL)); "
        "ghost (not installed here: no-such-program-x not on PATH)." in tool.description
    )
    assert "omit location" in tool.description
    assert tool.parameters["properties"]["type"]["enum"] == ["expert", "shell", "ghost"]

    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"
    tool = tools_of(owner)["dispatch_launch_agent"]
    assert "Types available now: expert, shell." in tool.description
    assert "Unavailable here: ghost (not installed here: no-such-program-x not on PATH)." in tool.description


def test_the_default_type_is_expert_with_an_endpoint_else_the_first_installed_llm_cli_never_a_shell(settings):
    settings.LLM_BASE_URL = ""
    settings.AGENT_TYPES = parse_agent_types(json.dumps(SHELL_AND_GHOST))
    assert default_launch_type() is None
    settings.AGENT_TYPES = parse_agent_types(
        json.dumps({"shell": {"argv": ["bash"], "kind": "shell"}, "fake-llm": {"argv": ["true"], "kind": "llm"}})
    )
    assert default_launch_type() == "fake-llm"
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"
    assert default_launch_type() == "expert"


def test_the_launch_tool_says_its_default_type(owner, settings):
    settings.LLM_BASE_URL = ""
    settings.AGENT_TYPES = parse_agent_types(
        json.dumps({"shell": {"argv": ["bash"], "kind": "shell"}, "fake-llm": {"argv": ["true"], "kind": "llm"}})
    )
    tool = tools_of(owner)["dispatch_launch_agent"]
    assert "Default type: fake-llm." in tool.description
    assert tool.parameters["properties"]["type"]["description"] == "Default: fake-llm."


async def test_without_a_default_type_a_launch_must_name_one_and_is_told_the_available_ones(owner, settings):
    settings.LLM_BASE_URL = ""
    settings.AGENT_TYPES = parse_agent_types(json.dumps(SHELL_AND_GHOST))
    tool = (await atools_of(owner))["dispatch_launch_agent"]
    assert "No default type here: give type" in tool.description
    assert tool.parameters["properties"]["type"]["description"].startswith("Required for a launch here")

    error = await fails(owner, "dispatch_launch_agent", {"name": "helper", "prompt": "summarise the repo"})

    assert error.code == "INVALID_REQUEST"
    assert error.message.startswith("type is required: there is no default agent type here")
    assert error.message.endswith("available types: shell")
    assert error.details == {"available_types": ["shell"]}
    assert not await database_sync_to_async(Agent.objects.exists)()  # above all, no shell got the prompt


async def test_with_an_endpoint_a_launch_without_a_type_is_an_expert_agent(owner, settings, tmp_path):
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"
    settings.DEFAULT_CWD = str(tmp_path)
    launched = await call(owner, "dispatch_launch_agent", {"name": "helper", "prompt": ""})
    assert (launched["type"], launched["status"]) == ("expert", "running")


# --- list_agents / get_agent_history ------------------------------------------------------


async def test_list_agents_lists_only_the_users_live_agents(owner, outsider, workdir):
    mine = await amake(owner, workdir, name="mine")
    child = await amake(owner, workdir, name="kid", parent=mine)
    gone = await amake(owner, workdir, name="gone")
    await database_sync_to_async(services.agent_archive)(agent=gone)
    await amake(outsider, workdir, name="theirs")

    listed = await call(owner, "list_agents", {})

    assert [entry["id"] for entry in listed] == [child.pk, mine.pk]
    assert listed[0]["parent"] == mine.pk and listed[1]["parent"] is None
    assert listed[0]["type"] == "expert" and listed[0]["status"] == "running"


async def test_get_agent_history_gives_runs_and_events_newest_first(owner, workdir):
    agent = await amake(owner, workdir)
    first = await database_sync_to_async(services.run_enqueue)(agent=agent, instruction="first thing")
    await database_sync_to_async(services.run_finish)(run=first, status=Run.Status.SUCCEEDED, output="did it")
    await database_sync_to_async(services.run_enqueue)(agent=agent, instruction="second thing")
    await database_sync_to_async(services.agent_event_record)(agent=agent, type="working", message="busy")

    history = await call(owner, "get_agent_history", {"agent_id": agent.pk})

    assert history["agent"]["id"] == agent.pk
    assert [run["instruction"] for run in history["runs"]] == ["second thing", "first thing"]
    assert history["runs"][1]["output"] == "did it"
    assert history["events"][0]["message"] == "busy"
    assert history["truncated"] is False
    assert (await call(owner, "get_agent_history", {"agent_id": agent.pk, "limit": 1}))["runs"][0]["instruction"] == (
        "second thing"
    )


async def test_get_agent_history_defaults_to_the_calling_agent(owner, workdir):
    agent = await amake(owner, workdir)
    history = await call(owner, "get_agent_history", {}, caller=agent)
    assert history["agent"]["id"] == agent.pk
    error = await fails(owner, "get_agent_history", {})  # a user must name one
    assert error.code == "INVALID_REQUEST" and "agent_id" in error.message


async def test_get_agent_history_stays_within_its_budget(owner, workdir):
    agent = await amake(owner, workdir)
    for index in range(30):
        run = await database_sync_to_async(services.run_enqueue)(agent=agent, instruction=f"job {index} " + "x" * 5000)
        await database_sync_to_async(services.run_finish)(run=run, status=Run.Status.SUCCEEDED, output="y" * 9000)

    history = await call(owner, "get_agent_history", {"agent_id": agent.pk, "limit": 100})

    assert history["truncated"] is True
    assert 0 < len(history["runs"]) < 30
    assert len(json.dumps(history)) < AGENT_HISTORY_BUDGET + 2_000
    assert "[cut: " in history["runs"][0]["instruction"]


async def test_another_users_agent_is_not_found(owner, outsider, workdir):
    theirs = await amake(outsider, workdir, name="secret")
    for arguments in ({"agent_id": theirs.pk}, {"agent_id": "agt_000000000000"}, {"agent_id": "../../etc"}):
        error = await fails(owner, "get_agent_history", arguments)
        assert error.code == "NOT_FOUND", arguments
    assert "secret" not in (await fails(owner, "get_agent_history", {"agent_id": theirs.pk})).message


# --- hostile arguments --------------------------------------------------------------------

HOSTILE = [
    ("list_agents", {"extra": 1}),
    ("list_agents", []),
    ("get_agent_history", {"agent_id": 5}),
    ("get_agent_history", {"agent_id": "x" * 10_000}),
    ("get_agent_history", {"agent_id": "agt_000000000000", "limit": 0}),
    ("get_agent_history", {"agent_id": "agt_000000000000", "limit": "3"}),
    ("get_agent_history", {"agent_id": "agt_000000000000", "limit": 10**12}),
    ("dispatch_launch_agent", {"name": "a"}),
    ("dispatch_launch_agent", {"name": 5, "prompt": "p"}),
    ("dispatch_launch_agent", {"name": "", "prompt": "p"}),
    ("dispatch_launch_agent", {"name": "n" * 101, "prompt": "p"}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p" * 200_001}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p", "type": "rm -rf /"}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p", "child": "yes"}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p", "type": "expert", "cwd": ["/"]}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p", "type": "expert", "cwd": "relative/dir"}),
    ("dispatch_launch_agent", {"name": "a", "prompt": "p", "type": "expert", "cwd": "/no/such/dir"}),
    ("dispatch_launch_agent", {"name": "a\x00b", "prompt": "p"}),
    ("dispatch_send_message", {"target": "x"}),
    ("dispatch_send_message", {"target": ["agt_000000000000"], "message": "hi"}),
    ("dispatch_send_message", {"target": "t" * 301, "message": "hi"}),
    ("dispatch_send_message", {"target": "x", "message": ""}),
    ("dispatch_send_message", {"target": "x", "message": "m" * 200_001}),
    ("message_status", {}),
    ("message_status", {"message_id": [1]}),
    ("message_status", {"message_id": 0}),
    ("message_status", {"message_id": "1" * 21}),
]


@pytest.mark.parametrize(("name", "arguments"), HOSTILE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(HOSTILE)])
async def test_hostile_arguments_are_invalid_requests_and_change_nothing(owner, workdir, name, arguments):
    caller = await amake(owner, workdir, name="caller")
    before = await database_sync_to_async(Agent.objects.count)()

    error = await fails(owner, name, arguments, caller=caller)

    assert error.code == "INVALID_REQUEST", error
    assert len(error.message) < 2_000
    assert await database_sync_to_async(Agent.objects.count)() == before


@pytest.mark.parametrize("message_id", [999_999, "999999", "abc", "-1", "1e3", 2**63 - 1])
async def test_an_unknown_message_id_is_not_found(owner, message_id):
    assert (await fails(owner, "message_status", {"message_id": message_id})).code == "NOT_FOUND"


async def test_dispatch_event_refuses_a_type_agents_do_not_report(owner, workdir):
    agent = await amake(owner, workdir)
    for arguments in ({"type": "system", "message": "x"}, {"type": "done"}, {"type": "done", "message": 5}):
        assert (await fails(owner, "dispatch_event", arguments, caller=agent)).code == "INVALID_REQUEST"
    big = {"type": "done", "message": "m" * (services.MAX_EVENT_MESSAGE_LENGTH + 1)}
    assert (await fails(owner, "dispatch_event", big, caller=agent)).code == "INVALID_REQUEST"
    assert not await database_sync_to_async(AgentEvent.objects.filter(agent=agent, type="done").exists)()


# --- dispatch_event -----------------------------------------------------------------------


async def test_dispatch_event_records_the_event_on_the_calling_agent(owner, workdir):
    agent = await amake(owner, workdir)

    event = await call(owner, "dispatch_event", {"type": "blocked", "message": "need the API key"}, caller=agent)

    assert (event["agent_id"], event["type"], event["message"]) == (agent.pk, "blocked", "need the API key")
    await database_sync_to_async(agent.refresh_from_db)()
    assert (agent.latest_event_type, agent.latest_event_message) == ("blocked", "need the API key")


# --- dispatch_send_message / message_status -----------------------------------------------


async def test_a_message_to_an_expert_agent_by_id_queues_a_run_and_is_delivered(owner, workdir):
    target = await amake(owner, workdir, name="worker")

    sent = await call(owner, "dispatch_send_message", {"target": target.pk, "message": "summarise the logs"})

    assert sent["status"] == "delivered" and sent["recipient"] == target.pk
    run = await database_sync_to_async(Run.objects.get)(agent=target)
    assert (run.status, run.input["instruction"]) == ("queued", "summarise the logs")
    status = await call(owner, "message_status", {"message_id": sent["message_id"]})
    assert status["status"] == "delivered" and status["error"] is None and status["delivered_at"]
    assert (await call(owner, "message_status", {"message_id": str(sent["message_id"])}))["status"] == "delivered"


async def test_a_message_from_an_agent_names_it_as_the_sender(owner, workdir):
    caller = await amake(owner, workdir, name="boss")
    await amake(owner, workdir, name="worker")

    sent = await call(owner, "dispatch_send_message", {"target": "worker", "message": "go"}, caller=caller)

    message = await database_sync_to_async(AgentMessage.objects.get)(pk=sent["message_id"])
    assert (message.sender_agent_id, message.sender_user_id) == (caller.pk, None)
    error = await fails(owner, "dispatch_send_message", {"target": "boss", "message": "me"}, caller=caller)
    assert error.code == "INVALID_REQUEST" and "itself" in error.message


async def test_an_ambiguous_name_lists_the_candidates(owner, workdir):
    one = await amake(owner, workdir, name="twin")
    two = await amake(owner, workdir, name="twin")

    error = await fails(owner, "dispatch_send_message", {"target": "twin", "message": "hi"})

    assert error.code == "INVALID_REQUEST"
    assert one.pk in error.message and two.pk in error.message
    assert {c["id"] for c in error.details["candidates"]} == {one.pk, two.pk}
    assert not await database_sync_to_async(AgentMessage.objects.exists)()


async def test_an_unknown_name_lists_the_running_agents(owner, outsider, workdir):
    await amake(owner, workdir, name="alpha")
    stopped = await amake(owner, workdir, name="beta")
    await database_sync_to_async(services.agent_set_status)(agent=stopped, status="stopped")
    await amake(outsider, workdir, name="gamma")

    error = await fails(owner, "dispatch_send_message", {"target": "gamma", "message": "hi"})

    assert error.code == "NOT_FOUND"
    assert "alpha" in error.message and "beta" not in error.message and "gamma (" not in error.message
    assert (await fails(owner, "dispatch_send_message", {"target": "beta", "message": "hi"})).code == "NOT_FOUND"


async def test_a_peer_address_is_refused_until_instances_can_be_linked(owner):
    error = await fails(owner, "dispatch_send_message", {"target": "laptop:agt_0123456789ab", "message": "hi"})
    assert error.code == "INVALID_REQUEST" and "linked instance" in error.message


async def test_another_users_agent_and_messages_are_out_of_reach(owner, outsider, workdir):
    theirs = await amake(outsider, workdir, name="theirs")
    error = await fails(owner, "dispatch_send_message", {"target": theirs.pk, "message": "hi"})
    assert error.code == "NOT_FOUND"
    sent = await call(outsider, "dispatch_send_message", {"target": theirs.pk, "message": "mine"})
    assert (await fails(owner, "message_status", {"message_id": sent["message_id"]})).code == "NOT_FOUND"


async def test_a_stopped_agent_by_id_is_a_conflict(owner, workdir):
    target = await amake(owner, workdir)
    await database_sync_to_async(force_status)(target, "stopped")
    assert (await fails(owner, "dispatch_send_message", {"target": target.pk, "message": "hi"})).code == "CONFLICT"


# --- dispatch_launch_agent ----------------------------------------------------------------


async def test_an_agent_launches_an_expert_child_in_its_own_directory(owner, workdir, tmp_path):
    caller = await amake(owner, workdir, name="boss")

    launched = await call(owner, "dispatch_launch_agent", {"name": "sub", "prompt": "count", "type": "expert"}, caller)

    assert (launched["type"], launched["status"]) == ("expert", "running")
    assert (launched["parent"], launched["launched_by"], launched["cwd"]) == (caller.pk, caller.pk, workdir)
    run = await database_sync_to_async(Run.objects.get)(agent_id=launched["id"])
    assert run.input["instruction"] == "count"

    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    sibling = await call(
        owner,
        "dispatch_launch_agent",
        {"name": "sib", "prompt": "", "type": "expert", "child": False, "cwd": str(elsewhere)},
        caller,
    )
    assert (sibling["parent"], sibling["launched_by"], sibling["cwd"]) == (None, caller.pk, str(elsewhere))


async def test_a_user_launch_defaults_to_the_instance_directory(owner, settings, tmp_path):
    settings.DEFAULT_CWD = str(tmp_path)
    launched = await call(owner, "dispatch_launch_agent", {"name": "mine", "prompt": "", "type": "expert"})
    assert (launched["parent"], launched["launched_by"], launched["cwd"]) == (None, None, str(tmp_path))


async def test_a_location_is_refused_while_no_instance_is_linked(owner):
    arguments = {"name": "far", "prompt": "hi", "type": "expert", "location": "laptop"}
    error = await fails(owner, "dispatch_launch_agent", arguments)
    assert error.code == "INVALID_REQUEST" and "no linked instance" in error.message
    assert not await database_sync_to_async(Agent.objects.exists)()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_an_agent_launches_a_shell_agent_in_tmux(owner, workdir, private_tmux):
    caller = await amake(owner, workdir, name="boss")

    launched = await call(
        owner, "dispatch_launch_agent", {"name": "sh", "prompt": "echo launched-$((6*7))", "type": "shell"}, caller
    )

    assert (launched["type"], launched["status"]) == ("shell", "running")
    assert (launched["parent"], launched["launched_by"]) == (caller.pk, caller.pk)
    agent = await database_sync_to_async(Agent.objects.get)(pk=launched["id"])
    name = cli.session_name(agent)
    assert private_tmux.exists(name)
    # The prompt is the agent's first message, from its launcher; the supervisor pastes it.
    first = await database_sync_to_async(AgentMessage.objects.get)(recipient_agent=agent)
    assert (first.sender_agent_id, first.content) == (caller.pk, "echo launched-$((6*7))")
    for _ in range(200):
        await database_sync_to_async(supervisor.supervise_once)(runner=private_tmux)
        if "launched-42" in private_tmux.capture(name):
            break
        await asyncio.sleep(0.05)
    assert "launched-42" in private_tmux.capture(name)
