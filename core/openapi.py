"""OpenAPI operations of the routes drf-spectacular cannot see: plain and async Django views
(they wait on a remote, a shim or a peer, or speak the peer protocol).

Each such view carries its operations (``documented``), described from the pydantic models
it validates with: the request body's ``model_json_schema(mode="validation")``, the
answer's ``mode="serialization"``, their ``$defs`` hoisted into ``components/schemas``.
The path and its parameters are read from the URLconf the view is served by (an
``<int:…>`` converter is an ``integer`` parameter), so a route is described where it is
written. ``add_documented_routes`` is the drf-spectacular postprocessing hook that adds
them (OpenAPI 3.1: JSON Schema 2020-12 takes pydantic's schemas as they are).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from django.conf import settings
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.converters import IntConverter
from django.urls.resolvers import RoutePattern
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from core import wire

View = TypeVar("View", bound=Callable[..., Any])

REF = "#/components/schemas/{model}"
OPERATIONS_ATTRIBUTE = "openapi_operations"
RATE_LIMITED_ATTRIBUTE = "rate_limited"  # on a view function or class: it has its own throttle (429)


@dataclass(frozen=True)
class Security:
    """Who may call an operation: ``schemes``, the names of the OpenAPI security schemes
    any one of which is enough (none: open); ``definitions``, the schemes to add to
    ``components/securitySchemes`` that drf-spectacular does not add itself;
    ``body_headers``, the headers a request with a body carries besides it."""

    schemes: tuple[str, ...]
    definitions: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    body_headers: tuple[str, ...] = ()

    @property
    def requirement(self) -> list[dict[str, list[str]]]:
        """The operation's ``security``: one alternative per scheme."""
        return [{name: []} for name in self.schemes]


# A user API token (``bearerAuth``, dispatch/schema.py's ``BearerTokenScheme``) or a session
# (its cookie's name is per instance, ``SESSION_COOKIE_NAME``: filled in when the schema is built).
USER = Security(("bearerAuth", "cookieAuth"), {"cookieAuth": {"type": "apiKey", "in": "cookie"}})
OPEN = Security(())
DEFAULT_ERRORS = {
    "4XX": {"description": "`{error: {code, message, details}}`"},
    "5XX": {"description": "`{error: {code, message, details}}` (unreachable, busy, timeout)"},
}


@dataclass(frozen=True)
class Operation:
    """One operation of a plain or async view, described from the models that validate it.

    ``body``: the request body's model (``None``: no body); its fields named like a path
    parameter come from the path and are left out of its schema. ``answer``: the model
    of the success answer, sent with ``status``. ``responses`` (descriptions only)
    replaces the default success + 4XX + 5XX, for answers that are not one JSON object (an
    event stream). ``form``: the body may be form-encoded too
    (``application/x-www-form-urlencoded``, as RFC 8628's clients send it), with the same
    fields. ``query``: OpenAPI query parameters. ``events``: the route answers
    ``text/event-stream`` too when the body asks (e.g. ``stream: true``); the text says
    which events, and is added to the success response beside its JSON answer.
    ``path_schemas``: path parameter name → the JSON Schema of the values the view
    accepts, where that says more than the converter's type (a pattern, a format): a
    value the view refuses must not be valid by the schema. ``errors``: status → the model
    of the route's error answers with that status, where they are not in the API's shape
    (the device endpoints answer RFC 6749 §5.2's ``{error, error_description}``).
    """

    method: str
    summary: str
    tag: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    status: int = 200
    security: Security = USER
    query: tuple[dict[str, Any], ...] = ()
    responses: dict[str, str] | None = None
    form: bool = False
    events: str | None = None
    path_schemas: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    errors: Mapping[int, type[BaseModel]] = field(default_factory=dict)


def documented(*operations: Operation, rate_limited: bool = False) -> Callable[[View], View]:
    """Attach ``operations`` to a view (the outermost decorator, so the URLconf's callback
    carries them); ``rate_limited``: the route has its own throttle, so it can answer 429."""

    def attach(view: View) -> View:
        setattr(view, OPERATIONS_ATTRIBUTE, (*getattr(view, OPERATIONS_ATTRIBUTE, ()), *operations))
        if rate_limited:
            setattr(view, RATE_LIMITED_ATTRIBUTE, True)
        return view

    return attach


@dataclass(frozen=True)
class ServedRoute:
    """A view at its OpenAPI path (``/api/v1/peers/{peer_id}``), with the path's parameters
    (name → JSON Schema type, in path order)."""

    path: str
    parameters: dict[str, str]
    callback: Callable[..., Any]

    @property
    def operations(self) -> tuple[Operation, ...]:
        """The operations ``documented`` attached to the view."""
        return tuple(getattr(self.callback, OPERATIONS_ATTRIBUTE, ()))

    @property
    def rate_limited(self) -> bool:
        """Whether the view (a function, or a DRF view's class) has its own throttle."""
        view_class = getattr(self.callback, "cls", None)
        return bool(
            getattr(self.callback, RATE_LIMITED_ATTRIBUTE, False) or getattr(view_class, RATE_LIMITED_ATTRIBUTE, False)
        )


