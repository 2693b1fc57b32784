"""Launching any local agent: one entry point for REST, MCP and the expert's tools.

spec/agents.md §5 ``POST /agents`` and §6 ``dispatch_launch_agent``. ``location``
(launching on a linked instance) comes with the peers issue.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from agents import cli, services
from agents.models import Agent
from agents.tokens import agent_scope_launch
from core.errors import InvalidRequest


def launchable_types() -> dict[str, bool]:
    """Every agent type with whether it can be launched here now (``expert`` always;
    a CLI type only when its program is on ``PATH``)."""
    return {services.EXPERT: True, **{name: spec.available() for name, spec in settings.AGENT_TYPES.items()}}


def agent_launch_any(
    *,
    owner: User,
    type: str,
    name: str,
    prompt: str = "",
    cwd: str | None = None,
    launched_by: Agent | None = None,
    child: bool = False,
    full_access: bool = False,
    launched_by_peer: dict[str, Any] | None = None,
) -> Agent:
    """Launch a local agent of ``type`` and return it (201 material).

    ``cwd`` defaults to the launching agent's cwd, else ``DISPATCH_DEFAULT_CWD``.
    ``child`` makes ``launched_by`` the parent (``launched_by`` is recorded either way).
    An expert agent is created ``running`` and ``prompt`` (if any) queued as its first
    run; a CLI agent is started in tmux with ``prompt`` as its first message
    (``cli.agent_launch``). Raises ``InvalidRequest`` for an unknown type or one whose
    program is not on PATH (the message lists what is available), a bad name or cwd;
    ``PERMISSION_DENIED`` for a full-access launch by an agent that is not full-access.
    ``launched_by_peer`` (``{instance_id, agent_id | null, name}``) marks an agent a peer
    launched (spec/peers.md §5): a ``shell`` agent then gets ``DISPATCH_LAUNCH_CONTEXT``.
    """
    types = launchable_types()
    if type not in types:
        raise InvalidRequest(
            f"unknown agent type '{type}'; known types: {', '.join(types)}", {"available_types": _available(types)}
        )
    if not types[type]:
        raise InvalidRequest(
            f"agent type '{type}' is unavailable here: its program is not on PATH",
            {"available_types": _available(types)},
        )
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string")
    agent_scope_launch(launched_by, full_access=full_access)
    where = cwd if cwd else (launched_by.cwd if launched_by is not None else settings.DEFAULT_CWD)
    parent = launched_by if child else None
    if type != services.EXPERT:
        # Not in a transaction: the tmux session outlives the request either way.
        return cli.agent_launch(
            owner=owner,
            type=type,
            name=name,
            prompt=prompt,
            cwd=where,
            parent=parent,
            launched_by=launched_by,
            full_access=full_access,
            launched_by_peer=launched_by_peer,
        )
    with transaction.atomic():
        agent = services.agent_create(
            owner=owner,
            type=type,
            name=name,
            cwd=where,
            parent=parent,
            launched_by=launched_by,
            full_access=full_access,
            launched_by_peer=launched_by_peer,
        )
        if prompt.strip():
            services.run_enqueue(agent=agent, instruction=prompt)
    return agent


def _available(types: dict[str, bool]) -> list[str]:
    return [name for name, ok in types.items() if ok]
