"""Reads about agents, always scoped to the caller (docs/agents.md#the-rest-api).

Pages are keyset pages, newest first, ordered by ``(created_at, id)`` descending: one
query per page whatever the size of the table. A cursor is opaque to clients (URL-safe
base64 of ``[created_at ISO 8601, id]``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.contrib.auth.models import User
from django.db.models import Model, Q, QuerySet

from agents.hooks import Link
from agents.models import Agent, AgentEvent, AgentMessage, Run
from core.errors import InvalidRequest, NotFound

EVENTS_DEFAULT_LIMIT = 200
EVENTS_MAX_LIMIT = 500
AGENTS_PAGE_SIZE = 100
RUNS_PAGE_SIZE = 100
MESSAGES_DEFAULT_LIMIT = 50
MESSAGES_MAX_LIMIT = 200

RowT = TypeVar("RowT", bound=Model)

# An agent's id (``models.new_agent_id``), and an agent on a linked instance as
# ``dispatch_send_message`` takes it: ``<label or instance id>:<agent id>`` (docs/agents.md#agent-tools).
AGENT_ID = re.compile(r"^agt_[0-9a-f]{12}$")
PEER_ADDRESS = re.compile(r"^(?P<peer>[^:]{1,64}):(?P<agent>agt_[0-9a-f]{12})$")

# Ids are `agt_`/`run_` + hex; anything outside this alphabet cannot name a row, and
# PostgreSQL would refuse some of it (NUL) with an error instead of "no such row".
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_valid_id(value: Any) -> bool:
    """Whether ``value`` could be an agent or run id (or an agent type)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def not_found(kind: str, value: Any) -> NotFound:
    """``NotFound("no <kind> '<id>'")``, echoing the id only when it is a plausible one."""
    return NotFound(f"no {kind} '{value}'" if is_valid_id(value) else f"no such {kind}")


@dataclass(frozen=True)
class Page(Generic[RowT]):
    """One page of rows, newest first; ``next`` is the cursor of the older page or None."""

    items: list[RowT]
    next: str | None


def encode_cursor(created_at: datetime, pk: Any) -> str:
    """An opaque cursor pointing just below ``(created_at, pk)``."""
    raw = json.dumps([created_at.isoformat(), pk], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, *, pk_type: type) -> tuple[datetime, Any]:
    """``(created_at, pk)`` from a cursor made by ``encode_cursor``.

    Raises ``InvalidRequest("invalid cursor")`` for anything else.
    """
    if not isinstance(cursor, str) or len(cursor) > 200:
        raise InvalidRequest("invalid cursor")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at_text, pk = json.loads(raw)
        created_at = datetime.fromisoformat(created_at_text)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise InvalidRequest("invalid cursor") from None
    if created_at.tzinfo is None or type(pk) is not pk_type:
        raise InvalidRequest("invalid cursor")
    if isinstance(pk, str) and not is_valid_id(pk):
        raise InvalidRequest("invalid cursor")
    return created_at, pk


def _page(rows: QuerySet[RowT], *, limit: int, before: str | None, pk_type: type) -> Page[RowT]:
    if before:
        created_at, pk = decode_cursor(before, pk_type=pk_type)
        # The plain ``created_at <= cursor`` bound lets the (owner/agent, -created_at, -id)
        # index seek to the page instead of walking every newer row (bench B9, deep pages).
        rows = rows.filter(created_at__lte=created_at).filter(
            Q(created_at__lt=created_at) | Q(created_at=created_at, pk__lt=pk)
        )
    items = list(rows.order_by("-created_at", "-pk")[: limit + 1])
    if len(items) <= limit:
        return Page(items=items, next=None)
    items = items[:limit]
    last = items[-1]
    return Page(items=items, next=encode_cursor(last.created_at, last.pk))  # type: ignore[attr-defined]


def page_limit(value: Any, *, default: int, maximum: int) -> int:
    """A page size from a query parameter: an integer from 1 to ``maximum``.

    ``None`` or ``""`` gives ``default``; anything else raises ``InvalidRequest``.
    """
    if value is None or value == "":
        return default
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"limit must be an integer from 1 to {maximum}") from None
    if not 1 <= limit <= maximum:
        raise InvalidRequest(f"limit must be an integer from 1 to {maximum}")
    return limit


def is_shadow(agent: Agent) -> bool:
    """Whether ``agent`` is a shadow: the local row of an agent on a linked instance
    (``peer_agent_id`` set, docs/peers.md#shadow-agents; ``peer`` is set with it and cleared only
    when the link's row is deleted). A shadow stays one when its link is removed: its
    process, events and messages are its peer's. The one place this is decided."""
    return bool(agent.peer_agent_id)