_PARAMETER = re.compile(r"<(?:[^>:]+:)?([^>]+)>")


def served_routes(urlconf: str | None = None) -> Iterator[ServedRoute]:
    """Every view of ``urlconf`` (default ``ROOT_URLCONF``) reached through ``path()`` routes,
    at its OpenAPI path. Views under a regular-expression route (the admin's) are left out."""

    def walk(
        patterns: list[URLPattern | URLResolver], prefix: str, parameters: dict[str, str]
    ) -> Iterator[ServedRoute]:
        for pattern in patterns:
            if not isinstance(pattern.pattern, RoutePattern):
                continue
            route = str(pattern.pattern)
            found = {
                name: "integer" if isinstance(converter, IntConverter) else "string"
                for name, converter in pattern.pattern.converters.items()
            }
            path = prefix + _PARAMETER.sub(r"{\1}", route)
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, path, {**parameters, **found})
            else:
                yield ServedRoute(path=path, parameters={**parameters, **found}, callback=pattern.callback)

    yield from walk(get_resolver(urlconf).url_patterns, "/", {})


def model_component(model: type[BaseModel], mode: JsonSchemaMode) -> tuple[str, dict[str, Any]]:
    """The component name and schema (its ``$defs`` inside, refs through ``REF``) of ``model``
    as a request body (``mode="validation"``) or an answer (``"serialization"``). A
    request's component is ``<Model>Request`` where its schema differs from the answer's
    (a request's says what it refuses, an answer's does not), and so is each nested model's
    whose schemas differ or that refers, directly or through others, to a renamed one, so
    one name never stands for two schemas. Plain views (``Components``) and DRF views
    (``dispatch.schema.PydanticBody``) name their models by this one rule."""
    answer = model.model_json_schema(mode="serialization", ref_template=REF)
    if mode == "serialization":
        return model.__name__, answer
    request = model.model_json_schema(mode="validation", ref_template=REF)
    answers = answer.get("$defs", {})
    defs: dict[str, Any] = request.get("$defs", {})
    differing = {name for name, found in defs.items() if answers.get(name) != found}
    # A def alike in both modes that refers to a renamed one is a request variant too: its
    # request schema points at the renamed def, its answer's at the original, so keeping its
    # name would make one name stand for two schemas. Renamed until nothing more changes.
    refers = {name: {ref.removeprefix(REF.format(model="")) for ref in _refs(found)} for name, found in defs.items()}
    while grown := {name for name in defs.keys() - differing if refers[name] & differing}:
        differing |= grown
    renamed = {name: f"{name}Request" for name in defs if name in differing}
    request = _renamed(request, {REF.format(model=old): REF.format(model=new) for old, new in renamed.items()})
    request["$defs"] = {renamed.get(name, name): found for name, found in request.get("$defs", {}).items()}
    same = {k: v for k, v in answer.items() if k != "$defs"} == {k: v for k, v in request.items() if k != "$defs"}
    if not request["$defs"]:
        del request["$defs"]
    return (model.__name__ if same and not renamed else f"{model.__name__}Request"), request


