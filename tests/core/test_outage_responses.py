"""REST answers 503 ``TEMPORARILY_UNAVAILABLE``, never 500, while the channel layer or the
database cannot be reached (docs/operating.md#health).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import InterfaceError, OperationalError
from django.test import AsyncClient, Client

from core.errors import CHANNEL_LAYER_UNAVAILABLE, DATABASE_UNAVAILABLE
from core.services import server_process_ensure
from remotes.models import Remote, WsSession
from tests.outage import LayerOutage

pytestmark = [pytest.mark.django_db(transaction=True)]


def _error(response: Any) -> dict[str, Any]:
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    return dict(body["error"])


def _remote(user: Any) -> None:
    session = WsSession.objects.create(
        user=user, channel_name="specific.abc!def", server_process_id=server_process_ensure(), auth_method="header"
    )
    Remote.objects.create(
        user=user,
        name="clock",
        ws_session=session,
        channel_name=session.channel_name,
        server_process_id=session.server_process_id,
        tools=[{"name": "now", "description": "the time", "parameters": {"type": "object", "properties": {}}}],
    )


async def test_a_remote_call_over_rest_answers_503_while_the_channel_layer_is_down(
    owner: Any, owner_token: str
) -> None:
    await database_sync_to_async(_remote)(owner)
    LayerOutage(get_channel_layer()).start()
    response = await AsyncClient().post(
        "/api/v1/remotes/clock/call",
        data={"function": "now", "args": {}},
        content_type="application/json",
        headers={"Authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 503
    error = _error(response)
    assert error["code"] == "TEMPORARILY_UNAVAILABLE"
    assert error["message"] == CHANNEL_LAYER_UNAVAILABLE
    assert error["details"] == {"service": "channel_layer"}


@pytest.mark.parametrize("failure", [OperationalError("connection refused"), InterfaceError("connection closed")])
def test_a_drf_route_answers_503_while_the_database_is_down(
    owner_token: str, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    def unreachable(**kwargs: Any) -> Any:
        raise failure

    monkeypatch.setattr("remotes.api.remotes_for", unreachable)
    response = Client(raise_request_exception=False).get(
        "/api/v1/remotes", headers={"Authorization": f"Bearer {owner_token}"}
    )
    assert response.status_code == 503
    assert _error(response) == {
        "code": "TEMPORARILY_UNAVAILABLE",
        "message": DATABASE_UNAVAILABLE,
        "details": {"service": "database"},
    }


def test_a_page_answers_503_while_the_database_is_down(owner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client(raise_request_exception=False)
    client.force_login(owner)

    def unreachable(**kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr("remotes.views.remotes_for", unreachable)
    response = client.get("/remotes/")
    assert response.status_code == 503
    assert response.content.decode() == DATABASE_UNAVAILABLE
