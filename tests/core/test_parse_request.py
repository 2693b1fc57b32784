"""``core.validation.parse_request``: a pydantic body on a DRF view answers what its DRF
serializer answered (docs/architecture.md#bodies). Each case validates the same body with
a DRF serializer (the oracle) and with the pydantic model, and compares the two answers
of ``core.api.exception_handler``: status, code, message, details and DRF's error codes."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from uuid import UUID

import pytest
from pydantic import BaseModel, Field, field_validator
from rest_framework import exceptions, serializers

from core.api import exception_handler
from core.validation import DateTime, Omittable, RawText, Text, WireModel, parse_request


class KeysSerializer(serializers.Serializer):
    auth = serializers.CharField(max_length=5, trim_whitespace=False)


class OracleSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=5)
    count = serializers.IntegerField(required=False)
    flag = serializers.BooleanField(required=False)
    kind = serializers.ChoiceField(choices=["a", "b"], required=False)
    when = serializers.DateTimeField(required=False)
    keys = KeysSerializer(required=False)
    tags = serializers.ListField(child=serializers.CharField(max_length=3), required=False)
    note = serializers.CharField(required=False)

    def validate_note(self, value: str) -> str:
        if value == "no":
            raise serializers.ValidationError("note must not be no")
        return value


class Keys(BaseModel):
    auth: RawText = Field(max_length=5)


class Model(WireModel):
    name: Text = Field(max_length=5, coerce_numbers_to_str=True)  # DRF's CharField took numbers
    # Left out: None; null is refused, as DRF's required=False fields do.
    count: Omittable[int] = None
    flag: Omittable[bool] = None
    kind: Omittable[Literal["a", "b"]] = None
    when: Omittable[DateTime] = None
    keys: Omittable[Keys] = None
    tags: Omittable[list[Annotated[Text, Field(max_length=3)]]] = None
    note: Omittable[Text] = None

    @field_validator("note")
    @classmethod
    def _not_no(cls, value: str | None) -> str | None:
        if value == "no":
            raise ValueError("note must not be no")
        return value


def answered(exc: exceptions.ValidationError) -> tuple[int, dict[str, Any], Any]:
    response = exception_handler(exc, {})
    assert response is not None
    return response.status_code, json.loads(json.dumps(response.data)), exc.get_codes()


def oracle(body: Any) -> tuple[int, dict[str, Any], Any]:
    serializer = OracleSerializer(data=body)
    with pytest.raises(exceptions.ValidationError) as raised:
        serializer.is_valid(raise_exception=True)
    return answered(raised.value)


def pydantic_answer(body: Any) -> tuple[int, dict[str, Any], Any]:
    with pytest.raises(exceptions.ValidationError) as raised:
        parse_request(Model, body)
    return answered(raised.value)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="missing"),
        pytest.param({"name": None}, id="null"),
        pytest.param({"name": ""}, id="blank"),
        pytest.param({"name": "   "}, id="blank-after-trim"),
        pytest.param({"name": "abcdef"}, id="too-long"),
        pytest.param({"name": ["a"]}, id="not-a-string"),
        pytest.param({"name": {"a": 1}}, id="object-not-a-string"),
        pytest.param({"name": "a", "count": "x"}, id="not-an-integer"),
        pytest.param({"name": "a", "count": 1.5}, id="a-fraction-not-an-integer"),
        pytest.param({"name": "a", "count": None}, id="null-integer"),
        pytest.param({"name": "a", "flag": "maybe"}, id="not-a-boolean"),
        pytest.param({"name": "a", "kind": "c"}, id="bad-choice"),
        pytest.param({"name": "a", "kind": None}, id="null-choice"),
        pytest.param({"name": "a", "when": "yesterday"}, id="bad-datetime"),
        pytest.param({"name": "a", "when": 1700000000}, id="a-number-for-a-datetime"),
        pytest.param({"name": "a", "when": "2024-02-30T00:00:00Z"}, id="no-such-day"),
        pytest.param({"name": "a", "when": None}, id="null-datetime"),
        pytest.param({"name": "a\x00"}, id="nul"),
        pytest.param({"name": True}, id="a-boolean-for-text"),
        pytest.param({"name": "a", "keys": {"auth": ""}}, id="raw-blank"),
        pytest.param({"name": "a", "keys": None}, id="nested-null"),
        pytest.param({"name": "a", "note": None}, id="null-with-a-validator"),
        pytest.param({"name": "a", "note": "no"}, id="validator-sentence"),
        pytest.param({"name": "a", "keys": {}}, id="nested-missing"),
        pytest.param({"name": "a", "keys": {"auth": "abcdefgh"}}, id="nested-too-long"),
        pytest.param({"name": "a", "keys": "x"}, id="nested-not-an-object"),
        pytest.param({"name": "a", "tags": ["ab", "abcd", ""]}, id="list-items"),
        pytest.param({"name": "a", "tags": "ab"}, id="not-a-list"),
        pytest.param({"name": "", "count": "x", "kind": "c"}, id="several-fields"),
        pytest.param(["name"], id="body-a-list"),
        pytest.param("name", id="body-a-string"),
        pytest.param(None, id="body-null"),
    ],
)
def test_parse_request_answers_what_the_drf_serializer_answered(body: Any) -> None:
    assert pydantic_answer(body) == oracle(body)


def test_the_answer_is_a_validation_error_naming_the_field() -> None:
    status, data, _ = pydantic_answer({"name": "abcdef"})
    assert status == 400
    assert data == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "name: Ensure this field has no more than 5 characters.",
            "details": {"name": ["Ensure this field has no more than 5 characters."]},
        }
    }


@pytest.mark.parametrize(
    "body",
    [
        {"name": " ab ", "keys": {"auth": " k "}, "unknown": 1},
        {"name": 12, "count": "3", "flag": "true", "tags": [" x ", "y"], "note": " n "},
        {"name": "a", "when": "2024-01-02T03:04:05"},
        {"name": "a", "when": "2024-01-02T03:04:05.123456+02:00"},
        {"name": "a", "keys": {"auth": "  "}},
    ],
)
def test_a_valid_body_reads_as_drfs_serializer_read_it(body: Any) -> None:
    serializer = OracleSerializer(data=body)
    assert serializer.is_valid(), serializer.errors
    parsed = parse_request(Model, body).model_dump(exclude_unset=True, exclude={"unknown"})
    assert {key: value for key, value in parsed.items() if key != "keys"} == {
        key: value for key, value in serializer.validated_data.items() if key != "keys"
    }
    if "keys" in body:
        assert parsed["keys"] == dict(serializer.validated_data["keys"])


class Bounded(BaseModel):
    seconds: int = Field(gt=0, lt=600)


@pytest.mark.parametrize(
    ("value", "sentence"),
    [(0, "Ensure this value is greater than 0."), (600, "Ensure this value is less than 600.")],
)
def test_an_exclusive_bound_is_worded_as_drfs_inclusive_ones(value: int, sentence: str) -> None:
    """DRF's fields have no exclusive bound; the table words one as theirs, not in
    pydantic's own "Input should be greater than 0"."""
    with pytest.raises(exceptions.ValidationError) as refused:
        parse_request(Bounded, {"seconds": value})
    assert refused.value.detail == {"seconds": [sentence]}


