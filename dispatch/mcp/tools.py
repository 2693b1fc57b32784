"""The tools an MCP caller sees, computed for each request (spec/agents.md §6).

Every caller gets ``list_machines`` and the ``local_pc_*`` tools (machines.md §6, via
``machines.tools.machine_tools``), the agent tools (``agents.tools``:
``list_agents``, ``get_agent_history``, ``dispatch_launch_agent``,
``dispatch_send_message``, ``message_status``, and ``dispatch_event`` for an agent token
only) and one tool per function of each of the user's connected remotes, named by
``remote_tool_names`` (sessions-and-remotes.md §2.6); native tools first, the first tool of
a name wins. With an agent token the agent is the caller: its id is the default machine
session and the audit's caller, and its launches record it as ``launched_by``. Nothing
is kept between requests: the remotes registry and the attached machines are read again
each time, because tool descriptions are the only place a model learns what exists.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from agents.models import Agent
from agents.tokens import agent_scope_session
from agents.tools import agent_tools
from machines.tools import machine_tools
from remotes.selectors import remote_list_for
from remotes.services import remote_call

# What model APIs accept as a tool name (§2.6).
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_NAME_MAX = 64
HASH_DIGITS = 6
DEFAULT_SESSION = "default"  # the machine session of a user token that names none (machines.md §4)
CALLER = "mcp"  # who asked, in the machine audit (machines.md §7)

_OUTSIDE_ALPHABET = re.compile(r"[^A-Za-z0-9_-]")

ToolRunner = Callable[[dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class McpTool:
    """One tool as the MCP client sees it: ``input_schema`` is a JSON Schema object.

    ``run(arguments)`` returns the JSON value of the result or raises ``DispatchError``.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    run: ToolRunner


def remote_full_name(remotename: str, function: str) -> str:
    """``remote__<remotename>__<function>`` before any sanitising (the hashed form)."""
    return f"remote__{remotename}__{function}"


def _hashed(name: str, full_name: str) -> str:
    """``name`` cut to fit and ended with ``_`` + 6 hex digits of SHA-256(``full_name``)."""
    digest = hashlib.sha256(full_name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_DIGITS]
    return f"{name[: TOOL_NAME_MAX - HASH_DIGITS - 1]}_{digest}"


def tool_name(full_name: str) -> str:
    """The tool name for ``full_name`` (§2.6): characters outside ``[A-Za-z0-9_-]`` become
    ``_``; a name still over 64 characters is cut and ends with ``_`` + 6 hex digits of
    the SHA-256 of the full name. The result always matches ``TOOL_NAME_PATTERN``."""
    name = _OUTSIDE_ALPHABET.sub("_", full_name) or "_"
    return _hashed(name, full_name) if len(name) > TOOL_NAME_MAX else name


def remote_tool_names(functions: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The tool name of each ``(remotename, function)`` pair (§2.6).

    Each gets ``tool_name(remote__<remotename>__<function>)``; pairs whose names collide
    (``a.b`` and ``a/b`` both give ``a_b``) all get the hash suffix instead, computed from
    their distinct full names, so every pair keeps a name of its own.
    """
    plain = {pair: tool_name(remote_full_name(*pair)) for pair in functions}
    taken = Counter(plain.values())
    names: dict[tuple[str, str], str] = {}
    for pair, name in plain.items():
        if taken[name] > 1:
            name = _hashed(_OUTSIDE_ALPHABET.sub("_", remote_full_name(*pair)), remote_full_name(*pair))
        names[pair] = name
    return names


def _remote_runner(user: User, remotename: str, function: str) -> ToolRunner:
    async def run(arguments: dict[str, Any]) -> Any:
        # remote_call checks the arguments against the function's schema (INVALID_REQUEST).
        return await remote_call(user=user, remotename=remotename, function=function, args=arguments)

    return run


async def remote_tools(*, user: User) -> list[McpTool]:
    """One tool per function of each of ``user``'s connected remotes, read from the registry now."""
    entries = await database_sync_to_async(remote_list_for)(user=user)
    names = remote_tool_names([(entry["remotename"], entry["name"]) for entry in entries])
    tools = []
    for entry in entries:
        remotename, function = entry["remotename"], entry["name"]
        summary = entry.get("description") or f"The function '{function}'."
        tools.append(
            McpTool(
                name=names[(remotename, function)],
                description=f"[remote '{remotename}', function '{function}'] {summary}",
                input_schema=entry["parameters"],
                run=_remote_runner(user, remotename, function),
            )
        )
    return tools


async def tools_for(
    *, user: User, session_id: str | None = None, caller_agent: Agent | None = None
) -> dict[str, McpTool]:
    """Every tool of an MCP caller, by name: machine tools, agent tools, then remote tools.

    ``caller_agent`` is the agent of an agent token (``None`` for a user token).
    ``session_id`` is the machine session the descriptions are computed for (the
    ``session_id`` argument of the call); ``None`` means the caller's own: the agent's id,
    or ``"default"`` for a user token (machines.md §4). Names are unique: the first tool
    of a name wins, so native tools shadow remote functions of the same name.
    """
    own_session = caller_agent.pk if caller_agent is not None else DEFAULT_SESSION
    audit_caller = caller_agent.pk if caller_agent is not None else CALLER
    guard = partial(agent_scope_session, caller_agent) if caller_agent is not None else None
    if caller_agent is not None:
        session_id = own_session  # an agent acts only in its own session; a call naming another is refused
    tools: dict[str, McpTool] = {}
    for tool in await machine_tools(
        user=user, session_id=session_id or own_session, caller=audit_caller, session_guard=guard
    ):
        tools.setdefault(tool.name, McpTool(tool.name, tool.description, tool.parameters, tool))
    for tool in agent_tools(user=user, caller_agent=caller_agent):
        tools.setdefault(tool.name, McpTool(tool.name, tool.description, tool.parameters, tool))
    for remote in await remote_tools(user=user):
        tools.setdefault(remote.name, remote)
    return tools
