"""Agent tokens: the ``DISPATCH_MCP_TOKEN`` of a CLI agent (docs/agents.md#agent-tokens).

A token is minted at each start, handed to the agent in its environment only (never in
argv, logs or URLs), and revoked at stop and archive. It authenticates as that agent on
``/mcp`` and REST: the caller's user is the agent's owner and the agent is the caller
(its id is the machine session; launches record it as ``launched_by``).

The scope of an agent token (README "What an agent token may do"):
it may read its owner's agents, runs, events and messages; launch (recording
``launched_by``), message, and stop, start or archive itself and the agents it launched
(``Agent.manages``); run machine ops and copies only in its own session (``session_id`` =
its agent id); list machines; call its owner's remotes. It may not manage tokens, revoke
machines or set the default machine, pair, link or unlink peers, approve device codes, or
act in another session. The ``agent_scope_*`` functions below are the one place each
refusal is decided; every edge (REST, MCP, the expert agent's tools) calls them.
"""

from __future__ import annotations

import hmac
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from rest_framework.request import Request

from agents.models import Agent, AgentToken
from core import credential_cache
from core.errors import DispatchError
from core.services import TOKEN_PREFIX_LENGTH, generate_token, token_digest

# Statuses in which an agent token authenticates: an agent that is up (or coming up).
ACTIVE_STATUSES = Agent.TOKEN_STATUSES


@transaction.atomic
def agent_token_mint(*, agent: Agent) -> str:
    """Revoke ``agent``'s earlier tokens and return a new raw token (43 characters).

    The raw value is returned once and stored only as its SHA-256 digest.
    """
    agent_tokens_revoke(agent=agent)
    raw = generate_token()
    AgentToken.objects.create(agent=agent, prefix=raw[:TOKEN_PREFIX_LENGTH], digest=token_digest(raw))
    return raw


def agent_tokens_revoke(*, agent: Agent) -> int:
    """Revoke every active token of ``agent`` (stop, archive); returns how many. This
    process's cached bearer lookups are dropped now and when the transaction commits (other
    processes' expire within ``core.credential_cache.BEARER_CACHE_SECONDS``)."""
    credential_cache.clear()
    transaction.on_commit(credential_cache.clear)  # a lookup meanwhile, by another thread, saw it valid
    return AgentToken.objects.filter(agent=agent, revoked_at__isnull=True).update(revoked_at=timezone.now())


def agent_token_authenticate(raw_token: str) -> Agent | None:
    """The agent whose active token is ``raw_token``, with its owner loaded, or ``None``.

    ``None`` for an unknown or revoked token, an agent not creating/running/stopping, or
    an inactive owner. Constant-time digest comparison.
    """
    if not raw_token or len(raw_token) > 200:
        return None
    digest = token_digest(raw_token)
    token = AgentToken.objects.select_related("agent__owner").filter(digest=digest, revoked_at__isnull=True).first()
    if token is None or not hmac.compare_digest(token.digest, digest):
        return None
    agent = token.agent
    if agent.status not in ACTIVE_STATUSES or not agent.owner.is_active:
        return None
    return agent


def agent_token_id(raw_token: str) -> int | None:
    """The primary key of the active ``AgentToken`` whose raw value is ``raw_token`` (what
    an event stream opened with it stands on, ``core.revocation``), or ``None``."""
    if not raw_token or len(raw_token) > 200:
        return None
    found: int | None = (
        AgentToken.objects.filter(digest=token_digest(raw_token), revoked_at__isnull=True)
        .values_list("pk", flat=True)
        .first()
    )
    return found


# --- the scope of an agent token ---------------------------------------------------------------


def agent_scope_forbid(agent: Agent | None, action: str) -> None:
    """Refuse ``action`` (e.g. ``"revoke machines"``) to a caller that is an agent.

    ``agent``: the calling agent, ``None`` for a user (then nothing is refused). Raises
    ``DispatchError`` ``PERMISSION_DENIED`` (403) naming the action.
    """
    if agent is not None:
        raise DispatchError(
            "PERMISSION_DENIED",
            f"an agent token cannot {action}; use a user token or the pages",
            {"agent_id": agent.pk},
        )


def agent_scope_session(agent: Agent | None, session_id: str) -> None:
    """Refuse a machine session other than the calling agent's own (its id).

    Raises ``DispatchError`` ``PERMISSION_DENIED`` (403) for an agent acting in another
    ``session_id``; a user may act in any session of theirs.
    """
    if agent is not None and session_id != agent.pk:
        raise DispatchError(
            "PERMISSION_DENIED",
            f"an agent token acts only in its own session ('{agent.pk}'), not in '{session_id[:100]}'",
            {"agent_id": agent.pk, "session_id": session_id[:100]},
        )


def agent_scope_manage(agent: Agent | None, target: Agent) -> None:
    """Refuse to stop, start, archive or cancel a run of ``target`` unless the calling
    agent is ``target`` or launched it (``Agent.manages``).

    Raises ``DispatchError`` ``PERMISSION_DENIED`` (403); a user manages all their agents.
    """
    if agent is not None and not agent.manages(target):
        raise DispatchError(
            "PERMISSION_DENIED",
            f"agent '{agent.pk}' may stop, start or archive only itself and the agents it launched, not '{target.pk}'",
            {"agent_id": agent.pk, "target": target.pk},
        )


def agent_scope_launch(launcher: Agent | None, *, full_access: bool) -> None:
    """Refuse an agent giving a new agent more than it has: a ``full_access`` launch by
    an agent that is not full-access itself (as a linked instance needs
    ``allow_full_access``, docs/peers.md#permissions).

    ``launcher``: the launching agent, ``None`` for a user. Raises ``DispatchError``
    ``PERMISSION_DENIED`` (403).
    """
    if launcher is not None and full_access and not launcher.full_access:
        raise DispatchError(
            "PERMISSION_DENIED",
            f"agent '{launcher.pk}' is not full-access, so it cannot launch a full-access agent",
            {"agent_id": launcher.pk},
        )


def agent_bearer(raw_token: str) -> tuple[User, Agent] | None:
    """The bearer-token kind of agent tokens (``core.authentication.bearer_kind_register``):
    ``(owner, Agent)`` — so ``request.auth`` is the calling agent — or ``None``."""
    agent = agent_token_authenticate(raw_token)
    return None if agent is None else (agent.owner, agent)


def calling_agent(request: Request | HttpRequest) -> Agent | None:
    """The agent whose token authenticated ``request``, or ``None`` for a user's request.

    Works for DRF requests (``BearerTokenAuthentication`` puts the agent in ``auth``) and
    for the async JSON views (``core.http.request_user`` does the same)."""
    auth = getattr(request, "auth", None)
    return auth if isinstance(auth, Agent) else None


def live_agent_tokens(ids: set[int], now: Any) -> QuerySet[Any]:
    """The agent tokens among ``ids`` still valid (``core.revocation.live_credentials_register``):
    not revoked, their agent creating, running or stopping (``Agent.TOKEN_STATUSES``)."""
    return AgentToken.objects.filter(pk__in=ids, revoked_at__isnull=True, agent__status__in=Agent.TOKEN_STATUSES)
