"""``GET /api/v1/remotes``: the caller's connected remotes, each with its functions as it
declared them (docs/ws-protocol.md#remote-connect)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import Client

from remotes.models import Remote
from remotes.protocol import FunctionSpec
from remotes.services import remote_connect, ws_session_open

pytestmark = pytest.mark.django_db


def test_a_remote_is_listed_as_it_was_answered_before_its_model(owner: Any, owner_token: str) -> None:
    channel = f"test.{uuid.uuid4().hex}"
    session = ws_session_open(user=owner, channel_name=channel, auth_method="token")
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = FunctionSpec.model_validate({"name": "add", "description": "adds", "parameters": parameters})
    remote_connect(user=owner, ws_session_id=session.pk, channel_name=channel, remotename="calc", tools=[spec])
    row = Remote.objects.get()

    response = Client().get("/api/v1/remotes", headers={"Authorization": f"Bearer {owner_token}"})

    assert response.status_code == 200
    connected = row.connected_at.isoformat().replace("+00:00", "Z")
    assert response.content.decode() == (
        '{"remotes":[{"remotename":"calc","functions":[{"name":"add","description":"adds",'
        '"parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}],'
        f'"ws_session":"{session.pk}","connected_at":"{connected}"}}]}}'
    )
