"""The scope of an agent token on the MCP tools (docs/agents.md#agent-tokens; the README's
table "What an agent token may do").

One table with a row for every MCP tool an agent token is offered: a row says what the
agent token gets and the test checks it. The agent ``me`` (alice's) calls; ``sibling`` is
an agent it did not launch (the ``world`` fixture of tests/agents/conftest.py). The table
is checked against the tools that exist, so a new tool without a row fails here. The REST
routes' table is test_agent_token_scope_rest.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from asgiref.sync import async_to_sync

from core.errors import DispatchError
from dispatch.mcp.tools import tools_for
from tests.agents.conftest import ALLOWED, FORBIDDEN, MY_APPROVAL, SIBLING_APPROVAL, World

pytestmark = pytest.mark.django_db(transaction=True)

MACHINE_OP_TOOLS = {
    "local_pc_file_read": {"path": "/tmp/x"},
    "local_pc_file_write": {"path": "/tmp/x", "content": "x"},
    "local_pc_file_list": {"path": "/tmp"},
    "local_pc_file_stat": {"path": "/tmp"},
    "local_pc_file_delete": {"path": "/tmp/x"},
    "local_pc_file_move": {"src": "/tmp/x", "dst": "/tmp/y"},
    "local_pc_execute_command": {"argv": ["true"]},
    "local_pc_pipe": {"source": {"machine": "a", "argv": ["true"]}, "destination": {"machine": "b", "argv": ["cat"]}},
    "local_pc_command_start": {"argv": ["true"]},
    "local_pc_file_copy": {
        "source_machine": "a",
        "source_path": "/a",
        "destination_machine": "b",
        "destination_path": "/b",
    },
}


@dataclass(frozen=True)
class ToolRow:
    tool: str
    arguments: Callable[[World], dict[str, Any]]
    outcome: str  # ALLOWED: no PERMISSION_DENIED (the tool's own answer or error); FORBIDDEN: refused
    code: str | None = None  # allowed: the DispatchError code it ends with (None: a result); forbidden: the message


def _tool_rows() -> list[ToolRow]:
    rows = [
        ToolRow("dispatch_event", lambda w: {"type": "working", "message": "on it"}, ALLOWED),
        ToolRow("list_agents", lambda w: {}, ALLOWED),
        ToolRow("get_agent_history", lambda w: {"agent_id": w.sibling.pk, "limit": 5}, ALLOWED),
        ToolRow("dispatch_launch_agent", lambda w: {"name": "kid", "prompt": "go", "type": "expert"}, ALLOWED),
        ToolRow(
            "dispatch_launch_agent",
            lambda w: {"name": "kid2", "prompt": "go", "type": "expert", "full_access": True},
            FORBIDDEN,
            "is not full-access, so it cannot launch a full-access agent",
        ),
        ToolRow("dispatch_send_message", lambda w: {"target": w.sibling.pk, "message": "hi"}, ALLOWED),
        ToolRow("message_status", lambda w: {"message_id": w.message.pk}, ALLOWED),
        ToolRow("list_approvals", lambda w: {}, ALLOWED),
        ToolRow(
            "answer_approval",
            lambda w: {"approval_id": SIBLING_APPROVAL, "decision": "deny", "message": "not now"},
            ALLOWED,
        ),
        ToolRow(
            "answer_approval",
            lambda w: {"approval_id": MY_APPROVAL, "decision": "allow_once"},
            FORBIDDEN,
            "cannot answer its own approval",
        ),
        ToolRow("list_machines", lambda w: {}, ALLOWED),
        ToolRow("list_machines", lambda w: {"session_id": w.me.pk}, ALLOWED),
        ToolRow("list_machines", lambda w: {"session_id": "default"}, FORBIDDEN),
    ]
    for name in ("local_pc_command_read", "local_pc_command_wait", "local_pc_command_cancel"):
        arguments = {"command_id": "cmd_" + "0" * 32}
        rows.append(ToolRow(name, lambda w, a=arguments: dict(a), ALLOWED, "NOT_FOUND"))
        rows.append(ToolRow(name, lambda w, a=arguments: {**a, "session_id": w.sibling.pk}, FORBIDDEN))
    for name, arguments in MACHINE_OP_TOOLS.items():
        rows.append(ToolRow(name, lambda w, a=arguments: dict(a), ALLOWED, "MACHINE_NOT_ATTACHED"))
        rows.append(ToolRow(name, lambda w, a=arguments: {**a, "session_id": w.sibling.pk}, FORBIDDEN))
    return rows


TOOLS = _tool_rows()


def test_the_tool_table_has_a_row_for_every_tool_an_agent_token_is_offered(world: World) -> None:
    offered = async_to_sync(tools_for)(user=world.owner, caller_agent=world.me)
    assert set(offered) == {row.tool for row in TOOLS}


@pytest.mark.parametrize("row", TOOLS, ids=[f"{row.tool} {row.outcome} {i}" for i, row in enumerate(TOOLS)])
def test_an_agent_token_gets_what_its_scope_says_from_every_mcp_tool(world: World, row: ToolRow, settings: Any) -> None:
    settings.DEFAULT_CWD = "/tmp"

    async def call() -> Any:
        tools = await tools_for(user=world.owner, caller_agent=world.me)
        return await asyncio.wait_for(tools[row.tool](row.arguments(world)), 10)

    try:
        value, code, message = async_to_sync(call)(), None, ""
    except DispatchError as exc:
        value, code, message = None, exc.code, exc.message
    if row.outcome == FORBIDDEN:
        assert code == "PERMISSION_DENIED" and (row.code or "acts only in its own session") in message, (code, message)
    else:
        assert code == row.code, (code, message, value)


def test_a_remote_function_is_offered_to_an_agent_token_as_to_its_owner(world: World) -> None:
    # Remote functions are the last kind of MCP tool: an agent token gets its owner's.
    from remotes.protocol import FunctionSpec
    from remotes.services import remote_connect, ws_session_open

    session = ws_session_open(user=world.owner, channel_name="test.remote!x", auth_method="token")
    remote_connect(
        user=world.owner,
        ws_session_id=session.pk,
        channel_name="test.remote!x",
        remotename="weather",
        tools=[FunctionSpec(name="get_forecast")],
    )
    offered = async_to_sync(tools_for)(user=world.owner, caller_agent=world.me)
    users = async_to_sync(tools_for)(user=world.owner)
    remote_tools = set(offered) - {row.tool for row in TOOLS}
    assert remote_tools == set(users) - set(MACHINE_OP_TOOLS) - {row.tool for row in TOOLS} != set()
