"""Every error under ``/api/`` is the JSON error shape, and the schema lists each
operation's error statuses (docs/architecture.md#errors)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client, override_settings

pytestmark = [pytest.mark.django_db]


def assert_error_shape(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = json.loads(response.content)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    return dict(body["error"])


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_a_body_over_djangos_upload_limit_is_a_json_413_not_an_html_400() -> None:
    body = json.dumps({"code": "x" * 5000})
    response = Client().post("/api/v1/peers/claim", data=body, content_type="application/json")
    error = assert_error_shape(response, 413, "REQUEST_TOO_LARGE")
    assert "DISPATCH_MAX_REQUEST_BYTES" in error["message"]


def test_a_wrong_method_on_a_plain_api_view_is_a_json_405_with_allow() -> None:
    response = Client().get("/api/v1/peers/claim")
    assert_error_shape(response, 405, "METHOD_NOT_ALLOWED")
    assert response["Allow"] == "POST"


@pytest.mark.parametrize("accept", ["c>Dh", "image/png", "text/csv;q=1"])
def test_an_accept_header_no_renderer_satisfies_gets_json_not_an_undocumented_406(
    owner_token: str, accept: str
) -> None:
    # What schemathesis sent (ST103: 406 undocumented); RFC 9110 §12.5.1 lets us disregard it.
    headers = {"Authorization": f"Bearer {owner_token}", "Accept": accept}
    response = Client().get("/api/v1/agents", headers=headers)
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"].startswith("application/json")
    assert "agents" in json.loads(response.content)
    missing = Client().get("/api/v1/agents/agt_ffffffffffff/events", headers=headers)
    assert_error_shape(missing, 404, "NOT_FOUND")


def test_a_session_write_without_csrf_is_a_json_403(owner: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    response = client.post("/api/v1/sessions/default/ops", data="{}", content_type="application/json")
    assert_error_shape(response, 403, "PERMISSION_DENIED")


def test_pages_outside_the_api_keep_their_html_errors() -> None:
    response = Client().get("/login/nothing-here")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


def test_the_schema_lists_every_operations_error_statuses_with_the_error_shape(owner_token: str) -> None:
    response = Client().get("/api/schema/", {"format": "json"}, headers={"Authorization": f"Bearer {owner_token}"})
    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["components"]["schemas"]["Error"]["required"] == ["error"]
    operations = {
        (method.upper(), path): operation
        for path, route in schema["paths"].items()
        for method, operation in route.items()
        if method in ("get", "post", "patch", "put", "delete")
    }
    for (method, path), operation in operations.items():
        responses = operation["responses"]
        assert {"400", "404", "503"} <= set(responses), (method, path)
        if method in ("POST", "PATCH", "PUT"):
            assert "413" in responses, (method, path)
    # Authenticated routes can refuse; throttled ones can say 429; writes can conflict.
    assert {"401", "403"} <= set(operations[("GET", "/api/v1/agents")]["responses"])
    assert "429" in operations[("POST", "/api/v1/peers/claim")]["responses"]
    assert "429" in operations[("POST", "/api/v1/auth/token")]["responses"]
    assert "409" in operations[("POST", "/api/v1/sessions/{session_id}/ops")]["responses"]
    error = operations[("GET", "/api/v1/agents")]["responses"]["404"]
    assert error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    # The device-token endpoint keeps its RFC 6749 400.
    assert (
        "authorization_pending"
        in operations[("POST", "/api/v1/machines/device/token")]["responses"]["400"]["description"]
    )
