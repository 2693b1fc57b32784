"""The bearer-token lookup cache (``core.authentication.bearer_credential``):
a token just looked up costs no query for a second, and revocation is still honoured —
at once in the process that revokes, within ``BEARER_CACHE_SECONDS`` (or its next
revocation sweep) in any other."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent
from agents.tokens import agent_token_mint, agent_tokens_revoke
from core import credential_cache
from core.authentication import bearer_cache_clear, bearer_credential
from core.models import ApiToken
from core.revocation import revocation_sweep_once
from core.services import AuthenticationFailed, api_token_create, api_token_revoke
from tests.agents.conftest import Api, force_status

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_cache() -> Any:
    bearer_cache_clear()
    yield
    bearer_cache_clear()


class Clock:
    """``time.monotonic`` of ``core.credential_cache``, moved by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(credential_cache.time, "monotonic", lambda: self.now)


def test_a_token_just_looked_up_costs_no_query(owner: Any) -> None:
    raw = api_token_create(user=owner).raw
    with CaptureQueriesContext(connection) as first:
        assert bearer_credential(raw)[0] == owner
    with CaptureQueriesContext(connection) as second:
        user, token = bearer_credential(raw)
    assert len(first) >= 1
    assert len(second) == 0
    assert (user, isinstance(token, ApiToken)) == (owner, True)


def test_a_token_revoked_here_is_refused_at_once(owner: Any, django_capture_on_commit_callbacks: Any) -> None:
    issued = api_token_create(user=owner)
    bearer_credential(issued.raw)
    with django_capture_on_commit_callbacks(execute=True):
        api_token_revoke(user=owner, token_id=issued.token.pk)
    with pytest.raises(AuthenticationFailed):
        bearer_credential(issued.raw)


def test_a_token_revoked_elsewhere_is_refused_within_the_cache_time(owner: Any, monkeypatch: Any) -> None:
    clock = Clock(monkeypatch)
    issued = api_token_create(user=owner)
    bearer_credential(issued.raw)
    # Another process revokes it: this process's cache is not told.
    ApiToken.objects.filter(pk=issued.token.pk).update(revoked_at=timezone.now())
    clock.now += credential_cache.BEARER_CACHE_SECONDS / 2
    assert bearer_credential(issued.raw)[0] == owner  # the bound, not a promise
    clock.now += credential_cache.BEARER_CACHE_SECONDS / 2
    with pytest.raises(AuthenticationFailed):
        bearer_credential(issued.raw)


@pytest.mark.django_db(transaction=True)
def test_the_revocation_sweep_drops_the_cache(owner: Any) -> None:
    issued = api_token_create(user=owner)
    bearer_credential(issued.raw)
    ApiToken.objects.filter(pk=issued.token.pk).update(revoked_at=timezone.now())
    asyncio.run(revocation_sweep_once())  # what the doorbell of a revocation elsewhere runs
    with pytest.raises(AuthenticationFailed):
        bearer_credential(issued.raw)


def test_a_refused_token_is_not_cached(owner: Any) -> None:
    with pytest.raises(AuthenticationFailed):
        bearer_credential("not-a-token")
    assert credential_cache._entries == {}


def test_an_agent_token_is_cached_and_refused_at_once_when_its_agent_stops(
    owner: Any, make_agent: Any, django_capture_on_commit_callbacks: Any
) -> None:
    agent = force_status(make_agent(owner), Agent.Status.RUNNING)
    raw = agent_token_mint(agent=agent)
    assert bearer_credential(raw) == (owner, agent)
    with CaptureQueriesContext(connection) as again:
        bearer_credential(raw)
    assert len(again) == 0
    with django_capture_on_commit_callbacks(execute=True):
        agent_tokens_revoke(agent=agent)
    with pytest.raises(AuthenticationFailed):
        bearer_credential(raw)


def test_rest_refuses_a_revoked_token_on_the_next_request(owner: Any, django_capture_on_commit_callbacks: Any) -> None:
    issued = api_token_create(user=owner)
    api = Api(issued.raw)
    assert api.client.get("/api/v1/auth/tokens", headers=api.headers).status_code == 200
    with django_capture_on_commit_callbacks(execute=True):
        api_token_revoke(user=owner, token_id=issued.token.pk)
    assert api.client.get("/api/v1/auth/tokens", headers=api.headers).status_code == 401
