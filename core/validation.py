"""Validating a wire body with its pydantic model, and the one error sentence a wire shows.

Every body model of Dispatch (``/ws`` actions, ``/ws/shim/`` ``HELLO``, the async REST
routes, the peer API) is a pydantic model, most of them ``WireModel``s; its edge
validates the body and answers the first error as text. Three styles exist on the wire
today, each kept byte for byte:

- ``describe_validation_error``: ``missing field 'x'`` / ``invalid <path>: <reason>``
  (``/ws`` actions, ``HELLO``, ``parse_body``);
- ``parse_plain`` (the peer API, pairing and the machine operation routes): one sentence
  per pydantic error type (``PLAIN_SENTENCES``, such as ``name must be a non-empty
  string``) naming the field by its wire path, or a validator's own sentence as is; a
  validator that must also answer ``details`` raises ``refusal(message, details)``;
- ``parse_request`` (the DRF views): DRF's ``ValidationError`` with the sentences DRF's
  serializer fields answered (``DRF_SENTENCES``), nested under their fields
  (docs/architecture.md#bodies).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, TypeVar

from django.utils.dateparse import parse_datetime
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainValidator,
    StrictStr,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema
from rest_framework import exceptions
from rest_framework.exceptions import ErrorDetail

from core.errors import InvalidRequest

Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")


class WireModel(BaseModel):
    """A request body as a route receives it: unknown fields ignored, fields readable by
    name or alias. The fields named (by wire name) in ``absent_as_null`` are validated as
    ``null`` when absent, so that their own validator answers for a missing field with the
    route's sentence (and the schema still lists them as required). The fields named in
    ``null_as_absent`` take their default when sent as ``null`` (a wire that says "none"
    with null), so that their type need not admit ``None``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    absent_as_null: ClassVar[tuple[str, ...]] = ()
    null_as_absent: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _absent_as_null(cls, value: Any) -> Any:
        if isinstance(value, dict) and cls.null_as_absent:
            value = {k: v for k, v in value.items() if v is not None or k not in cls.null_as_absent}
        if isinstance(value, dict) and cls.absent_as_null:
            return {**dict.fromkeys(cls.absent_as_null), **value}
        return value


def _first(exc: ValidationError) -> Any:
    return exc.errors(include_url=False)[0]


def describe_validation_error(exc: ValidationError) -> str:
    """The first pydantic error as ``invalid <field path>: <reason>`` (``missing field
    '<path>'`` for an absent required field); a path reads ``tools[0].name``."""
    error = _first(exc)
    path = _field_path(error["loc"])
    reason = str(error.get("ctx", {}).get("error") or error["msg"])
    if error["type"] == "missing":
        return f"missing field '{path}'"
    return f"invalid {path}: {reason}"


def first_error_message(exc: ValidationError) -> str:
    """The first error's own sentence: the ``ValueError`` text a validator raised, else
    pydantic's message."""
    return _own_sentence(_first(exc))


def _own_sentence(error: Any) -> str:
    return str(error.get("ctx", {}).get("error") or error["msg"])


def refusal(message: str, details: dict[str, Any]) -> PydanticCustomError:
    """What a validator raises to refuse a value with ``details`` beside its sentence:
    ``parse_plain`` answers ``InvalidRequest(message, details)`` (a ``ValueError`` carries
    the sentence alone)."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "details": details})


def rule(sentence: str) -> PydanticCustomError:
    """What a validator of a nested model's field raises to refuse it with ``sentence``
    said after the field's wire path: ``parse_plain`` answers ``<path> <sentence>``
    (``launched_by.agent_id must be an agent id …``), the model being used under several
    names."""
    return PydanticCustomError("plain_rule", "{rule}", {"rule": sentence})


def parse_body(model: type[Model], body: Any, *, context: dict[str, Any] | None = None) -> Model:
    """Validate a body against ``model``; ``InvalidRequest`` (400) with
    ``describe_validation_error``'s text when it does not fit."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


# --- plain views: a pydantic body, one sentence per error type -----------------------------

