"""The agent tools shared by the expert agent and the MCP endpoint (docs/agents.md#agent-tools).

``agent_tools(user=…, caller_agent=…)`` builds, for one caller and one request:

- ``list_agents()`` — the user's non-archived agents;
- ``get_agent_history(agent_id, limit)`` — an agent's earlier runs and latest events;
- ``dispatch_launch_agent(name, prompt, type?, cwd?, location?, child, full_access)``;
- ``dispatch_send_message(target, message)`` and ``message_status(message_id)``;
- ``list_approvals(status?, agent_id?)`` and ``answer_approval(approval_id, decision,
  message?)`` — the permission requests of the caller's agents
  (docs/agents.md#approvals): an agent caller sees and answers those of the other agents of its owner
  (the agents it may message), never its own, and its answer is recorded as its own;
- ``dispatch_event(type, message)`` — only for an agent caller (an agent token), and only
  when ``event_tool`` is true: the expert agent's own steps are recorded by its loop, so it
  does not get this tool.

Each is a ``core.tools.Tool``: ``await tool(arguments)`` validates ``arguments``
against the tool's JSON schema (``InvalidRequest``) and returns a JSON value, or raises
``DispatchError`` (``NOT_FOUND``, ``INVALID_REQUEST``, ``CONFLICT`` …); a refusal is cut
to ``ERROR_MESSAGE_MAX`` characters. Descriptions are computed per call (the launchable
types, the default type, the linked instances). ``tool_set`` puts them together with the
machine tools and a caller's remote tools: the one builder, for MCP
(``dispatch.mcp.tools``) and the expert agent (``agents.expert``). Linked instances are
``peers``' (``peers.remote_launch``, ``peers.selectors``, ``peers.services.outgoing``): the tools
are an edge, above ``peers`` (docs/architecture.md#the-layers).

Threads: ``agent_tools`` is async; short database work runs through
``database_sync_to_async``; launching a CLI agent blocks on tmux subprocesses, so it runs
on a thread of its own (``sync_to_async(thread_sensitive=False)``), which closes the
database connection it opened before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.db import close_old_connections, connection

from agents import approval_selectors, approvals, services
from agents import tool_handlers as handlers
from agents.launching import agent_type_availability, default_launch_type, launch_type_resolve
from agents.models import Agent
from agents.serializers import agent_data
from agents.tokens import agent_scope_session
from core.errors import InvalidRequest
from core.tools import Tool
from machines.audit_note import AUDIT_NOTE
from machines.tools import machine_tools
from peers.remote_launch import launch_at_location, linked_instances_text

T = TypeVar("T")

HISTORY_DEFAULT_LIMIT = 20
HISTORY_MAX_LIMIT = 100
MAX_PROMPT = 200_000
MAX_TARGET = 300
ERROR_MESSAGE_MAX = 500
# Event types an agent reports about itself (docs/agents.md#the-timeline); ``system`` is Dispatch's own.
REPORTED_EVENT_TYPES = ("working", "blocked", "waiting_user", "done", "idle")


def _on_own_thread(function: Callable[..., T]) -> Callable[..., Any]:
    """``function`` run on a new worker thread (not the shared database thread), its database
    connection closed when it is done (a thread-local connection would otherwise leak)."""

    def run(*args: Any) -> T:
        try:
            return function(*args)
        finally:
            connection.close()
            close_old_connections()

    return sync_to_async(run, thread_sensitive=False)


# --- the tools ------------------------------------------------------------------------------------


def _tool(*, name: str, description: str, parameters: dict[str, Any], handler: Any) -> Tool:
    """An agent tool: its refusals stay short (a schema error quoting a 200,000-character
    argument is cut to ``ERROR_MESSAGE_MAX`` characters: it goes back to a model)."""
    return Tool(
        name=name, description=description, parameters=parameters, handler=handler, refusal_max=ERROR_MESSAGE_MAX
    )


@dataclass(frozen=True)
class LaunchChoices:
    """What ``dispatch_launch_agent``'s description says now: the types (all, and which is
    the default, ``None`` when a launch here must name one) and the linked instances
    (``peers.remote_launch.linked_instances_text``)."""

    linked: str
    types: list[str]
    default: str | None
    description: str


def launch_choices(user: User) -> LaunchChoices:
    """The launch tool's choices for ``user`` now (a short query: run it through
    ``database_sync_to_async`` from async code): the types that work here, those that do
    not with why (``launching.agent_type_availability``), and the default type
    (``launching.default_launch_type``) or that ``type`` is required."""
    linked_text = linked_instances_text(user=user)
    listed = agent_type_availability()
    available = [entry.type for entry in listed if entry.available]
    unavailable = [f"{entry.type} ({entry.reason})" for entry in listed if not entry.available]
    default = default_launch_type()
    text = (
        "Launch a new agent here and give it a first prompt. Types available now: "
        + (", ".join(available) or "none")
        + "."
        + (f" Unavailable here: {'; '.join(unavailable)}." if unavailable else "")
        + (
            f" Default type: {default}."
            if default is not None
            else " No default type here: give type (one of the available ones) for a launch here."
        )
        + " 'expert' is Dispatch's built-in tool-calling agent; the others run in tmux. "
        "cwd defaults to the launching agent's directory (else the instance's default directory). "
        "With child (default true) the new agent is your child. "
        + linked_text
        + " Returns the new agent (id, name, type, status ...; for a launch on a linked instance, its shadow "
        "here, with peer and peer_agent_id)."
    )
    return LaunchChoices(linked=linked_text, types=[entry.type for entry in listed], default=default, description=text)


def list_agents_tool(user: User) -> Tool:
    """``list_agents()``: ``user``'s non-archived agents, newest first (``tool_handlers.agents_list``)."""

    async def list_agents(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.agents_list)(user)

    return _tool(
        name="list_agents",
        description="List your agents (not archived), newest first: id, name, type, status, latest event, parent.",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
        handler=list_agents,
    )


