"""The SDK's low-level ``Server`` behind ``/mcp`` (docs/mcp.md).

Tool lists differ per user and per request, so the handlers compute the catalogue
(``dispatch.mcp.tools.tools_for``) on every ``tools/list`` and ``tools/call``. The
caller (``Caller``: the user, and the agent of an agent token) is what ``dispatch.mcp.app``
authenticated and put in the ASGI scope.

A ``tools/call`` runs with ``core.tools.TOOL_CALL`` set
(docs/live-operations.md#mcp-progress-and-cancellation): ``progress`` sends
``notifications/progress`` on the call's own response stream when the client sent a
``progressToken`` (else ``None``: nobody listens), and ``call_key`` names the call — by
token, MCP session (when the client has one) and request id — so that a
``notifications/cancelled`` POST reaching any process cancels its operations
(``dispatch.mcp.app``).

Errors (docs/mcp.md#results-and-errors): a ``DispatchError`` while running a tool, and
arguments that fail the tool's schema, are tool results with ``isError: true`` whose text
starts with the code (``MACHINE_NOT_ATTACHED: …``, ``INVALID_REQUEST: …``); an unknown
tool is a JSON-RPC error ``-32602`` (MCP 2025-11-25, "Error Handling").

``notifications/tools/list_changed`` (docs/mcp.md#tool-list-changes): ``tools.listChanged:
true`` at every protocol version (``DispatchServer``). At 2026-07-28 a client opens
``subscriptions/listen`` (the SDK's ``ListenHandler``, SSE even in JSON-response mode); at
2025-11-25 it opens ``GET /mcp`` (``dispatch.mcp.events``). Both are fed by the user's relay
(``dispatch.mcp.relay``) of the channel-layer group ``tools_group(user_id)``
(``core.tool_changes``), which the services ring on commit whenever one of the user's
remotes connects or disconnects, a machine attaches or detaches, a ws session closes or a
dead process is reaped; both are rows of ``dispatch.mcp.streams`` (the per-user limit, the
end on revocation or shutdown).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import mcp_types as types
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.utils import timezone
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import ListenHandler
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS

from agents.models import Agent, AgentEvent
from agents.services import agent_event_record
from core import wire
from core.errors import DispatchError, unavailable_error
from core.tools import TOOL_CALL, ToolCall
from dispatch.mcp.relay import user_feed
from dispatch.mcp.sessions import session_tag
from dispatch.mcp.streams import stream_close, stream_open
from dispatch.mcp.tools import CALLER, tools_for
from oauth.scopes import allows as scope_allows
from oauth.scopes import tool_scope

logger = logging.getLogger(__name__)

SERVER_NAME = "dispatch"
CALLER_SCOPE_KEY = "dispatch.caller"  # where dispatch.mcp.app puts the authenticated caller
TOKEN_SCOPE_KEY = "dispatch.token"  # ... and the bearer token it came with (for stream rows)
SESSION_SCOPE_KEY = "dispatch.mcp_session"  # ... and the verified Mcp-Session-Id, when one was sent
PROGRESS_SEND_SECONDS = 5.0  # a progress notification not written by then: the client is gone


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``user``, and ``agent`` when the bearer token is an agent token
    (the agent is then the caller of the tools, docs/mcp.md#tools). An OAuth access token
    (``/mcp/oauth``, docs/mcp.md#oauth) carries its ``scopes``, which limit the tools it
    lists and calls (``oauth.scopes``), its row id ``oauth_token_id`` and its application's
    ``oauth_application_id`` and claimed ``oauth_application_name``; a header token has none
    (``scopes`` ``None``: every tool)."""

    user: User
    agent: Agent | None = None
    scopes: frozenset[str] | None = None
    oauth_token_id: int | None = None
    oauth_application_id: int | None = None
    oauth_application_name: str = ""

    @property
    def audit_caller(self) -> str:
        """Who asked, in the machine audit (the Machines page's *Caller*): ``"mcp"``, or for
        an OAuth token ``"mcp oauth <application id>: <claimed name>"`` (the id tells two
        applications of one claimed name apart)."""
        if self.oauth_application_id is None:
            return CALLER
        return f"{CALLER} oauth {self.oauth_application_id}: {self.oauth_application_name[:80]}"


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


