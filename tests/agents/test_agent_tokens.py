"""Agent tokens: minted per start, revoked at stop, authenticating as the agent
(docs/agents.md#agent-tokens)."""

from __future__ import annotations

from typing import Any

from agents.models import Agent, AgentToken
from agents.tokens import agent_token_authenticate, agent_token_mint, agent_tokens_revoke
from tests.agents.conftest import Api, force_status


def test_a_minted_token_authenticates_as_its_agent_and_is_stored_only_hashed(owner: Any, make_agent: Any) -> None:
    agent = make_agent(owner)
    raw = agent_token_mint(agent=agent)
    assert len(raw) == 43 and not raw.startswith("-")
    stored = AgentToken.objects.get(agent=agent)
    assert stored.prefix == raw[:8] and raw not in stored.digest
    found = agent_token_authenticate(raw)
    assert found is not None and found.pk == agent.pk and found.owner == owner


def test_minting_again_revokes_the_earlier_token(owner: Any, make_agent: Any) -> None:
    agent = make_agent(owner)
    first = agent_token_mint(agent=agent)
    second = agent_token_mint(agent=agent)
    assert agent_token_authenticate(first) is None
    assert agent_token_authenticate(second) is not None


def test_a_revoked_token_or_a_stopped_agent_does_not_authenticate(owner: Any, make_agent: Any) -> None:
    agent = make_agent(owner)
    raw = agent_token_mint(agent=agent)
    force_status(agent, Agent.Status.STOPPED)
    assert agent_token_authenticate(raw) is None
    force_status(agent, Agent.Status.RUNNING)
    assert agent_token_authenticate(raw) is not None
    assert agent_tokens_revoke(agent=agent) == 1
    assert agent_token_authenticate(raw) is None


def test_garbage_never_authenticates(owner: Any, make_agent: Any) -> None:
    agent_token_mint(agent=make_agent(owner))
    for raw in ("", "x" * 500, "\udcff", "not-a-token"):
        assert agent_token_authenticate(raw) is None


def test_an_inactive_owner_disables_the_agent_token(owner: Any, make_agent: Any) -> None:
    raw = agent_token_mint(agent=make_agent(owner))
    owner.is_active = False
    owner.save()
    assert agent_token_authenticate(raw) is None


def test_rest_accepts_an_agent_token_in_its_owners_scope(owner: Any, outsider: Any, make_agent: Any) -> None:
    agent = make_agent(owner, name="me")
    other = make_agent(outsider, name="theirs")
    api = Api(agent_token_mint(agent=agent))
    assert api.get(f"/api/v1/agents/{agent.pk}").status_code == 200
    assert api.get(f"/api/v1/agents/{other.pk}").status_code == 404
    agent_tokens_revoke(agent=agent)
    refused = api.get(f"/api/v1/agents/{agent.pk}")
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"


def test_an_agent_token_cannot_list_or_revoke_its_users_api_tokens(
    owner: Any, owner_token: str, make_agent: Any
) -> None:
    from core.models import ApiToken

    agent = make_agent(owner, name="me")
    api = Api(agent_token_mint(agent=agent))
    listed = api.get("/api/v1/auth/tokens")
    assert listed.status_code == 403 and "agent tokens cannot" in listed.json()["error"]["message"]
    token = ApiToken.objects.get(user=owner)
    assert api.delete(f"/api/v1/auth/tokens/{token.pk}").status_code == 403
    token.refresh_from_db()
    assert token.revoked_at is None
    assert Api(owner_token).get("/api/v1/auth/tokens").status_code == 200
