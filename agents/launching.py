"""Which agent types work here, and which one a launch without a type gets (docs/agents.md#agent-types;
``GET /api/v1/agent-types``).

A type is **available** when an agent of it would work now: ``expert`` when a model
endpoint is configured (``DISPATCH_LLM_BASE_URL``; without one its runs fail at once),
a CLI type of ``settings.AGENT_TYPES`` (``DISPATCH_AGENT_TYPES``) when its
program is on ``PATH``. Every listing (the agent types API and page, the launch tool's
description) says which are not, and why.

A type is **launchable** when a launch of it is accepted: a CLI type only when available
(the launch is refused), ``expert`` always — an expert agent has no process, and it works
as soon as the instance is restarted with an endpoint, so asking for one by name is not
refused; it is only never chosen for a caller who did not ask.

The **default type** (``default_launch_type``) is ``expert`` with an endpoint, else the
first available CLI type of kind ``llm``, else none — never a ``shell`` type, which would
type a prose prompt into bash. ``launch_type_resolve`` is what every launch without a type
calls (REST, the page, the MCP/expert launch tool, a linked instance's launch here). The
launch itself is ``agents.lifecycle.agent_launch_any``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from agents import services
from core.errors import InvalidRequest

# The one wording of "the expert agent has no model" (an expert run fails with it).
NO_ENDPOINT = "no model endpoint configured (set DISPATCH_LLM_BASE_URL)"


@dataclass(frozen=True)
class TypeAvailability:
    """One agent type as listings show it: ``kind`` is ``expert``, ``llm`` or ``shell``;
    ``reason`` says why it is not ``available`` ("" when it is)."""

    type: str
    kind: str
    available: bool
    reason: str


def agent_type_availability() -> list[TypeAvailability]:
    """Every agent type, ``expert`` first, then the CLI types in ``DISPATCH_AGENT_TYPES``
    order, each with whether it works here now and why not (``NO_ENDPOINT``; "not
    installed here: <program> not on PATH")."""
    expert_ok = bool(settings.LLM_BASE_URL)
    listed = [TypeAvailability(services.EXPERT, "expert", expert_ok, "" if expert_ok else NO_ENDPOINT)]
    for name, spec in settings.AGENT_TYPES.items():
        missing = spec.missing_programs()
        reason = f"not installed here: {', '.join(missing)} not on PATH" if missing else ""
        listed.append(TypeAvailability(str(name), spec.kind, not missing, reason))
    return listed


def available_types() -> list[str]:
    """The names of the types that work here now (``agent_type_availability``), in order."""
    return [entry.type for entry in agent_type_availability() if entry.available]


def launchable_types() -> dict[str, bool]:
    """Every agent type with whether a launch of it is accepted here: ``expert`` always
    (see the module docstring), a CLI type only when its program is on ``PATH``."""
    return {services.EXPERT: True, **{name: spec.available() for name, spec in settings.AGENT_TYPES.items()}}


def default_launch_type() -> str | None:
    """The type a launch without one gets: ``expert`` when a model endpoint is configured,
    else the first available CLI type of kind ``llm`` (in ``DISPATCH_AGENT_TYPES`` order:
    claude, codex, opencode by default), else ``None`` (the caller must name a type).
    Never a ``shell``-kind type."""
    if settings.LLM_BASE_URL:
        return services.EXPERT
    for name, spec in settings.AGENT_TYPES.items():
        if spec.kind == "llm" and spec.available():
            return str(name)
    return None


def no_default_message() -> str:
    """Why a launch here must name its type, with the types that work here."""
    available = available_types()
    return (
        "type is required: there is no default agent type here (the expert agent has no model endpoint: "
        "set DISPATCH_LLM_BASE_URL; no LLM CLI such as claude, codex or opencode is installed); available types: "
        + (", ".join(available) or "none")
    )


def launch_type_resolve(requested: str | None) -> str:
    """The type of a launch: ``requested`` when given (non-empty; checked by the launch
    itself), else ``default_launch_type()``. Raises ``InvalidRequest`` (400, details
    ``{"available_types": [...]}``) when none was given and there is no default."""
    if requested:
        return requested
    default = default_launch_type()
    if default is None:
        raise InvalidRequest(no_default_message(), {"available_types": available_types()})
    return default


def agent_types_data() -> list[dict[str, Any]]:
    """Every agent type as ``GET /api/v1/agent-types`` lists it: ``[{"type", "kind",
    "available", "reason"}]`` (``agent_type_availability``)."""
    return [
        {"type": entry.type, "kind": entry.kind, "available": entry.available, "reason": entry.reason}
        for entry in agent_type_availability()
    ]
