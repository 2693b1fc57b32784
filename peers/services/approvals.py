"""Approvals a linked peer may see and answer here (docs/peers.md#approvals).

A link acts as its user here (``peer.owner``, docs/peers.md#permissions): the peer sees the pending
approvals of that user's **local** agents — the agents it mirrors as shadows — and may
answer them. Both need the link's ``allow_message`` capability (what lets the peer write
to those agents at all; an answer is the same reach as a message); the routes check it
(``incoming.capability_require``) before these run. An answer is recorded as the link's
(``Approval.answered_by_peer``), naming the person there ("bob on Laptop").
"""

from __future__ import annotations

import json
from typing import Any

from agents import approval_selectors, approvals
from agents.models import Approval
from core.errors import NotFound
from peers.models import Peer
from peers.protocol import ApprovalAnswerBody

# Pending approvals one listing carries (oldest first): a page, not an export.
PEER_APPROVALS_MAX = 100
# Characters of one input's JSON a listing carries whole; a longer one goes as
# ``{"input_cut": <its first PEER_INPUT_SHOWN characters>}``. A hook may send a megabyte a
# request, and a page shows 16,000 characters of it (agents.approval_pages.INPUT_SHOWN).
PEER_INPUT_SHOWN = 16_000


def _iso(value: Any) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


def peer_approval_data(approval: Approval) -> dict[str, Any]:
    """``approval`` as ``peers.protocol.PeerApproval``: ``{id, agent_id, agent_name,
    tool_name, tool_summary, tool_input, suggestions, status, asked_at, expires_at}``
    (ids ours, times ISO 8601 UTC with ``Z``; an input whose JSON is longer than
    ``PEER_INPUT_SHOWN`` characters as ``{"input_cut": <its start>}``)."""
    tool_input = approval.tool_input if isinstance(approval.tool_input, dict) else {"input": approval.tool_input}
    text = json.dumps(tool_input, ensure_ascii=False)
    if len(text) > PEER_INPUT_SHOWN:
        tool_input = {"input_cut": text[:PEER_INPUT_SHOWN]}
    return {
        "id": approval.pk,
        "agent_id": approval.agent_id,
        "agent_name": approval.agent.name,
        "tool_name": approval.tool_name,
        "tool_summary": approval.tool_summary,
        "tool_input": tool_input,
        "suggestions": approval.suggestions if isinstance(approval.suggestions, list) else [],
        "status": approval.status,
        "asked_at": _iso(approval.asked_at),
        "expires_at": _iso(approval.expires_at),
    }


def peer_approvals_pending(*, peer: Peer) -> list[dict[str, Any]]:
    """The pending approvals of ``peer.owner``'s local agents (never a shadow's: those are
    answered where their agent runs), oldest first, at most ``PEER_APPROVALS_MAX``, each
    as ``peer_approval_data``."""
    rows = (
        approval_selectors.approvals_for(user=peer.owner, status=Approval.Status.PENDING)
        .filter(agent__peer__isnull=True)
        .order_by("asked_at", "pk")[:PEER_APPROVALS_MAX]
    )
    return [peer_approval_data(approval) for approval in rows]


def peer_approval_answer(*, peer: Peer, approval_id: str, answer: ApprovalAnswerBody) -> dict[str, Any]:
    """Answer ``peer.owner``'s agent's pending approval ``approval_id`` for ``peer``
    (``approvals.approval_answer(by_peer=peer, by_peer_name=<the person there>)``).

    Returns ``peers.protocol.PeerApprovalAnswer``: ``{id, agent_id, status, decision,
    answered_by, answered_at}``. Raises as ``approval_answer``: ``NotFound`` (404: unknown,
    another user's, or a shadow's approval — never which), ``ApprovalAnswered`` (409
    ``APPROVAL_ANSWERED``, naming who answered), ``InvalidRequest`` (400: a message with
    an allow). Nothing changes on an error.
    """
    found = approval_selectors.approval_get_for(user=peer.owner, approval_id=approval_id)
    if found.agent.peer_id is not None:
        raise NotFound(f"no approval '{approval_id}'")
    answered = approvals.approval_answer(
        approval_id=found.pk,
        decision=answer.decision,
        message=answer.message,
        by_peer=peer,
        by_peer_name=answer.answered_by.name,
    )
    return {
        "id": answered.pk,
        "agent_id": answered.agent_id,
        "status": answered.status,
        "decision": answered.decision,
        "answered_by": answered.answered_by,
        "answered_at": _iso(answered.answered_at),
    }