# pydantic error type → the sentence a plain view (the peer API, pairing, the machine
# operation routes) answers for it, formatted with ``field`` (the field's wire name and
# path, ``launched_by.name``, ``messages[0].idempotency_key``) and the error's ``ctx``. One
# style for every plain view's body (docs/architecture.md#bodies): a typed field refuses
# with these, a validator of a real rule raises its own sentence (a ``ValueError``, a
# ``refusal``), answered as is.
PLAIN_SENTENCES: dict[str, str] = {
    "missing": "{field} is required",
    "string_type": "{field} must be a string",
    "string_too_short": "{field} must be at least {min_length} characters",
    "string_too_long": "{field} must be at most {max_length} characters",
    "string_pattern_mismatch": "{field} must match {pattern}",
    "bool_type": "{field} must be true or false",
    "bool_parsing": "{field} must be true or false",
    "int_type": "{field} must be an integer",
    "int_parsing": "{field} must be an integer",
    "int_from_float": "{field} must be an integer",
    "float_type": "{field} must be a number",
    "float_parsing": "{field} must be a number",
    "finite_number": "{field} must be a finite number",
    "greater_than": "{field} must be greater than {gt}",
    "greater_than_equal": "{field} must be at least {ge}",
    "less_than": "{field} must be less than {lt}",
    "less_than_equal": "{field} must be at most {le}",
    "literal_error": "{field} must be one of: {expected}",
    "enum": "{field} must be one of: {expected}",
    "dict_type": "{field} must be an object",
    "model_type": "{field} must be an object",
    "model_attributes_type": "{field} must be an object",
    "list_type": "{field} must be a list",
    "too_short": "{field} must have at least {min_length} items",
    "too_long": "{field} must have at most {max_length} items",
    "extra_forbidden": "unknown field {field}",
    "null": "{field} must not be null",  # an ``Omittable`` field sent as null
    "null_characters_not_allowed": "{field} must not contain NUL characters",
}
# Overrides of ``PLAIN_SENTENCES`` for one value of the error's ``ctx`` (a string of at
# least one character: "non-empty", as "" and a blank ``NonBlank`` are refused).
_PLAIN_SPECIAL: dict[tuple[str, str, Any], str] = {
    ("string_too_short", "min_length", 1): "{field} must be a non-empty string",
    ("too_short", "min_length", 1): "{field} must not be empty",
}
_QUOTED = re.compile(r"'((?:[^'\\]|\\.)*)'")


