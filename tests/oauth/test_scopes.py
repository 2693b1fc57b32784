"""What each OAuth scope lets a token reach (docs/mcp.md#oauth-scopes)."""

from __future__ import annotations

from typing import Any

import pytest

from core.tools import NATIVE, Tool
from machines.tools import COMMAND_HANDLE_TOOL_NAMES, MACHINE_TOOL_NAMES
from oauth.scopes import AGENTS, MACHINES_READ, MACHINES_SHELL, MACHINES_WRITE, REMOTES, allows, granted, tool_scope


async def _nothing(arguments: dict[str, Any]) -> Any:
    return None


def tool(name: str, source: str = NATIVE) -> Tool:
    return Tool(name=name, description="", parameters={"type": "object"}, handler=_nothing, source=source)


@pytest.mark.parametrize(
    ("name", "scope"),
    [
        ("list_machines", MACHINES_READ),
        ("local_pc_file_read", MACHINES_READ),
        ("local_pc_file_write", MACHINES_WRITE),
        ("local_pc_file_copy", MACHINES_WRITE),
        ("local_pc_execute_command", MACHINES_SHELL),
        ("local_pc_pipe", MACHINES_SHELL),
        ("list_agents", AGENTS),
        ("answer_approval", AGENTS),
    ],
)
def test_each_native_tool_needs_its_scope(name: str, scope: str) -> None:
    assert tool_scope(tool(name)) == scope


def test_every_command_handle_and_every_unnamed_machine_tool_needs_the_shell() -> None:
    assert COMMAND_HANDLE_TOOL_NAMES <= MACHINE_TOOL_NAMES
    for name in COMMAND_HANDLE_TOOL_NAMES:
        assert tool_scope(tool(name)) == MACHINES_SHELL


def test_a_remote_is_a_remote_whatever_its_name() -> None:
    """A remote may be named ``native``: its functions still need ``mcp:remotes``."""
    for remotename in ("native", "weather", "list_agents"):
        remote = tool(f"remote__{remotename}__f", source=remotename)
        assert tool_scope(remote) == REMOTES
        assert not allows(frozenset([AGENTS]), remote)
        assert allows(frozenset([REMOTES]), remote)


def test_mcp_allows_everything_and_a_header_token_is_unrestricted() -> None:
    assert allows(frozenset(["mcp"]), tool("local_pc_execute_command"))
    assert allows(None, tool("local_pc_execute_command"))
    assert not allows(frozenset([MACHINES_READ]), tool("local_pc_execute_command"))


def test_granted_keeps_mcp_alone_or_the_known_narrow_scopes_in_order() -> None:
    assert granted(["mcp:remotes", "mcp"]) == ["mcp"]
    assert granted(["mcp:machines:shell", "bogus", "mcp:agents"]) == [AGENTS, MACHINES_SHELL]
    assert granted([]) == []