def history_tool(user: User, caller_agent: Agent | None) -> Tool:
    """``get_agent_history(agent_id, limit)``: an agent's runs and events within the budget;
    ``agent_id`` defaults to ``caller_agent``."""

    async def get_agent_history(arguments: dict[str, Any]) -> Any:
        agent_id = arguments.get("agent_id") or (caller_agent.pk if caller_agent is not None else None)
        if not agent_id:
            raise InvalidRequest("agent_id is required")
        limit = int(arguments.get("limit", HISTORY_DEFAULT_LIMIT))
        return await database_sync_to_async(handlers.agent_history)(user, agent_id, limit)

    return _tool(
        name="get_agent_history",
        description=(
            "An agent's earlier runs (instruction, output, status) and its latest events, newest first, "
            "cut to a size budget." + (" agent_id defaults to you." if caller_agent is not None else "")
        ),
        parameters={
            "type": "object",
            "properties": {
                "agent_id": {"type": "string", "maxLength": 64, "description": "The agent's id (agt_…)."},
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": HISTORY_MAX_LIMIT,
                    "default": HISTORY_DEFAULT_LIMIT,
                    "description": "At most this many runs and this many events.",
                },
            },
            "required": [] if caller_agent is not None else ["agent_id"],
            "additionalProperties": False,
        },
        handler=get_agent_history,
    )


def launch_tool(user: User, caller_agent: Agent | None, choices: LaunchChoices) -> Tool:
    """``dispatch_launch_agent(name, prompt, type?, cwd?, location?, child, full_access)``:
    here (``lifecycle.agent_launch_any``; a CLI launch on a thread of its own, it blocks on
    tmux) or, with ``location``, on a linked instance (``peers.remote_launch.launch_at_location``: its shadow here)."""

    async def dispatch_launch_agent(arguments: dict[str, Any]) -> Any:
        location = arguments.get("location")
        if location:  # on a linked instance (docs/peers.md#using-a-link): its shadow here
            shadow = await launch_at_location(user=user, caller_agent=caller_agent, location=location, fields=arguments)
            return await database_sync_to_async(agent_data)(shadow)
        type = launch_type_resolve(arguments.get("type"))
        if type == services.EXPERT:
            return await database_sync_to_async(handlers.launch)(user, caller_agent, arguments, type)
        return await _on_own_thread(handlers.launch)(user, caller_agent, arguments, type)

    return _tool(
        name="dispatch_launch_agent",
        description=choices.description,
        parameters={
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 100},
                "prompt": {"type": "string", "maxLength": MAX_PROMPT, "description": "Its first instruction."},
                "type": {
                    "enum": choices.types,
                    "description": f"Default: {choices.default}."
                    if choices.default is not None
                    else "Required for a launch here: this instance has no default type (with location, the "
                    "linked instance picks its own).",
                },
                "cwd": {
                    "type": "string",
                    "maxLength": 4096,
                    "description": "Absolute directory; a leading ~ is the home directory (of the linked "
                    "instance, with location).",
                },
                "location": {
                    "type": ["string", "null"],
                    "maxLength": 200,
                    "description": choices.linked,
                },
                "child": {"type": "boolean", "default": True},
                "full_access": {"type": "boolean", "default": False},
            },
            "required": ["name", "prompt"],
            "additionalProperties": False,
        },
        handler=dispatch_launch_agent,
    )