def shadow_link(agent: Agent) -> Link | None:
    """The live link of the shadow ``agent``: its ``peer`` unless the link was removed —
    the row deleted, or revoked (unlinking revokes a link, by us or by the peer:
    docs/peers.md#unlinking) — else ``None``. Only meaningful when ``is_shadow(agent)``."""
    peer = agent.peer
    return peer if peer is not None and peer.revoked_at is None else None


def shadow_link_for_message(agent: Agent) -> Link:
    """The live link a message to the shadow ``agent`` goes through (docs/peers.md#the-outbox).

    Raises ``InvalidRequest`` when its link was removed (deleted or revoked): "agent 'x'
    belongs to a link that was removed: it cannot be messaged".
    """
    link = shadow_link(agent)
    if link is None:
        raise InvalidRequest(f"agent '{agent.pk}' belongs to a link that was removed: it cannot be messaged")
    return link


def agent_get_for(*, user: User, agent_id: str) -> Agent:
    """``user``'s agent ``agent_id`` (archived included). ``NotFound`` for anyone else's."""
    agent = None
    if is_valid_id(agent_id):
        agent = Agent.objects.select_related("peer").filter(owner=user, pk=agent_id).first()
    if agent is None:
        raise not_found("agent", agent_id)
    agent.owner = user  # the filter's own user: joining the row again would read it twice
    return agent


def agents_for(
    *, user: User, status: str | None = None, type: str | None = None, before: str | None = None
) -> Page[Agent]:
    """``user``'s agents, newest first, 100 per page.

    Archived agents are hidden unless ``status="archived"`` is asked for. An unknown
    ``status`` raises ``InvalidRequest``.
    """
    rows = Agent.objects.select_related("owner", "peer").filter(owner=user)
    if status:
        if status not in Agent.Status.values:
            raise InvalidRequest(f"unknown status '{status}'; known: {', '.join(Agent.Status.values)}")
        rows = rows.filter(status=status)
    else:
        rows = rows.exclude(status=Agent.Status.ARCHIVED)
    if type:
        if not is_valid_id(type):
            raise InvalidRequest(f"invalid type filter '{type[:64]}'")
        rows = rows.filter(type=type)
    return _page(rows, limit=AGENTS_PAGE_SIZE, before=before, pk_type=str)


def events_page(*, agent: Agent, limit: int = EVENTS_DEFAULT_LIMIT, before: str | None = None) -> Page[AgentEvent]:
    """One page of ``agent``'s events, newest first (docs/agents.md#the-rest-api).

    ``limit`` is 1–500 (``InvalidRequest`` otherwise); ``before`` a cursor from an earlier
    page. The caller has already scoped ``agent`` (``agent_get_for``).
    """
    limit = page_limit(limit, default=EVENTS_DEFAULT_LIMIT, maximum=EVENTS_MAX_LIMIT)
    return _page(AgentEvent.objects.filter(agent=agent), limit=limit, before=before, pk_type=int)


def runs_page(*, agent: Agent, before: str | None = None) -> Page[Run]:
    """One page (100) of ``agent``'s runs, newest first."""
    return _page(Run.objects.filter(agent=agent), limit=RUNS_PAGE_SIZE, before=before, pk_type=str)


def run_get_for(*, user: User, run_id: str) -> Run:
    """``user``'s run ``run_id``. ``NotFound`` for another user's run."""
    runs = Run.objects.select_related("agent").filter(agent__owner=user, pk=run_id)
    run = runs.first() if is_valid_id(run_id) else None
    if run is None:
        raise not_found("run", run_id)
    return run


def messages_page(
    *, agent: Agent, limit: int = MESSAGES_DEFAULT_LIMIT, before: str | None = None
) -> Page[AgentMessage]:
    """One page of the messages ``agent`` received or sent, newest first.

    ``limit`` is 1–200 (``InvalidRequest`` otherwise); ``before`` a cursor from an earlier
    page. One query per page (senders joined). The caller has already scoped ``agent``.
    """
    limit = page_limit(limit, default=MESSAGES_DEFAULT_LIMIT, maximum=MESSAGES_MAX_LIMIT)
    rows = AgentMessage.objects.select_related("sender_user").filter(Q(recipient_agent=agent) | Q(sender_agent=agent))
    return _page(rows, limit=limit, before=before, pk_type=int)
