"""A DRF view's pydantic body models in the OpenAPI document (``dispatch.schema.PydanticBody``;
docs/architecture.md#bodies): a request in pydantic's validation mode, an answer in its
serialization mode, nested models as components of their own."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import extend_schema
from pydantic import BaseModel, Field, computed_field
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.openapi import REF
from core.validation import DATE_TIME_PATTERN, NOT_BLANK, DateTime, Text


class Part(BaseModel):
    label: Text = Field(max_length=10)


class Body(BaseModel):
    name: str = Field(pattern=r"^\S+$")
    count: int = 1  # a request may leave it out
    part: Part | None = None


class Answer(BaseModel):
    name: Text
    when: DateTime

    @computed_field  # type: ignore[prop-decorator]
    @property
    def shout(self) -> str:
        return self.name.upper()


class Sample(APIView):
    @extend_schema(request=Body, responses={200: Answer})
    def post(self, request: Request) -> Response:
        return Response({})

    @extend_schema(request=Answer, responses={200: Answer})
    def put(self, request: Request) -> Response:
        return Response({})


class Carrier(BaseModel):
    part: Part


class Echoed(BaseModel):
    label: str


class Echo(APIView):
    @extend_schema(request=Echoed, responses={200: Echoed})
    def put(self, request: Request) -> Response:
        return Response({})

    @extend_schema(responses={200: Carrier})
    def get(self, request: Request) -> Response:
        return Response({})


@pytest.fixture
def document() -> dict[str, Any]:
    generator = SchemaGenerator(patterns=[path("sample", Sample.as_view()), path("echo", Echo.as_view())])
    built: dict[str, Any] = generator.get_schema(request=None, public=True)
    return built


def test_a_request_body_is_the_models_validation_schema(document: dict[str, Any]) -> None:
    operation = document["paths"]["/sample"]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == REF.format(model="BodyRequest")  # its Part's text says what it refuses
    component = document["components"]["schemas"]["BodyRequest"]
    assert component["required"] == ["name"]
    assert component["properties"]["name"]["pattern"] == r"^\S+$"
    assert component["properties"]["part"]["anyOf"][0] == {"$ref": REF.format(model="PartRequest")}
    part = document["components"]["schemas"]["PartRequest"]["properties"]["label"]
    assert part["maxLength"] == 10 and part["pattern"] == NOT_BLANK


def test_a_nested_model_in_an_answer_and_a_request_is_two_components(document: dict[str, Any]) -> None:
    answered = document["components"]["schemas"]["Carrier"]["properties"]["part"]
    assert answered == {"$ref": REF.format(model="Part")}
    assert "pattern" not in document["components"]["schemas"]["Part"]["properties"]["label"]


def test_an_answer_is_the_models_serialization_schema(document: dict[str, Any]) -> None:
    operation = document["paths"]["/sample"]["post"]
    ref = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == REF.format(model="Answer")
    component = document["components"]["schemas"]["Answer"]
    assert set(component["required"]) == {"name", "when", "shout"}


def test_a_model_whose_two_modes_differ_is_two_components(document: dict[str, Any]) -> None:
    operation = document["paths"]["/sample"]["put"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == REF.format(model="AnswerRequest")
    request = document["components"]["schemas"]["AnswerRequest"]
    assert request["required"] == ["name", "when"]  # no shout to send
    # What a request's text and date-time refuse is said for requests only.
    assert request["properties"]["name"]["pattern"] == NOT_BLANK
    assert request["properties"]["when"] == {
        "type": "string",
        "format": "date-time",
        "pattern": DATE_TIME_PATTERN,
        "title": "When",
    }
    assert "pattern" not in document["components"]["schemas"]["Answer"]["properties"]["name"]
    assert "pattern" not in document["components"]["schemas"]["Answer"]["properties"]["when"]
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": REF.format(model="Answer")}


def test_a_model_alike_both_ways_is_one_component(document: dict[str, Any]) -> None:
    operation = document["paths"]["/echo"]["put"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {"$ref": REF.format(model="Echoed")}
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": REF.format(model="Echoed")
    }
    assert not any("$defs" in component for component in document["components"]["schemas"].values())


def test_plain_views_name_their_models_by_the_same_rule() -> None:
    """``core.openapi.Components`` (the plain views) names a model as ``PydanticBody`` does:
    a nested model whose request schema differs from its answer's is two components, not
    one name for two schemas (which raised ``ValueError``)."""
    from core.openapi import Components, model_component

    components = Components({})
    assert components.schema_of(Carrier, "validation") == {"$ref": REF.format(model="CarrierRequest")}
    assert components.schema_of(Carrier, "serialization") == {"$ref": REF.format(model="Carrier")}
    assert {"Part", "PartRequest", "Carrier", "CarrierRequest"} <= set(components.schemas)
    assert components.schemas["PartRequest"] != components.schemas["Part"]
    assert model_component(Echoed, "validation")[0] == model_component(Echoed, "serialization")[0] == "Echoed"
