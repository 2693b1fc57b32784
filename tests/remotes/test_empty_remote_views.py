"""A remote with no functions yet on the Remotes page and in ``GET /api/v1/remotes``
(0 to 128 functions: docs/ws-protocol.md#remote-connect)."""

from __future__ import annotations

import html
import uuid

import pytest

from remotes.services import remote_connect, ws_session_open

FRESH = "remote-center/fresh"


def connect_empty(user, name: str = FRESH) -> None:
    channel = f"test.{uuid.uuid4().hex}"
    session = ws_session_open(user=user, channel_name=channel, auth_method="token")
    remote_connect(user=user, ws_session_id=session.pk, channel_name=channel, remotename=name, tools=[])


@pytest.mark.django_db
def test_the_remotes_page_shows_a_remote_with_no_functions_yet(client, owner):
    connect_empty(owner)
    client.force_login(owner)
    page = html.unescape(client.get("/remotes/").content.decode())
    assert f'data-remote="{FRESH}"' in page
    assert "no functions yet" in page
    assert 'id="no-remotes"' not in page


@pytest.mark.django_db
def test_the_rest_api_lists_a_remote_with_no_functions(client, owner, owner_token):
    connect_empty(owner)
    response = client.get("/api/v1/remotes", headers={"Authorization": f"Bearer {owner_token}"})
    assert response.status_code == 200, response.content
    body = response.json()
    entries = body if isinstance(body, list) else body.get("remotes", body.get("results"))
    [entry] = [e for e in entries if e.get("remotename", e.get("name")) == FRESH]
    assert entry["functions"] == []