class Expiring(BaseModel):
    expires_at: DateTime | None = None


@pytest.mark.parametrize("moment", ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+01:00"])
def test_a_date_time_utc_cannot_hold_is_refused_as_drf_refused_it(moment: str) -> None:
    """Accepted, it failed later with OverflowError (a 500) when saved or written back."""
    with pytest.raises(exceptions.ValidationError) as refused:
        parse_request(Expiring, {"expires_at": moment})
    assert refused.value.detail == {"expires_at": ["Datetime value out of range."]}


def test_a_refused_value_is_echoed_at_most_40_characters_long() -> None:
    class Choice(BaseModel):
        decision: Literal["allow", "deny"]

    with pytest.raises(exceptions.ValidationError) as refused:
        parse_request(Choice, {"decision": ["x" * 100_000]})
    (sentence,) = refused.value.detail["decision"]
    assert len(sentence) < 80 and sentence.startswith("\"['xxxx")


def test_a_refusal_without_a_drf_sentence_keeps_pydantics_own_even_with_braces() -> None:
    # pydantic's message is no template: "found `{` at 0" must not be formatted (a 500).
    class Identified(BaseModel):
        x: UUID

    with pytest.raises(exceptions.ValidationError) as refused:
        parse_request(Identified, {"x": "{not-a-uuid"})
    assert refused.value.detail["x"] == ["Input should be a valid UUID, invalid character: found `{` at 0"]
