"""The bodies of the machines app's async REST routes (operations, copy, pipe, the default
machine) and their answers (device login's: ``machines.device_schemas``; the machine
lists': ``machines.list_schemas``): models that validate a body and that the
views document (``core.openapi.documented``), with the JSON schemas they publish
(docs/shim-protocol.md, docs/live-operations.md). The wire protocol itself is
``machines.protocol``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)

from core.validation import NonBlank, WireModel, drf_errors, rule
from machines.protocol import CALLER_OPERATIONS, DEFAULT_LIMITS
from machines.shim.payloads import PATH_DESCRIPTION, PAYLOADS, LiveFields

# pydantic's Field arguments a payload field's metadata may carry (machines.shim.payloads).
_FIELD_ARGUMENTS = ("description", "ge", "gt", "le", "min_length")


def payload_model(shared: type[Any], *, exclude: Iterable[str] = ()) -> type[BaseModel]:
    """The pydantic model of an operation payload defined once in ``machines.shim.payloads``
    (a standard-library dataclass, since the shim installs without pydantic): the same
    fields, types, defaults, bounds and descriptions (not its docstring, written for
    developers: a schema's ``description`` reaches models and clients); strict (``"3"`` is not an integer,
    ``1`` not a boolean, as the shim's ``payload_of`` reads them); unknown fields ignored.
    ``exclude`` leaves fields out (a tool's schema omits what the platform sets).
    Validate ``without_nulls(payload)``: a ``null`` field reads as absent, as in the shim.
    """
    hints = get_type_hints(shared)
    definitions: dict[str, Any] = {}
    for field in dataclasses.fields(shared):
        if field.name in exclude:
            continue
        arguments = {name: field.metadata[name] for name in _FIELD_ARGUMENTS if name in field.metadata}
        if field.default is not dataclasses.MISSING:
            arguments["default"] = field.default
        definitions[field.name] = (hints[field.name], Field(**arguments))
    model: type[BaseModel] = create_model(
        shared.__name__,
        __config__=ConfigDict(strict=True, extra="ignore"),
        __module__=__name__,
        **definitions,
    )
    return model


PAYLOAD_MODELS: dict[str, type[BaseModel]] = {str(op): payload_model(shared) for op, shared in PAYLOADS.items()}
"""Operation → the pydantic model of its payload (``payload_model``), as the shim reads it."""

PLATFORM_FIELDS = tuple(field.name for field in dataclasses.fields(LiveFields))
"""The payload fields the platform sets (a stream, a pipe: docs/live-operations.md), never a
caller (``machines.services.arguments.check_plain_payload`` refuses them set)."""

CALLER_PAYLOAD_MODELS: dict[str, type[BaseModel]] = {
    str(op): payload_model(shared, exclude=PLATFORM_FIELDS) for op, shared in PAYLOADS.items()
}
"""Operation → its payload as a caller gives it (``PAYLOAD_MODELS`` without the
``PLATFORM_FIELDS``): what ``POST …/ops`` validates and documents, and the tools take."""


def _payload_alternatives() -> list[JsonValue]:
    """``SessionOpBody``'s ``oneOf``: one alternative per operation, its ``op`` and its caller
    payload. (Not an ``if``/``then`` per operation: seven of those multiply into more
    alternatives than a schema-driven generator such as schemathesis resolves.)"""
    alternatives: list[JsonValue] = []
    for op, model in CALLER_PAYLOAD_MODELS.items():
        payload: dict[str, Any] = {key: value for key, value in model.model_json_schema().items() if key != "title"}
        required = set(payload.get("required", []))
        # The route reads an optional field sent as null as absent (``without_nulls``), as
        # the shim does: the schema accepts that null too.
        payload["properties"] = {
            name: (field if name in required else {"anyOf": [field, {"type": "null"}]})
            for name, field in payload.get("properties", {}).items()
        }
        alternative: dict[str, JsonValue] = {"properties": {"op": {"const": op}, "payload": payload}}
        if model.model_json_schema().get("required"):  # an absent payload is {}: it lacks them
            alternative["required"] = ["payload"]
        alternatives.append(alternative)
    return alternatives


def without_nulls(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` without its ``null`` fields: a payload's ``null`` means absent (the shim's rule)."""
    return {name: value for name, value in payload.items() if value is not None}


def payload_error(exc: ValidationError) -> str:
    """A payload's first error as ``payload.<field path>: <sentence>``, the sentence from
    the table every body's errors read (``core.validation.drf_errors``):
    ``payload.offset: A valid integer is required.``, ``payload.env.A: Not a valid string.``"""
    path, node = ["payload"], drf_errors(exc)
    while isinstance(node, dict):
        key = next(iter(node))
        path.append(str(key))
        node = node[key]
    return f"{'.'.join(path)}: {node[0]}"


REQUEST_ID_SCHEMA = {
    "anyOf": [{"type": "string", "format": "uuid"}, {"type": "null"}],
    "description": "a UUID you choose, to cancel the operation by (POST …/ops/{request_id}/cancel); "
    "unset: the platform picks one",
}
TARGET_MACHINES_MAX = 256  # names in one target_machines list (more than a session attaches)
MACHINE_NAME_MAX = 255
"""The longest machine name a body may give: longer than any machine id, host or display
name stored (their columns are 64 and 255 characters), so a longer one can match nothing."""


def request_id_of(value: Any) -> str | None:
    """A client-chosen ``request_id`` in canonical form (lower-case, hyphenated), or ``None``.

    Raises ``ValueError("request_id must be a UUID …")`` for anything but a UUID string
    (a caller chooses it to cancel the operation by: docs/live-operations.md#cancelling).
    """
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 45:
        raise ValueError("request_id must be a UUID string, e.g. 3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError(
            f"request_id must be a UUID, e.g. 3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01 (got {value[:45]!r})"
        ) from None


RequestId = Annotated[StrictStr | None, AfterValidator(request_id_of), WithJsonSchema(REQUEST_ID_SCHEMA)]
"""A body's ``request_id``: a string (``"request_id must be a string"``) that is a UUID
(``request_id_of``'s sentence), kept in canonical form, or ``None``."""


def target_machines_of(value: Any) -> list[str] | Literal["*"] | None:
    """``target_machines`` as given (docs/live-operations.md#fan-out-to-many-machines): a non-empty list of distinct
    machine names (each what a ``target_machine`` may be), ``"*"`` (every attached machine
    with the capability), or ``None``. Raises ``ValueError`` saying what is wrong."""
    if value is None or value == "*":
        return value
    if not isinstance(value, list) or not value:
        raise ValueError('target_machines must be a non-empty list of machine names, or "*" for every machine')
    if len(value) > TARGET_MACHINES_MAX:
        raise ValueError(f"target_machines names at most {TARGET_MACHINES_MAX} machines")
    for name in value:
        if not isinstance(name, str) or not name.strip() or len(name) > MACHINE_NAME_MAX:
            raise ValueError(
                f"target_machines entries must be non-empty machine names of at most {MACHINE_NAME_MAX} characters"
            )
    if len(set(value)) != len(value):
        raise ValueError("target_machines names a machine twice")
    return list(value)


TARGET_MACHINES_SCHEMA = {
    "anyOf": [
        {
            "type": "array",
            "items": {"type": "string", "pattern": r"\S", "maxLength": MACHINE_NAME_MAX},
            "minItems": 1,
            "maxItems": TARGET_MACHINES_MAX,
            "uniqueItems": True,
        },
        {"const": "*"},
        {"type": "null"},
    ],
    "description": 'run on each of these machines in parallel ("*": every attached machine with the '
    "capability); the answer is then per machine. Exclusive with target_machine.",
}


class SessionOpBody(WireModel):
    """``POST /api/v1/sessions/{session_id}/ops``: ``{op, payload?, target_machine?,
    target_machines?, stream?, request_id?}`` (docs/live-operations.md).

    Typed fields refuse with ``core.validation.PLAIN_SENTENCES``'s sentences (``"op is
    required"``, ``"payload must be an object"``, ``"target_machine must be a string"``,
    ``"stream must be true or false"``; docs/architecture.md#bodies). ``op`` is a string
    whose name, like the ``target_machine``, ``machines.services.operations.machine_op``
    checks with the protocol's error codes; the ``payload`` (an object, default ``{}``) of a
    known operation is checked here against its model (``CALLER_PAYLOAD_MODELS``:
    ``"payload.offset: A valid integer is required."``), so a bad one is refused once,
    before any machine is asked. ``target_machines`` (``target_machines_of``) and
    ``target_machine`` are exclusive; ``stream`` (default false) is for ``EXECUTE_COMMAND``
    only; ``request_id`` is a UUID (``RequestId``, canonical form).
    """

    # What machines.services.operations refuses of a body its fields allow: stream: true
    # other than for EXECUTE_COMMAND, target_machine beside target_machines; and each
    # operation's payload (its model, which _combinations validates it with).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": _payload_alternatives(),
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "then": {"properties": {"op": {"const": "EXECUTE_COMMAND"}}},
            "not": {
                "properties": {"target_machine": {"type": "string"}, "target_machines": {"not": {"type": "null"}}},
                "required": ["target_machine", "target_machines"],
            },
        }
    )
    op: Annotated[StrictStr, WithJsonSchema({"type": "string", "enum": sorted(CALLER_OPERATIONS)})] = Field(
        description="a machine operation"
    )
    payload: Annotated[dict[str, Any], WithJsonSchema({"type": "object", "description": "the operation's payload"})] = (
        Field(default_factory=dict)
    )
    target_machine: Annotated[
        StrictStr | None,
        WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}], "description": "a machine_id"}),
    ] = None
    target_machines: Annotated[Any, WithJsonSchema(TARGET_MACHINES_SCHEMA)] = None
    stream: Annotated[
        StrictBool,
        WithJsonSchema(
            {
                "type": "boolean",
                "default": False,
                "description": "EXECUTE_COMMAND only: answer text/event-stream (started, output, result or "
                "error; fan-out: those of each machine, then done); closing the stream cancels the command",
            }
        ),
    ] = False
    request_id: RequestId = None

    @field_validator("target_machines", mode="before")
    @classmethod
    def _target_machines(cls, value: Any) -> Any:
        return target_machines_of(value)

    @model_validator(mode="after")
    def _combinations(self) -> SessionOpBody:
        if self.target_machines is not None and self.target_machine is not None:
            raise ValueError("target_machine and target_machines are exclusive: give one of them")
        if self.stream and self.op != "EXECUTE_COMMAND":
            raise ValueError(f"stream: true is for EXECUTE_COMMAND only (op is {self.op[:40]!r})")
        model = CALLER_PAYLOAD_MODELS.get(self.op)
        if model is not None:
            try:
                model.model_validate(without_nulls(self.payload))
            except ValidationError as exc:
                raise ValueError(payload_error(exc)) from None
        return self


