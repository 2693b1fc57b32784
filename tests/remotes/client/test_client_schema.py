"""Function specs derived from type hints and docstrings (docs/ws-protocol.md#the-python-client)."""

from __future__ import annotations

from typing import Literal

import jsonschema
import pydantic
import pytest

from remotes.client import function_spec


class Address(pydantic.BaseModel):
    """A postal address."""

    street: str
    country: str = "IT"


def ship(
    item: str,
    quantity: int,
    address: Address,
    express: bool = False,
    tags: list[str] | None = None,
    *,
    carrier: Literal["dhl", "ups"] = "dhl",
    weight_kg: float,
) -> str:
    """Ship an item.

    Books a courier and returns the tracking number.

    Args:
        item: What to ship.
        quantity: How many, at least 1.
        address: Where to.
        carrier: Which courier.

    Returns:
        The tracking number.
    """
    return item


def test_the_spec_has_the_name_and_both_descriptions() -> None:
    spec = function_spec(ship)

    assert spec["name"] == "ship"
    assert spec["description"] == "Ship an item.\n\nBooks a courier and returns the tracking number."


def test_parameters_are_an_object_schema_of_the_type_hints() -> None:
    parameters = function_spec(ship)["parameters"]
    properties = parameters["properties"]

    assert parameters["type"] == "object"
    assert list(properties) == [
        "item",
        "quantity",
        "address",
        "express",
        "tags",
        "carrier",
        "weight_kg",
    ]
    assert properties["item"]["type"] == "string"
    assert properties["quantity"]["type"] == "integer"
    assert properties["express"] == {"type": "boolean", "default": False}
    assert properties["weight_kg"] == {"type": "number"}
    assert properties["carrier"]["enum"] == ["dhl", "ups"]
    assert {"type": "array", "items": {"type": "string"}} in properties["tags"]["anyOf"]
    jsonschema.Draft202012Validator.check_schema(parameters)


def test_only_parameters_without_defaults_are_required() -> None:
    parameters = function_spec(ship)["parameters"]

    assert sorted(parameters["required"]) == [
        "address",
        "item",
        "quantity",
        "weight_kg",
    ]
    assert parameters["properties"]["carrier"]["default"] == "dhl"


def test_parameter_descriptions_come_from_the_docstring() -> None:
    properties = function_spec(ship)["parameters"]["properties"]

    assert properties["item"]["description"] == "What to ship."
    assert properties["quantity"]["description"] == "How many, at least 1."
    assert properties["carrier"]["description"] == "Which courier."
    assert "description" not in properties["express"]


def test_a_model_parameter_is_described_by_its_fields() -> None:
    parameters = function_spec(ship)["parameters"]
    validator = jsonschema.Draft202012Validator(parameters)
    good = {
        "item": "book",
        "quantity": 1,
        "address": {"street": "Via Roma 1"},
        "weight_kg": 0.5,
    }

    assert parameters["properties"]["address"]["$ref"] == "#/$defs/Address"
    address = parameters["$defs"]["Address"]
    assert address["required"] == ["street"]
    assert address["properties"]["country"]["default"] == "IT"
    assert validator.is_valid(good)
    assert not validator.is_valid(good | {"address": {"country": "FR"}})
    assert not validator.is_valid(good | {"surprise": 1})


def test_a_function_without_parameters_or_docstring() -> None:
    def ping() -> str:
        return "pong"

    assert function_spec(ping) == {
        "name": "ping",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {},
            "required": [],
            "additionalProperties": False,
        },
    }


def test_reST_style_docstrings_work_too() -> None:
    def greet(name: str) -> str:
        """Say hello.

        :param name: Who to greet.
        """
        return name

    assert function_spec(greet)["parameters"]["properties"]["name"]["description"] == "Who to greet."


def test_parameters_that_cannot_be_keywords_are_refused() -> None:
    def positional(x: int, /) -> None: ...

    def variadic(*numbers: int) -> None: ...

    for function in (positional, variadic):
        with pytest.raises(TypeError, match="cannot be passed by keyword"):
            function_spec(function)
