"""Device login (RFC 8628) through the HTTP endpoints and /machines/activate (docs/shim-protocol.md#getting-a-token)."""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from machines.models import DeviceAuthorization, MachineToken
from machines.services.connections import shim_authenticate

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

USER_CODE = re.compile(r"^[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}$")
MACHINE = {
    "machine_id": "3f2b9c1e-0000-4000-8000-000000000001",
    "hostname": "alice-laptop",
    "platform": "darwin",
    "arch": "arm64",
}


def request_code(client: Client, **overrides: Any) -> dict[str, Any]:
    response = client.post("/api/v1/machines/device/code", {**MACHINE, **overrides}, content_type="application/json")
    assert response.status_code == 200, response.content
    result: dict[str, Any] = response.json()
    return result


def poll(client: Client, device_code: str) -> tuple[int, dict[str, Any]]:
    response = client.post(
        "/api/v1/machines/device/token",
        {"grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": device_code},
        content_type="application/json",
    )
    assert response["Cache-Control"] == "no-store"
    return response.status_code, response.json()


def last_poll_long_ago(device_code: str) -> None:
    """Pretend the shim waited its interval since the last poll."""
    digest = hashlib.sha256(device_code.encode()).hexdigest()
    DeviceAuthorization.objects.filter(device_code_digest=digest).update(
        last_polled_at=timezone.now() - timedelta(seconds=60)
    )


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def decide(browser: Client, user_code: str, decision: str) -> Any:
    return browser.post("/machines/activate", {"user_code": user_code, "decision": decision})


# --- the code request ------------------------------------------------------------------------


def test_a_code_request_answers_the_rfc_8628_shape(client, settings):
    settings.PUBLIC_URL = "https://dispatch.example"
    response = client.post("/api/v1/machines/device/code", MACHINE, content_type="application/json")
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    body = response.json()
    assert set(body) == {
        "device_code",
        "user_code",
        "verification_uri",
        "verification_uri_complete",
        "expires_in",
        "interval",
    }
    assert USER_CODE.match(body["user_code"]), body["user_code"]
    assert len(body["device_code"]) >= 43  # 256 bits, base64url
    assert body["verification_uri"] == "https://dispatch.example/machines/activate"
    assert (
        body["verification_uri_complete"] == f"https://dispatch.example/machines/activate?user_code={body['user_code']}"
    )
    assert body["expires_in"] == 600
    assert body["interval"] == 5


def test_a_code_request_accepts_a_form_body_with_client_id_and_grant_type(client):
    response = client.post(
        "/api/v1/machines/device/code",
        {**MACHINE, "client_id": "dispatch-shim", "grant_type": "urn:ietf:params:oauth:grant-type:device_code"},
    )
    assert response.status_code == 200
    assert USER_CODE.match(response.json()["user_code"])


def test_codes_differ_between_requests(client):
    first, second = request_code(client), request_code(client)
    assert first["device_code"] != second["device_code"]
    assert first["user_code"] != second["user_code"]


