"""OpenAPI (drf-spectacular) description of Dispatch's authentication."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """``Authorization: Bearer <api token>`` in the OpenAPI schema."""

    target_class = "core.authentication.BearerTokenAuthentication"
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
    "/api/v1/events": {
        "get": {
            "summary": "Server-sent events for the UI: a snapshot, then agent, run and message frames",
            "tags": ["agents"],
            "security": [{"bearerAuth": []}, {"cookieAuth": []}],
            "parameters": [
                {
                    "name": "pane",
                    "in": "query",
                    "required": False,
                    "schema": _STRING,
                    "description": "a local CLI agent's id: also send its terminal pane as `pane` frames",
                }
            ],
            "responses": {
                "200": {
                    "description": "text/event-stream: snapshot, agent.upsert, agent.deleted, agent.event, "
                    "run.updated, message.created, message.updated (and pane) frames, each with an id"
                }
            },
        }
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


def _peer_operation(summary: str, request: dict[str, Any] | None, response: dict[str, Any]) -> dict[str, Any]:
    """A peer route: bearer token + RFC 9421 signature, Idempotency-Key on POSTs (peers.md §4)."""
    operation = _operation(summary, request, response, "peer API")
    operation["security"] = [{"peerAuth": []}]
    if request is not None:
        operation["parameters"] = [
            {"name": "Idempotency-Key", "in": "header", "required": True, "schema": _STRING},
            {"name": "Signature", "in": "header", "required": True, "schema": _STRING},
            {"name": "Signature-Input", "in": "header", "required": True, "schema": _STRING},
            {"name": "Content-Digest", "in": "header", "required": True, "schema": _STRING},
        ]
    return operation


_ADDRESS = _obj(instance_id=_STRING, agent_id={"type": "string", "nullable": True}, name=_STRING)
_PEER_AGENT = _obj(agent_id=_STRING, name=_STRING, status=_STRING)
_FLAGS = {
    "allow_launch": {"type": "boolean"},
    "allow_message": {"type": "boolean"},
    "allow_full_access": {"type": "boolean"},
    "allow_events": {"type": "boolean"},
}
_AGENT_ID_PARAM = {"name": "agent_id", "in": "path", "required": True, "schema": _STRING}

# The peer API (spec/peers.md §5) and the pairing/management routes (§2, §6), served by
# plain Django views.
PEER_ROUTES: dict[str, dict[str, Any]] = {
    "/api/v1/peers/claim": {
        "post": {
            **_operation(
                "Pairing: claim an offer with its code (open, 5 a minute per address; 401 for any bad code)",
                _obj(
                    code=_STRING,
                    protocol_version={"type": "integer"},
                    instance_id=_STRING,
                    name=_STRING,
                    url=_STRING,
                    public_key=_STRING,
                    token_for_you=_STRING,
                ),
                _obj(
                    protocol_version={"type": "integer"},
                    instance_id=_STRING,
                    name=_STRING,
                    url=_STRING,
                    public_key=_STRING,
                    token_for_you=_STRING,
                ),
                "peers",
            ),
            "security": [],
        }
    },
    "/api/v1/peers/offers": {
        "post": _operation(
            "Make a pairing offer (staff): its code, valid 10 minutes, usable once",
            _obj(as_user=_STRING, **_FLAGS),
            _obj(code=_STRING, expires_at=_STRING, address=_STRING, fingerprint=_STRING),
            "peers",
        )
    },
    "/api/v1/peers/link": {
        "post": _operation(
            "Link with another instance's pairing code (staff)",
            _obj(url=_STRING, code=_STRING, label=_STRING, as_user=_STRING, **_FLAGS),
            _obj(peer={"type": "object"}, our_fingerprint=_STRING, their_fingerprint=_STRING),
            "peers",
        )
    },
    "/api/v1/peers": {"get": _operation("Your linked instances", None, _obj(peers={"type": "array"}), "peers")},
    "/api/v1/peers/{peer_id}": {
        "parameters": [{"name": "peer_id", "in": "path", "required": True, "schema": {"type": "integer"}}],
        "patch": _operation("Rename a link or change what it may do here", _obj(label=_STRING, **_FLAGS), {}, "peers"),
        "delete": _operation("Unlink (revokes both directions)", None, {}, "peers"),
    },
    "/api/v1/peers/launch": {
        "post": _peer_operation(
            "Launch an agent here for the peer (allow_launch)",
            _obj(
                name=_STRING,
                prompt=_STRING,
                type=_STRING,
                cwd=_STRING,
                full_access={"type": "boolean"},
                child={"type": "boolean"},
                launched_by=_ADDRESS,
            ),
            _PEER_AGENT,
        )
    },
    "/api/v1/peers/messages": {
        "post": _peer_operation(
            "Deliver a message to one of our agents (allow_message); a repeated key answers duplicate",
            _obj(to_agent_id=_STRING, content=_STRING, **{"from": _ADDRESS}),
            _obj(delivered={"type": "boolean"}, message_id={"type": "integer"}, duplicate={"type": "boolean"}),
        )
    },
    "/api/v1/peers/events": {
        "get": {
            **_peer_operation("Server-sent events mirroring the link user's local agents", None, {}),
            "responses": {"200": {"description": "text/event-stream: snapshot, then agent.upsert frames"}},
        }
    },
    "/api/v1/peers/repos": {
        "get": _peer_operation("The repo roots advertised for launches", None, _obj(roots={"type": "array"}))
    },
    "/api/v1/peers/agents/{agent_id}/stop": {
        "parameters": [_AGENT_ID_PARAM],
        "post": _peer_operation("Stop an agent this peer launched (allow_launch)", {}, _PEER_AGENT),
    },
    "/api/v1/peers/agents/{agent_id}/archive": {
        "parameters": [_AGENT_ID_PARAM],
        "post": _peer_operation("Archive an agent this peer launched (allow_launch)", {}, _PEER_AGENT),
    },
    "/api/v1/peers/unlink": {
        "post": _peer_operation(
            "The peer unlinked us: revoke the link here too", {}, _obj(unlinked={"type": "boolean"})
        )
    },
}


def add_async_routes(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add ``ASYNC_ROUTES``, ``PEER_ROUTES`` and the
    cookie and peer security schemes."""
    paths = result.setdefault("paths", {})
    for path, route in {**ASYNC_ROUTES, **PEER_ROUTES}.items():
        parameters = route.get("parameters", [])
        paths[path] = {}
        for method, operation in route.items():
            if method == "parameters":
                continue
            operation_id = path.strip("/").replace("/", "_").replace("{", "").replace("}", "") + f"_{method}"
            merged = [*parameters, *operation.get("parameters", [])]
            paths[path][method] = {**operation, "operationId": operation_id, "parameters": merged}
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes.setdefault("cookieAuth", {"type": "apiKey", "in": "cookie", "name": "sessionid"})
    schemes.setdefault(
        "peerAuth",
        {
            "type": "http",
            "scheme": "bearer",
            "description": "A linked instance's token plus an RFC 9421 Ed25519 signature (keyid: its fingerprint).",
        },
    )
    return result


