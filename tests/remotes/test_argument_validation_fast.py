"""Remote-call arguments are checked by jsonschema-rs first and by jsonschema for every
refusal (remotes.schemas): the same calls pass, the same sentences refuse the others."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from jsonschema.exceptions import best_match

from remotes.schemas import compile_validator, python_validator, rust_agrees
from remotes.services import RemoteError, RemoteRoute, check_arguments

PLAIN = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 5},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "where": {"type": "object", "additionalProperties": False, "properties": {"lat": {"type": "number"}}},
        "any": {"anyOf": [{"type": "null"}, {"const": [0]}]},
    },
    "required": ["city"],
}

ARGUMENTS: list[dict[str, Any]] = [
    {"city": "Rome"},
    {"city": "Rome", "days": 3, "units": "metric", "tags": ["a", "b"], "where": {"lat": 1.5}, "any": None},
    {"city": "R"},
    {"city": "Rome, Italy"},
    {},
    {"city": 5},
    {"city": "Rome", "days": 3.0},
    {"city": "Rome", "days": 2.5},
    {"city": "Rome", "days": True},
    {"city": "Rome", "days": 0},
    {"city": "Rome", "units": "kelvin"},
    {"city": "Rome", "tags": ["a", "a"]},
    {"city": "Rome", "where": {"lat": 1, "lon": 2}},
    {"city": "Rome", "any": [0.0]},
    {"city": "Rome", "any": [False]},
    {"city": "😀😀"},
]


# Row ids no other test uses: remotes.services caches a validator per (row id, function).
_ROW_IDS = itertools.count(10**12)


def route_for(parameters: dict[str, Any]) -> RemoteRoute:
    return RemoteRoute(
        remote_id=next(_ROW_IDS),
        channel_name="x",
        server_process_id="p",
        tools=[{"name": "f", "description": "", "parameters": parameters}],
    )


def test_a_plain_schema_is_compiled_for_jsonschema_rs_once_per_schema() -> None:
    first = compile_validator(PLAIN)
    assert first.rust is not None
    # The same schema from another remote (or the same remote after a reconnect) is
    # compiled once, whatever the order of its keys.
    assert compile_validator(dict(reversed(list(PLAIN.items())))) is first


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_jsonschema_rs_and_jsonschema_agree_and_refusals_keep_jsonschemas_words(arguments: dict[str, Any]) -> None:
    fast = compile_validator(PLAIN)
    reference = python_validator(PLAIN)
    assert fast.rust is not None
    assert fast.rust.is_valid(arguments) == reference.is_valid(arguments) == fast.is_valid(arguments)
    expected = best_match(reference.iter_errors(arguments))
    route = route_for(PLAIN)
    if expected is None:
        assert check_arguments(route, "weather", "f", arguments) > 0
        return
    with pytest.raises(RemoteError) as refused:
        check_arguments(route, "weather", "f", arguments)
    assert refused.value.message.startswith(f"invalid arguments for 'weather.f': {expected.message}")
    assert refused.value.code == "INVALID_REQUEST"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}}},
        {"type": "object", "properties": {"x": {"type": "string", "pattern": "^a"}}},
        {"type": "object", "properties": {"x": {"type": "string", "format": "email"}}},
        {"type": "object", "properties": {"x": {"multipleOf": 0.1}}},
        {"$schema": "https://example.com/unknown-draft", "type": "object"},
    ],
)
def test_schemas_where_the_two_validators_differ_are_left_to_jsonschema(schema: dict[str, Any]) -> None:
    assert compile_validator(schema).rust is None


def test_a_multiple_of_a_fraction_is_judged_as_jsonschema_judges_it() -> None:
    # jsonschema-rs calls 0.3 a multiple of 0.1; jsonschema (floating point) does not.
    schema = {"type": "object", "properties": {"x": {"multipleOf": 0.1}}}
    assert not rust_agrees(schema)
    with pytest.raises(RemoteError) as refused:
        check_arguments(route_for(schema), "weather", "f", {"x": 0.3})
    assert "is not a multiple of 0.1" in refused.value.message


def test_a_reference_cycle_is_refused_as_before() -> None:
    # jsonschema-rs would accept any value here; jsonschema recurses and says so.
    schema = {"type": "object", "$defs": {"a": {"$ref": "#/$defs/a"}}, "properties": {"x": {"$ref": "#/$defs/a"}}}
    with pytest.raises(RemoteError) as refused:
        check_arguments(route_for(schema), "weather", "f", {"x": 1})
    assert refused.value.message == ("invalid arguments for 'weather.f': the schema cannot be applied (RecursionError)")
