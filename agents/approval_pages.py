"""The approval pages (docs/agents.md#approvals-on-the-pages): ``/approvals/`` and
``/approvals/<id>/``, the answer form every approval box posts to, and the policy rules.

An approval box shows the tool, the exact input (escaped, monospace, wrapping), the CLI's
suggested rules and when it was asked, with three buttons: Approve once, Always allow this
rule, Deny (with a message the CLI shows the model). Answers go through
``agents.approvals.approval_answer(user=…)``; a lost race ("already answered by X",
``APPROVAL_ANSWERED``) comes back as a note on the page, never an error page. Every page
needs a login: a notification's link to ``/approvals/<id>/`` only shows the approval, and
another user's id is 404.

The pending approvals of the user's agents on linked instances are a fragment of the
``peers`` app (``/approvals/linked``, fetched by the page after it loads, so a slow or
down peer never holds the page up); this module knows nothing of peers.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from agents import approval_selectors, approvals, selectors
from agents.models import Agent, Approval, ApprovalRule
from core.authentication import authenticated_user
from core.errors import DispatchError
from core.views import htmx_login_required

DECISIONS_SHOWN = 20  # answered approvals on a page (the API lists the rest)
# Pending approvals one page shows (oldest first; the API lists the rest), and characters of
# one approval's full input shown under "Full input". An agent holding its own token can
# make requests of up to a megabyte each, as many as it likes: a page stays a page.
PENDING_SHOWN = 50
INPUT_SHOWN = 16_000
OUTCOMES = {
    "allow_once": "approved once",
    "allow_always": "always allowed",
    "deny": "denied",
}


# Characters an approval box shows as ``⟨U+202E⟩`` instead of obeying: bidi controls,
# zero-width and other format characters, controls but newline and tab, line and paragraph
# separators. A right-to-left override can make ``rm -rf ~`` read as something harmless
# ("Trojan Source", CVE-2021-42574); a person approving must see the text as it runs.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Zl", "Zp", "Co", "Cs"})


def shown_plainly(text: str) -> str:
    """``text`` with every character of ``_HIDDEN_CATEGORIES`` (but newline and tab) written
    as ``⟨U+XXXX⟩``; the rest as it is."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(
        f"⟨U+{ord(c):04X}⟩" if c not in "\n\t" and unicodedata.category(c) in _HIDDEN_CATEGORIES else c for c in text
    )


@dataclass(frozen=True)
class ApprovalCard:
    """One approval as a page shows it, here or on a linked instance (``peer_label`` set).

    Times are aware datetimes; ``answer_url`` is where its box's form posts; ``agent_url``
    its agent's page here ("" for an agent on a peer without a shadow here).
    """

    id: str
    agent_id: str
    agent_name: str
    tool_name: str
    tool_summary: str
    tool_input: Any
    suggestions: Any
    status: str
    asked_at: datetime | None
    expires_at: datetime | None
    answer_url: str
    agent_url: str
    decision: str = ""
    message: str = ""
    answered_by: str = ""
    answered_at: datetime | None = None
    rule: str = ""
    peer_label: str = ""

    @property
    def summary_text(self) -> str:
        """The summary as the box shows it (``shown_plainly``)."""
        return shown_plainly(self.tool_summary)

    @property
    def tool_name_text(self) -> str:
        """The tool's name as the box shows it (``shown_plainly``)."""
        return shown_plainly(self.tool_name)

    @property
    def input_text(self) -> str:
        """The full input as indented JSON (``shown_plainly``), cut to ``INPUT_SHOWN``
        characters (saying how much more there is: the API has it whole)."""
        try:
            text = json.dumps(self.tool_input, indent=2, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError):
            text = str(self.tool_input)
        if len(text) <= INPUT_SHOWN:
            return shown_plainly(text)
        more = f"… ({len(text) - INPUT_SHOWN:,} more characters: GET /api/v1/approvals/{self.id})"
        return f"{shown_plainly(text[:INPUT_SHOWN])}\n{more}"

    @property
    def outcome(self) -> str:
        """ "approved once", "always allowed", "denied", or "expired (denied)" for a timeout."""
        words = OUTCOMES.get(self.decision, self.status)
        return f"expired ({words})" if self.status == Approval.Status.EXPIRED else words

    @property
    def answered_by_text(self) -> str:
        """Who decided: the policy rule (its action, tool and pattern) or the answerer."""
        if self.rule:
            return f"policy: {self.rule}"
        if self.status == Approval.Status.EXPIRED:
            return "nobody (timeout: the agent's default)"
        return self.answered_by or "—"


