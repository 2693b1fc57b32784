"""Reads of approvals and their policy rules (docs/agents.md#approvals): always for a caller,
never a bare ``.get``; the writes and the policy are ``agents.approvals``'.

The machine audit's question — which approval allowed the call an agent makes now — is
here too (``approval_for_tool_call``).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db.models import Q, QuerySet
from django.utils import timezone

from agents.models import Agent, Approval, ApprovalRule
from agents.selectors import is_valid_id
from core.errors import InvalidRequest, NotFound

Status = Approval.Status


def approvals_for(
    *, user: User, status: str | None = "pending", agent: Agent | None = None, exclude_agent: Agent | None = None
) -> QuerySet[Approval]:
    """``user``'s agents' approvals, newest first, with their agent and answerers joined.

    ``status``: one of ``Approval.Status`` or ``None``/``""`` for all; ``pending`` leaves
    out those whose time is up (they are expired at the next expiry pass). ``agent``: only
    that agent's; ``exclude_agent``: not that agent's (an agent token never sees its own
    as answerable). Raises ``InvalidRequest`` for an unknown status.
    """
    rows = Approval.objects.filter(agent__owner=user)
    if status:
        if status not in Status.values:
            raise InvalidRequest(f"status must be one of {', '.join(Status.values)}, not '{str(status)[:40]}'")
        rows = rows.filter(status=status)
        if status == Status.PENDING:
            rows = rows.filter(expires_at__gt=timezone.now())
    if agent is not None:
        rows = rows.filter(agent=agent)
    if exclude_agent is not None:
        rows = rows.exclude(agent=exclude_agent)
    return rows.select_related(
        "agent", "agent__owner", "answered_by_user", "answered_by_agent", "answered_by_rule", "answered_by_peer"
    ).order_by("-asked_at", "-pk")


def approval_get_for(*, user: User, approval_id: str) -> Approval:
    """``user``'s agent's approval ``approval_id``; ``NotFound`` for an unknown id or
    another user's (the same answer for both)."""
    found = None
    if is_valid_id(approval_id):
        found = approvals_for(user=user, status=None).filter(pk=approval_id).first()
    if found is None:
        raise NotFound(f"no approval '{approval_id}'" if is_valid_id(approval_id) else "no such approval")
    return found


def approval_of_agent(*, agent: Agent, approval_id: str) -> Approval:
    """``agent``'s own approval ``approval_id`` (what its hook waits on); ``NotFound`` otherwise."""
    found = None
    if is_valid_id(approval_id):
        found = Approval.objects.select_related("agent").filter(pk=approval_id, agent=agent).first()
    if found is None:
        raise NotFound(f"no approval '{approval_id}'" if is_valid_id(approval_id) else "no such approval")
    return found


def approval_rules_for(*, user: User, agent: Agent | None = None) -> QuerySet[ApprovalRule]:
    """``user``'s policy rules, oldest first: all of them, or with ``agent`` those that
    apply to it (its own and the user-wide ones)."""
    rules = ApprovalRule.objects.filter(owner=user)
    if agent is not None:
        rules = rules.filter(Q(agent=agent) | Q(agent__isnull=True))
    return rules.select_related("agent", "created_by_approval").order_by("pk")


def approval_rule_get_for(*, user: User, rule_id: Any) -> ApprovalRule:
    """``user``'s rule ``rule_id`` (an integer or its decimal text); ``NotFound`` otherwise."""
    try:
        pk = int(str(rule_id)) if str(rule_id).isdigit() and len(str(rule_id)) <= 18 else None
    except ValueError:
        pk = None
    rule = ApprovalRule.objects.filter(owner=user, pk=pk).first() if pk is not None else None
    if rule is None:
        raise NotFound(f"no approval rule '{str(rule_id)[:20]}'")
    return rule


# How recent an approval must be to be named in the audit of the call it allowed, seconds.
AUDIT_WINDOW = 600


def approval_for_tool_call(*, agent: Agent, tool_name: str, arguments: Any) -> Approval | None:
    """The approval that allowed the call ``agent`` now makes of its Dispatch MCP tool
    ``tool_name`` with ``arguments``, or ``None``: ``agent``'s most recently answered
    approval, when it allowed exactly this call — the tool the CLI named
    ``mcp__<server>__<tool_name>`` (Claude Code's MCP names), the same input — within
    ``AUDIT_WINDOW`` seconds. The machine audit names it (docs/agents.md#approvals)."""
    latest = (
        Approval.objects.filter(agent=agent, answered_at__isnull=False)
        .only("id", "tool_name", "tool_input", "decision", "answered_at")
        .order_by("-answered_at", "-pk")
        .first()
    )
    if latest is None or not latest.allowed:
        return None
    if latest.answered_at is None or (timezone.now() - latest.answered_at).total_seconds() > AUDIT_WINDOW:
        return None
    named = latest.tool_name.startswith("mcp__") and latest.tool_name.endswith(f"__{tool_name}")
    return latest if named and latest.tool_input == arguments else None