def send_tool(user: User, caller_agent: Agent | None) -> Tool:
    """``dispatch_send_message(target, message)`` (``tool_handlers.send``)."""

    async def dispatch_send_message(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.send)(
            user, caller_agent, arguments["target"], arguments["message"]
        )

    return _tool(
        name="dispatch_send_message",
        description=(
            "Send a message to one of your agents. target: an agent id, the name of one running agent "
            "(an expert agent gets it as a prompt; a CLI agent gets it typed into its terminal), or "
            "<label or instance id>:<agent id> for an agent on a linked instance (queued until that instance "
            "accepts it). Returns message_id and status; follow it with message_status."
        ),
        parameters={
            "type": "object",
            "properties": {
                "target": {"type": "string", "minLength": 1, "maxLength": MAX_TARGET},
                "message": {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT},
            },
            "required": ["target", "message"],
            "additionalProperties": False,
        },
        handler=dispatch_send_message,
    )


def status_tool(user: User) -> Tool:
    """``message_status(message_id)`` (``tool_handlers.status``)."""

    async def message_status(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.status)(user, arguments["message_id"])

    return _tool(
        name="message_status",
        description=(
            "The status of a message you sent: queued, delivered, failed or dead, with its error (for an agent "
            "on a linked instance also the instance, the attempts so far and the next attempt)."
        ),
        parameters={
            "type": "object",
            "properties": {"message_id": {"type": ["integer", "string"], "maxLength": 20, "minimum": 1}},
            "required": ["message_id"],
            "additionalProperties": False,
        },
        handler=message_status,
    )


def list_approvals_tool(user: User, caller_agent: Agent | None) -> Tool:
    """``list_approvals(status?, agent_id?)`` (``tool_handlers.approvals_list``)."""

    async def list_approvals(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.approvals_list)(
            user, caller_agent, arguments.get("status", "pending"), arguments.get("agent_id")
        )

    return _tool(
        name="list_approvals",
        description=(
            "Permission requests of your agents' CLIs (a command, a file, a URL they want to use), newest first, "
            f"at most {handlers.APPROVALS_LISTED}: approval_id, agent, tool_name, tool_summary, status, "
            "and the answer. "
            "status: pending (default; waiting for an answer), allowed, denied, expired or all."
            + (" Your own requests are not listed: a person or another agent answers them." if caller_agent else "")
        ),
        parameters={
            "type": "object",
            "properties": {
                "status": {"enum": ["pending", "allowed", "denied", "expired", "all"], "default": "pending"},
                "agent_id": {"type": "string", "maxLength": 64, "description": "Only this agent's requests."},
            },
            "additionalProperties": False,
        },
        handler=list_approvals,
    )


def answer_approval_tool(user: User, caller_agent: Agent | None) -> Tool:
    """``answer_approval(approval_id, decision, message?)`` (``tool_handlers.approval_answer``)."""

    async def answer_approval(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.approval_answer)(user, caller_agent, arguments)

    return _tool(
        name="answer_approval",
        description=(
            "Answer a pending permission request of one of your agents (list_approvals): allow_once runs the "
            "tool this time, "
            + ("" if caller_agent else "allow_always also allows this tool and pattern for that agent from now on, ")
            + "deny refuses it (message: what that agent's model is told). The first answer wins; a later one is "
            "refused with APPROVAL_ANSWERED naming who answered."
            + (
                " Your answer is recorded as yours; you cannot answer your own requests, and lasting rules "
                "(allow_always) are a person's."
                if caller_agent
                else ""
            )
        ),
        parameters={
            "type": "object",
            "properties": {
                "approval_id": {"type": "string", "minLength": 1, "maxLength": 64},
                "decision": {
                    "enum": [answer for answer in approvals.ANSWERS if not (caller_agent and answer == "allow_always")]
                },
                "message": {"type": "string", "maxLength": approvals.MAX_MESSAGE},
            },
            "required": ["approval_id", "decision"],
            "additionalProperties": False,
        },
        handler=answer_approval,
    )


