"""Prompting an expert agent (docs/agents.md#prompts-and-runs).

The options every edge accepts (``prompt_options_check``) and the run an expert agent's
prompt becomes (``agent_prompt``, ``agent_prompt_for``). The edges call
``agents.lifecycle.agent_prompt_any``, which also takes a CLI agent's prompt as a message.
The remote entries of ``options.remotes`` are kept as given in ``run.input["remotes"]``;
they are resolved into tools once, at run start (``remote_entries``, used by the
ExpertAgent).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import User

from agents import services
from agents.models import Agent, Run
from agents.selectors import agent_get_for, not_found
from core.errors import DispatchError, InvalidRequest

PREFIX = re.compile(r"[A-Za-z0-9_-]{0,16}")
MAX_REMOTES = 100
MAX_TOOL_NAMES = 200


@dataclass(frozen=True)
class RemoteEntry:
    """One entry of ``options.remotes``: a remote's name and the prefix of its tool names."""

    name: str
    prefix: str = ""


def remote_entries(value: Any) -> list[RemoteEntry]:
    """``options.remotes`` as entries.

    Each item is a remote name or ``{"name": …, "prefix": …}`` with a prefix matching
    ``[A-Za-z0-9_-]{0,16}`` (empty by default). Raises ``InvalidRequest`` naming the bad
    entry.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("options.remotes must be a list of remote names or {name, prefix} objects")
    if len(value) > MAX_REMOTES:
        raise InvalidRequest(f"options.remotes may name at most {MAX_REMOTES} remotes")
    entries = []
    for index, item in enumerate(value):
        name: Any
        prefix: Any
        if isinstance(item, str):
            name, prefix = item, ""
        elif isinstance(item, Mapping):
            unknown = sorted(set(item) - {"name", "prefix"})
            if unknown:
                raise InvalidRequest(
                    f"options.remotes[{index}]: unknown key '{unknown[0][:64]}' (allowed: name, prefix)"
                )
            name, prefix = item.get("name"), item.get("prefix", "")
        else:
            raise InvalidRequest(f"options.remotes[{index}] must be a remote name or a {{name, prefix}} object")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise InvalidRequest(f"options.remotes[{index}]: name must be a non-empty string")
        if not isinstance(prefix, str) or PREFIX.fullmatch(prefix) is None:
            raise InvalidRequest(
                f"options.remotes[{index}]: prefix must match [A-Za-z0-9_-]{{0,16}}",
                {"prefix": prefix if isinstance(prefix, str) and len(prefix) <= 64 else None},
            )
        entries.append(RemoteEntry(name=name, prefix=prefix))
    return entries


def tool_names(value: Any) -> list[str] | None:
    """``options.tools`` (a list of native tool names) or ``None`` when absent.

    Raises ``InvalidRequest`` for anything but a list of non-empty strings.
    """
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > MAX_TOOL_NAMES
        or not all(isinstance(name, str) and 0 < len(name) <= 64 for name in value)
    ):
        raise InvalidRequest("options.tools must be a list of native tool names")
    return list(value)


def prompt_options_check(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a prompt, checked; raises ``InvalidRequest``.

    Reserved keys ``instruction`` and ``input`` are refused; ``remotes`` and ``tools``
    must have their documented shapes; other keys are kept as given (JSON values).
    """
    checked = services.prompt_options_validate(options)
    remote_entries(checked.get("remotes"))
    tool_names(checked.get("tools"))
    return checked


def agent_prompt(*, user: User, agent: Agent, instruction: str, input: Any = None, **options: Any) -> Run:
    """Prompt ``agent`` as ``user`` (the design's ``Agent.prompt``).

    For an expert agent, queues a run with ``input = {"instruction", "input", **options}``
    and returns it. ``agent`` must be ``user``'s (the edges scope it with
    ``agent_get_for``). Raises ``InvalidRequest`` for bad options, an empty instruction,
    or a CLI agent (its prompt is a message: ``lifecycle.agent_prompt_any``), ``CONFLICT`` (409) for
    a stopped agent ("agent 'x' is not running", as a message to it would), and
    ``NotFound`` for another user's agent.
    """
    if agent.owner_id != user.pk:
        raise not_found("agent", agent.pk)
    checked = prompt_options_check(options)
    if agent.type != services.EXPERT:
        raise InvalidRequest("prompting CLI agents is not available yet")
    if agent.status != Agent.Status.RUNNING:
        raise DispatchError("CONFLICT", f"agent '{agent.pk}' is not running", {"status": agent.status})
    return services.run_enqueue(agent=agent, instruction=instruction, input=input, **checked)


def agent_prompt_for(*, user: User, agent_id: Any, instruction: Any, input: Any = None, options: Any = None) -> Run:
    """``agent_prompt`` for the agent named ``agent_id``, as the edges receive it.

    ``options`` is a JSON object or ``None``. Raises ``NotFound`` ("no agent 'x'") for an
    unknown agent or another user's, ``InvalidRequest`` as ``agent_prompt``.
    """
    agent = agent_get_for(user=user, agent_id=agent_id)
    if options is None:
        options = {}
    if not isinstance(instruction, str):
        raise InvalidRequest("instruction must be a non-empty string")
    # Checked before they become keyword arguments: a reserved key must be refused, not
    # collide with ``instruction=`` or ``input=``.
    checked = prompt_options_check(options)
    return agent_prompt(user=user, agent=agent, instruction=instruction, input=input, **checked)
