"""The device-token endpoint against RFC 6749 §5.1-5.2 and RFC 8628 §3.4-3.5 as strict
OAuth clients read it (docs/shim-protocol.md#getting-a-token): both no-cache headers on
every answer, the grant_type checks, and no WARNING log line for a normal poll."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.test import Client

from machines.models import DeviceAuthorization

pytestmark = pytest.mark.django_db

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
MACHINE = {"machine_id": "conformance-1", "hostname": "laptop", "platform": "linux", "arch": "x86_64"}
TOKEN_URL = "/api/v1/machines/device/token"


def start(client: Client) -> str:
    response = client.post("/api/v1/machines/device/code", MACHINE, content_type="application/json")
    assert response.status_code == 200, response.content
    assert response["Pragma"] == "no-cache"
    device_code: str = response.json()["device_code"]
    return device_code


def poll(client: Client, body: dict[str, Any], *, form: bool = False) -> Any:
    if form:
        return client.post(TOKEN_URL, body)
    return client.post(TOKEN_URL, body, content_type="application/json")


def assert_not_cached(response: Any) -> None:
    assert response["Cache-Control"] == "no-store"
    assert response["Pragma"] == "no-cache"


@pytest.mark.parametrize("form", [False, True], ids=["json", "form"])
def test_every_token_answer_carries_both_no_cache_headers(client, owner, form):
    device_code = start(client)
    pending = poll(client, {"grant_type": GRANT_TYPE, "device_code": device_code}, form=form)
    assert pending.status_code == 400 and pending.json()["error"] == "authorization_pending"
    assert_not_cached(pending)
    slow = poll(client, {"grant_type": GRANT_TYPE, "device_code": device_code}, form=form)
    assert slow.json()["error"] == "slow_down"
    assert_not_cached(slow)
    DeviceAuthorization.objects.update(status=DeviceAuthorization.Status.APPROVED, user=owner, last_polled_at=None)
    issued = poll(client, {"grant_type": GRANT_TYPE, "device_code": device_code}, form=form)
    assert issued.status_code == 200 and issued.json()["token_type"] == "Bearer"
    assert_not_cached(issued)


def test_a_missing_grant_type_is_invalid_request_and_counts_no_poll(client):
    device_code = start(client)
    response = poll(client, {"device_code": device_code})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"
    assert "grant_type" in response.json()["error_description"]
    assert_not_cached(response)
    assert DeviceAuthorization.objects.get().last_polled_at is None


@pytest.mark.parametrize(
    "grant_type", ["authorization_code", "client_credentials", "urn:ietf:params:oauth:grant-type:x"]
)
def test_another_grant_type_is_unsupported_grant_type(client, grant_type):
    device_code = start(client)
    response = poll(client, {"grant_type": grant_type, "device_code": device_code})
    assert response.status_code == 400
    assert response.json()["error"] == "unsupported_grant_type"
    assert_not_cached(response)
    assert DeviceAuthorization.objects.get().last_polled_at is None


def test_a_non_string_grant_type_is_invalid_request(client):
    response = poll(client, {"grant_type": 7, "device_code": start(client)})
    assert response.json()["error"] == "invalid_request"


def test_a_rate_limited_poll_is_not_cached_either(client, settings):
    for _ in range(31):
        response = poll(client, {"grant_type": GRANT_TYPE, "device_code": "x"})
    assert response.status_code == 429
    assert_not_cached(response)


def test_normal_polls_log_no_warning(client, caplog):
    device_code = start(client)
    with caplog.at_level(logging.INFO):
        for _ in range(2):  # authorization_pending, then slow_down
            assert poll(client, {"grant_type": GRANT_TYPE, "device_code": device_code}).status_code == 400
    noisy = [record for record in caplog.records if record.levelno >= logging.INFO]
    assert noisy == [], [record.getMessage() for record in noisy]
