"""What drf-spectacular cannot see by itself, added to ``/api/schema/`` (OpenAPI 3.1):

- the authentication schemes (``BearerTokenScheme``, cookie, peer);
- the routes served by plain or async Django views (``ROUTES``: remote calls, machine
  operations and device login, the event streams, pairing and the peer API), each
  described from the pydantic models its view validates with
  (``model_json_schema(mode="validation")``, ``$defs`` hoisted into
  ``components/schemas``);
- the error statuses of every operation, with the one error shape (spec/overview.md
  "Error shapes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from machines.protocol import (
    DeviceCodeBody,
    DeviceTokenBody,
    SessionCopyAnswer,
    SessionCopyBody,
    SessionOpAnswer,
    SessionOpBody,
)
from peers.protocol import (
    ClaimAnswer,
    ClaimBody,
    EmptyBody,
    LaunchBody,
    LinkAnswer,
    LinkBody,
    MessageAnswer,
    MessageBody,
    OfferAnswer,
    OfferBody,
    PeerAgentAnswer,
    PeerAnswer,
    PeerListAnswer,
    PeerUpdateBody,
    ReposAnswer,
    UnlinkAnswer,
)
from remotes.protocol import RemoteCallAnswer, RemoteCallBody


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


# --- routes drf-spectacular cannot see -----------------------------------------------------

Auth = Literal["user", "peer", "open"]

SECURITY: dict[str, list[dict[str, list[str]]]] = {
    "user": [{"bearerAuth": []}, {"cookieAuth": []}],
    "peer": [{"peerAuth": []}],  # bearer token + RFC 9421 signature (peers.md §4)
    "open": [],
}
# What a peer POST carries besides its body (peers.md §4).
PEER_POST_HEADERS = ("Idempotency-Key", "Signature", "Signature-Input", "Content-Digest")
DEFAULT_ERRORS = {
    "4XX": {"description": "`{error: {code, message, details}}`"},
    "5XX": {"description": "`{error: {code, message, details}}` (unreachable, busy, timeout)"},
}


@dataclass(frozen=True)
class Route:
    """One operation served by a plain or async Django view (it waits on a remote, a shim or
    a peer, or speaks the peer protocol), described from the models that validate it.

    ``body``: the request body's model (``None``: no body); the path's ``{fields}`` are
    parameters (``integer`` when named in ``INTEGER_PARAMETERS``) and are left out of the
    body's schema. ``answer``: the 200 answer's model. ``responses`` (descriptions only)
    replaces the default 200 + 4XX + 5XX, for answers that are not one JSON object (an
    event stream, RFC 8628's). ``body_required`` is false where a form body is accepted too.
    """

    method: str
    path: str
    tag: str
    summary: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    auth: Auth = "user"
    query: tuple[dict[str, Any], ...] = ()
    responses: dict[str, str] | None = None
    body_required: bool = True

    @property
    def path_fields(self) -> tuple[str, ...]:
        """The names of the path's parameters, in order."""
        return tuple(part[1:-1] for part in self.path.split("/") if part.startswith("{"))


INTEGER_PARAMETERS = frozenset({"peer_id"})
_PANE = {
    "name": "pane",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "a local CLI agent's id: also send its terminal pane as `pane` frames",
}
_EVENTS = (
    "text/event-stream: snapshot, agent.upsert, agent.deleted, agent.event, run.updated, message.created, "
    "message.updated (and pane) frames, each with an id"
)

# fmt: off
ROUTES: tuple[Route, ...] = (
    Route("post", "/api/v1/remotes/{remotename}/call", "remotes",
          "Call a function of one of your connected remotes", RemoteCallBody, RemoteCallAnswer),
    Route("post", "/api/v1/sessions/{session_id}/ops", "machines",
          "Route an operation to a machine of the session", SessionOpBody, SessionOpAnswer),
    Route("post", "/api/v1/sessions/{session_id}/copy", "machines",
          "Copy a file between two machines, verified by SHA-256", SessionCopyBody, SessionCopyAnswer),
    Route("get", "/api/v1/events", "agents",
          "Server-sent events for the UI: a snapshot, then agent, run and message frames",
          query=(_PANE,), responses={"200": _EVENTS}),
    Route("post", "/api/v1/machines/device/code", "machines",
          "Start a shim's device login (RFC 8628 §3.1); unauthenticated, rate-limited", DeviceCodeBody,
          auth="open", body_required=False,
          responses={"200": "device_code, user_code, verification_uri(_complete), expires_in, interval"}),
    Route("post", "/api/v1/machines/device/token", "machines",
          "Poll for the machine token (RFC 8628 §3.4); errors as RFC 6749 §5.2", DeviceTokenBody,
          auth="open", body_required=False,
          responses={"200": "access_token, token_type: Bearer",
                     "400": "authorization_pending, slow_down, access_denied, expired_token, invalid_grant"}),
    # Pairing and the staff routes (peers.md §2, §6).
    Route("post", "/api/v1/peers/claim", "peers",
          "Pairing: claim an offer with its code (open, 5 a minute per address; 401 for any bad code)",
          ClaimBody, ClaimAnswer, auth="open"),
    Route("post", "/api/v1/peers/offers", "peers",
          "Make a pairing offer (staff): its code, valid 10 minutes, usable once", OfferBody, OfferAnswer),
    Route("post", "/api/v1/peers/link", "peers",
          "Link with another instance's pairing code (staff)", LinkBody, LinkAnswer),
    Route("get", "/api/v1/peers", "peers", "Your linked instances", answer=PeerListAnswer),
    Route("patch", "/api/v1/peers/{peer_id}", "peers",
          "Rename a link or change what it may do here", PeerUpdateBody, PeerAnswer),
    Route("delete", "/api/v1/peers/{peer_id}", "peers", "Unlink (revokes both directions)", answer=PeerAnswer),
    # The peer API (peers.md §5): a linked instance's token and signature.
    Route("post", "/api/v1/peers/launch", "peer API",
          "Launch an agent here for the peer (allow_launch)", LaunchBody, PeerAgentAnswer, auth="peer"),
    Route("post", "/api/v1/peers/messages", "peer API",
          "Deliver a message to one of our agents (allow_message); a repeated key answers duplicate",
          MessageBody, MessageAnswer, auth="peer"),
    Route("get", "/api/v1/peers/events", "peer API",
          "Server-sent events mirroring the link user's local agents", auth="peer",
          responses={"200": "text/event-stream: snapshot, then agent.upsert frames"}),
    Route("get", "/api/v1/peers/repos", "peer API",
          "The repo roots advertised for launches", answer=ReposAnswer, auth="peer"),
    Route("post", "/api/v1/peers/agents/{agent_id}/stop", "peer API",
          "Stop an agent this peer launched (allow_launch)", EmptyBody, PeerAgentAnswer, auth="peer"),
    Route("post", "/api/v1/peers/agents/{agent_id}/archive", "peer API",
          "Archive an agent this peer launched (allow_launch)", EmptyBody, PeerAgentAnswer, auth="peer"),
    Route("post", "/api/v1/peers/unlink", "peer API",
          "The peer unlinked us: revoke the link here too", EmptyBody, UnlinkAnswer, auth="peer"),
)
# fmt: on

REF = "#/components/schemas/{model}"


class Components:
    """The ``components/schemas`` the routes' models add: each model's
    ``model_json_schema`` (``validation`` for bodies, ``serialization`` for answers), its
    ``$defs`` hoisted beside it (refs already point there through ``ref_template``)."""

    def __init__(self, existing: dict[str, Any]) -> None:
        self.schemas = existing

    def add(self, name: str, schema: dict[str, Any]) -> None:
        known = self.schemas.setdefault(name, schema)
        if known != schema:
            raise ValueError(f"two different OpenAPI components named {name!r}")

    def schema_of(
        self, model: type[BaseModel], mode: JsonSchemaMode, *, without: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """A schema for ``model``: a ``$ref`` to its component, or (``without`` fields) the
        schema itself with those properties left out."""
        schema = model.model_json_schema(mode=mode, ref_template=REF)
        for name, definition in schema.pop("$defs", {}).items():
            self.add(name, definition)
        if without:
            schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in without}
            schema["required"] = [name for name in schema.get("required", []) if name not in without]
            return schema
        self.add(model.__name__, schema)
        return {"$ref": REF.format(model=model.__name__)}


def _parameter_type(name: str) -> str:
    return "integer" if name in INTEGER_PARAMETERS else "string"


def route_operation(route: Route, components: Components) -> dict[str, Any]:
    """The OpenAPI operation of ``route`` (its ``operationId`` is made from the path)."""
    operation_id = route.path.strip("/").replace("/", "_").replace("{", "").replace("}", "") + f"_{route.method}"
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": _parameter_type(name)}}
        for name in route.path_fields
    ]
    parameters += route.query
    operation: dict[str, Any] = {
        "summary": route.summary,
        "tags": [route.tag],
        "security": SECURITY[route.auth],
        "operationId": operation_id,
    }
    if route.responses is not None:
        operation["responses"] = {status: {"description": text} for status, text in route.responses.items()}
    else:
        answer = {} if route.answer is None else components.schema_of(route.answer, "serialization")
        operation["responses"] = {
            "200": {"description": "OK", "content": {"application/json": {"schema": answer}}},
            **DEFAULT_ERRORS,
        }
    if route.body is not None:
        fields = tuple(name for name in route.path_fields if name in route.body.model_fields)
        schema = components.schema_of(route.body, "validation", without=fields)
        operation["requestBody"] = {"content": {"application/json": {"schema": schema}}}
        if route.body_required:
            operation["requestBody"] = {"required": True, **operation["requestBody"]}
        if route.auth == "peer":
            parameters += [
                {"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
                for name in PEER_POST_HEADERS
            ]
    operation["parameters"] = parameters
    return operation


def add_async_routes(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add ``ROUTES`` (their bodies and answers from
    their pydantic models, ``components/schemas``) and the cookie and peer security schemes."""
    paths = result.setdefault("paths", {})
    components = Components(result.setdefault("components", {}).setdefault("schemas", {}))
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = route_operation(route, components)
    schemes = result["components"].setdefault("securitySchemes", {})
    schemes.setdefault("cookieAuth", {"type": "apiKey", "in": "cookie", "name": settings.SESSION_COOKIE_NAME})
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
