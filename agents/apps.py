from __future__ import annotations

from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """Agents: CLI agents in tmux and the built-in expert agent (spec/agents.md)."""

    name = "agents"
    verbose_name = "Agents"