def _field_path(loc: tuple[str | int, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def _choices(expected: str) -> str:
    # pydantic says a Literal's values as "'a', 'b' or 'c'"; the sentence lists "a, b, c".
    names = _QUOTED.findall(expected)
    return ", ".join(names) if names else expected


def plain_sentence(error: Any) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as a plain view's
    sentence: a validator's own sentence as is, else ``PLAIN_SENTENCES``'s template for
    its type (pydantic's message for a type the table lacks)."""
    kind = error["type"]
    if kind in _OWN_SENTENCE:
        return _own_sentence(error)
    ctx = dict(error.get("ctx", {}))
    if kind == "plain_rule":
        return f"{_field_path(error['loc'])} {ctx['rule']}"
    special = next((t for (k, key, value), t in _PLAIN_SPECIAL.items() if k == kind and ctx.get(key) == value), "")
    template = special or PLAIN_SENTENCES.get(kind, "")
    if not template:
        return f"{_field_path(error['loc'])}: {error['msg']}"
    if "expected" in ctx:
        ctx["expected"] = _choices(str(ctx["expected"]))
    return template.format(**ctx, field=_field_path(error["loc"]))


def parse_plain(model: type[Model], body: Any, *, context: dict[str, Any] | None = None) -> Model:
    """Validate a body against ``model``; ``InvalidRequest`` (400) with the first error's
    ``plain_sentence`` (a validator's own sentence, else ``PLAIN_SENTENCES``'s) when it
    does not fit, and the ``details`` of a ``refusal``."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        error = _first(exc)
        raise InvalidRequest(plain_sentence(error), error.get("ctx", {}).get("details")) from None


# --- DRF views: a pydantic body, DRF's error answer ------------------------------------

# DRF's DateTimeField named the formats it reads when it refused a value.
DATETIME_WRONG = (
    "Datetime has wrong format. Use one of these formats instead: YYYY-MM-DDThh:mm[:ss[.uuuuuu]][+HH:MM|-HH:MM|Z]."
)

DATETIME_OUT_OF_RANGE = "Datetime value out of range."

# pydantic error type → (DRF error code, the sentence DRF's field answered for it). A
# sentence is formatted with the error's ``ctx`` and ``input`` (its text) and
# ``input_type`` (its Python type's name). One table for every DRF view's body
# (docs/architecture.md#bodies).
DRF_SENTENCES: dict[str, tuple[str, str]] = {
    "missing": ("required", "This field is required."),
    "string_type": ("invalid", "Not a valid string."),
    "string_too_long": ("max_length", "Ensure this field has no more than {max_length} characters."),
    "string_too_short": ("min_length", "Ensure this field has at least {min_length} characters."),
    "string_pattern_mismatch": ("invalid", "This value does not match the required pattern."),
    "int_type": ("invalid", "A valid integer is required."),
    "int_parsing": ("invalid", "A valid integer is required."),
    "int_from_float": ("invalid", "A valid integer is required."),
    "float_type": ("invalid", "A valid number is required."),
    "float_parsing": ("invalid", "A valid number is required."),
    "greater_than_equal": ("min_value", "Ensure this value is greater than or equal to {ge}."),
    "less_than_equal": ("max_value", "Ensure this value is less than or equal to {le}."),
    # DRF's fields have inclusive bounds only; an exclusive one is worded as theirs are.
    "greater_than": ("min_value", "Ensure this value is greater than {gt}."),
    "less_than": ("max_value", "Ensure this value is less than {lt}."),
    "bool_type": ("invalid", "Must be a valid boolean."),
    "bool_parsing": ("invalid", "Must be a valid boolean."),
    "literal_error": ("invalid_choice", '"{input}" is not a valid choice.'),
    "enum": ("invalid_choice", '"{input}" is not a valid choice.'),
    "datetime_type": ("invalid", DATETIME_WRONG),
    "datetime_parsing": ("invalid", DATETIME_WRONG),
    "datetime_from_date_parsing": ("invalid", DATETIME_WRONG),
    "model_type": ("invalid", "Invalid data. Expected a dictionary, but got {input_type}."),
    "model_attributes_type": ("invalid", "Invalid data. Expected a dictionary, but got {input_type}."),
    "dict_type": ("not_a_dict", 'Expected a dictionary of items but got type "{input_type}".'),
    "list_type": ("not_a_list", 'Expected a list of items but got type "{input_type}".'),
    "null_characters_not_allowed": ("null_characters_not_allowed", "Null characters are not allowed."),
    "too_long": ("max_length", "Ensure this field has no more than {max_length} elements."),
    "too_short": ("min_length", "Ensure this field has at least {min_length} elements."),
}
# A sentence of its own: a validator's ValueError/AssertionError, a ``refusal``.
_OWN_SENTENCE = frozenset({"value_error", "assertion_error", "invalid_request"})


def _drf_sentence(error: Any) -> ErrorDetail:
    kind = error["type"]
    value = error.get("input")
    if value is None and not error["loc"]:  # the body itself is null
        return ErrorDetail("No data provided", code="null")
    if value is None and kind != "missing":
        # DRF refuses a null before the type or any validator looks at it (a field that
        # takes null has None in its type: no error).
        return ErrorDetail("This field may not be null.", code="null")
    if kind in _OWN_SENTENCE:
        return ErrorDetail(_own_sentence(error), code="invalid")
    ctx = error.get("ctx", {})
    if kind == "string_too_short" and ctx.get("min_length") == 1:
        return ErrorDetail("This field may not be blank.", code="blank")  # "" or, trimmed, spaces only
    if kind == "too_long" and isinstance(value, str):  # a length on a validated string
        kind = "string_too_long"
    if kind not in DRF_SENTENCES:  # pydantic's own sentence, as is: it may hold braces
        return ErrorDetail(str(error["msg"]), code="invalid")
    code, sentence = DRF_SENTENCES[kind]
    # A refused value is echoed at most 40 characters long: an error never returns a
    # client's large value to it (the serializers cut a non-string choice the same way).
    shown = value if isinstance(value, str) and len(value) <= 40 else str(value)[:40]
    return ErrorDetail(sentence.format(**ctx, input=shown, input_type=type(value).__name__), code=code)


def drf_errors(exc: ValidationError) -> dict[str, Any]:
    """pydantic's errors as a DRF serializer's ``errors``: field → ``[sentence]``, a nested
    object's fields in a dict under its field, a list's items under their index (as
    DRF's ``ListField``); an error of the whole body (not an object; a model validator)
    under ``non_field_errors``. A field keeps its first error, as DRF's fields do."""
    tree: dict[str, Any] = {}  # the body's fields by name; deeper, a list's items by index
    for error in exc.errors(include_url=False):
        path: list[str | int] = [*error["loc"]]
        if not path or (error["type"] in ("model_type", "model_attributes_type") and error["input"] is not None):
            # DRF's serializer, not one of its fields, refused a body that is no object
            path.append("non_field_errors")
        node: dict[Any, Any] = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # the field already failed as a whole
                break
            node = child
        else:
            node.setdefault(path[-1], [_drf_sentence(error)])
    return tree


def parse_request(model: type[Model], data: Any, *, context: dict[str, Any] | None = None) -> Model:
    """Validate a DRF view's ``request.data`` against ``model``; DRF's ``ValidationError``
    with ``drf_errors`` (each sentence DRF's fields answered, ``DRF_SENTENCES``) when it
    does not fit, which ``core.api.exception_handler`` answers as 400 ``VALIDATION_ERROR``
    ``{"message": "<field>: <sentence>", "details": {<field>: [<sentence>]}}``
    (docs/architecture.md#errors)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise exceptions.ValidationError(drf_errors(exc)) from None


# --- DRF's field types, as pydantic types ------------------------------------------------

# The RFC 3339 date-times DRF's DateTimeField reads (django.utils.dateparse): an upper-case
# T and Z, a year from 0001, seconds up to 59 (no leap second).
DATE_TIME_PATTERN = (
    r"^([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}"
    r"T[0-9]{2}:[0-9]{2}:[0-5][0-9](\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})$"
)
NO_NUL = r"^[^\x00]*$"
NOT_BLANK = r"^[^\x00]*[^\s\x00][^\x00]*$"  # and, trimmed, not empty


class RequestSchema:
    """Annotation metadata: keywords a body's JSON Schema adds in validation mode only (a
    request's rules; an answer may well carry ``""``)."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        described = handler(schema)
        if handler.mode == "validation":
            described = {**handler.resolve_ref_schema(described), **self.keywords}
        return described


def _no_nul(value: str) -> str:
    if "\x00" in value:  # DRF's ProhibitNullCharactersValidator
        raise PydanticCustomError("null_characters_not_allowed", "Null characters are not allowed.")
    return value


# DRF's CharField as a request field reads it: a JSON string only (a number or boolean is
# "Not a valid string."; add ``Field(coerce_numbers_to_str=True)`` for DRF's plain
# CharField, which took numbers as text), no NUL, trimmed unless ``Raw``, "" (or spaces)
# refused unless ``Blank``. A length is ``Field(max_length=N)`` on the field.
Text = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1),
    AfterValidator(_no_nul),
    RequestSchema(pattern=NOT_BLANK),
]
BlankText = Annotated[
    str, StringConstraints(strip_whitespace=True), AfterValidator(_no_nul), RequestSchema(pattern=NO_NUL)
]
RawText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_no_nul), RequestSchema(pattern=NO_NUL)]
RawBlankText = Annotated[str, AfterValidator(_no_nul), RequestSchema(pattern=NO_NUL)]


