"""Django's middleware with its hooks on the event loop (``core.middleware``): through the
ASGI handler a request makes no database-thread hop per middleware hook, and what needs the
database still gets it — a login, a saved session, stored messages, a CSRF check of a form,
a login-required page for an anonymous visitor."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref import sync
from django.contrib.auth.models import User
from django.test import AsyncClient

from core.models import ApiToken
from tests.conftest import PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The name of every function this process hands to the database thread."""
    seen: list[str] = []
    original = sync.SyncToAsync.__call__

    async def counted(self: sync.SyncToAsync[Any, Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(sync.SyncToAsync, "__call__", counted)
    yield seen


async def test_healthz_hops_only_for_its_own_database_check(hops: list[str]) -> None:
    client = AsyncClient()
    assert (await client.get("/healthz")).status_code == 200
    hops.clear()
    assert (await client.get("/healthz")).status_code == 200
    assert not [name for name in hops if "Middleware" in name], hops
    assert len(hops) <= 3, hops  # request_started, the database check, request_finished


async def test_an_api_request_with_a_token_hops_for_its_view_not_for_the_middleware(
    owner_token: str, hops: list[str]
) -> None:
    client, bearer = AsyncClient(), {"authorization": f"Bearer {owner_token}"}
    assert (await client.get("/api/v1/agents", headers=bearer)).status_code == 200
    hops.clear()
    assert (await client.get("/api/v1/agents", headers=bearer)).status_code == 200
    assert not [name for name in hops if "Middleware" in name], hops


async def test_an_anonymous_visitor_of_a_page_is_sent_to_the_login(hops: list[str]) -> None:
    response = await AsyncClient().get("/settings/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=/settings/")
    assert "LoginRequiredMiddleware.process_view" in hops  # the user was loaded, in a hop


async def _logged_in(owner: User, *, enforce_csrf: bool = False) -> AsyncClient:
    client = AsyncClient(enforce_csrf_checks=enforce_csrf)
    page = await client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token is not None
    response = await client.post(
        "/login/", {"username": owner.username, "password": PASSWORD, "csrfmiddlewaretoken": token.group(1)}
    )
    assert response.status_code == 302, response.content[:300]
    return client


async def test_a_login_saves_its_session_and_the_next_page_knows_the_user(owner: User) -> None:
    client = await _logged_in(owner, enforce_csrf=True)
    page = await client.get("/settings/")
    assert page.status_code == 200
    assert owner.username in page.content.decode()


async def test_a_form_without_its_csrf_token_is_refused_and_with_it_accepted(owner: User) -> None:
    client = await _logged_in(owner, enforce_csrf=True)
    token = await ApiToken.objects.acreate(user=owner, name="old", prefix="abcd1234", digest="x" * 64)
    refused = await client.post(f"/settings/tokens/{token.pk}/revoke")
    assert refused.status_code == 403
    assert (await ApiToken.objects.aget(pk=token.pk)).revoked_at is None
    page = await client.get("/settings/")
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert csrf is not None
    accepted = await client.post(f"/settings/tokens/{token.pk}/revoke", {"csrfmiddlewaretoken": csrf.group(1)})
    assert accepted.status_code == 302
    assert (await ApiToken.objects.aget(pk=token.pk)).revoked_at is not None
    # The message the revoke added was stored in the session (a hop) and is shown once.
    shown = (await client.get("/settings/")).content.decode()
    assert "revoked" in shown
    assert "revoked." not in (await client.get("/settings/")).content.decode()