def _refs(schema: Any) -> Iterator[str]:
    """Every ``$ref`` target within ``schema``."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _refs(item)


def _renamed(schema: Any, refs: dict[str, str]) -> Any:
    """``schema`` with each ``$ref`` in ``refs`` replaced by its new target."""
    if isinstance(schema, dict):
        return {
            key: refs.get(value, value) if key == "$ref" else _renamed(value, refs) for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_renamed(item, refs) for item in schema]
    return schema


class Components:
    """The ``components/schemas`` the operations' models add: each model's
    ``model_component`` (``validation`` for bodies, ``serialization`` for answers), its
    ``$defs`` hoisted beside it (refs already point there through ``ref_template``)."""

    def __init__(self, existing: dict[str, Any]) -> None:
        self.schemas = existing

    def add(self, name: str, schema: dict[str, Any]) -> None:
        """Add ``schema`` as ``name``; ``ValueError`` if another schema has that name."""
        known = self.schemas.setdefault(name, schema)
        if known != schema:
            raise ValueError(f"two different OpenAPI components named {name!r}")

    def schema_of(
        self, model: type[BaseModel], mode: JsonSchemaMode, *, without: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """A schema for ``model``: a ``$ref`` to its component, or (``without`` fields) the
        schema itself with those properties left out."""
        name, schema = model_component(model, mode)
        for nested, definition in schema.pop("$defs", {}).items():
            self.add(nested, definition)
        if without:
            schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in without}
            schema["required"] = [name for name in schema.get("required", []) if name not in without]
            return schema
        self.add(name, schema)
        return {"$ref": REF.format(model=name)}


def operation_schema(route: ServedRoute, operation: Operation, components: Components) -> dict[str, Any]:
    """The OpenAPI operation of ``operation`` at ``route`` (its ``operationId`` is made from
    the path and the method)."""
    operation_id = route.path.strip("/").replace("/", "_").replace("{", "").replace("}", "") + f"_{operation.method}"
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": operation.path_schemas.get(name, {"type": kind})}
        for name, kind in route.parameters.items()
    ]
    parameters += operation.query
    described: dict[str, Any] = {
        "summary": operation.summary,
        "tags": [operation.tag],
        "security": operation.security.requirement,
        "operationId": operation_id,
    }
    if operation.responses is not None:
        described["responses"] = {status: {"description": text} for status, text in operation.responses.items()}
    else:
        answer = {} if operation.answer is None else components.schema_of(operation.answer, "serialization")
        success: dict[str, Any] = {
            "description": HTTPStatus(operation.status).phrase,
            "content": {"application/json": {"schema": answer}},
        }
        if operation.events is not None:
            success["description"] += f"; or text/event-stream: {operation.events}"
            success["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        # Error answers in their own shape are all described: no catch-all in the API's.
        described["responses"] = {str(operation.status): success, **({} if operation.errors else DEFAULT_ERRORS)}
    for status, model in operation.errors.items():
        described["responses"][str(status)] = {
            "description": f"{HTTPStatus(status).phrase}: {' '.join((model.__doc__ or model.__name__).split())}",
            "content": {"application/json": {"schema": components.schema_of(model, "serialization")}},
        }
    if operation.body is not None:
        fields = tuple(name for name in route.parameters if name in operation.body.model_fields)
        schema = components.schema_of(operation.body, "validation", without=fields)
        content = {"application/json": {"schema": schema}}
        if operation.form:
            content["application/x-www-form-urlencoded"] = {"schema": schema}
        described["requestBody"] = {"required": True, "content": content}
        parameters += [
            {"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
            for name in operation.security.body_headers
        ]
    described["parameters"] = parameters
    return described


def documented_routes(urlconf: str | None = None) -> Iterator[tuple[ServedRoute, Operation]]:
    """Each operation ``documented`` on a view of ``urlconf``, with the route serving it."""
    for route in served_routes(urlconf):
        for operation in route.operations:
            yield route, operation


def add_documented_routes(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add every ``documented`` operation (bodies and
    answers from their pydantic models, in ``components/schemas``) and the security
    schemes they name."""
    paths = result.setdefault("paths", {})
    components = result.setdefault("components", {})
    schemas = Components(components.setdefault("schemas", {}))
    schemes = components.setdefault("securitySchemes", {})
    for route, operation in documented_routes(getattr(generator, "urlconf", None)):
        paths.setdefault(route.path, {})[operation.method] = operation_schema(route, operation, schemas)
        for name, definition in operation.security.definitions.items():
            schemes.setdefault(name, definition)
    if "cookieAuth" in schemes:
        schemes["cookieAuth"] = {**schemes["cookieAuth"], "name": settings.SESSION_COOKIE_NAME}
    return result


# --- free-form JSON values -------------------------------------------------------------

WIRE_VALUE = "WireValue"
WIRE_VALUE_SCHEMA: dict[str, Any] = {
    "description": "Any JSON value the channel layer carries (core/wire.py): integers within the signed "
    f"64-bit range, nested at most {wire.MAX_DEPTH} deep; a body holding another is refused (400).",
    "type": ["object", "array", "string", "number", "boolean", "null"],
    "minimum": wire.INT_MIN,
    "maximum": wire.INT_MAX,
    "items": {"$ref": REF.format(model=WIRE_VALUE)},
    "additionalProperties": {"$ref": REF.format(model=WIRE_VALUE)},
}


def _open_objects(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object schema (``type`` object) within ``schema`` that lets any member in
    beside the ones it names (``additionalProperties`` absent, ``true`` or ``{}``); the
    subschemas of ``if``/``then``/``not`` say no type and are left as they are."""
    if isinstance(schema, list):
        for item in schema:
            yield from _open_objects(item)
        return
    if not isinstance(schema, dict):
        return
    kinds = schema.get("type")
    if kinds == "object" or (isinstance(kinds, list) and "object" in kinds):
        if schema.get("additionalProperties", True) in (True, {}):
            yield schema
    for value in schema.values():
        yield from _open_objects(value)


def wire_values_constrained(schema: Any) -> None:
    """Make every object within ``schema`` that lets any member in take only ``WireValue``
    members there (in place; the component itself is ``WIRE_VALUE_SCHEMA``)."""
    for found in list(_open_objects(schema)):
        found["additionalProperties"] = {"$ref": REF.format(model=WIRE_VALUE)}


def add_wire_values(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook (after ``add_documented_routes``): an object's
    members beyond those it names (a free-form ``payload`` or ``args``, or the unknown
    fields a body may carry and its view ignores) are ``WireValue`` (component): the JSON
    ``core.wire.loads`` reads from every body, so the schema does not call valid a value
    the server refuses (an integer beyond 64 bits)."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    wire_values_constrained(schemas)
    wire_values_constrained(result.get("paths", {}))
    schemas[WIRE_VALUE] = WIRE_VALUE_SCHEMA
    return result