class _Described:
    """Annotation metadata: keywords a field's JSON Schema adds in both modes (a rule the
    value keeps once validated, so an answer holds it too)."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler.resolve_ref_schema(handler(schema)), **self.keywords}


def _not_blank(value: str) -> str:
    if not value.strip():  # refused as "" is, by min_length 1: "must be a non-empty string"
        raise PydanticCustomError("string_too_short", "String should have at least 1 character", {"min_length": 1})
    return value


# A plain view's required text: a JSON string only, not blank (spaces alone are refused),
# kept as sent (neither trimmed nor checked for NUL). A length is ``Field(max_length=N)``.
NonBlank = Annotated[StrictStr, AfterValidator(_not_blank), _Described(minLength=1, pattern=r"\S")]


def _drf_datetime(value: Any) -> datetime:
    parsed = value if isinstance(value, datetime) else None
    if parsed is None and isinstance(value, str):
        try:
            parsed = parse_datetime(value)
        except ValueError:
            parsed = None
    if parsed is None:
        raise ValueError(DATETIME_WRONG)
    # USE_TZ: DRF read a date-time without an offset as the current time zone's (UTC).
    parsed = parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
    try:  # a moment UTC cannot hold (9999-12-31T23:59-01:00 is in year 10000)
        parsed.astimezone(UTC)
    except OverflowError:
        raise ValueError(DATETIME_OUT_OF_RANGE) from None
    return parsed


# DRF's DateTimeField as a request field reads it: RFC 3339 text (Django's
# ``parse_datetime``, not a number), one without an offset in UTC.
DateTime = Annotated[
    datetime,
    PlainValidator(_drf_datetime, json_schema_input_type=datetime),
    RequestSchema(pattern=DATE_TIME_PATTERN),
]


def _utc(value: datetime) -> datetime:
    # DRF's DateTimeField wrote a date-time in the current time zone (UTC): "…Z".
    return value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)


# A date-time an answer carries, as DRF's DateTimeField wrote it: in UTC, ``…Z``, with its
# microseconds (``model_dump(mode="json")``).
UtcDateTime = Annotated[datetime, AfterValidator(_utc)]


class _NullRefused:
    """Annotation metadata for ``X | None`` defaulting to ``None``: a ``null`` sent is
    refused (as DRF's ``required=False`` fields did), and the JSON Schema says ``X``."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def refuse_null(value: Any, validate: core_schema.ValidatorFunctionWrapHandler) -> Any:
            if value is None:  # only when sent: a default is not validated
                raise PydanticCustomError("null", "This field may not be null.")
            return validate(value)

        return core_schema.no_info_wrap_validator_function(refuse_null, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        described = handler(schema)
        branches = [branch for branch in described.get("anyOf", ()) if branch != {"type": "null"}]
        if len(branches) == 1:
            described = {**{k: v for k, v in described.items() if k != "anyOf"}, **branches[0]}
        return described


# A body field that may be left out (``None``, with ``= None``) but not sent as ``null``.
Omittable = Annotated[T | None, _NullRefused()]
