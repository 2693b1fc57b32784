"""The SDK's low-level ``Server`` behind ``/mcp`` (spec/agents.md §6).

Tool lists differ per user and per request, so the handlers compute the catalogue
(``dispatch.mcp.tools.tools_for``) on every ``tools/list`` and ``tools/call``. The
caller (``Caller``: the user, and the agent of an agent token) is what ``dispatch.mcp.app``
authenticated and put in the ASGI scope.

Errors (spec/overview.md "Error shapes"): a ``DispatchError`` while running a tool, and
arguments that fail the tool's schema, are tool results with ``isError: true`` whose text
starts with the code (``MACHINE_NOT_ATTACHED: …``, ``INVALID_REQUEST: …``); an unknown
tool is a JSON-RPC error ``-32602`` (MCP 2025-11-25, "Error Handling").

``notifications/tools/list_changed`` (spec/agents.md §6): the server cannot push anything
at protocol versions before 2026-07-28 (stateless, no standing stream), so there it
advertises ``tools.listChanged: false`` and the per-request descriptions are the truth. At
2026-07-28 a client opens ``subscriptions/listen`` (the SDK's ``ListenHandler``, SSE even
in JSON-response mode) and the server advertises ``tools.listChanged: true``: each
user's listen streams in a process share one bus fed by the channel-layer group
``tools_group(user_id)`` (``dispatch.tool_changes``), which the services ring on commit
whenever one of the user's remotes connects or disconnects, a machine attaches or
detaches, a ws session closes or a dead process is reaped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from channels.layers import get_channel_layer
from django.contrib.auth.models import User
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from dispatch import wire
from dispatch.errors import DispatchError
from dispatch.mcp.tools import tools_for
from dispatch.models import Agent
from dispatch.tool_changes import TOOLS_CHANGED_MESSAGE, tools_group

logger = logging.getLogger(__name__)

SERVER_NAME = "dispatch"
CALLER_SCOPE_KEY = "dispatch.caller"  # where dispatch.mcp.app puts the authenticated caller


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``user``, and ``agent`` when the bearer token is an agent token
    (the agent is then the caller of the tools, spec/agents.md §6)."""

    user: User
    agent: Agent | None = None