class SessionOpAnswer(BaseModel):
    """The shim's response: ``{machine_id, type, payload}``."""

    machine_id: str
    type: str
    payload: dict[str, Any]


class MachineOutcome(BaseModel):
    """One machine's part of a fan-out: ``{machine_id, name, ok, result | error}``
    (``result`` as ``SessionOpAnswer``; ``error`` ``{code, message}``)."""

    machine_id: str
    name: str
    ok: bool
    result: SessionOpAnswer | None = None
    error: dict[str, Any] | None = None


class SessionFanOutAnswer(BaseModel):
    """A fan-out's answer (``target_machines``): ``{"results": [outcome, …]}``, one per machine."""

    results: list[MachineOutcome]


class SessionOpResult(RootModel[SessionOpAnswer | SessionFanOutAnswer]):
    """``POST /api/v1/sessions/{session_id}/ops``'s JSON answer: one machine's response
    (``SessionOpAnswer``), or with ``target_machines`` a fan-out's (``SessionFanOutAnswer``)."""


class SessionCancelAnswer(BaseModel):
    """``POST …/ops/{request_id}/cancel`` answers 202 ``{request_id, cancelled: true}``: the
    cancel was sent; the operation itself ends with its own answer (``cancelled: true``)."""

    request_id: str
    cancelled: bool


