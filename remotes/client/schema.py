"""Function specs for ``remote-connect``, derived from a Python callable (docs/ws-protocol.md#remote-connect).

The parameter schema comes from pydantic (the same arguments validator that checks calls)
and the descriptions from the docstring (``docstring_parser``); nothing here maps types
to JSON Schema by hand.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import docstring_parser
import pydantic
from pydantic.json_schema import GenerateJsonSchema

_KEYWORD_KINDS = (
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


class _UntitledFields(GenerateJsonSchema):
    """Leave out the ``title`` pydantic derives from each parameter name: it repeats the key."""

    def field_title_should_be_set(self, schema: object) -> bool:
        return False


def function_spec(function: Callable[..., Any]) -> dict[str, Any]:
    """Describe ``function`` as a remote function spec.

    Returns ``{"name": str, "description": str, "parameters": {"type": "object",
    "properties": {...}, "required": [...], "additionalProperties": False}}``, where each
    property may carry a ``description`` from the docstring's parameter section and
    nested models appear under ``$defs``. The description is the docstring's short and
    long descriptions, joined by a blank line (``""`` without a docstring).

    Raises ``TypeError`` when a parameter cannot be passed by keyword (positional-only,
    ``*args``, ``**kwargs``): remote calls pass their ``args`` object as keyword
    arguments. Raises ``pydantic.PydanticUserError`` (or a subclass) when a type hint has
    no JSON Schema.
    """
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind not in _KEYWORD_KINDS:
            raise TypeError(
                f"{function.__qualname__}: parameter {parameter.name!r} cannot be passed by"
                " keyword, and remote calls pass their arguments by keyword"
            )
    docstring = docstring_parser.parse(inspect.getdoc(function) or "")
    # A callable's TypeAdapter is its arguments validator (what validate_call checks).
    adapter = pydantic.TypeAdapter(function)  # type: ignore[arg-type]
    parameters = adapter.json_schema(schema_generator=_UntitledFields)
    parameters.setdefault("required", [])
    for param in docstring.params:
        prop = parameters["properties"].get(param.arg_name)
        if prop is not None and param.description:
            prop.setdefault("description", param.description)
    description = "\n\n".join(text for text in (docstring.short_description, docstring.long_description) if text)
    return {
        "name": function.__name__,
        "description": description,
        "parameters": parameters,
    }
