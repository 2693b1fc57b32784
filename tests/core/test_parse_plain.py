"""parse_plain: a plain view's body refused with one sentence per pydantic error type
(core.validation.PLAIN_SENTENCES), naming the field by its wire path."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field, StrictBool, field_validator

from core.errors import InvalidRequest
from core.validation import NonBlank, parse_plain, refusal, rule


class Inner(BaseModel):
    key: NonBlank = Field(max_length=3)


class Body(BaseModel):
    name: NonBlank = Field(max_length=5)
    flag: StrictBool = False
    count: int = Field(default=0, ge=0, le=9)
    choice: Literal["a", "b", "c"] = "a"
    sender: Inner | None = Field(default=None, alias="from")
    items: list[Inner] = Field(default_factory=list, max_length=2)
    rule: str = ""

    @field_validator("rule")
    @classmethod
    def _rule(cls, value: str) -> str:
        if value == "own":
            raise ValueError("rule has a sentence of its own")
        if value == "details":
            raise refusal("rule refused with details", {"rule": "x"})
        return value


@pytest.mark.parametrize(
    ("body", "sentence"),
    [
        ({}, "name is required"),
        ({"name": 5}, "name must be a string"),
        ({"name": None}, "name must be a string"),
        ({"name": ""}, "name must be a non-empty string"),
        ({"name": "   "}, "name must be a non-empty string"),
        ({"name": "n" * 6}, "name must be at most 5 characters"),
        ({"name": "n", "flag": 1}, "flag must be true or false"),
        ({"name": "n", "count": "x"}, "count must be an integer"),
        ({"name": "n", "count": 10}, "count must be at most 9"),
        ({"name": "n", "count": -1}, "count must be at least 0"),
        ({"name": "n", "choice": "d"}, "choice must be one of: a, b, c"),
        ({"name": "n", "from": []}, "from must be an object"),
        ({"name": "n", "from": {"key": " "}}, "from.key must be a non-empty string"),
        ({"name": "n", "items": {}}, "items must be a list"),
        ({"name": "n", "items": [{"key": "k"}, {"key": 1}]}, "items[1].key must be a string"),
        ({"name": "n", "items": [{"key": "k"}] * 3}, "items must have at most 2 items"),
        ({"name": "n", "rule": "own"}, "rule has a sentence of its own"),
        ({"name": 5, "flag": "x"}, "name must be a string"),  # the first field's error
    ],
)
def test_sentence(body, sentence):
    with pytest.raises(InvalidRequest) as caught:
        parse_plain(Body, body)
    assert caught.value.message == sentence


def test_refusal_keeps_its_details():
    with pytest.raises(InvalidRequest) as caught:
        parse_plain(Body, {"name": "n", "rule": "details"})
    assert (caught.value.message, caught.value.details) == ("rule refused with details", {"rule": "x"})


def test_non_blank_is_kept_as_sent():
    assert parse_plain(Body, {"name": " n "}).name == " n "
    assert Body.model_json_schema()["properties"]["name"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 5,
        "pattern": r"\S",
        "title": "Name",
    }


class Address(BaseModel):
    host: str

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if ":" in value:
            raise rule("must be a host name without a port")
        return value


class Route(BaseModel):
    source: Address
    target: Address
    hops: list[int] = Field(default=[1], min_length=1)


@pytest.mark.parametrize(
    ("body", "sentence"),
    [
        ({"source": {"host": "a:1"}, "target": {"host": "b"}}, "source.host must be a host name without a port"),
        ({"source": {"host": "a"}, "target": {"host": "b:2"}}, "target.host must be a host name without a port"),
        ({"source": {"host": "a"}, "target": {"host": "b"}, "hops": []}, "hops must not be empty"),
    ],
)
def test_a_rule_is_said_after_the_path_of_its_field(body, sentence):
    with pytest.raises(InvalidRequest) as caught:
        parse_plain(Route, body)
    assert caught.value.message == sentence
