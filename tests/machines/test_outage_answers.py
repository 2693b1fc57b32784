"""A machine operation that finds no machine while this process sees the channel layer down
answers 503 naming the layer, not 404 ``MACHINE_NOT_ATTACHED``: the outage disconnected the
shims and they come back with it (docs/operating.md#health)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import AsyncClient
from redis.exceptions import ConnectionError as RedisConnectionError

from core.outage import tracker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_tracker() -> Any:
    tracker._down.clear()
    yield
    tracker._down.clear()


async def op(token: str, **body: Any) -> Any:
    return await AsyncClient().post(
        "/api/v1/sessions/s1/ops",
        json.dumps({"op": "FILE_STAT", "payload": {"path": "/tmp"}, **body}),
        content_type="application/json",
        headers={"authorization": f"Bearer {token}"},
    )


@pytest.mark.parametrize("target", [None, "laptop"])
async def test_no_machine_during_a_layer_outage_is_503_naming_the_layer(owner_token: str, target: Any) -> None:
    extra = {"target_machine": target} if target else {}
    assert (await op(owner_token, **extra)).json()["error"]["code"] == "MACHINE_NOT_ATTACHED"
    tracker.failed("channel_layer", RedisConnectionError("Connection refused"))
    response = await op(owner_token, **extra)
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    error = response.json()["error"]
    assert error["code"] == "TEMPORARILY_UNAVAILABLE"
    assert error["message"].startswith("the channel layer (Redis) cannot be reached")
    assert error["details"] == {"service": "channel_layer"}
    tracker.ok("channel_layer")
    assert (await op(owner_token, **extra)).json()["error"]["code"] == "MACHINE_NOT_ATTACHED"


async def test_a_fan_out_to_every_machine_during_a_layer_outage_is_503(owner_token: str) -> None:
    tracker.failed("channel_layer", RedisConnectionError("Connection refused"))
    response = await op(owner_token, target_machines="*")
    assert response.status_code == 503
    assert response.json()["error"]["details"] == {"service": "channel_layer"}
