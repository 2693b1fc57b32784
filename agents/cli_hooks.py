"""The CLIs' own hooks as the source of truth for a CLI agent's readiness, delivery and
state (docs/agents.md#hooks).

Claude Code and codex run a command at each of their hook events with the event's JSON on
stdin; Dispatch gives them ``hook_command(event)``, which runs ``agents/hook_client.py``
(stdlib only) to ``POST /api/v1/agents/<id>/hooks`` with the agent's own token
(``agents.hook_api``). ``hook_event_record`` is what such a report does:

- ``SessionStart``: the session is ready (``Agent.ready_at``, set once per session);
- ``UserPromptSubmit``: the pasted message whose text the prompt carries is ``delivered``
  (a prompt matching none was typed in the terminal); ``working``;
- ``PreToolUse``: ``working`` "tool: <name>"; ``PermissionRequest``: an ``Approval``
  (``agents.approvals.approval_request``): answered at once by a policy rule, else
  ``blocked`` (shown as "waiting for approval") while the hook client waits for the answer
  (``approval_output``; docs/agents.md#approvals); ``PostToolUse`` after ``blocked``
  (answered in the terminal): ``working`` again;
- ``Notification``: ``permission_prompt`` → ``blocked``, ``idle_prompt`` → ``idle``;
- ``Stop``: ``done``; ``SessionEnd``: a ``system`` event (the supervisor still judges the
  pane's end), and the session's pending approvals expire (``approvals.approvals_end_for``).

Every state is a timeline event through ``services.agent_event_record`` (so the timeline,
``latest_event_*`` and the live broadcasts work as for any event) with
``metadata.hook`` naming the event; ``hook_state`` reads the newest of the current session
back, which is what the supervisor's delivery waits on.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents import approvals, messages, services
from agents.models import Agent, AgentEvent, AgentMessage, Approval
from agents.tmux import pasteable
from core.errors import InvalidRequest

# Every event name either CLI reports (FINDINGS of tests/agents/real_cli; docs/agents.md#hooks).
HOOK_EVENTS = (
    "SessionStart",
    "UserPromptSubmit",
    "PreToolUse",
    "PostToolUse",
    "PermissionRequest",
    "Notification",
    "Stop",
    "SubagentStop",
    "PreCompact",
    "PostCompact",
    "SessionEnd",
)
# Largest hook payload taken, as JSON text in UTF-8 bytes (what the hook client sends).
MAX_PAYLOAD_BYTES = 1024 * 1024
# A tool's input is kept in an event's metadata up to this many characters of JSON: the
# timeline shows what a tool does, not a whole file it writes.
TOOL_INPUT_LIMIT = 2048
# Characters kept of free texts from a payload (the last answer, a typed prompt).
TEXT_LIMIT = 2000

HOOK_CLIENT = Path(__file__).resolve().parent / "hook_client.py"
# Seconds between the hook client's reads of a pending approval (it waits for the answer).
APPROVAL_POLL_SECONDS = 0.5

Type = AgentEvent.Type


def hook_command(event: str) -> str:
    """The shell command a CLI runs for hook ``event`` (e.g. ``"SessionStart"``):
    ``shlex.join([sys.executable, "<abs path of agents/hook_client.py>", event])``, quoted
    for the POSIX shell both CLIs run hooks through."""
    return shlex.join([sys.executable, str(HOOK_CLIENT), event])


def hook_state(agent: Agent) -> str | None:
    """The state the agent's CLI last reported through a hook in its current session: the
    type of its newest non-``system`` event with ``metadata.hook`` since ``ready_at``, or
    ``None`` (no session ready, or nothing reported yet)."""
    if agent.ready_at is None:
        return None
    found: str | None = (
        AgentEvent.objects.filter(agent=agent, created_at__gte=agent.ready_at, metadata__has_key="hook")
        .exclude(type=Type.SYSTEM)
        .order_by("-created_at", "-pk")
        .values_list("type", flat=True)
        .first()
    )
    return found


def _text(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``value`` as storable text of at most ``limit`` characters (``""`` for a non-string)."""
    if not isinstance(value, str):
        return ""
    text = value if len(value) <= limit else value[: limit - 1] + "…"
    return text.replace("\x00", "")


