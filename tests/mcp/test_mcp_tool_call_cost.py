"""An MCP ``tools/call`` of a machine tool builds the machine tools only: they shadow every
other tool of their name, so the agent tools' and the remotes' queries are not run for
it."""

from __future__ import annotations

from typing import Any

import pytest

from agents import tools as agent_tools_module
from dispatch.mcp import tools as mcp_tools
from machines.tools import MACHINE_TOOL_NAMES, machine_tools

pytestmark = pytest.mark.django_db(transaction=True)


async def test_machine_tool_names_are_the_machine_tools(owner: Any) -> None:
    built = await machine_tools(user=owner, session_id="s1", caller="test")
    assert {tool.name for tool in built} == MACHINE_TOOL_NAMES


async def test_a_machine_tool_call_builds_nothing_else(owner: Any, monkeypatch: Any) -> None:
    everything = await mcp_tools.tools_for(user=owner)

    async def refused(**kwargs: Any) -> Any:
        raise AssertionError("built for a machine tool call")

    monkeypatch.setattr(mcp_tools, "remote_tools", refused)
    monkeypatch.setattr(agent_tools_module, "agent_tools", refused)
    for name in sorted(MACHINE_TOOL_NAMES):
        tools = await mcp_tools.tools_for(user=owner, name=name)
        assert set(tools) == MACHINE_TOOL_NAMES
        assert tools[name].description.split(".")[0] == everything[name].description.split(".")[0]
    with pytest.raises(AssertionError, match="built for a machine tool call"):
        await mcp_tools.tools_for(user=owner, name="launch_agent")
