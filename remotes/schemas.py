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

Speed: jsonschema-rs answers "valid" first (compiled once per schema, offline: it
retrieves nothing), and the Python validator above runs only when it does not, so every
refusal keeps jsonschema's words. jsonschema-rs is asked only about schemas where the two
agree on what is valid (``rust_agrees``): none with ``$ref`` (a reference cycle the Python
validator refuses with ``RecursionError``, jsonschema-rs accepts), patterns or formats
(other regular-expression dialects), or ``multipleOf`` (jsonschema-rs calls ``0.3`` a
multiple of ``0.1``, floating point does not).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import orjson
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


def python_validator(schema: dict[str, Any]) -> Validator:
    """jsonschema's validator for ``schema`` (its declared draft, 2020-12 by default) with
    local-only ``$ref`` resolution and time-limited patterns: the one whose errors callers
    show."""
    base = validator_for(schema, default=Draft202012Validator)
    safe = extend(base, validators={"pattern": _pattern, "patternProperties": _pattern_properties})
    return safe(schema, registry=LOCAL_ONLY)


# Keywords whose meaning jsonschema-rs and the Python validator do not share exactly.
_RUST_DISAGREES = frozenset(
    {"$ref", "$dynamicRef", "$recursiveRef", "pattern", "patternProperties", "format", "multipleOf"}
)


def rust_agrees(schema: Any) -> bool:
    """Whether ``schema`` uses none of the keywords on which jsonschema-rs and jsonschema
    may disagree about validity (module docstring); a property merely *named* like one
    counts too, which only costs speed."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not _RUST_DISAGREES.isdisjoint(node.keys()):
                return False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return True


class ArgumentValidator:
    """Validates one function's arguments: ``is_valid(args) -> bool`` and
    ``iter_errors(args)`` (jsonschema ``ValidationError``s, for ``best_match``).

    ``is_valid`` asks jsonschema-rs first when it has a compiled schema and returns
    ``True`` on its word; otherwise (or when it says no) the Python validator decides, and
    may raise what it raises (``ValidationError`` from a pattern, ``Unresolvable``,
    ``RecursionError``). The Python validator is built on first use."""

    __slots__ = ("_lock", "_python", "rust", "schema")

    def __init__(self, schema: dict[str, Any], rust: Any) -> None:
        self.schema = schema
        self.rust = rust
        self._python: Validator | None = None
        self._lock = threading.Lock()

    @property
    def python(self) -> Validator:
        """The Python validator (built once; patterns run in worker threads, hence the lock)."""
        if self._python is None:
            with self._lock:
                if self._python is None:
                    self._python = python_validator(self.schema)
        return self._python

    def is_valid(self, instance: Any) -> bool:
        if self.rust is not None:
            try:
                if self.rust.is_valid(instance):
                    return True
            except (ValueError, TypeError, OverflowError):
                pass  # a value it cannot read: the Python validator decides
        return self.python.is_valid(instance)

    def iter_errors(self, instance: Any) -> Iterator[ValidationError]:
        return self.python.iter_errors(instance)


def _compile_rust(schema: dict[str, Any]) -> Any:
    """jsonschema-rs's validator for ``schema``, or ``None`` when it should not be asked
    (``rust_agrees``) or cannot compile it (an unknown ``$schema``, a keyword form it
    refuses): then the Python validator alone decides, as before."""
    if not rust_agrees(schema):
        return None
    try:
        return jsonschema_rs.validator_for(schema, offline=True)
    except (ValueError, TypeError, OverflowError):  # jsonschema_rs.ValidationError is a ValueError
        return None


_COMPILED: OrderedDict[bytes, ArgumentValidator] = OrderedDict()
_COMPILED_SIZE = 1024
_COMPILED_LOCK = threading.Lock()


def compile_validator(schema: dict[str, Any]) -> ArgumentValidator:
    """The argument validator for ``schema`` (an ``ArgumentValidator``), compiled once per
    schema text and shared by every remote that declares the same schema (a reconnecting
    remote, many sessions of one client); the last ``_COMPILED_SIZE`` schemas are kept."""
    try:
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not plain JSON (cannot come from the wire): not cached
        return ArgumentValidator(schema, _compile_rust(schema))
    with _COMPILED_LOCK:
        found = _COMPILED.get(key)
        if found is not None:
            _COMPILED.move_to_end(key)
            return found
    found = ArgumentValidator(schema, _compile_rust(schema))
    with _COMPILED_LOCK:
        _COMPILED[key] = found
        if len(_COMPILED) > _COMPILED_SIZE:
            _COMPILED.popitem(last=False)
    return found
