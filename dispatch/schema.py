"""OpenAPI (drf-spectacular) description of Dispatch's authentication."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """``Authorization: Bearer <api token>`` in the OpenAPI schema."""

    target_class = "dispatch.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A user API token (Settings page or POST /api/v1/auth/token).",
        }


def _operation(summary: str, request: dict[str, Any] | None, response: dict[str, Any], tag: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "tags": [tag],
        "security": [{"bearerAuth": []}, {"cookieAuth": []}],
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": response}}},
            "4XX": {"description": "`{error: {code, message, details}}`"},
            "5XX": {"description": "`{error: {code, message, details}}` (unreachable, busy, timeout)"},
        },
    }
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
    return operation


def _obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


_STRING = {"type": "string"}
_SESSION_PARAM = {"name": "session_id", "in": "path", "required": True, "schema": _STRING}

# Routes served by async Django views (they wait on a remote or a shim), which
# drf-spectacular cannot see: described here so /api/schema/ is complete.
ASYNC_ROUTES: dict[str, dict[str, Any]] = {
    "/api/v1/remotes/{remotename}/call": {
        "parameters": [{"name": "remotename", "in": "path", "required": True, "schema": _STRING}],
        "post": _operation(
            "Call a function of one of your connected remotes",
            _obj(function=_STRING, args={"type": "object"}, timeout={"type": "number", "maximum": 300}),
            _obj(result={}),
            "remotes",
        ),
    },
    "/api/v1/sessions/{session_id}/ops": {
        "parameters": [_SESSION_PARAM],
        "post": _operation(
            "Route an operation to a machine of the session",
            _obj(op=_STRING, payload={"type": "object"}, target_machine={"type": "string", "nullable": True}),
            _obj(machine_id=_STRING, type=_STRING, payload={"type": "object"}),
            "machines",
        ),
    },
    "/api/v1/sessions/{session_id}/copy": {
        "parameters": [_SESSION_PARAM],
        "post": _operation(
            "Copy a file between two machines, verified by SHA-256",
            _obj(
                source_machine=_STRING,
                source_path=_STRING,
                destination_machine=_STRING,
                destination_path=_STRING,
                overwrite={"type": "boolean"},
            ),
            _obj(size_bytes={"type": "integer"}, sha256=_STRING),
            "machines",
        ),
    },
    "/api/v1/machines/device/code": {
        "post": {
            "summary": "Start a shim's device login (RFC 8628 §3.1); unauthenticated, rate-limited",
            "tags": ["machines"],
            "security": [],
            "requestBody": {
                "content": {
                    "application/json": {
                        "schema": _obj(machine_id=_STRING, hostname=_STRING, platform=_STRING, arch=_STRING)
                    }
                }
            },
            "responses": {
                "200": {"description": "device_code, user_code, verification_uri(_complete), expires_in, interval"}
            },
        }
    },
    "/api/v1/machines/device/token": {
        "post": {
            "summary": "Poll for the machine token (RFC 8628 §3.4); errors as RFC 6749 §5.2",
            "tags": ["machines"],
            "security": [],
            "requestBody": {"content": {"application/json": {"schema": _obj(device_code=_STRING)}}},
            "responses": {
                "200": {"description": "access_token, token_type: Bearer"},
                "400": {"description": "authorization_pending, slow_down, access_denied, expired_token, invalid_grant"},
            },
        }
    },
}


def add_async_routes(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add ``ASYNC_ROUTES`` and the cookie scheme."""
    paths = result.setdefault("paths", {})
    for path, route in ASYNC_ROUTES.items():
        parameters = route.get("parameters", [])
        paths[path] = {}
        for method, operation in route.items():
            if method == "parameters":
                continue
            operation_id = path.strip("/").replace("/", "_").replace("{", "").replace("}", "") + f"_{method}"
            paths[path][method] = {"operationId": operation_id, "parameters": parameters, **operation}
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes.setdefault("cookieAuth", {"type": "apiKey", "in": "cookie", "name": "sessionid"})
    return result