def rule_text(rule: ApprovalRule) -> str:
    """``allow Bash 'git *' (every agent)``: a rule as the pages name it."""
    scope = f"agent {rule.agent.name}" if rule.agent_id and rule.agent is not None else "every agent"
    pattern = f" '{rule.pattern}'" if rule.pattern else ""
    return f"#{rule.pk} {rule.action} {rule.tool}{pattern} ({scope})"


def approval_card(approval: Approval) -> ApprovalCard:
    """``approval`` (with its ``agent`` and ``answered_by_rule`` loaded) as a card."""
    return ApprovalCard(
        id=approval.pk,
        agent_id=approval.agent_id,
        agent_name=approval.agent.name,
        tool_name=approval.tool_name,
        tool_summary=approval.tool_summary,
        tool_input=approval.tool_input,
        suggestions=approval.suggestions,
        status=approval.status,
        asked_at=approval.asked_at,
        expires_at=approval.expires_at,
        answer_url=reverse("approval-answer", kwargs={"approval_id": approval.pk}),
        agent_url=reverse("agent", kwargs={"agent_id": approval.agent_id}),
        decision=approval.decision,
        message=approval.message,
        answered_by=approval.answered_by,
        answered_at=approval.answered_at,
        rule=rule_text(approval.answered_by_rule) if approval.answered_by_rule is not None else "",
    )


def agent_approval_cards(*, user: User, agent: Agent) -> tuple[list[ApprovalCard], list[ApprovalCard]]:
    """``(pending, answered)`` approvals of ``user``'s ``agent``: the oldest
    ``PENDING_SHOWN`` pending ones and the last ``DECISIONS_SHOWN`` answered ones (newest first)."""
    pending = approval_selectors.approvals_for(user=user, status=Approval.Status.PENDING, agent=agent)
    answered = (
        approval_selectors.approvals_for(user=user, status=None, agent=agent)
        .exclude(status=Approval.Status.PENDING)
        .order_by("-answered_at", "-asked_at")[:DECISIONS_SHOWN]
    )
    shown = pending.order_by("asked_at")[:PENDING_SHOWN]
    return [approval_card(a) for a in shown], [approval_card(a) for a in answered]


def _next_url(request: HttpRequest, fallback: str) -> str:
    """The form's ``next`` when it is a path on this site, else ``fallback``."""
    candidate = request.POST.get("next", "")
    if candidate and url_has_allowed_host_and_scheme(candidate, allowed_hosts={request.get_host()}):
        return candidate
    return fallback


def _list_context(user: User) -> dict[str, Any]:
    pending = approval_selectors.approvals_for(user=user, status=Approval.Status.PENDING).order_by("asked_at")
    answered = (
        approval_selectors.approvals_for(user=user, status=None)
        .exclude(status=Approval.Status.PENDING)
        .order_by("-answered_at", "-asked_at")[:DECISIONS_SHOWN]
    )
    rules = approval_selectors.approval_rules_for(user=user)
    shown = [approval_card(a) for a in pending[:PENDING_SHOWN]]
    total = len(shown) if len(shown) < PENDING_SHOWN else pending.count()
    return {
        "pending": shown,
        "pending_total": total,
        "pending_more": total - len(shown),
        "decisions": [approval_card(a) for a in answered],
        "rules": [(rule, rule_text(rule)) for rule in rules],
        "rule_agents": selectors.agents_for(user=user).items,
        "rule_actions": ApprovalRule.Action.values,
        "back": reverse("approvals"),
    }


