"""Approvals: an agent's permission requests, their answers and the policy rules applied
first (docs/agents.md#approvals).

A CLI's ``PermissionRequest`` hook (``agents.cli_hooks``) calls ``approval_request``,
which records an ``Approval`` and applies the policy rules: a rule that allows or denies
answers it at once; otherwise it stays ``pending`` — the agent shows ``waiting for
approval`` — until a person, a supervising agent or a linked instance answers it
(``approval_answer``) or its ``expires_at`` passes (``approvals_expire_due``: ``expired``
with the agent's default decision). The first answer wins; any later one gets
``APPROVAL_ANSWERED`` (409) naming who answered.

Policy order: the rules of the agent itself first, then its owner's rules for every
agent; within one level the most restrictive matching rule decides (deny, then ask, then
allow; the oldest first among equals). A matching ``ask`` rule asks a person even where a
user-wide rule would allow. A full-access agent never gets here: its CLI runs with its
bypass flag and asks nothing.

Each request and each answer is a timeline event (``metadata.approval_id``) and a signal
(``agents.signals.approval_requested`` / ``approval_answered``) after commit.
"""

from __future__ import annotations

import glob
import json
import shlex
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents import services
from agents.approval_selectors import approval_rule_get_for
from agents.hooks import Link
from agents.models import Agent, AgentEvent, Approval, ApprovalRule
from agents.selectors import is_valid_id
from agents.signals import approval_answered, approval_requested, send_on_commit
from core.errors import DispatchError, InvalidRequest, NotFound

Status = Approval.Status
Decision = Approval.Decision
Action = ApprovalRule.Action

ANSWERS = (Decision.ALLOW_ONCE, Decision.ALLOW_ALWAYS, Decision.DENY)
MAX_TOOL_NAME = 200
MAX_PATTERN = 1000
MAX_MESSAGE = 2000  # characters of a deny message (it goes to the model)
MAX_SUMMARY = 10_000  # characters of a tool summary kept (what a pattern is matched on)
SHORT_SUMMARY = 120  # characters of the summary in a timeline message
EXPIRE_BATCH = 100
# The input fields that say what a tool is asked to do, in the order they are looked for:
# a shell command, a file, a URL, a search (Claude Code's and codex's tool inputs).
SUMMARY_FIELDS = ("command", "file_path", "notebook_path", "path", "url", "pattern", "query")
# Most restrictive first: the order rules of one level are judged in.
_SEVERITY = {Action.DENY: 0, Action.ASK: 1, Action.ALLOW: 2}
_VERBS = {
    Decision.ALLOW_ONCE: "approved once",
    Decision.ALLOW_ALWAYS: "always allowed",
    Decision.DENY: "denied",
}


class ApprovalAnswered(DispatchError):
    """``APPROVAL_ANSWERED`` (409): the approval already has its answer; the message names
    it ("allowed by alice at 2026-12-05T04:01:02+00:00"), ``details`` carries ``status``,
    ``decision``, ``answered_by`` and ``answered_at``."""

    def __init__(self, approval: Approval) -> None:
        answered_at = approval.answered_at.isoformat() if approval.answered_at else None
        super().__init__(
            "APPROVAL_ANSWERED",
            f"approval '{approval.pk}' was already answered ({describe(approval)})",
            {
                "approval_id": approval.pk,
                "status": approval.status,
                "decision": approval.decision,
                "answered_by": approval.answered_by,
                "answered_at": answered_at,
            },
        )

    @property
    def http_status(self) -> int:
        return 409


# --- reading a request ------------------------------------------------------------------------