class OperationInFlight(BaseModel):
    """One operation in flight (``machines.services.live.operations_in_flight``)."""

    model_config = ConfigDict(extra="allow")

    request_id: str
    session_id: str
    kind: Literal["command", "copy", "pipe"]
    op: str
    machine_ids: list[str]
    machines: list[str]
    summary: str
    caller: str
    started_at: str


class OperationsInFlightAnswer(BaseModel):
    """``GET /api/v1/sessions/{session_id}/ops``: ``{"operations": [...]}``, newest first."""

    operations: list[OperationInFlight]


def _pipe_end(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{field} is required: {{machine, argv | command, cwd?}}")
    machine = value.get("machine")
    if not isinstance(machine, str) or not machine.strip() or len(machine) > MACHINE_NAME_MAX:
        raise ValueError(f"{field}.machine is required (a machine name)")
    argv, command = value.get("argv"), value.get("command")
    if (argv is None) == (command is None):
        raise ValueError(f"{field} needs argv (a list of strings) or command (a string), exactly one")
    if argv is not None and (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)):
        raise ValueError(f"{field}.argv must be a non-empty list of strings")
    if command is not None and (not isinstance(command, str) or not command):
        raise ValueError(f"{field}.command must be a non-empty string")
    cwd = value.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError(f"{field}.cwd must be a string")
    env = value.get("env")
    if env is not None and (
        not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ValueError(f"{field}.env must be an object of strings")
    unknown = set(value) - {"machine", "argv", "command", "cwd", "env"}
    if unknown:
        raise ValueError(f"{field} has unknown fields: {', '.join(sorted(unknown)[:5])}")
    return {k: v for k, v in value.items() if v is not None}


PIPE_END_SCHEMA = {
    "type": "object",
    "properties": {
        "machine": {
            "type": "string",
            "pattern": r"\S",
            "maxLength": MACHINE_NAME_MAX,
            "description": "a machine name, as target_machine",
        },
        "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "command": {"type": "string", "minLength": 1, "description": "run through the user's shell"},
        "cwd": {"type": "string"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["machine"],
    "oneOf": [{"required": ["argv"]}, {"required": ["command"]}],
    "additionalProperties": False,
}


def _timeout_range(value: float | None) -> float | None:
    # One sentence for either bound (and NaN, which compares false), as before the field
    # was typed; the type's refusal is PLAIN_SENTENCES's "timeout_seconds must be a number".
    if value is not None and not 0 < value < 10**7:
        raise rule("must be a number of seconds greater than 0")
    return value


class SessionPipeBody(WireModel):
    """``POST /api/v1/sessions/{session_id}/pipe``: ``{source, destination, timeout_seconds?,
    request_id?}`` (docs/live-operations.md#cross-machine-pipes): each end ``{machine, argv | command,
    cwd?, env?}`` (exactly one of argv and command); the source's stdout goes into the
    destination's stdin. ``timeout_seconds`` bounds the pipe (seconds, a number > 0 and
    < 10⁷: ``"timeout_seconds must be a number of seconds greater than 0"``, its ``rule``);
    ``request_id``
    is a UUID (``RequestId``). The ends keep ``_pipe_end``'s own sentences."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})  # as _known_fields
    absent_as_null = ("source", "destination")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, value: Any) -> Any:
        # Refused like an end's unknown fields (``stream`` is not a pipe's: it answers JSON).
        if isinstance(value, dict):
            unknown = set(value) - {"source", "destination", "timeout_seconds", "request_id"}
            if unknown:
                raise ValueError(f"the pipe has unknown fields: {', '.join(sorted(map(str, unknown))[:5])}")
        return value

    source: Annotated[Any, WithJsonSchema(PIPE_END_SCHEMA)]
    destination: Annotated[Any, WithJsonSchema(PIPE_END_SCHEMA)]
    timeout_seconds: Annotated[
        StrictFloat | None,
        AfterValidator(_timeout_range),
        WithJsonSchema(
            {
                "anyOf": [
                    # machines.services.pipe: at most the machines' max_command_timeout_seconds
                    # (the platform's, unless a shim lowered its own).
                    {"type": "number", "exclusiveMinimum": 0, "maximum": DEFAULT_LIMITS["max_command_timeout_seconds"]},
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    request_id: RequestId = None

    @field_validator("source", "destination", mode="before")
    @classmethod
    def _end(cls, value: Any, info: ValidationInfo) -> dict[str, Any]:
        return _pipe_end(value, str(info.field_name))


class SessionPipeAnswer(BaseModel):
    """A pipe's answer: ``{request_id, bytes, source, destination}`` — ``bytes`` moved
    (raw), each end's result (``machine_id``, ``name``, ``exit_code``, ``stderr``,
    ``timed_out``, ``cancelled``, …; the destination's ``stdout`` too)."""

    model_config = ConfigDict(extra="allow")

    request_id: str
    bytes: int
    source: dict[str, Any]
    destination: dict[str, Any]


class SessionCopyBody(WireModel):
    """``POST /api/v1/sessions/{session_id}/copy``: ``{source_machine, source_path,
    destination_machine, destination_path, overwrite?, stream?, request_id?}``
    (docs/shim-protocol.md#cross-machine-copy); each of the four a non-empty string, then
    ``overwrite`` and ``stream`` booleans (default false), ``request_id`` a UUID
    (``RequestId``). Typed fields refuse, in this order, with PLAIN_SENTENCES's sentences
    (``"source_path is required"``, ``"source_path must be a non-empty string"``,
    ``"overwrite must be true or false"``; docs/architecture.md#bodies)."""

    @model_validator(mode="before")
    @classmethod
    def _no_targets(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for name in ("target_machines", "target_machine"):
                if name in value:
                    raise ValueError(f"copy takes source_machine and destination_machine, not {name}")
        return value

    source_machine: StrictStr = Field(min_length=1, description="the machine to copy from, named as target_machine")
    source_path: StrictStr = Field(min_length=1, description=PATH_DESCRIPTION)
    destination_machine: StrictStr = Field(min_length=1, description="the machine to copy to, named as target_machine")
    destination_path: StrictStr = Field(min_length=1, description=PATH_DESCRIPTION)
    overwrite: StrictBool = Field(default=False, description="replace a file already at destination_path")
    stream: Annotated[
        StrictBool,
        WithJsonSchema(
            {
                "type": "boolean",
                "default": False,
                "description": "answer text/event-stream: progress {request_id, bytes_done, bytes_total} events, "
                "then result or error; closing the stream cancels the copy",
            }
        ),
    ] = False
    request_id: RequestId = None


class SessionCopyAnswer(BaseModel):
    """A verified copy: ``{size_bytes, sha256}``."""

    size_bytes: int
    sha256: str


def _machine_name_length(value: str | None) -> str | None:
    # A rule of its own, not Field(max_length): on NonBlank | None pydantic would apply it
    # outside the string ("must have at most 255 items").
    if value is not None and len(value) > MACHINE_NAME_MAX:
        raise rule(f"must be at most {MACHINE_NAME_MAX} characters")
    return value


class DefaultMachineBody(WireModel):
    """``PUT /api/v1/machines/default``: ``{machine_id}``, the machine to route to by default
    (docs/shim-protocol.md#routing, step 3) — anything a ``target_machine`` may be (a ``machine_id``, a host or display
    name, a unique prefix of either), resolved among the caller's machines by
    ``machines.services.router.default_machine_set`` — or ``null`` to clear it. Refused
    with PLAIN_SENTENCES's sentences (docs/architecture.md#bodies): ``"machine_id is
    required"``, ``"machine_id must be a string"``, ``"machine_id must be a non-empty
    string"`` (blank too), ``"machine_id must be at most 255 characters"``."""

    machine_id: Annotated[
        NonBlank | None,
        AfterValidator(_machine_name_length),
        WithJsonSchema(
            {
                "anyOf": [{"type": "string", "minLength": 1, "maxLength": MACHINE_NAME_MAX}, {"type": "null"}],
                "description": "a machine id, host name, display name or unique prefix (as target_machine); "
                "null clears the default",
            }
        ),
    ]


class DefaultMachineAnswer(BaseModel):
    """The default machine now: ``{machine_id}`` (the resolved id, or ``null`` when cleared)."""

    machine_id: str | None
