"""Validating a wire body with its pydantic model, and the one error sentence a wire shows.

Every body model of Dispatch (``/ws`` actions, ``/ws/shim/`` ``HELLO``, the async REST
routes, the peer API) is a pydantic model, most of them ``WireModel``s; its edge
validates the body and answers the first error as text. Two styles exist on the wire
today, both kept byte for byte:

- ``describe_validation_error``: ``missing field 'x'`` / ``invalid <path>: <reason>``
  (``/ws`` actions, ``HELLO``, ``parse_body``);
- ``first_error_message``: the validator's own sentence, as is (the peer API and the
  machine operation routes, whose models raise the exact text the route answered before
  it had a model, such as ``name must be a non-empty string``); a validator that must
  also answer ``details`` raises ``refusal(message, details)``.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from core.errors import InvalidRequest

Model = TypeVar("Model", bound=BaseModel)


class WireModel(BaseModel):
    """A request body as a route receives it: unknown fields ignored, fields readable by
    name or alias. The fields named (by wire name) in ``absent_as_null`` are validated as
    ``null`` when absent, so that their own validator answers for a missing field with the
    route's sentence (and the schema still lists them as required)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    absent_as_null: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _absent_as_null(cls, value: Any) -> Any:
        if isinstance(value, dict) and cls.absent_as_null:
            return {**dict.fromkeys(cls.absent_as_null), **value}
        return value


def _first(exc: ValidationError) -> Any:
    return exc.errors(include_url=False)[0]


def describe_validation_error(exc: ValidationError) -> str:
    """The first pydantic error as ``invalid <field path>: <reason>`` (``missing field
    '<path>'`` for an absent required field); a path reads ``tools[0].name``."""
    error = _first(exc)
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    reason = str(error.get("ctx", {}).get("error") or error["msg"])
    if error["type"] == "missing":
        return f"missing field '{path}'"
    return f"invalid {path or 'body'}: {reason}"


def first_error_message(exc: ValidationError) -> str:
    """The first error's own sentence: the ``ValueError`` text a validator raised, else
    pydantic's message."""
    error = _first(exc)
    return str(error.get("ctx", {}).get("error") or error["msg"])


def refusal(message: str, details: dict[str, Any]) -> PydanticCustomError:
    """What a validator raises to refuse a value with ``details`` beside its sentence:
    ``parse_plain`` answers ``InvalidRequest(message, details)`` (a ``ValueError`` carries
    the sentence alone)."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "details": details})


def parse_body(model: type[Model], body: Any, *, context: dict[str, Any] | None = None) -> Model:
    """Validate a body against ``model``; ``InvalidRequest`` (400) with
    ``describe_validation_error``'s text when it does not fit."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


def parse_plain(model: type[Model], body: Any, *, context: dict[str, Any] | None = None) -> Model:
    """Validate a body against ``model``; ``InvalidRequest`` (400) with the validator's
    own sentence (``first_error_message``) when it does not fit, and the ``details`` of a
    ``refusal``."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise InvalidRequest(first_error_message(exc), _first(exc).get("ctx", {}).get("details")) from None