def event_tool_for(agent: Agent) -> Tool:
    """``dispatch_event(type, message)``: ``agent`` reports its state on its timeline (``tool_handlers.record``)."""

    async def dispatch_event(arguments: dict[str, Any]) -> Any:
        return await database_sync_to_async(handlers.record)(agent, arguments["type"], arguments["message"])

    return _tool(
        name="dispatch_event",
        description=(
            "Report your state on your Dispatch timeline: working, blocked, waiting_user (you need the "
            "user), done or idle, with a short message."
        ),
        parameters={
            "type": "object",
            "properties": {
                "type": {"enum": list(REPORTED_EVENT_TYPES)},
                "message": {"type": "string", "maxLength": services.MAX_EVENT_MESSAGE_LENGTH},
            },
            "required": ["type", "message"],
            "additionalProperties": False,
        },
        handler=dispatch_event,
    )


async def agent_tools(*, user: User, caller_agent: Agent | None, event_tool: bool = True) -> list[Tool]:
    """The agent tools for ``user``, called by ``caller_agent`` (``None``: the user).

    ``caller_agent`` is recorded as ``launched_by`` (and parent, with ``child``) of the
    agents it launches and as the sender of its messages; it is the default agent of
    ``get_agent_history``. ``dispatch_event`` is included only when ``caller_agent`` is
    set and ``event_tool`` is true. Each tool's result is a JSON value; failures raise
    ``DispatchError`` (see the module docstring).
    """
    choices = await database_sync_to_async(launch_choices)(user)
    tools = [
        list_agents_tool(user),
        history_tool(user, caller_agent),
        launch_tool(user, caller_agent, choices),
        send_tool(user, caller_agent),
        status_tool(user),
        list_approvals_tool(user, caller_agent),
        answer_approval_tool(user, caller_agent),
    ]
    if caller_agent is not None and event_tool:
        tools.append(event_tool_for(caller_agent))
    return tools


# --- the tool set -------------------------------------------------------------------------------


def with_approval_note(tool: Tool, agent: Agent) -> Tool:
    """``tool`` (a machine tool called by ``agent``) whose audit records name the approval
    that allowed the call, when there is one (``approval_selectors.approval_for_tool_call``): set as
    ``machines.audit_note.AUDIT_NOTE`` ``{"approval_id"}`` around the call (docs/agents.md#approvals,
    its paragraph on the audit)."""
    handler = tool.handler

    async def noted(arguments: dict[str, Any]) -> Any:
        approval = await database_sync_to_async(approval_selectors.approval_for_tool_call)(
            agent=agent, tool_name=tool.name, arguments=arguments
        )
        if approval is None:
            return await handler(arguments)
        token = AUDIT_NOTE.set({"approval_id": approval.pk})
        try:
            return await handler(arguments)
        finally:
            AUDIT_NOTE.reset(token)

    return replace(tool, handler=noted)


async def tool_set(
    *,
    user: User,
    caller_agent: Agent | None,
    session_id: str | None = None,
    audit_caller: str | None = None,
    event_tool: bool = True,
    remotes: Iterable[Tool] = (),
    machines_only: bool = False,
) -> dict[str, Tool]:
    """Every tool of one caller, by name: the machine tools, the agent tools, then
    ``remotes`` (docs/agents.md#agent-tools, docs/mcp.md#tools); with
    ``machines_only``, the machine tools alone — what a call of one of them needs, since
    they shadow every other tool of their name (an MCP ``tools/call`` of a machine tool builds
    nothing else). The first tool of a
    name wins, so native tools shadow remote functions of the same name.

    With ``caller_agent`` the agent is the caller: its id is the machine session (a call
    naming another session is refused, ``agent_scope_session``) and the audit's caller.
    For a user caller ``session_id`` (the machine session the descriptions are computed
    for) and ``audit_caller`` (who asked, for the audit record) are required: ``ValueError``
    otherwise. ``event_tool`` as ``agent_tools``. What ``remotes`` holds is the caller's:
    MCP offers every function of the user's connected remotes, an expert run those of the
    remotes it names.
    """
    guard = None
    if caller_agent is not None:
        session_id = audit_caller = caller_agent.pk
        guard = partial(agent_scope_session, caller_agent)
    elif session_id is None or audit_caller is None:
        raise ValueError("a user's tool set needs the machine session and the audit caller")
    tools: dict[str, Tool] = {}
    machines = await machine_tools(user=user, session_id=session_id, caller=audit_caller, session_guard=guard)
    if caller_agent is not None:
        machines = [with_approval_note(tool, caller_agent) for tool in machines]
    natives = [
        *machines,
        *([] if machines_only else await agent_tools(user=user, caller_agent=caller_agent, event_tool=event_tool)),
    ]
    for tool in [*natives, *remotes]:
        tools.setdefault(tool.name, tool)
    return tools
