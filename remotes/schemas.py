"""JSON Schema validation of remote arguments, safe against hostile schemas.

A remote's ``parameters`` schema comes from a client, so validating arguments against it
must not let that client reach anything or stall the server:

- ``$ref`` is resolved only inside the schema itself (``#…``): a registry that retrieves
  nothing replaces jsonschema's default, which would fetch ``http://`` and ``file://``
  URLs; non-local references are refused at ``remote-connect`` too;
- ``pattern`` and ``patternProperties`` run with the ``regex`` module under a time limit,
  so a catastrophic pattern (``^(a+)+$``) fails the one call instead of freezing the
  process (Python's ``re`` holds the interpreter for as long as it backtracks);
- a schema with patterns is validated in a worker thread (``has_patterns``; the caller
  uses ``sync_to_async(thread_sensitive=False)``), others inline, which is cheaper.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import regex
from jsonschema import Draft202012Validator, ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import extend, validator_for
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource

PATTERN_TIMEOUT = 0.25  # seconds one pattern may take on one string


def _refuse(uri: str) -> Resource[Any]:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


# Resolves nothing outside the schema being validated.
LOCAL_ONLY = Registry(retrieve=_refuse)  # type: ignore[call-arg]


def _search(pattern: str, text: str) -> bool:
    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT, concurrent=True) is not None
    except TimeoutError:
        raise ValidationError(f"pattern {pattern!r} took too long on this value") from None
    except regex.error as exc:
        raise ValidationError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None


def _pattern(validator: Validator, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, properties: dict[str, Any], instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in properties.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def non_local_refs(schema: Any) -> list[str]:
    """Every ``$ref``/``$dynamicRef`` in ``schema`` that does not start with ``#``."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("$ref", "$dynamicRef") and isinstance(value, str) and not value.startswith("#"):
                    found.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def has_patterns(schema: Any) -> bool:
    """Whether ``schema`` uses ``pattern``, ``patternProperties`` or a ``format`` anywhere
    (the keywords that run regular expressions)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if {"pattern", "patternProperties", "format"} & node.keys():
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def compile_validator(schema: dict[str, Any]) -> Validator:
    """A validator for ``schema`` (its declared draft, 2020-12 by default) with local-only
    ``$ref`` resolution and time-limited patterns."""
    base = validator_for(schema, default=Draft202012Validator)
    safe = extend(base, validators={"pattern": _pattern, "patternProperties": _pattern_properties})
    return safe(schema, registry=LOCAL_ONLY)
