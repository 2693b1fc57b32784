"""The user's pending approvals on linked instances, fetched and answered through the
peer API (docs/peers.md#approvals): the other side of ``GET /api/v1/peers/approvals``
and ``POST /api/v1/peers/approvals/{id}/answer``.

Every call is async and bounded (``LINKED_APPROVALS_TIMEOUT`` for a listing,
``ANSWER_TIMEOUT`` for an answer): a page asks every live link at once and a peer that is
down, slow, refuses, or is too old to serve approvals becomes one line ("Laptop:
unreachable"), never a broken page.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils.dateparse import parse_datetime
from pydantic import ValidationError

from agents.approval_pages import ApprovalCard
from agents.models import Agent
from agents.selectors import is_valid_id
from core.errors import DispatchError, NotFound
from peers.client import PeerClient, PeerUnreachable
from peers.models import Peer
from peers.protocol import PeerApproval, PeerApprovalList
from peers.selectors import peer_get_for, peers_for
from peers.services.identity import identity_get

logger = logging.getLogger(__name__)

# Seconds a page waits for one linked instance's list (all are asked at once).
LINKED_APPROVALS_TIMEOUT = 3.0
# Seconds an answer waits for the linked instance.
ANSWER_TIMEOUT = 10.0
APPROVALS_PATH = "/api/v1/peers/approvals"


@dataclass
class LinkedApprovals:
    """One linked instance's part of the Approvals page: its ``cards`` (pending, oldest
    first), or ``problem`` saying why there are none to show ("unreachable", "approvals
    not permitted …")."""

    peer_id: int
    label: str
    cards: list[ApprovalCard] = field(default_factory=list)
    problem: str = ""


def _when(value: str | None) -> datetime | None:
    return parse_datetime(value) if value else None


def _refusal(peer: Peer, status: int, body: Any) -> str:
    """A peer's non-200 answer as the page's words."""
    message = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = str(body["error"].get("message", ""))[:300]
    if status == 403:
        return f"approvals not permitted by {peer.label} ({message or 'capability not granted'})"
    if status == 404:
        return f"{peer.label} does not offer approvals (an older Dispatch)"
    return f"{peer.label} answered {status}{': ' + message if message else ''}"


def _cards(peer: Peer, approvals: list[PeerApproval], shadows: dict[str, str]) -> list[ApprovalCard]:
    return [
        ApprovalCard(
            id=approval.id,
            agent_id=approval.agent_id,
            agent_name=approval.agent_name,
            tool_name=approval.tool_name,
            tool_summary=approval.tool_summary,
            tool_input=approval.tool_input,
            suggestions=approval.suggestions,
            status=approval.status,
            asked_at=_when(approval.asked_at),
            expires_at=_when(approval.expires_at),
            answer_url=reverse("approvals-linked-answer", kwargs={"peer_id": peer.pk, "approval_id": approval.id}),
            agent_url=reverse("agent", kwargs={"agent_id": shadows[approval.agent_id]})
            if approval.agent_id in shadows
            else "",
            peer_label=peer.label,
        )
        for approval in approvals
    ]


def _shadows_of(peer: Peer) -> dict[str, str]:
    """``{agent id there: shadow id here}`` for ``peer``'s shadows of its owner."""
    rows = Agent.objects.filter(owner_id=peer.owner_id, peer=peer).values_list("peer_agent_id", "pk")
    return {remote: local for remote, local in rows if remote}


async def linked_approvals_of(peer: Peer, *, timeout: float = LINKED_APPROVALS_TIMEOUT) -> LinkedApprovals:
    """``peer``'s pending approvals for this link (``GET /api/v1/peers/approvals``), or
    the reason there are none to show. Never raises for the peer's failures."""
    part = LinkedApprovals(peer_id=peer.pk, label=peer.label)
    if peer.unlinked_by_peer:
        part.problem = f"{peer.label} unlinked this instance"
        return part
    granted = peer.granted_by_peer if isinstance(peer.granted_by_peer, dict) else {}
    if granted.get("allow_message") is False:
        part.problem = f"approvals not permitted by {peer.label} (it does not let this instance message its agents)"
        return part
    try:
        response = await asyncio.wait_for(PeerClient(peer, timeout=timeout).get(APPROVALS_PATH), timeout + 1.0)
    except (PeerUnreachable, TimeoutError):
        part.problem = f"instance {peer.label}: unreachable"
        return part
    except Exception:  # a broken key store or any other local failure: one line, not the page
        logger.exception("listing approvals on peer %s failed", peer.label)
        part.problem = f"instance {peer.label}: could not be asked"
        return part
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        part.problem = _refusal(peer, response.status_code, body)
        return part
    try:
        listing = PeerApprovalList.model_validate(body)
    except ValidationError:
        listing = None
    # Its ids go into this page's links and back into the path of an answer to it: an id
    # that is no id (a "/", "..", "?") would break the page or reach another route there.
    if listing is None or not all(is_valid_id(a.id) and is_valid_id(a.agent_id) for a in listing.approvals):
        part.problem = f"{peer.label} sent approvals this instance cannot read"
        return part
    shadows = await database_sync_to_async(_shadows_of)(peer)
    part.cards = _cards(peer, listing.approvals, shadows)
    return part


async def linked_approvals_for(*, user: User, timeout: float = LINKED_APPROVALS_TIMEOUT) -> list[LinkedApprovals]:
    """Every live link of ``user``, by label, with its pending approvals or its problem;
    all asked at once, so the whole takes at most about ``timeout`` seconds."""
    peers = await database_sync_to_async(lambda: list(peers_for(user=user)))()
    return list(await asyncio.gather(*(linked_approvals_of(peer, timeout=timeout) for peer in peers)))


async def linked_approval_answer(
    *, user: User, peer_id: int, approval_id: str, decision: str, message: str
) -> dict[str, Any]:
    """Answer the approval ``approval_id`` on ``user``'s link ``peer_id`` as ``user``
    (``POST /api/v1/peers/approvals/{id}/answer``; its timeline there says "approved once
    by alice on <our name>").

    Returns the peer's answer ``{id, agent_id, status, decision, answered_by, answered_at}``.
    Raises ``NotFound`` for a link that is not ``user``'s or an ``approval_id`` that is
    no id (``agents.selectors.is_valid_id``: nothing is sent); ``DispatchError`` with the
    peer's own code and message for its refusals (``APPROVAL_ANSWERED`` 409 naming who
    answered, ``NOT_FOUND``, ``CAPABILITY_NOT_GRANTED``, ``INVALID_REQUEST``), and
    ``TEMPORARILY_UNAVAILABLE`` (503) when the peer cannot be reached: nothing was answered.
    """
    peer = await database_sync_to_async(peer_get_for)(user=user, peer_id=peer_id)
    if not is_valid_id(approval_id):  # it becomes part of the path asked there
        raise NotFound("no such approval")
    identity = await database_sync_to_async(identity_get)()
    body = {
        "decision": decision,
        "message": message,
        "answered_by": {"instance_id": identity.instance_id, "agent_id": None, "name": user.get_username()},
    }
    path = f"{APPROVALS_PATH}/{approval_id}/answer"
    try:
        response = await PeerClient(peer, timeout=ANSWER_TIMEOUT, identity=identity).post(path, body)
    except PeerUnreachable:
        raise DispatchError(
            "TEMPORARILY_UNAVAILABLE", f"instance {peer.label}: unreachable; the approval was not answered"
        ) from None
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code == 200 and isinstance(answer, dict):
        return answer
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        error = answer["error"]
        raise DispatchError(
            str(error.get("code") or "INVALID_RESPONSE"),
            f"{peer.label}: {str(error.get('message', ''))[:500]}",
            {"peer": peer.label, "status": response.status_code},
        )
    raise DispatchError("INVALID_RESPONSE", f"{peer.label} answered {response.status_code}", {"peer": peer.label})