# --- error responses (spec/overview.md "Error shapes") ------------------------------------

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "details"],
            "properties": {
                "code": {"type": "string", "description": "UPPER_SNAKE, e.g. VALIDATION_ERROR"},
                "message": {"type": "string"},
                "details": {"type": "object"},
            },
        }
    },
}

_ERROR_DESCRIPTIONS = {
    "400": "Invalid request (VALIDATION_ERROR, INVALID_REQUEST, …)",
    "401": "Not authenticated: no, an unknown, a revoked or an expired token (WWW-Authenticate: Bearer)",
    "403": "Permission denied (PERMISSION_DENIED, CAPABILITY_NOT_GRANTED, an agent token outside its scope, CSRF)",
    "404": "Not found (NOT_FOUND, MACHINE_NOT_ATTACHED, PATH_NOT_FOUND, …)",
    "409": "Conflict with the current state (CONFLICT, MACHINE_AMBIGUOUS, …)",
    "413": "Request body over DISPATCH_MAX_REQUEST_BYTES (REQUEST_TOO_LARGE) or a file too large (FILE_TOO_LARGE)",
    "429": "Rate limited (RATE_LIMITED)",
    "503": "Temporarily unavailable: the database or channel layer is busy or unreachable (TEMPORARILY_UNAVAILABLE)",
}

# Routes with their own throttle (password checks, pairing claims, device login).
THROTTLED_PATHS = frozenset(
    {
        "/api/v1/auth/token",
        "/api/v1/peers/claim",
        "/api/v1/machines/device/code",
        "/api/v1/machines/device/token",
    }
)
_WRITES = frozenset({"post", "put", "patch", "delete"})


def error_statuses(path: str, method: str, operation: dict[str, Any], default_security: list[Any]) -> list[str]:
    """The error statuses an operation can answer, by what it is: every route can be
    refused as invalid (400), not found (404, a missing route or object) or temporarily
    unavailable (503); an authenticated one 401/403; a write 409; one with a body 413; a
    throttled one 429."""
    statuses = ["400", "404", "503"]
    if operation.get("security", default_security):
        statuses += ["401", "403"]
    if method in _WRITES:
        statuses.append("409")
    if "requestBody" in operation or method in ("post", "put", "patch"):
        statuses.append("413")
    if path in THROTTLED_PATHS:
        statuses.append("429")
    return sorted(statuses)


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook (after ``add_async_routes``): every operation
    lists the error statuses it can answer (``error_statuses``), each with the one error
    shape ``{"error": {"code", "message", "details"}}`` (component ``Error``). A response
    an operation already describes (the device-token endpoint's RFC 6749 400) is kept."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    default_security = result.get("security", [{"bearerAuth": []}])
    for path, route in result.get("paths", {}).items():
        for method, operation in route.items():
            if method not in ("get", "put", "post", "patch", "delete") or not isinstance(operation, dict):
                continue
            responses = operation.setdefault("responses", {})
            for status in error_statuses(path, method, operation, default_security):
                responses.setdefault(
                    status,
                    {
                        "description": _ERROR_DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    },
                )
    return result
