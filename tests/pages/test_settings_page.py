"""The Settings page: API tokens created (shown once), listed and revoked
(docs/ws-protocol.md#authentication)."""

from __future__ import annotations

import html
import re

import pytest
from django.test import Client

from core.models import ApiToken

pytestmark = pytest.mark.django_db

NEW_TOKEN = re.compile(r'<code id="new-token" class="secret">([^<]+)</code>')


def text_of(response) -> str:
    return html.unescape(response.content.decode())


def create_token(client, **fields) -> tuple[str, object]:
    response = client.post("/settings/", {"name": "", "expires_in_days": "", **fields})
    assert response.status_code == 200, text_of(response)
    match = NEW_TOKEN.search(response.content.decode())
    assert match, "the new token is not on the page"
    return match.group(1), response


@pytest.fixture
def alice_client(client, owner):
    client.force_login(owner)
    return client


def test_it_shows_an_empty_state_without_tokens(alice_client):
    response = alice_client.get("/settings/")
    assert response.status_code == 200
    assert 'id="no-tokens"' in response.content.decode()
    assert "You have no API tokens yet" in text_of(response)


def test_it_shows_a_new_token_once(alice_client, owner):
    raw, response = create_token(alice_client, name="laptop remote")
    assert response.content.decode().count(raw) == 1
    assert "it will not be shown again" in text_of(response)
    assert 'data-copy="#new-token"' in response.content.decode()
    assert "no-store" in response["Cache-Control"]

    later = alice_client.get("/settings/")
    assert raw not in later.content.decode()
    token = ApiToken.objects.get(user=owner)
    assert raw.startswith(token.prefix)
    assert f"{token.prefix}…" in text_of(later)
    assert "laptop remote" in text_of(later)
    assert "active" in text_of(later)


def test_the_new_token_authenticates_the_api(alice_client):
    raw, _ = create_token(alice_client)
    api = Client()  # no session: only the token can authenticate
    assert api.get("/api/v1/remotes").status_code in (401, 403)
    response = api.get("/api/v1/remotes", headers={"Authorization": f"Bearer {raw}"})
    assert response.status_code == 200


def test_it_creates_a_token_that_expires_after_the_days_given(alice_client, owner):
    create_token(alice_client, name="short", expires_in_days="7")
    token = ApiToken.objects.get(user=owner)
    assert token.name == "short"
    assert token.expires_at is not None
    assert 6 <= (token.expires_at - token.created_at).days <= 7


def test_it_refuses_an_expiry_that_is_not_a_positive_number_of_days(alice_client, owner):
    response = alice_client.post("/settings/", {"name": "bad", "expires_in_days": "0"})
    assert response.status_code == 400
    assert 'id="token-form-error"' in response.content.decode()
    assert "The token was not created" in text_of(response)
    assert 'id="new-token"' not in response.content.decode()
    assert not ApiToken.objects.filter(user=owner).exists()


def test_it_lists_only_the_users_own_tokens(alice_client, member, token_for):
    token_for(member, name="bobs secret token")
    bob_prefix = ApiToken.objects.get(user=member).prefix
    response = alice_client.get("/settings/")
    assert "bobs secret token" not in text_of(response)
    assert bob_prefix not in response.content.decode()
    assert 'id="no-tokens"' in response.content.decode()


def test_it_revokes_a_token_and_the_token_is_refused_afterwards(alice_client, owner):
    raw, _ = create_token(alice_client, name="to revoke")
    token = ApiToken.objects.get(user=owner)
    response = alice_client.post(f"/settings/tokens/{token.pk}/revoke", follow=True)
    assert response.status_code == 200
    assert f"Token {token.prefix}… revoked." in text_of(response)
    assert "revoked" in text_of(response)
    token.refresh_from_db()
    assert token.revoked_at is not None
    refused = Client().get("/api/v1/remotes", headers={"Authorization": f"Bearer {raw}"})
    assert refused.status_code == 401


def test_it_refuses_to_revoke_another_users_token(client, owner, member, token_for):
    raw = token_for(owner, name="alice's")
    alice_token = ApiToken.objects.get(user=owner)
    client.force_login(member)
    response = client.post(f"/settings/tokens/{alice_token.pk}/revoke", follow=True)
    assert response.status_code == 200
    assert f"no token {alice_token.pk}" in text_of(response)
    alice_token.refresh_from_db()
    assert alice_token.revoked_at is None
    assert Client().get("/api/v1/remotes", headers={"Authorization": f"Bearer {raw}"}).status_code == 200


def test_revoking_only_accepts_posts(alice_client, owner, token_for):
    token_for(owner)
    token = ApiToken.objects.get(user=owner)
    assert alice_client.get(f"/settings/tokens/{token.pk}/revoke").status_code == 405
    token.refresh_from_db()
    assert token.revoked_at is None
