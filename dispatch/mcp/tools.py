"""The tools an MCP caller sees, computed for each request (docs/mcp.md#tools).

Every caller gets ``list_machines`` and the ``local_pc_*`` tools (via
``machines.tools.machine_tools``), the agent tools (``agents.tools``:
``list_agents``, ``get_agent_history``, ``dispatch_launch_agent``,
``dispatch_send_message``, ``message_status``, and ``dispatch_event`` for an agent token
only) and one tool per function of each of the user's connected remotes, named by
``core.tools.remote_tool_names``; native tools first, the
first tool of a name wins (``agents.tools.tool_set``, the one builder). With an agent token
the agent is the caller: its id is the default machine session and the audit's caller,
and its launches record it as ``launched_by``. Nothing is kept between requests: the
remotes registry and the attached machines are read again each time, because tool
descriptions are the only place a model learns what exists.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from agents.models import Agent
from agents.tools import tool_set
from core.tools import Tool, ToolHandler, remote_tool_names
from machines.tools import MACHINE_TOOL_NAMES
from oauth.scopes import allows as scope_allows
from remotes.selectors import remote_list_for
from remotes.services import remote_call

DEFAULT_SESSION = "default"  # the machine session of a user token that names none (docs/mcp.md#tools)
CALLER = "mcp"  # who asked, in the machine audit (``AuditRecord.caller``)


def _remote_runner(user: User, remotename: str, function: str) -> ToolHandler:
    async def run(arguments: dict[str, Any]) -> Any:
        # remote_call checks the arguments against the function's schema (INVALID_REQUEST).
        return await remote_call(user=user, remotename=remotename, function=function, args=arguments)

    return run


async def remote_tools(*, user: User) -> list[Tool]:
    """One tool per function of each of ``user``'s connected remotes, read from the registry now."""
    entries = await database_sync_to_async(remote_list_for)(user=user)
    names = remote_tool_names([(entry["remotename"], entry["name"]) for entry in entries])
    tools = []
    for entry in entries:
        remotename, function = entry["remotename"], entry["name"]
        summary = entry.get("description") or f"The function '{function}'."
        tools.append(
            Tool(
                name=names[(remotename, function)],
                description=f"[remote '{remotename}', function '{function}'] {summary}",
                parameters=entry["parameters"],
                handler=_remote_runner(user, remotename, function),
                source=remotename,
                checked=False,
            )
        )
    return tools


async def tools_for(
    *,
    user: User,
    session_id: str | None = None,
    caller_agent: Agent | None = None,
    name: str | None = None,
    scopes: frozenset[str] | None = None,
    audit_caller: str = CALLER,
) -> dict[str, Tool]:
    """Every tool of an MCP caller, by name: machine tools, agent tools, then remote tools.

    ``caller_agent`` is the agent of an agent token (``None`` for a user token).
    ``session_id`` is the machine session the descriptions are computed for (the
    ``session_id`` argument of the call); ``None`` means the caller's own: the agent's id,
    or ``"default"`` for a user token. Names are unique: the first tool
    of a name wins, so native tools shadow remote functions of the same name. ``name``: the
    tool a ``tools/call`` runs; a machine tool's name builds the machine tools only (they
    shadow the rest), without the agent tools' and the remotes' queries. ``scopes``: an
    OAuth token's (docs/mcp.md#oauth-scopes), which keep only the tools they allow;
    ``None`` (a header token) keeps every tool. ``audit_caller``: who the machine audit
    names as the caller (``Caller.audit_caller``).
    """
    machines_only = name is not None and name in MACHINE_TOOL_NAMES
    if scopes is not None:
        everything = await tools_for(
            user=user, session_id=session_id, caller_agent=caller_agent, name=name, audit_caller=audit_caller
        )
        return {tool_name: tool for tool_name, tool in everything.items() if scope_allows(scopes, tool)}
    return await tool_set(
        user=user,
        caller_agent=caller_agent,  # an agent acts only in its own session; a call naming another is refused
        session_id=session_id or DEFAULT_SESSION,
        audit_caller=audit_caller,
        remotes=() if machines_only else await remote_tools(user=user),
        machines_only=machines_only,
    )
