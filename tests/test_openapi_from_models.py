"""The OpenAPI schema (``/api/schema/``, OpenAPI 3.1) describes the routes drf-spectacular
cannot see from the pydantic models their views validate with, declared on each view
(``core.openapi.documented``), and still documents every path, method and status it
documented before the models (a peer launch answers 201, as it always did)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from core.openapi import REF, Components, documented_routes, served_routes, wire_values_constrained
from core.validation import Text
from machines.schemas import SessionOpBody
from peers.protocol import LaunchBody
from remotes.protocol import RemoteCallBody

pytestmark = pytest.mark.django_db

# (method, path) → the statuses documented before the schemas came from the models.
DOCUMENTED = {
    ("post", "/api/v1/remotes/{remotename}/call"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/sessions/{session_id}/ops"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/sessions/{session_id}/copy"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("get", "/api/v1/sessions/{session_id}/ops"): "200 400 401 403 404 4XX 503 5XX",
    ("post", "/api/v1/sessions/{session_id}/ops/{request_id}/cancel"): "202 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/sessions/{session_id}/pipe"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("put", "/api/v1/machines/default"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("get", "/api/v1/events"): "200 400 401 403 404 503",
    ("post", "/api/v1/machines/device/code"): "200 400 404 409 413 429 503",
    ("post", "/api/v1/machines/device/token"): "200 400 404 409 413 429 503",
    ("post", "/api/v1/peers/claim"): "200 400 404 409 413 429 4XX 503 5XX",
    ("post", "/api/v1/peers/offers"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/link"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("get", "/api/v1/peers"): "200 400 401 403 404 4XX 503 5XX",
    ("delete", "/api/v1/peers/{peer_id}"): "200 400 401 403 404 409 4XX 503 5XX",
    ("patch", "/api/v1/peers/{peer_id}"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/launch"): "201 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/messages"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/messages/batch"): "200 400 401 403 404 409 413 4XX 503 5XX",  # batched delivery (bench B8)
    ("get", "/api/v1/peers/events"): "200 400 401 403 404 503",
    ("get", "/api/v1/peers/repos"): "200 400 401 403 404 4XX 503 5XX",
    ("post", "/api/v1/peers/agents/{agent_id}/stop"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/agents/{agent_id}/archive"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("post", "/api/v1/peers/unlink"): "200 400 401 403 404 409 413 4XX 503 5XX",
    ("get", "/api/v1/peers/approvals"): "200 400 401 403 404 4XX 503 5XX",
    ("post", "/api/v1/peers/approvals/{approval_id}/answer"): "200 400 401 403 404 409 413 4XX 503 5XX",
}


@pytest.fixture
def schema(client: Any, owner_token: str) -> dict[str, Any]:
    response = client.get("/api/schema/", {"format": "json"}, HTTP_AUTHORIZATION=f"Bearer {owner_token}")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].removeprefix(REF.format(model=""))
        resolved: dict[str, Any] = schema["components"]["schemas"][name]
        return resolved
    return node


def _refs(node: Any) -> list[str]:
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found += [value for key, value in item.items() if key == "$ref" and isinstance(value, str)]
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return found


def test_it_is_openapi_3_1_with_every_route_it_documented_before(schema: dict[str, Any]) -> None:
    assert schema["openapi"] == "3.1.0"
    for (method, path), statuses in DOCUMENTED.items():
        assert " ".join(sorted(schema["paths"][path][method]["responses"])) == statuses, (method, path)
    assert {(operation.method, route.path) for route, operation in documented_routes()} == set(DOCUMENTED)


def test_each_route_body_is_the_schema_of_the_model_its_view_validates_with(schema: dict[str, Any]) -> None:
    for route, operation in documented_routes():
        if operation.body is None:
            continue
        described = schema["paths"][route.path][operation.method]
        documented = _resolve(schema, described["requestBody"]["content"]["application/json"]["schema"])
        expected = operation.body.model_json_schema(mode="validation", ref_template=REF)
        expected.pop("$defs", None)
        wire_values_constrained(expected)  # members it does not name: what core.wire reads
        for field in set(route.parameters) & set(operation.body.model_fields):  # from the path, not the body
            expected["properties"].pop(field)
            expected["required"] = [name for name in expected.get("required", []) if name != field]
        assert documented == expected, route.path


def test_a_body_fields_rules_reach_the_schema(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    assert components["LaunchBody"]["required"] == ["name", "launched_by", "cwd"]
    assert components["LaunchBody"]["properties"]["launched_by"] == {"$ref": "#/components/schemas/SenderAddress"}
    assert components["SenderAddress"]["properties"]["agent_id"]["anyOf"][1] == {"type": "null"}
    assert components["SessionOpBody"]["required"] == ["op"]
    default = components["DefaultMachineBody"]
    assert default["required"] == ["machine_id"]
    assert default["properties"]["machine_id"]["anyOf"] == [
        {"type": "string", "minLength": 1, "maxLength": 255},
        {"type": "null"},
    ]
    assert "target_machine" in default["properties"]["machine_id"]["description"]
    call = schema["paths"]["/api/v1/remotes/{remotename}/call"]["post"]
    body = call["requestBody"]["content"]["application/json"]["schema"]
    assert "remotename" not in body["properties"] and body["required"] == ["function"]
    assert body["properties"]["timeout"]["maximum"] == 300
    assert [parameter["name"] for parameter in call["parameters"]] == ["remotename"]
    assert {LaunchBody.__name__, SessionOpBody.__name__} <= set(components)
    assert RemoteCallBody.__name__ not in components  # inlined without its path field


def test_an_operation_payloads_optional_field_may_be_null_as_the_route_reads_it(schema: dict[str, Any]) -> None:
    """``POST …/ops`` reads an optional payload field sent as null as absent (and the shim
    does): the documented body accepts it, and still refuses a null required one."""
    validator = Draft202012Validator({"$ref": "#/components/schemas/SessionOpBody", "components": schema["components"]})
    assert validator.is_valid({"op": "FILE_READ", "payload": {"path": "/a", "encoding": None, "offset": None}})
    assert not validator.is_valid({"op": "FILE_READ", "payload": {"path": None}})


def test_every_ref_resolves_and_no_defs_are_left_inside(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    for ref in _refs(schema):
        assert ref.startswith("#/components/schemas/") and ref.removeprefix("#/components/schemas/") in components
    assert "$defs" not in str(schema)
    for component in components.values():
        Draft202012Validator.check_schema(component)


def test_peer_routes_keep_their_security_and_signed_headers(schema: dict[str, Any]) -> None:
    launch = schema["paths"]["/api/v1/peers/launch"]["post"]
    assert launch["security"] == [{"peerAuth": []}]
    assert [p["name"] for p in launch["parameters"]] == [
        "Idempotency-Key",
        "Signature",
        "Signature-Input",
        "Content-Digest",
    ]
    assert schema["paths"]["/api/v1/peers/repos"]["get"]["parameters"] == []
    assert schema["paths"]["/api/v1/machines/device/code"]["post"]["security"] == []
    # Required (an empty body is refused invalid_request), as JSON or a form (RFC 8628 §3.1).
    device_body = schema["paths"]["/api/v1/machines/device/code"]["post"]["requestBody"]
    assert device_body["required"] is True
    assert set(device_body["content"]) == {"application/json", "application/x-www-form-urlencoded"}


def test_a_routes_path_and_parameters_are_read_from_the_urlconf(schema: dict[str, Any]) -> None:
    routes = {route.path: route for route in served_routes()}
    assert routes["/api/v1/peers/{peer_id}"].parameters == {"peer_id": "integer"}  # <int:peer_id>
    assert routes["/api/v1/remotes/{remotename}/call"].parameters == {"remotename": "string"}  # <path:remotename>
    patch = schema["paths"]["/api/v1/peers/{peer_id}"]["patch"]
    assert patch["parameters"] == [{"name": "peer_id", "in": "path", "required": True, "schema": {"type": "integer"}}]
    assert patch["operationId"] == "api_v1_peers_peer_id_patch"
    # Rate-limited views, plain or DRF, can answer 429; others cannot.
    assert {path for path, route in routes.items() if route.rate_limited} == {
        "/api/v1/auth/token",
        "/api/v1/peers/claim",
        "/api/v1/machines/device/code",
        "/api/v1/machines/device/token",
    }
    assert "429" in schema["paths"]["/api/v1/auth/token"]["post"]["responses"]
    assert "429" not in schema["paths"]["/api/v1/peers/link"]["post"]["responses"]


def test_the_device_login_routes_answer_the_success_status_the_schema_documents(
    schema: dict[str, Any], owner: Any
) -> None:
    from django.test import Client

    shim, browser = Client(), Client()
    browser.force_login(owner)
    machine = {"machine_id": "3f2b9c1e-0000-4000-8000-000000000009", "hostname": "h", "platform": "linux", "arch": "x"}
    grant = shim.post("/api/v1/machines/device/code", machine, content_type="application/json")
    browser.post("/machines/activate", {"user_code": grant.json()["user_code"], "decision": "approve"})
    token = shim.post(
        "/api/v1/machines/device/token",
        {"grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": grant.json()["device_code"]},
        content_type="application/json",
    )
    for path, response in (("/api/v1/machines/device/code", grant), ("/api/v1/machines/device/token", token)):
        documented = [code for code in schema["paths"][path]["post"]["responses"] if code.startswith("2")]
        assert documented == [str(response.status_code)], (path, response.content)


def test_the_schema_builds_valid_and_without_a_warning(tmp_path: Path) -> None:
    """drf-spectacular's own check: the document validates against OpenAPI 3.1 and its
    generation warns of nothing (a warning is a component or enum it had to guess a name
    for, or a view it could not describe)."""
    from django.core.management import call_command

    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


class _Leaf(BaseModel):
    name: Text  # trimmed and not blank on input: its request schema says so, its answer's does not


class _Mid(BaseModel):
    leaf: _Leaf  # alike in both modes itself, but refers to a model that is not


class _Outer(BaseModel):
    mid: _Mid


class _Envelope(BaseModel):
    outer: _Outer


@pytest.mark.parametrize("request_first", [True, False])
def test_a_model_referring_to_a_request_variant_is_one_too(request_first: bool) -> None:
    """A nested model whose own two schemas are alike but that refers (through another) to
    one whose are not is a request variant as well: the request's ``_Mid`` points at
    ``_LeafRequest`` and the answer's at ``_Leaf``, so both named ``_Mid`` would be one name
    for two schemas (``Components.add`` raised ``ValueError``)."""
    components = Components({})
    calls: list[tuple[type[BaseModel], JsonSchemaMode]] = [(_Outer, "validation"), (_Envelope, "serialization")]
    refs = {mode: components.schema_of(model, mode) for model, mode in (calls if request_first else calls[::-1])}
    assert refs["validation"] == {"$ref": REF.format(model="_OuterRequest")}
    assert refs["serialization"] == {"$ref": REF.format(model="_Envelope")}
    schemas = components.schemas
    assert schemas["_OuterRequest"]["properties"]["mid"] == {"$ref": REF.format(model="_MidRequest")}
    assert schemas["_MidRequest"]["properties"]["leaf"] == {"$ref": REF.format(model="_LeafRequest")}
    assert schemas["_Outer"]["properties"]["mid"] == {"$ref": REF.format(model="_Mid")}
    assert schemas["_Mid"]["properties"]["leaf"] == {"$ref": REF.format(model="_Leaf")}
    document = {"components": {"schemas": schemas}}
    blank = {"mid": {"leaf": {"name": " "}}}
    assert not Draft202012Validator({"$ref": refs["validation"]["$ref"], **document}).is_valid(blank)
    assert Draft202012Validator({"$ref": REF.format(model="_Outer"), **document}).is_valid(blank)
