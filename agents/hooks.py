"""What the agents app registers with the kernel: how the revocation sweep checks event
streams opened with an agent token (``core.revocation``)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from agents.models import Agent, AgentToken


def live_agent_tokens(ids: set[int], now: Any) -> QuerySet[Any]:
    """The agent tokens among ``ids`` still valid: not revoked, their agent creating,
    running or stopping (``Agent.TOKEN_STATUSES``)."""
    return AgentToken.objects.filter(pk__in=ids, revoked_at__isnull=True, agent__status__in=Agent.TOKEN_STATUSES)