def tool_summary(tool_name: str, tool_input: Any) -> str:
    """The one text a request is shown and matched by: the first of ``SUMMARY_FIELDS``
    in ``tool_input`` that is a string (a command given as a list of words is joined as a
    shell line), else ``tool_input`` as compact JSON; at most ``MAX_SUMMARY`` characters."""
    text = ""
    if isinstance(tool_input, Mapping):
        for field in SUMMARY_FIELDS:
            value = tool_input.get(field)
            if isinstance(value, str) and value:
                text = value
                break
            if field == "command" and isinstance(value, list) and all(isinstance(word, str) for word in value):
                text = shlex.join(value)
                break
    if not text and tool_input not in (None, {}, []):
        try:
            text = json.dumps(tool_input, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        except (TypeError, ValueError):
            text = ""
    return text.replace("\x00", "")[:MAX_SUMMARY]


def _short(approval: Approval) -> str:
    """``Bash `ls -la`\u0060`` — the tool and its summary on one line, for the timeline."""
    summary = " ".join(approval.tool_summary.split())
    if len(summary) > SHORT_SUMMARY:
        summary = summary[: SHORT_SUMMARY - 1] + "…"
    return f"{approval.tool_name} `{summary}`" if summary else approval.tool_name


def describe(approval: Approval) -> str:
    """How the approval was answered, in words: ``pending``, ``allowed by alice at <ISO
    8601>``, ``denied by policy rule #3 at …``, ``expired: denied (default) at …``."""
    if approval.status == Status.PENDING:
        return "pending"
    when = approval.answered_at.isoformat() if approval.answered_at else "?"
    if approval.status == Status.EXPIRED:
        return f"expired: {'allowed' if approval.allowed else 'denied'} (default) at {when}"
    return f"{approval.status} by {approval.answered_by or 'someone'} at {when}"


def approval_settings_for(agent: Agent) -> tuple[int, str]:
    """``(timeout seconds, default decision)`` for ``agent``'s requests: its type's
    ``approval_timeout`` / ``approval_default`` (``DISPATCH_AGENT_TYPES``), else
    ``DISPATCH_APPROVAL_TIMEOUT`` / ``DISPATCH_APPROVAL_DEFAULT`` (docs/operating.md)."""
    spec = settings.AGENT_TYPES.get(agent.type)
    timeout = getattr(spec, "approval_timeout", None) or settings.APPROVAL_TIMEOUT
    default = getattr(spec, "approval_default", None) or settings.APPROVAL_DEFAULT
    return int(timeout), str(default)


# --- policy -----------------------------------------------------------------------------------


# What lets a shell run more than the command a rule names: chaining, pipes, background,
# command substitution, redirection, another line.
SHELL_OPERATORS = (";", "&", "|", "`", "$(", "\n", "\r", ">", "<")


def _chained_past(rule: ApprovalRule, tool_name: str, summary: str) -> bool:
    """Whether ``rule`` is a ``Bash`` allow with a pattern and ``summary`` holds a shell
    operator the pattern does not (``npm test*`` against ``npm test && curl … | sh``): such
    a rule allows the command it names, not what is chained after it — Claude Code too asks
    about each part of a chained command. Deny and ask rules match the whole text."""
    if rule.action != Action.ALLOW or not rule.pattern or tool_name != "Bash":
        return False
    return any(operator in summary and operator not in rule.pattern for operator in SHELL_OPERATORS)


def policy_rule_for(*, agent: Agent, tool_name: str, summary: str) -> ApprovalRule | None:
    """The rule that decides a request of ``agent`` for ``tool_name`` with ``summary``, or
    ``None`` (no rule matches: a person is asked). The agent's own rules first, then its
    owner's rules for every agent; within a level deny beats ask beats allow, the oldest
    first among equals (module docstring; docs/agents.md#approvals). A ``Bash`` allow rule
    with a pattern never allows a command chained past it (``_chained_past``)."""
    rules = ApprovalRule.objects.filter(owner_id=agent.owner_id, tool__in=[tool_name, "*"]).filter(
        Q(agent=agent) | Q(agent__isnull=True)
    )
    matching = [
        rule
        for rule in rules.order_by("pk")
        if rule.matches(tool_name=tool_name, tool_summary=summary) and not _chained_past(rule, tool_name, summary)
    ]
    for level in ([r for r in matching if r.agent_id is not None], [r for r in matching if r.agent_id is None]):
        if level:
            return min(level, key=lambda rule: (_SEVERITY[Action(rule.action)], rule.pk))
    return None


# --- services ---------------------------------------------------------------------------------


APPROVAL_REQUESTED = "approval requested: "
"""How the ``blocked`` timeline event of a pending approval begins (then the tool and its
summary): what a linked instance's mirror of the agent sees of it."""


def _event(approval: Approval, type: str, message: str, **metadata: Any) -> None:
    services.agent_event_record(
        agent=approval.agent,
        type=type,
        message=message,
        metadata={"hook": approval.hook_event, "approval_id": approval.pk, **metadata},
    )


def _storable_json(value: Any, what: str) -> Any:
    """``value`` if PostgreSQL's jsonb stores it (JSON-serialisable, no NUL), else ``InvalidRequest``."""
    services._json_text(value, what)
    return value


@transaction.atomic
def approval_request(
    *,
    agent: Agent,
    tool_name: str,
    tool_input: Any,
    suggestions: Any = None,
    hook_event: str = "PermissionRequest",
    event_metadata: Mapping[str, Any] | None = None,
) -> Approval:
    """Record ``agent``'s CLI asking to run ``tool_name`` with ``tool_input`` (any JSON
    value, as the CLI sent it), with the CLI's own ``suggestions`` (Claude Code's
    ``permission_suggestions``: a list, anything else is kept as ``[]``), and apply the
    policy rules (``policy_rule_for``).

    Returns the approval: ``allowed``/``denied`` with ``answered_by_rule`` when a rule
    decided (an event "allowed by policy rule #3: Read `x`"; ``approval_answered``),
    else ``pending`` until ``expires_at`` (now + the agent's ``approval_settings_for``
    timeout; an event "approval requested: Bash `ls`" of type ``blocked``, shown as
    "waiting for approval"; ``approval_requested``). Raises ``InvalidRequest`` for a
    tool name that is not 1-200 characters of storable text or an input JSON cannot
    store; nothing is recorded then. ``event_metadata`` is added to the timeline event's
    metadata (the hook's own view of the request).
    """
    if not isinstance(tool_name, str) or not 1 <= len(tool_name) <= MAX_TOOL_NAME:
        raise InvalidRequest(f"tool_name must be 1 to {MAX_TOOL_NAME} characters")
    services.storable_text(tool_name, "tool_name")
    _storable_json(tool_input, "tool_input")
    kept_suggestions = _storable_json(suggestions, "suggestions") if isinstance(suggestions, list) else []
    timeout, default = approval_settings_for(agent)
    now = timezone.now()
    approval = Approval.objects.create(
        agent=agent,
        tool_name=tool_name,
        tool_input=tool_input if tool_input is not None else {},
        tool_summary=tool_summary(tool_name, tool_input),
        suggestions=kept_suggestions,
        hook_event=hook_event[:40],
        asked_at=now,
        expires_at=now + timedelta(seconds=timeout),
        timeout_decision=default,
    )
    rule = policy_rule_for(agent=agent, tool_name=tool_name, summary=approval.tool_summary)
    if rule is not None and rule.action != Action.ASK:
        allow = rule.action == Action.ALLOW
        _settle(
            approval,
            status=Status.ALLOWED if allow else Status.DENIED,
            decision=Decision.ALLOW_ONCE if allow else Decision.DENY,
            answered_by=f"policy rule #{rule.pk}",
            answered_by_rule=rule,
            message="" if allow else f"denied by Dispatch policy rule #{rule.pk}",
        )
        verb = "allowed" if allow else "denied"
        _event(
            approval,
            AgentEvent.Type.WORKING,
            f"{verb} by policy rule #{rule.pk}: {_short(approval)}",
            decision=approval.decision,
            rule_id=rule.pk,
            tool_name=tool_name,
        )
        send_on_commit(approval_answered, Approval, approval=approval)
        return approval
    _event(
        approval,
        AgentEvent.Type.BLOCKED,
        f"{APPROVAL_REQUESTED}{_short(approval)}",
        tool_name=tool_name,
        tool_summary=approval.tool_summary[: SHORT_SUMMARY * 4],
        expires_at=approval.expires_at.isoformat(),
        **({"rule_id": rule.pk} if rule is not None else {}),
        **(event_metadata or {}),
    )
    send_on_commit(approval_requested, Approval, approval=approval)
    return approval


def _settle(approval: Approval, *, status: str, decision: str, answered_by: str, **fields: Any) -> None:
    approval.status = status
    approval.decision = decision
    approval.answered_by = answered_by[:300]
    approval.answered_at = timezone.now()
    for name, value in fields.items():
        setattr(approval, name, value)
    approval.save(
        update_fields=["status", "decision", "answered_by", "answered_at", *fields],
    )


def _claude_rule_glob(content: str) -> str:
    """A Claude Code ``Bash`` rule as the glob of a Dispatch rule: the old prefix form
    ``npm test:*`` is ``npm test*``; in the current form each ``*`` is a wildcard
    (``npm test *``: "npm test", a space, anything) and everything else is literal."""
    if content.endswith(":*"):
        return glob.escape(content[:-2]) + "*"
    return "*".join(glob.escape(part) for part in content.split("*"))


def _literal_in(content: str) -> bool:
    """Whether a suggested rule names any text at all: ``:*``, ``*`` or ``* *`` (only
    wildcards, a colon and spaces) would allow every command."""
    return bool(content.replace("*", "").replace(":", "").strip())


def _rule_pattern(approval: Approval) -> str:
    """The pattern of the rule "Always allow this rule" makes: for ``Bash``, Claude Code's
    own suggested rule when it gave one (``ls:*`` — a prefix — becomes ``ls*``, ``npm test *``
    stays a wildcard; anything else is literal: ``_claude_rule_glob``), else the request's
    exact summary (glob characters escaped).
    Suggestions arrive with the hook's payload, so a malformed one, one of wildcards only
    (``:*``, ``*``: every command, ``_literal_in``) or one longer than ``MAX_PATTERN`` is
    passed over."""
    if approval.tool_name == "Bash":
        for suggestion in approval.suggestions:
            if not isinstance(suggestion, Mapping) or suggestion.get("type") != "addRules":
                continue
            rules = suggestion.get("rules")
            for rule in rules if isinstance(rules, list) else []:
                content = rule.get("ruleContent") if isinstance(rule, Mapping) else None
                if not isinstance(content, str) or rule.get("toolName") != "Bash" or not _literal_in(content):
                    continue
                pattern = _claude_rule_glob(content)
                if len(pattern) <= MAX_PATTERN:
                    return pattern
    return glob.escape(approval.tool_summary)[:MAX_PATTERN]


def approval_answer(
    *,
    approval_id: str,
    decision: str,
    message: str = "",
    user: User | None = None,
    by_agent: Agent | None = None,
    by_peer: Link | None = None,
    by_peer_name: str = "",
) -> Approval:
    """Answer the pending approval ``approval_id`` as exactly one of: ``user`` (its
    agent's owner), ``by_agent`` (another agent of the same owner — one an agent may
    message; recorded as ``answered_by_agent``), ``by_peer`` (a linked instance acting for
    the link's user; ``by_peer_name`` is who answered there, for the timeline).

    ``decision``: ``allow_once``, ``allow_always`` (also records an ``ApprovalRule`` for
    this agent, tool and pattern — ``_rule_pattern`` — and passes the CLI's own
    suggestions back to it) or ``deny``; ``message`` (deny only, at most 2000 characters)
    is what the model is told. Returns the answered approval; the agent's timeline gets
    "approved once by alice: Bash `ls`" and ``approval_answered`` is sent after commit.

    Raises ``InvalidRequest`` (no answerer or two, an unknown decision, a message with an
    allow or too long), ``NotFound`` (an unknown id, or another user's: never which),
    ``DispatchError("PERMISSION_DENIED")`` (403: an agent answering its own approval, or
    answering ``allow_always``: rules are a person's),
    ``ApprovalAnswered`` (409 ``APPROVAL_ANSWERED``: answered already, expired included,
    naming who answered). Nothing changes on any error.
    """
    answerers = [who for who in (user, by_agent, by_peer) if who is not None]
    if len(answerers) != 1:
        raise InvalidRequest("an approval is answered by exactly one of a user, an agent or a linked instance")
    if decision not in ANSWERS:
        raise InvalidRequest(f"decision must be one of {', '.join(ANSWERS)}, not '{str(decision)[:40]}'")
    if not isinstance(message, str) or len(message) > MAX_MESSAGE:
        raise InvalidRequest(f"message must be text of at most {MAX_MESSAGE} characters")
    services.storable_text(message, "message")
    if message.strip() and decision != Decision.DENY:
        raise InvalidRequest("a message goes with deny only (it is what the model is told)")
    if by_agent is not None and decision == Decision.ALLOW_ALWAYS:
        # A rule outlives the request: an agent could otherwise widen what its peers may do.
        raise DispatchError(
            "PERMISSION_DENIED",
            "an agent answers allow_once or deny: allow_always makes a lasting rule, which only a person makes",
        )
    if user is not None:
        owner_id, label = user.pk, user.get_username()
    elif by_agent is not None:
        owner_id, label = by_agent.owner_id, f"agent {by_agent.name} (supervisor)"
    else:
        assert by_peer is not None
        owner_id = by_peer.owner_id
        label = f"{by_peer_name[:100]} on {by_peer.label}" if by_peer_name else f"linked instance {by_peer.label}"
    if not is_valid_id(approval_id):
        raise NotFound("no such approval")
    approvals_expire_due(approval_id=approval_id)  # its own commit: a late answer must see the expiry stay
    with transaction.atomic():
        approval = (
            Approval.objects.select_for_update(of=("self",))
            .select_related("agent", "agent__owner")
            .filter(pk=approval_id, agent__owner_id=owner_id)
            .first()
        )
        if approval is None:
            raise NotFound(f"no approval '{approval_id}'")
        if by_agent is not None and by_agent.pk == approval.agent_id:
            raise DispatchError(
                "PERMISSION_DENIED",
                f"agent '{by_agent.pk}' cannot answer its own approval '{approval.pk}': a person, a policy or "
                "another agent answers it",
                {"approval_id": approval.pk},
            )
        if approval.status != Status.PENDING:
            raise ApprovalAnswered(approval)
        allow = decision != Decision.DENY
        _settle(
            approval,
            status=Status.ALLOWED if allow else Status.DENIED,
            decision=decision,
            answered_by=label,
            message=message.strip(),
            answered_by_user=user,
            answered_by_agent=by_agent,
            answered_by_peer_id=by_peer.pk if by_peer is not None else None,
        )
        extra: dict[str, Any] = {}
        text = f"{_VERBS[Decision(decision)]} by {label}"
        if decision == Decision.ALLOW_ALWAYS:
            rule = ApprovalRule.objects.create(
                owner_id=owner_id,
                agent=approval.agent,
                tool=approval.tool_name,
                pattern=_rule_pattern(approval),
                action=Action.ALLOW,
                created_by_approval=approval,
            )
            extra["rule_id"] = rule.pk
            text += f" (rule #{rule.pk})"
        text += f": {_short(approval)}"
        if approval.message:
            text += f" — {approval.message}"
        if by_agent is not None:
            extra["answered_by_agent"] = by_agent.pk
        _event(approval, AgentEvent.Type.WORKING, text, decision=decision, answered_by=label, **extra)
        send_on_commit(approval_answered, Approval, approval=approval)
    return approval


def approvals_expire_due(
    *, approval_id: str | None = None, agent: Agent | None = None, now: datetime | None = None
) -> list[Approval]:
    """Expire pending approvals whose ``expires_at`` has passed (only ``approval_id`` when
    given, only ``agent``'s with ``agent``; at most ``EXPIRE_BATCH`` at a time): each becomes ``expired`` with its
    ``timeout_decision`` (the agent's default when it was asked), an event "expired:
    denied (default): Bash `ls`" and ``approval_answered``. Rows another transaction is
    answering are skipped (it decides them). Returns those expired, in their own commit."""
    moment = now or timezone.now()
    with transaction.atomic():
        due = Approval.objects.filter(status=Status.PENDING, expires_at__lte=moment)
        if approval_id is not None:
            due = due.filter(pk=approval_id)
        if agent is not None:
            due = due.filter(agent=agent)
        rows = list(
            due.select_for_update(of=("self",), skip_locked=True)
            .select_related("agent", "agent__owner")
            .order_by("expires_at")[:EXPIRE_BATCH]
        )
        for approval in rows:
            _settle(approval, status=Status.EXPIRED, decision=approval.timeout_decision, answered_by="timeout")
            outcome = "allowed" if approval.allowed else "denied"
            _event(
                approval,
                AgentEvent.Type.WORKING,
                f"expired: {outcome} (default): {_short(approval)}",
                decision=approval.decision,
            )
            send_on_commit(approval_answered, Approval, approval=approval)
    return rows


def approvals_end_for(*, agent: Agent) -> list[Approval]:
    """Expire now every pending approval of ``agent`` (its default applies, as on a
    timeout): its CLI session ended, so no hook waits for them any more. Returns those
    expired."""
    now = timezone.now()
    Approval.objects.filter(agent=agent, status=Status.PENDING, expires_at__gt=now).update(expires_at=now)
    return approvals_expire_due(agent=agent, now=now)


# --- rules ------------------------------------------------------------------------------------


@transaction.atomic
def approval_rule_create(
    *,
    user: User,
    tool: str,
    action: str,
    pattern: str = "",
    agent: Agent | None = None,
    created_by_approval: Approval | None = None,
) -> ApprovalRule:
    """A policy rule of ``user``: for ``agent`` (one of ``user``'s) or, with ``None``,
    every agent of theirs. ``tool``: a tool's exact name (1-200 characters, no spaces or
    control characters) or ``*``; ``pattern``: an ``fnmatch`` glob on the request's
    summary, at most 1000 characters, ``""`` = any; ``action``: ``allow``, ``ask`` or
    ``deny``. Raises ``InvalidRequest`` or ``NotFound`` (another user's agent)."""
    if not isinstance(tool, str) or not 1 <= len(tool) <= MAX_TOOL_NAME or any(c.isspace() for c in tool):
        raise InvalidRequest(f"tool must be a tool's name (1 to {MAX_TOOL_NAME} characters, no spaces) or '*'")
    if any(ord(c) < 32 or ord(c) == 127 for c in tool):
        raise InvalidRequest("tool must not hold control characters")
    services.storable_text(tool, "tool")
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        raise InvalidRequest(f"pattern must be text of at most {MAX_PATTERN} characters")
    services.storable_text(pattern, "pattern")
    if action not in Action.values:
        raise InvalidRequest(f"action must be one of {', '.join(Action.values)}, not '{str(action)[:40]}'")
    if agent is not None and agent.owner_id != user.pk:
        raise NotFound(f"no agent '{agent.pk}'")
    return ApprovalRule.objects.create(
        owner=user, agent=agent, tool=tool, pattern=pattern, action=action, created_by_approval=created_by_approval
    )


@transaction.atomic
def approval_rule_delete(*, user: User, rule_id: Any) -> None:
    """Delete ``user``'s rule ``rule_id``; ``NotFound`` for an unknown id or another user's.
    Approvals it decided keep their answer (``answered_by`` still names it)."""
    rule = approval_rule_get_for(user=user, rule_id=rule_id)
    rule.delete()
