"""Which agent types can be launched here (spec/agents.md §2, §5 ``GET /agent-types``, §6).

``expert`` always; a CLI type of ``settings.AGENT_TYPES`` (``DISPATCH_AGENT_TYPES``) only
when its program is on ``PATH``. The launch itself is ``agents.lifecycle.agent_launch_any``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from agents import services


def launchable_types() -> dict[str, bool]:
    """Every agent type with whether it can be launched here now (``expert`` always;
    a CLI type only when its program is on ``PATH``)."""
    return {services.EXPERT: True, **{name: spec.available() for name, spec in settings.AGENT_TYPES.items()}}


def default_launch_type() -> str:
    """The type ``dispatch_launch_agent`` launches when none is given: the first available
    CLI type of kind ``llm`` (in ``DISPATCH_AGENT_TYPES`` order: claude, codex, opencode by
    default), else ``expert`` (always available)."""
    for name, spec in settings.AGENT_TYPES.items():
        if spec.kind == "llm" and spec.available():
            return str(name)
    return services.EXPERT


def agent_types_data() -> list[dict[str, Any]]:
    """Every agent type: ``[{"type", "kind", "available"}]``, ``expert`` first (kind
    ``expert``), then the configured CLI types in ``DISPATCH_AGENT_TYPES`` order."""
    available = launchable_types()
    kinds = {services.EXPERT: "expert", **{name: spec.kind for name, spec in settings.AGENT_TYPES.items()}}
    return [{"type": name, "kind": kinds[name], "available": ok} for name, ok in available.items()]