def caller_of(ctx: ServerRequestContext[Any, Any]) -> Caller:
    """The authenticated caller of the HTTP request behind ``ctx``.

    Raises ``PermissionError`` when there is none: every request reaching the server
    passed ``dispatch.mcp.app``'s authentication, so a missing caller is a bug.
    """
    request = ctx.request
    caller = request.scope.get(CALLER_SCOPE_KEY) if request is not None else None
    if not isinstance(caller, Caller) or not isinstance(caller.user, User):
        raise PermissionError("MCP request without an authenticated caller")
    return caller


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
    """``tools/list``: the caller's tools now, descriptions computed for the caller's own
    machine session (the agent's id for an agent token, ``"default"`` for a user token)."""
    caller = caller_of(ctx)
    tools = await tools_for(user=caller.user, caller_agent=caller.agent)
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
    caller = caller_of(ctx)
    tools = await tools_for(
        user=caller.user,
        session_id=session_id if isinstance(session_id, str) and session_id else None,
        caller_agent=caller.agent,
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


# --- tools/list_changed over subscriptions/listen (2026-07-28) ------------------------------------

LISTEN_MAX_PER_USER = 64  # concurrent listen streams of one user in one process
FEED_RETRY_SECONDS = 1.0
GROUP_REJOIN_SECONDS = 3600.0


class _UserFeed:
    """One user's listen streams in this process: a bus, the SDK's ``ListenHandler`` on it,
    and a task relaying the channel-layer group ``tools_group(user_id)`` onto the bus while
    at least one stream is open."""

    def __init__(self, user_id: int) -> None:
        self.user_id = user_id
        self.loop = asyncio.get_running_loop()
        self.bus = InMemorySubscriptionBus()
        self.handler = ListenHandler(self.bus, max_subscriptions=LISTEN_MAX_PER_USER)
        self.streams = 0
        self.joined: asyncio.Future[None] = self.loop.create_future()
        self.task: asyncio.Task[None] | None = None

    async def listen(
        self, ctx: ServerRequestContext[Any, Any], params: types.SubscriptionsListenRequestParams
    ) -> types.SubscriptionsListenResult:
        """Serve one listen stream; the relay is in the group before the stream is acknowledged."""
        self.streams += 1
        try:
            if self.task is None or self.task.done():
                self.joined = self.loop.create_future()
                self.task = self.loop.create_task(self._relay())
            await asyncio.shield(self.joined)
            return await self.handler(ctx, params)
        finally:
            self.streams -= 1
            if self.streams == 0:
                _feeds.pop(self.user_id, None)
                if self.task is not None:
                    self.task.cancel()

    async def _relay(self) -> None:
        layer = get_channel_layer()
        group = tools_group(self.user_id)
        while True:
            channel = None
            refresher = None
            try:
                channel = await layer.new_channel()
                await layer.group_add(group, channel)
                # Group memberships expire (channels_redis: a day): rejoin while streams are open.
                refresher = asyncio.create_task(self._rejoin(layer, group, channel))
                if not self.joined.done():
                    self.joined.set_result(None)
                while True:
                    message = await layer.receive(channel)
                    if message.get("type") == TOOLS_CHANGED_MESSAGE:
                        await self.bus.publish(ToolsListChanged())
            except asyncio.CancelledError:
                if channel is not None:
                    await asyncio.shield(self._leave(layer, group, channel, refresher))
                raise
            except Exception:
                logger.exception("the tool-change relay of user %s failed; retrying", self.user_id)
                if channel is not None:
                    await self._leave(layer, group, channel, refresher)
                if not self.joined.done():
                    self.joined.set_result(None)  # serve the stream; events may come once the layer is back
                await asyncio.sleep(FEED_RETRY_SECONDS)

    @staticmethod
    async def _rejoin(layer: Any, group: str, channel: str) -> None:
        while True:
            await asyncio.sleep(GROUP_REJOIN_SECONDS)
            try:
                await layer.group_add(group, channel)
            except Exception:
                logger.warning("could not renew the membership of %s in %s", channel, group, exc_info=True)

    @staticmethod
    async def _leave(layer: Any, group: str, channel: str, refresher: asyncio.Task[None] | None) -> None:
        if refresher is not None:
            refresher.cancel()
        try:
            await layer.group_discard(group, channel)
        except Exception:
            logger.warning("could not leave %s", group, exc_info=True)


_feeds: dict[int, _UserFeed] = {}


async def subscriptions_listen(
    ctx: ServerRequestContext[Any, Any], params: types.SubscriptionsListenRequestParams
) -> types.SubscriptionsListenResult:
    """``subscriptions/listen`` (2026-07-28): a stream of ``notifications/tools/list_changed``
    for the caller's user, open until the client goes away."""
    user_id = caller_of(ctx).user.pk
    loop = asyncio.get_running_loop()
    feed = _feeds.get(user_id)
    if feed is None or feed.loop is not loop:
        feed = _feeds[user_id] = _UserFeed(user_id)
    return await feed.listen(ctx, params)


def build_server() -> Server[Any]:
    """A new low-level ``Server`` answering ``tools/list`` and ``tools/call``.

    ``get_tool_input_schema`` answers ``None`` for every tool: no Dispatch schema declares
    ``Mcp-Param-*`` headers, and without it the SDK would list every tool again before
    each 2026-07-28 ``tools/call`` to look for such declarations.
    """
    return Server(
        SERVER_NAME,
        version="1",
        instructions=(
            "Dispatch: your machines (local_pc_* tools), your agents (list_agents, dispatch_launch_agent, "
            "dispatch_send_message ...) and your connected remotes (remote__* tools)."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_subscriptions_listen=subscriptions_listen,
        get_tool_input_schema=lambda name: None,
    )
