"""Agent tokens: the ``DISPATCH_MCP_TOKEN`` of a CLI agent (spec/agents.md §2, §6).

A token is minted at each start, handed to the agent in its environment only (never in
argv, logs or URLs), and revoked at stop and archive. It authenticates as that agent on
``/mcp`` and REST: the caller's user is the agent's owner and the agent is the caller
(its id is the machine session; launches record it as ``launched_by``).
"""

from __future__ import annotations

import hmac

from django.db import transaction
from django.utils import timezone

from dispatch.models import Agent, AgentToken
from dispatch.services import TOKEN_PREFIX_LENGTH, generate_token, token_digest

# Statuses in which an agent token authenticates: an agent that is up (or coming up).
ACTIVE_STATUSES = frozenset({Agent.Status.CREATING, Agent.Status.RUNNING, Agent.Status.STOPPING})


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
    """Revoke every active token of ``agent`` (stop, archive); returns how many."""
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