@require_GET
def approvals_page(request: HttpRequest) -> HttpResponse:
    """``/approvals/``: every pending approval of the user's agents (live), those on linked
    instances (the ``/approvals/linked`` fragment), recent decisions, and the policy rules
    with a form to add one."""
    return render(request, "approvals/approvals.html", _list_context(authenticated_user(request)))


@htmx_login_required
@require_GET
def approvals_fragment(request: HttpRequest) -> HttpResponse:
    """The live part of ``/approvals/`` (pending and recent decisions), re-fetched on a change."""
    return render(request, "approvals/_approvals_live.html", _list_context(authenticated_user(request)))


@require_GET
def approval_page(request: HttpRequest, approval_id: str) -> HttpResponse:
    """``/approvals/<id>/``: one approval (the link notifications carry): its box while
    pending, else who or which rule answered it. Another user's or an unknown id is 404."""
    user = authenticated_user(request)
    try:
        approval = approval_selectors.approval_get_for(user=user, approval_id=approval_id)
    except DispatchError as exc:
        return render(request, "agents/missing.html", {"message": exc.message}, status=404)
    return render(request, "approvals/approval.html", {"card": approval_card(approval)})


@require_POST
def approval_answer_form(request: HttpRequest, approval_id: str) -> HttpResponse:
    """``POST /approvals/<id>/answer`` ``decision=allow_once|allow_always|deny``,
    ``message`` (with a deny), ``next`` (a path here to return to; default the approval's
    page). A lost race shows "already answered by …" as a note; another user's or an
    unknown id is 404; a bad decision a note naming the choices."""
    user = authenticated_user(request)
    try:
        approval = approval_selectors.approval_get_for(user=user, approval_id=approval_id)
    except DispatchError as exc:
        return render(request, "agents/missing.html", {"message": exc.message}, status=404)
    back = _next_url(request, reverse("approval", kwargs={"approval_id": approval_id}))
    decision = request.POST.get("decision", "")
    try:
        answered = approvals.approval_answer(
            approval_id=approval.pk, decision=decision, message=request.POST.get("message", ""), user=user
        )
    except DispatchError as exc:
        if exc.code == "APPROVAL_ANSWERED":
            messages.warning(request, exc.message)
        else:
            messages.error(request, exc.message)
        return redirect(back)
    messages.success(request, f"{answered.tool_name}: {OUTCOMES.get(answered.decision, answered.status)}.")
    return redirect(back)


@require_POST
def approval_rule_add_form(request: HttpRequest) -> HttpResponse:
    """``POST /approvals/rules``: add a policy rule (``action``, ``tool``, ``pattern``,
    ``agent`` — an agent id, "" for every agent) through ``approvals.approval_rule_create``;
    a bad one is a note and nothing is added."""
    user = authenticated_user(request)
    post = request.POST
    try:
        agent = selectors.agent_get_for(user=user, agent_id=post["agent"]) if post.get("agent") else None
        approvals.approval_rule_create(
            user=user,
            agent=agent,
            tool=post.get("tool", "").strip(),
            pattern=post.get("pattern", "").strip(),
            action=post.get("action", ""),
        )
    except DispatchError as exc:
        messages.error(request, f"Rule not added: {exc.message}")
    else:
        messages.success(request, "Rule added.")
    return redirect(f"{reverse('approvals')}#rules")


@require_POST
def approval_rule_delete_form(request: HttpRequest, rule_id: int) -> HttpResponse:
    """``POST /approvals/rules/<id>/delete``: delete one of the user's rules (another's: a note, nothing deleted)."""
    try:
        approvals.approval_rule_delete(user=authenticated_user(request), rule_id=rule_id)
    except DispatchError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, "Rule deleted.")
    return redirect(f"{reverse('approvals')}#rules")
