"""What the OpenAPI document (``/api/schema/``, OpenAPI 3.1) adds to drf-spectacular's view
of the DRF views, project-wide:

- the user API token's security scheme (``BearerTokenScheme``);
- the pydantic body models of the DRF views (``extend_schema(request=Model,
  responses={200: Model})``; ``PydanticBody``, docs/architecture.md#bodies);
- the plain and async views' operations, each declared beside its view from the pydantic
  models it validates with (``core.openapi.documented``; hook
  ``core.openapi.add_documented_routes``);
- the error statuses of every operation, with the one error shape
  (docs/architecture.md#errors; hook ``add_error_responses``).
"""

from __future__ import annotations

import enum
import typing
from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiSerializerExtension
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from pydantic import BaseModel

from core.openapi import model_component, served_routes


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's ``AutoSchema`` (``DEFAULT_SCHEMA_CLASS``): a DELETE with a declared
    body has it documented. The bodies themselves are pydantic models (``PydanticBody``,
    docs/architecture.md#bodies), which say what they refuse."""

    def _declared_request(self) -> Any:
        """The request serializer ``extend_schema(request=...)`` names, else ``None`` (not
        drf-spectacular's guess from the view, which a DELETE never had)."""
        guess = SpectacularAutoSchema.get_request_serializer
        if type(self).get_request_serializer is guess:
            return None
        self._get_serializer = lambda: None  # type: ignore[method-assign]  # no guess, just the override
        try:
            return self.get_request_serializer()
        finally:
            del self._get_serializer

    def _get_request_body(self, direction: str = "request") -> Any:
        # drf-spectacular documents a body for POST, PUT and PATCH only; a DELETE that reads
        # one says so with extend_schema(request=...) and gets it documented too.
        if self.method == "DELETE" and self._declared_request() is not None:
            self.method = "POST"
            try:
                return super()._get_request_body(direction)
            finally:
                self.method = "DELETE"
        return super()._get_request_body(direction)


class PydanticBody(OpenApiSerializerExtension):
    """A pydantic model named as a DRF view's body (``extend_schema(request=Model,
    responses={200: Model})``), described as the plain views' models are
    (``core.openapi``): a request by ``model_json_schema(mode="validation")``, an answer by
    ``mode="serialization"``, each model (nested ones too) a component named after it; a
    request's is ``<Model>Request`` where its two modes differ (a request's text says what
    it refuses, an answer's does not). ``ValueError`` when two different schemas would
    take one component name (they would otherwise replace one another silently). Takes
    over from drf-spectacular's own ``contrib.pydantic``, which describes a request in
    serialization mode."""

    target_class = "pydantic.BaseModel"
    match_subclasses = True
    priority = 1

    def _schemas(self, direction: str) -> tuple[str, dict[str, Any]]:
        return model_component(self.target, "validation" if direction == "request" else "serialization")

    def get_name(self, auto_schema: Any, direction: str) -> str:
        return self._schemas(direction)[0]

    def map_serializer(self, auto_schema: Any, direction: str) -> dict[str, Any]:
        schema = self._schemas(direction)[1]
        registry = auto_schema.registry
        classes = _nested_classes(self.target)
        for name, definition in schema.pop("$defs", {}).items():
            # The class itself (as for a top-level component): drf-spectacular warns when one
            # name stands for two identities.
            identity = classes.get(name.removesuffix("Request") if name not in classes else name, name)
            component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=identity, schema=definition)
            if component.key in registry._components and registry[component].schema != definition:
                raise ValueError(f"two different OpenAPI components named {name!r}")
            registry.register_on_missing(component)
        return schema


def _nested_classes(model: type[BaseModel]) -> dict[str, type]:
    """The models and enums ``model``'s fields name, at any depth, by class name (the names
    of pydantic's ``$defs``)."""
    found: dict[str, type] = {}
    pending: list[Any] = [field.annotation for field in model.model_fields.values()]
    while pending:
        kind = pending.pop()
        if isinstance(kind, type) and issubclass(kind, (BaseModel, enum.Enum)):
            if kind.__name__ not in found:
                found[kind.__name__] = kind
                if issubclass(kind, BaseModel):
                    pending += [field.annotation for field in kind.model_fields.values()]
        pending += typing.get_args(kind)
    return found


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


# --- error responses (docs/architecture.md#errors) ---------------------------------------

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
_WRITES = frozenset({"post", "put", "patch", "delete"})


def error_statuses(
    method: str, operation: dict[str, Any], default_security: list[Any], rate_limited: bool
) -> list[str]:
    """The error statuses an operation can answer, by what it is: every route can be
    refused as invalid (400), not found (404, a missing route or object) or temporarily
    unavailable (503); an authenticated one 401/403; a write 409; one with a body 413; a
    route with its own throttle (``rate_limited``) 429."""
    statuses = ["400", "404", "503"]
    if operation.get("security", default_security):
        statuses += ["401", "403"]
    if method in _WRITES:
        statuses.append("409")
    if "requestBody" in operation or method in ("post", "put", "patch"):
        statuses.append("413")
    if rate_limited:
        statuses.append("429")
    return sorted(statuses)


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook (after ``add_documented_routes``): every operation
    lists the error statuses it can answer (``error_statuses``; a view marked
    ``rate_limited``, function or DRF class, can answer 429), each with the one error shape
    ``{"error": {"code", "message", "details"}}`` (component ``Error``). A response an
    operation already describes (the device-token endpoint's RFC 6749 400) is kept."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    default_security = result.get("security", [{"bearerAuth": []}])
    rate_limited = {route.path for route in served_routes(getattr(generator, "urlconf", None)) if route.rate_limited}
    for path, route in result.get("paths", {}).items():
        for method, operation in route.items():
            if method not in ("get", "put", "post", "patch", "delete") or not isinstance(operation, dict):
                continue
            responses = operation.setdefault("responses", {})
            for status in error_statuses(method, operation, default_security, path in rate_limited):
                responses.setdefault(
                    status,
                    {
                        "description": _ERROR_DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    },
                )
    return result
