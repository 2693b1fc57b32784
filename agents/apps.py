from __future__ import annotations

from django.apps import AppConfig


class AgentsConfig(AppConfig):
    """Agents: CLI agents in tmux and the built-in expert agent."""

    name = "agents"
    verbose_name = "Agents"

    def ready(self) -> None:
        from agents.tokens import agent_bearer, live_agent_tokens
        from core.authentication import bearer_kind_register
        from core.revocation import live_credentials_register

        # Agent tokens (DISPATCH_MCP_TOKEN) authenticate wherever a user API token does.
        bearer_kind_register(agent_bearer)

        # An event stream opened with an agent token ends with the token or its agent.
        live_credentials_register("a", "agent_token_id", live_agent_tokens)