@pytest.mark.parametrize(
    "body",
    [
        {k: v for k, v in MACHINE.items() if k != "machine_id"},
        {**MACHINE, "machine_id": "-starts-with-dash"},
        {**MACHINE, "machine_id": "x" * 65},
        {**MACHINE, "hostname": ""},
        {**MACHINE, "platform": 3},
    ],
)
def test_a_bad_code_request_is_invalid_request(client, body):
    response = client.post("/api/v1/machines/device/code", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"
    assert DeviceAuthorization.objects.count() == 0


def test_a_non_json_body_is_invalid_request(client):
    response = client.post("/api/v1/machines/device/code", "{oops", content_type="application/json")
    assert (response.status_code, response.json()["error"]) == (400, "invalid_request")


def test_codes_are_stored_only_hashed(client, browser):
    grant = request_code(client)
    decide(browser, grant["user_code"], "approve")
    status, issued = poll(client, grant["device_code"])
    assert status == 200
    raw_values = {grant["device_code"], grant["user_code"], grant["user_code"].replace("-", ""), issued["access_token"]}
    for model in (DeviceAuthorization, MachineToken):
        for row in model.objects.values():
            for column, value in row.items():
                for raw in raw_values:
                    assert raw not in str(value), f"{model.__name__}.{column} holds a raw code"


# --- polling ----------------------------------------------------------------------------------


def test_polling_before_approval_is_authorization_pending(client):
    grant = request_code(client)
    status, body = poll(client, grant["device_code"])
    assert (status, body["error"]) == (400, "authorization_pending")


def test_polling_too_fast_is_slow_down_and_the_interval_grows_by_five_seconds(client):
    grant = request_code(client)
    assert poll(client, grant["device_code"])[1]["error"] == "authorization_pending"
    assert poll(client, grant["device_code"])[1]["error"] == "slow_down"
    assert DeviceAuthorization.objects.get().interval == 10
    assert poll(client, grant["device_code"])[1]["error"] == "slow_down"
    assert DeviceAuthorization.objects.get().interval == 15
    last_poll_long_ago(grant["device_code"])
    assert poll(client, grant["device_code"])[1]["error"] == "authorization_pending"


def test_an_unknown_device_code_is_invalid_grant(client):
    assert poll(client, "no-such-code")[1]["error"] == "invalid_grant"
    response = client.post("/api/v1/machines/device/token", {}, content_type="application/json")
    assert response.json()["error"] == "invalid_request"


def test_approval_issues_a_bearer_token_once(client, browser, owner):
    grant = request_code(client)
    assert poll(client, grant["device_code"])[1]["error"] == "authorization_pending"
    assert decide(browser, grant["user_code"], "approve").status_code == 200
    status, body = poll(client, grant["device_code"])  # right after the last poll: no slow_down
    assert status == 200
    assert body["token_type"] == "Bearer"
    assert body["machine_id"] == MACHINE["machine_id"]
    identity = shim_authenticate(body["access_token"])
    assert identity is not None
    assert (identity.user, identity.machine_id) == (owner, MACHINE["machine_id"])
    last_poll_long_ago(grant["device_code"])
    status, again = poll(client, grant["device_code"])
    assert (status, again["error"]) == (400, "invalid_grant")
    assert MachineToken.objects.count() == 1


def test_a_denied_request_is_access_denied(client, browser):
    grant = request_code(client)
    response = decide(browser, grant["user_code"], "deny")
    assert response.status_code == 200
    assert b"Denied" in response.content
    assert poll(client, grant["device_code"])[1]["error"] == "access_denied"
    assert MachineToken.objects.count() == 0


def test_an_expired_code_is_expired_token_and_cannot_be_approved(client, browser):
    grant = request_code(client)
    DeviceAuthorization.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert poll(client, grant["device_code"])[1]["error"] == "expired_token"
    response = decide(browser, grant["user_code"], "approve")
    assert response.status_code == 400
    assert DeviceAuthorization.objects.get().status == DeviceAuthorization.Status.PENDING


def test_the_device_endpoints_are_rate_limited_per_address(client):
    statuses = [
        client.post("/api/v1/machines/device/token", {"device_code": "x"}, content_type="application/json").status_code
        for _ in range(31)
    ]
    assert statuses[:30] == [400] * 30
    assert statuses[30] == 429


# --- the activation page ----------------------------------------------------------------------


def test_the_activation_page_needs_a_login(client):
    response = client.get("/machines/activate")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_the_activation_page_prefills_the_code_from_the_link(client, browser):
    grant = request_code(client)
    response = browser.get("/machines/activate", {"user_code": grant["user_code"]})
    assert response.status_code == 200
    assert f'value="{grant["user_code"]}"'.encode() in response.content


def test_entering_a_code_in_any_case_with_spaces_shows_the_machine(client, browser):
    grant = request_code(client)
    typed = " " + grant["user_code"].lower().replace("-", " - ") + " "
    response = browser.post("/machines/activate", {"user_code": typed})
    assert response.status_code == 200
    page = response.content.decode()
    assert "alice-laptop" in page
    assert "darwin / arm64" in page
    assert 'id="approve"' in page and 'id="deny"' in page
    approved = decide(browser, typed, "approve")
    assert approved.status_code == 200
    assert "Approved" in approved.content.decode()
    assert poll(client, grant["device_code"])[0] == 200


def test_a_wrong_code_is_refused_without_saying_why(client, browser):
    request_code(client)
    response = browser.post("/machines/activate", {"user_code": "BCDF-GHJK"})
    assert response.status_code == 400
    assert "not valid or has expired" in response.content.decode()


def test_five_wrong_codes_lock_the_user_out_even_with_the_right_code(client, browser, member):
    grant = request_code(client)
    for wrong in ("BBBB-BBBB", "CCCC-CCCC", "nope", "DDDD-DDDD", "FFFF-FFFF"):
        assert browser.post("/machines/activate", {"user_code": wrong}).status_code == 400
    refused = browser.post("/machines/activate", {"user_code": grant["user_code"]})
    assert refused.status_code == 429
    assert decide(browser, grant["user_code"], "approve").status_code == 429
    assert DeviceAuthorization.objects.get().status == DeviceAuthorization.Status.PENDING
    # The limit is per user: bob is not locked out.
    bob = Client()
    bob.force_login(member)
    assert bob.post("/machines/activate", {"user_code": grant["user_code"]}).status_code == 200


def test_the_approver_owns_the_token_and_a_code_cannot_be_approved_twice(client, browser, member, owner):
    grant = request_code(client)
    bob = Client()
    bob.force_login(member)
    assert decide(bob, grant["user_code"], "approve").status_code == 200
    second = decide(browser, grant["user_code"], "approve")
    assert second.status_code == 400
    status, body = poll(client, grant["device_code"])
    assert status == 200
    identity = shim_authenticate(body["access_token"])
    assert identity is not None and identity.user == member
    assert not MachineToken.objects.filter(user=owner).exists()
    assert decide(bob, grant["user_code"], "deny").status_code == 400  # consumed: no second decision