def _tool_input(value: Any) -> Any:
    """A tool's input for metadata: as it is when its JSON fits ``TOOL_INPUT_LIMIT``, else
    the start of its JSON text."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None
    if len(text) <= TOOL_INPUT_LIMIT:
        return value
    return text[: TOOL_INPUT_LIMIT - 1] + "…"


def _prompt_form(text: str) -> str:
    """Text as compared between a pasted message and a submitted prompt: every run of
    whitespace as one space, none at the ends. The CLIs change whitespace on the way: Claude
    Code turns a tab into four spaces and keeps its ``> `` prefix, codex trims the
    ends (docs/agents.md#hooks)."""
    return " ".join(text.split())


def _pasted_forms(agent: Agent, message: AgentMessage) -> set[str]:
    text = pasteable(message.content)
    forms = {_prompt_form(text)}
    spec = settings.AGENT_TYPES.get(agent.type)
    if spec is not None:
        forms.add(_prompt_form(spec.neutralise(text)))
    return forms


def _record(agent: Agent, type: str, message: str, event: str, **metadata: Any) -> None:
    services.agent_event_record(agent=agent, type=type, message=message, metadata={"hook": event, **metadata})


@dataclass(frozen=True)
class HookAnswer:
    """What a hook report answers: ``output``, the JSON object the CLI reads on the hook's
    stdout (``None``: print nothing), and the ``approval`` a ``PermissionRequest`` made
    (``None`` for every other event)."""

    output: dict[str, Any] | None = None
    approval: Approval | None = None


def approval_output(approval: Approval) -> dict[str, Any] | None:
    """The ``PermissionRequest`` hook output carrying ``approval``'s answer, or ``None``
    while it is pending. Both CLIs read ``{"hookSpecificOutput": {"hookEventName":
    "PermissionRequest", "decision": {"behavior": "allow" | "deny", "message"?,
    "updatedPermissions"?}}}`` (FINDINGS of tests/agents/real_cli; Claude Code's hooks
    reference; codex's permission-request output schema). A deny carries ``message``, what
    the model is told; "Always allow this rule" gives Claude Code its own
    ``permission_suggestions`` back as ``updatedPermissions`` with ``destination``
    ``"session"`` (Dispatch keeps the lasting rule; nothing is written into the user's
    project) — never to codex, which
    refuses any ``updatedPermissions`` (fails closed)."""
    if approval.status == Approval.Status.PENDING:
        return None
    decision: dict[str, Any] = {"behavior": "allow" if approval.allowed else "deny"}
    if not approval.allowed:
        decision["message"] = _denial(approval)
    spec = settings.AGENT_TYPES.get(approval.agent.type)
    family = spec.hooks if spec is not None else None
    if approval.decision == Approval.Decision.ALLOW_ALWAYS and family == "claude":
        # For this session only: the lasting rule is Dispatch's own (agents.approvals), so
        # the CLI writes nothing into the project (its suggestions name .claude/settings.local.json).
        updates = [{**entry, "destination": "session"} for entry in approval.suggestions if isinstance(entry, Mapping)]
        if updates:
            decision["updatedPermissions"] = updates
    return {"hookSpecificOutput": {"hookEventName": approval.hook_event, "decision": decision}}


def _denial(approval: Approval) -> str:
    """What the model is told of a deny: the answerer's message, else who denied it."""
    if approval.message:
        return approval.message
    if approval.status == Approval.Status.EXPIRED:
        return "Nobody answered the permission request in time: denied by default (Dispatch)."
    return f"Denied by {approval.answered_by or 'a person'} through Dispatch."


@transaction.atomic
def hook_event_record(*, agent: Agent, event: str, payload: Mapping[str, Any] | None) -> HookAnswer:
    """Apply one hook report of ``agent``'s CLI (docs/agents.md#hooks) and return the
    ``HookAnswer``: the ``output`` for the CLI (a JSON object it reads on the hook's
    stdout) or ``None``, and for ``PermissionRequest`` the ``Approval`` recorded — its
    output is there at once when a policy rule answered it, else the hook client waits for
    it (``approval_output``; docs/agents.md#approvals).

    ``event``: one of ``HOOK_EVENTS``; ``payload``: the event's stdin JSON object as the
    CLI wrote it (``None`` when the client could not read one), shapes as in
    docs/agents.md#hooks. Fields the CLIs do not send are taken as absent. Raises
    ``InvalidRequest`` for an unknown event or a payload that is not an object; nothing
    changes then. Every other event answers ``None``.
    """
    if event not in HOOK_EVENTS:
        raise InvalidRequest(f"unknown hook event '{event[:40]}'; known: {', '.join(HOOK_EVENTS)}")
    if payload is not None and not isinstance(payload, Mapping):
        raise InvalidRequest("payload must be a JSON object or null")
    body: Mapping[str, Any] = payload or {}
    current = Agent.objects.select_for_update().get(pk=agent.pk)
    handler = _HANDLERS.get(event)
    answer = handler(current, event, body) if handler is not None else None
    agent.ready_at = Agent.objects.values_list("ready_at", flat=True).get(pk=agent.pk)
    return answer or HookAnswer()


def _session_start(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    source = _text(body.get("source"), 40)
    # Only the session's first SessionStart makes it ready: a later one (after a compaction
    # or a /clear) must not move ``ready_at``, which bounds the session's reported states.
    if agent.ready_at is None:
        agent.ready_at = timezone.now()
        Agent.objects.filter(pk=agent.pk).update(ready_at=agent.ready_at)
        _record(agent, Type.SYSTEM, "ready (SessionStart)", event, source=source)
        messages.doorbell_ring(agent.host)  # a message waiting for the CLI to be ready
    else:
        _record(agent, Type.SYSTEM, f"session restarted ({source or 'SessionStart'})", event, source=source)


def _user_prompt_submit(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    submitted = _prompt_form(prompt) if isinstance(prompt, str) else None
    pasted = messages.messages_pasted_unconfirmed(agent=agent)
    match = next((m for m in pasted if submitted is not None and submitted in _pasted_forms(agent, m)), None)
    if match is not None and messages.message_mark_delivered(message=match, metadata={"hook": event}):
        _record(agent, Type.WORKING, "working on the message", event, message_id=match.pk)
    else:
        _record(agent, Type.WORKING, "prompt typed in the terminal", event, prompt=_text(prompt))


def _pre_tool_use(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    tool = _text(body.get("tool_name"), 200) or "?"
    _record(agent, Type.WORKING, f"tool: {tool}", event, tool_name=tool, tool_input=_tool_input(body.get("tool_input")))


def _post_tool_use(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    # A tool that ran after a permission prompt was approved by a person at the terminal.
    if hook_state(agent) == Type.BLOCKED:
        tool = _text(body.get("tool_name"), 200) or "?"
        _record(agent, Type.WORKING, "approved in the terminal", event, tool_name=tool)


def _permission_request(agent: Agent, event: str, body: Mapping[str, Any]) -> HookAnswer:
    tool = _text(body.get("tool_name"), 200) or "?"
    tool_input = body.get("tool_input")
    approval = approvals.approval_request(
        agent=agent,
        tool_name=tool,
        tool_input=tool_input if isinstance(tool_input, (Mapping, list, str, int, float, bool)) else {},
        suggestions=body.get("permission_suggestions"),
        hook_event=event,
        event_metadata={
            "tool_input": _tool_input(tool_input),
            "permission_suggestions": _tool_input(body.get("permission_suggestions")),
        },
    )
    return HookAnswer(output=approval_output(approval), approval=approval)


def _notification(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    kind = _text(body.get("notification_type"), 60)
    said = _text(body.get("message"), 200)
    if kind == "permission_prompt":
        if hook_state(agent) != Type.BLOCKED:
            _record(agent, Type.BLOCKED, f"waiting for approval: {said}".rstrip(": "), event, notification_type=kind)
    elif kind == "idle_prompt":
        _record(agent, Type.IDLE, "idle: waiting for input", event, notification_type=kind)
        messages.doorbell_ring(agent.host)


def _stop(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    _record(agent, Type.DONE, "turn finished", event, last_assistant_message=_text(body.get("last_assistant_message")))
    messages.doorbell_ring(agent.host)  # the next message waited for this turn to end


def _session_end(agent: Agent, event: str, body: Mapping[str, Any]) -> None:
    reason = _text(body.get("reason"), 100) or "unknown"
    _record(agent, Type.SYSTEM, f"session ended ({reason})", event, reason=reason)
    approvals.approvals_end_for(agent=agent)  # nobody waits for their answers now


_HANDLERS = {
    "SessionStart": _session_start,
    "UserPromptSubmit": _user_prompt_submit,
    "PreToolUse": _pre_tool_use,
    "PostToolUse": _post_tool_use,
    "PermissionRequest": _permission_request,
    "Notification": _notification,
    "Stop": _stop,
    "SessionEnd": _session_end,
}