def call_key(raw_token: str, request_id: str | int, session_id: str | None = None) -> str:
    """The ``ToolCall.call_key`` of an MCP ``tools/call``: ``"mcp:" + sha256(token)[:32] +
    ":" + json.dumps(request_id)`` — the JSON-RPC id as JSON, so ``1`` and ``"1"`` differ
    as they do on the wire — or, within an MCP session (``session_id``, a verified
    ``Mcp-Session-Id``), ``"mcp:" + sha256(token)[:32] + ":s" + session_tag + ":" +
    json.dumps(request_id)``: request ids are unique only within a session
    (docs/mcp.md#sessions). ``notifications/cancelled`` names the call by the same triple."""
    digest = hashlib.sha256(raw_token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    scope = f"{digest}:s{session_tag(session_id)}" if session_id else digest
    return f"mcp:{scope}:{json.dumps(request_id)}"


def tool_call_of(ctx: ServerRequestContext[Any, Any]) -> ToolCall:
    """The ``ToolCall`` of the ``tools/call`` behind ``ctx``: a progress sink when the
    client asked for progress (``_meta.progressToken``), and its ``call_key``."""
    request_id = ctx.request_id
    key = call_key(token_of(ctx), request_id, session_of(ctx)) if isinstance(request_id, str | int) else None
    if progress_token_from_params(ctx.params) is None:
        return ToolCall(progress=None, call_key=key)

    gone = False

    async def progress(done: float, total: float | None, message: str | None) -> None:
        # A client that went away leaves the request's stream unread: a report must never
        # hold the call (and its command) up, so one that cannot go within
        # PROGRESS_SEND_SECONDS ends the reports of this call.
        nonlocal gone
        if gone:
            return
        try:
            async with asyncio.timeout(PROGRESS_SEND_SECONDS):
                await ctx.session.report_progress(done, total, message)
        except Exception as exc:
            gone = True
            logger.info("MCP progress for request %s not sent (%r); no more reports for it", request_id, exc)

    return ToolCall(progress=progress, call_key=key)


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


def uncarriable(arguments: dict[str, Any]) -> str | None:
    """What in a tool's ``arguments`` the channel layer cannot carry, or ``None``
    (docs/mcp.md#results-and-errors): :func:`core.wire.problem` (integers outside the signed
    64-bit range, NaN/Infinity, lone surrogates in strings or keys, nesting over
    ``wire.MAX_DEPTH``), its path under ``arguments``. The SDK's JSON parsers let most of
    these through, so ``call_tool`` checks before a tool runs; the answer names the field,
    e.g. ``arguments.limit: integer 2361183241434822606848 is outside the signed 64-bit
    range``.
    """
    return wire.problem(arguments, root=("arguments",))


async def list_tools(
    ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    """``tools/list``: the caller's tools now, descriptions computed for the caller's own
    machine session (the agent's id for an agent token, ``"default"`` for a user token)."""
    caller = caller_of(ctx)
    tools = await tools_for(user=caller.user, caller_agent=caller.agent, scopes=caller.scopes)
    return types.ListToolsResult(
        tools=[
            types.Tool(name=tool.name, description=tool.description, input_schema=tool.parameters)
            for tool in tools.values()
        ]
    )


async def call_tool(ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> types.CallToolResult:
    """``tools/call``: find the tool among the caller's tools now and run it.

    Each call is one INFO line (``call_noted``) and, for an agent's token, one ``system``
    event on that agent's timeline (docs/agents.md#hooks). Raises
    ``MCPError(-32602)`` for a tool the caller does not have.
    """
    arguments = params.arguments or {}
    session_id = arguments.get("session_id")
    caller = caller_of(ctx)
    started_at, started = timezone.now(), time.monotonic()
    outcome = "cancelled"  # what a call the client gave up on ends as
    try:
        try:
            tools = await tools_for(
                user=caller.user,
                session_id=session_id if isinstance(session_id, str) and session_id else None,
                caller_agent=caller.agent,
                name=params.name,
                audit_caller=caller.audit_caller,
            )
        except Exception as exc:
            mapped = unavailable_error(exc)
            if mapped is None:
                raise
            outcome = f"error {mapped.code}"
            return error_result(mapped.code, mapped.message)
        tool = tools.get(params.name)
        if tool is not None and not scope_allows(caller.scopes, tool):
            outcome = "error FORBIDDEN"
            return error_result(
                "FORBIDDEN",
                f"the tool '{params.name}' needs the scope '{tool_scope(tool)}', which this connection was not "
                f"granted (granted: {' '.join(sorted(caller.scopes or ())) or 'none'})",
            )
        if tool is None:
            outcome = "unknown tool"
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown tool: {params.name[:200]}")
        problem = uncarriable(arguments)
        if problem is not None:
            outcome = "error INVALID_REQUEST"
            return error_result("INVALID_REQUEST", problem)
        token = TOOL_CALL.set(tool_call_of(ctx))
        try:
            value = await _detached(tool(arguments))
        except DispatchError as exc:
            outcome = f"error {exc.code}"
            return error_result(exc.code, exc.message)
        except Exception as exc:
            # Redis or the database down (frozen: past its deadline) is the outage's 503, no traceback.
            mapped = unavailable_error(exc)
            if mapped is not None:
                outcome = f"error {mapped.code}"
                return error_result(mapped.code, mapped.message)
            outcome = "error INTERNAL_ERROR"
            logger.exception("MCP tool %s failed", params.name)
            return error_result("INTERNAL_ERROR", f"the tool '{params.name}' failed unexpectedly")
        finally:
            TOOL_CALL.reset(token)
        outcome = "ok"
        return tool_result(value)
    finally:
        call_noted(caller=caller, tool=params.name, outcome=outcome, started_at=started_at, started=started)


_noting: set[asyncio.Future[Any]] = set()


def call_noted(*, caller: Caller, tool: str, outcome: str, started_at: datetime, started: float) -> None:
    """Note one ``tools/call``: an INFO line ``MCP tool <name> by agent <id>: <outcome> in
    <ms> ms`` (``by user <id>`` for a user's token) and, for an agent, a ``system`` event
    "MCP tool <name>" with ``metadata {tool, ok, ms}``, dated when the call began and not
    made the agent's latest event (docs/agents.md#hooks). ``outcome``: ``ok``, ``error <CODE>``,
    ``unknown tool`` or ``cancelled``. The arguments are never logged: they may hold
    anything the model wrote.

    Never waits and never raises: the event is written by a task of its own (a cancelled
    call's handler can await nothing), whose failure is only logged.
    """
    ms = int((time.monotonic() - started) * 1000)
    who = f"agent {caller.agent.pk}" if caller.agent is not None else f"user {caller.user.pk}"
    logger.info("MCP tool %s by %s: %s in %d ms", tool[:200], who, outcome, ms)
    if caller.agent is None:
        return
    note = asyncio.ensure_future(
        database_sync_to_async(_call_event)(caller.agent, tool[:200], outcome == "ok", ms, started_at)
    )
    _noting.add(note)
    note.add_done_callback(_noting.discard)


def _call_event(agent: Agent, tool: str, ok: bool, ms: int, started_at: datetime) -> None:
    try:
        agent_event_record(
            agent=agent,
            type=AgentEvent.Type.SYSTEM,
            message=f"MCP tool {tool}",
            metadata={"tool": tool, "ok": ok, "ms": ms},
            created_at=started_at,
            latest=False,
        )
    except Exception:
        logger.exception("could not record agent %s's MCP call of %s", agent.pk, tool)


_detached_calls: set[asyncio.Future[Any]] = set()


async def _detached(call: Coroutine[Any, Any, Any]) -> Any:
    """Run a tool ``call`` as a task of its own and wait for it.

    The SDK runs a handler inside an anyio cancel scope, and anyio cancellation is
    level-triggered: once a client is gone and the scope is cancelled, every ``await`` in
    the handler fails at once, so a tool's own cleanup (cancelling its command on the
    machine, deleting its in-flight row) could not run. Here the handler's cancellation
    reaches the task as one ordinary ``CancelledError``, and the task cleans up on its own.
    """
    task = asyncio.ensure_future(call)
    _detached_calls.add(task)
    task.add_done_callback(_detached_calls.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        raise


# --- tools/list_changed over subscriptions/listen (2026-07-28) ------------------------------------


def token_of(ctx: ServerRequestContext[Any, Any]) -> str:
    """The bearer token of the HTTP request behind ``ctx`` (put in the scope by ``app``)."""
    request = ctx.request
    token = request.scope.get(TOKEN_SCOPE_KEY) if request is not None else None
    return token if isinstance(token, str) else ""


def session_of(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The verified ``Mcp-Session-Id`` of the HTTP request behind ``ctx`` (put in the scope
    by ``app``), or ``None`` for a request without one."""
    request = ctx.request
    session_id = request.scope.get(SESSION_SCOPE_KEY) if request is not None else None
    return session_id if isinstance(session_id, str) else None


async def subscriptions_listen(
    ctx: ServerRequestContext[Any, Any], params: types.SubscriptionsListenRequestParams
) -> types.SubscriptionsListenResult:
    """``subscriptions/listen`` (2026-07-28): a stream of ``notifications/tools/list_changed``
    for the caller's user, open until the client goes away, its credential stops being
    valid or the process shuts down (``dispatch.mcp.streams``; it counts towards the
    user's ``STREAMS_PER_USER``).

    Raises ``MCPError`` (``INTERNAL_ERROR``, as the SDK's own limit does) past the limit.
    """
    caller = caller_of(ctx)
    try:
        stream = await stream_open(user=caller.user, raw_token=token_of(ctx), oauth_token_id=caller.oauth_token_id)
    except DispatchError as exc:
        raise MCPError(code=INTERNAL_ERROR, message=f"{exc.code}: {exc.message}") from None
    try:
        async with user_feed(stream.user_id).held() as bus:
            # One handler per stream, so ending this stream ends no other (close() is graceful:
            # the client gets the listen result, then re-listens).
            handler = ListenHandler(bus, max_subscriptions=1)

            async def end_when_told() -> None:
                await stream.ended.wait()
                handler.close()

            watcher = asyncio.create_task(end_when_told())
            try:
                return await handler(ctx, params)
            finally:
                watcher.cancel()
    finally:
        await stream_close(stream)


class DispatchServer(Server[Any]):
    """The low-level ``Server`` advertising ``tools.listChanged: true`` at every protocol
    version (docs/mcp.md#tool-list-changes): at 2026-07-28 the SDK derives it from the
    ``subscriptions/listen`` handler; before that the SDK takes it from
    ``NotificationOptions``, and Dispatch delivers it on the ``GET /mcp`` stream."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True), experimental_capabilities, extensions
        )


def build_server() -> Server[Any]:
    """A new low-level ``Server`` answering ``tools/list`` and ``tools/call``.

    ``get_tool_input_schema`` answers ``None`` for every tool: no Dispatch schema declares
    ``Mcp-Param-*`` headers, and without it the SDK would list every tool again before
    each 2026-07-28 ``tools/call`` to look for such declarations.
    """
    return DispatchServer(
        SERVER_NAME,
        version="1",
        instructions=(
            "Dispatch: your machines (local_pc_* tools), your agents (list_agents, dispatch_launch_agent, "
            "dispatch_send_message ...) and your connected remotes (remote__* tools). An OAuth connection "
            "has the ones its scopes allow: tools/list shows them."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_subscriptions_listen=subscriptions_listen,
        get_tool_input_schema=lambda name: None,
    )
