"""The SDK's low-level ``Server`` behind ``/mcp`` (spec/agents.md §6).

Tool lists differ per user and per request, so the handlers compute the catalogue
(``dispatch.mcp.tools.tools_for``) on every ``tools/list`` and ``tools/call``. The
caller is the Django user ``dispatch.mcp.app`` authenticated and put in the ASGI scope.

Errors (spec/overview.md "Error shapes"): a ``DispatchError`` while running a tool, and
arguments that fail the tool's schema, are tool results with ``isError: true`` whose text
starts with the code (``MACHINE_NOT_ATTACHED: …``, ``INVALID_REQUEST: …``); an unknown
tool is a JSON-RPC error ``-32602`` (MCP 2025-11-25, "Error Handling").
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mcp_types as types
from django.contrib.auth.models import User
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from dispatch import wire
from dispatch.errors import DispatchError
from dispatch.mcp.tools import DEFAULT_SESSION, tools_for

logger = logging.getLogger(__name__)

SERVER_NAME = "dispatch"
USER_SCOPE_KEY = "dispatch.user"  # where dispatch.mcp.app puts the authenticated caller


def caller_of(ctx: ServerRequestContext[Any, Any]) -> User:
    """The authenticated user of the HTTP request behind ``ctx``.

    Raises ``PermissionError`` when there is none: every request reaching the server
    passed ``dispatch.mcp.app``'s authentication, so a missing user is a bug.
    """
    request = ctx.request
    user = request.scope.get(USER_SCOPE_KEY) if request is not None else None
    if not isinstance(user, User):
        raise PermissionError("MCP request without an authenticated caller")
    return user


def tool_result(value: Any) -> types.CallToolResult:
    """A successful result: the value as JSON text, and as ``structuredContent`` when it is
    an object (protocol versions before 2026-07-28 allow only objects there)."""
    text = json.dumps(value, ensure_ascii=False)
    if not wire.encodable(text):  # a lone surrogate from a remote: keep the escape
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(value))])
    structured = value if isinstance(value, dict) else None
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)


def error_result(code: str, message: str) -> types.CallToolResult:
    """An ``isError`` result whose text starts with the stable code word."""
    return types.CallToolResult(content=[types.TextContent(text=f"{code}: {message}")], is_error=True)


async def list_tools(
    ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    """``tools/list``: the caller's tools now, descriptions computed for the default session."""
    tools = await tools_for(user=caller_of(ctx), session_id=DEFAULT_SESSION)
    return types.ListToolsResult(
        tools=[
            types.Tool(name=tool.name, description=tool.description, input_schema=tool.input_schema)
            for tool in tools.values()
        ]
    )


async def call_tool(ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> types.CallToolResult:
    """``tools/call``: find the tool among the caller's tools now and run it.

    Raises ``MCPError(-32602)`` for a tool the caller does not have.
    """
    arguments = params.arguments or {}
    session_id = arguments.get("session_id")
    tools = await tools_for(
        user=caller_of(ctx), session_id=session_id if isinstance(session_id, str) and session_id else DEFAULT_SESSION
    )
    tool = tools.get(params.name)
    if tool is None:
        raise MCPError(code=INVALID_PARAMS, message=f"Unknown tool: {params.name[:200]}")
    try:
        value = await tool.run(arguments)
    except DispatchError as exc:
        return error_result(exc.code, exc.message)
    except Exception:
        logger.exception("MCP tool %s failed", params.name)
        return error_result("INTERNAL_ERROR", f"the tool '{params.name}' failed unexpectedly")
    return tool_result(value)


def build_server() -> Server[Any]:
    """A new low-level ``Server`` answering ``tools/list`` and ``tools/call``.

    ``get_tool_input_schema`` answers ``None`` for every tool: no Dispatch schema declares
    ``Mcp-Param-*`` headers, and without it the SDK would list every tool again before
    each 2026-07-28 ``tools/call`` to look for such declarations.
    """
    return Server(
        SERVER_NAME,
        version="1",
        instructions="Dispatch: your machines (local_pc_* tools) and your connected remotes (remote__* tools).",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        get_tool_input_schema=lambda name: None,
    )
