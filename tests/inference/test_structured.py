from __future__ import annotations

import enum
from typing import Any, Literal, Optional

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, TypeAdapter

from engine.json_schema_support import MAX_DEPTH, REFUSED
from inference.errors import InvalidRequest
from inference.structured import SCHEMA_PARAM, check_json_schema


class Color(enum.Enum):
    red = "red"
    blue = "blue"


class Item(BaseModel):
    name: str = Field(description="what it is", max_length=20)
    qty: int = Field(ge=0, le=100)


class Order(BaseModel):
    id: str
    color: Color
    kind: Literal["a", "b"]
    items: list[Item] = Field(max_length=5)
    note: Optional[str]  # noqa: UP045 - the Optional spelling emits the same anyOf
    score: float
    parent: Optional[Order] = None  # noqa: UP045


def refusal(schema: Any, **kwargs: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        check_json_schema(schema, **kwargs)
    return caught.value


def in_a_property(**node: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": node}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    to_strict_json_schema(Order),
    TypeAdapter(Order).json_schema(),
    TypeAdapter(list[Item]).json_schema(),
    {"type": "object"},
    {"type": "string", "format": "date-time"},
    {"type": ["integer", "null"], "multipleOf": 5, "minimum": 0},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
     "required": ["next"]},
], ids=["openai-strict", "pydantic", "pydantic-list", "object", "format", "nullable-int",
        "recursive"])
def test_a_typical_schema_is_accepted(schema):
    check_json_schema(schema)


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_each_refused_keyword_is_named(keyword):
    error = refusal(in_a_property(type="string", **{keyword: {}}))
    assert error.param == f"{SCHEMA_PARAM}.properties.a.{keyword}"
    assert f"'{keyword}'" in error.message
    assert (error.status, error.code) == (400, "unsupported_parameter")


@pytest.mark.parametrize(("node", "keyword"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "iri"}, "format"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf"),
    ({"type": "integer", "minimum": 0.5}, "minimum"),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "maximum": 3}]}, "allOf"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"$ref": "#/properties/b"}, "$ref"),
    ({"anyOf": [{"type": "integer"}], "maximum": 3}, "maximum"),
    ({"type": "string", "enum": ["x"], "maxLength": 3}, "maxLength"),
    ({"minLength": 3}, "minLength"),
    ({"type": "string", "pattern": "^(?!x).*$"}, "pattern"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items"),
    ({"$id": "https://example.com/a", "type": "integer"}, "$id"),
])
def test_what_the_engine_cannot_enforce_is_refused(node, keyword):
    error = refusal(in_a_property(**node))
    assert error.param == f"{SCHEMA_PARAM}.properties.a.{keyword}"
    assert f"'{keyword}'" in error.message
    assert error.code == "unsupported_parameter"


@pytest.mark.parametrize("schema", [[], "object", None, True, 3])
def test_a_schema_that_is_not_an_object_is_refused(schema):
    error = refusal(schema)
    assert (error.param, error.code) == (SCHEMA_PARAM, "invalid_value")


@pytest.mark.parametrize(("schema", "where"), [
    ({"$ref": "#/$defs/Missing"}, "$ref"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required"),
    ({"type": "strng"}, "type"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "string", "enum": ["a", 1]}, "enum"),
    ({"enum": []}, "enum"),
    ({"anyOf": []}, "anyOf"),
    ({"type": "object", "properties": {"a": 1}}, "properties.a"),
])
def test_an_invalid_schema_is_refused(schema, where):
    error = refusal(schema)
    assert (error.param, error.code) == (f"{SCHEMA_PARAM}.{where}", "invalid_value")


def test_a_schema_nested_too_deep_is_refused():
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_DEPTH + 1):
        schema = {"type": "array", "items": schema}
    assert refusal(schema).code == "invalid_value"
    check_json_schema(schema["items"])


def test_the_param_names_where_the_schema_came_from():
    error = refusal({"not": {}}, param="tools[0].function.parameters")
    assert error.param == "tools[0].function.parameters.not"


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(129)}},
     "properties"),
    ({"type": "object", "required": ["a", "b"], "properties": {
        key: {"type": "object", "properties": {f"{key}{i}": {"type": "integer"}
                                               for i in range(100)}} for key in "ab"}},
     "properties.b.properties"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1,20000}$"}}},
     "properties.a.pattern"),
    ({"type": "object", "properties": {"a": {"type": "string",
                                             "pattern": "^(a{1,40}b){1,40}$"}}},
     "properties.a.pattern"),
    ({"type": "string", "pattern": "a" * 1001}, "pattern"),
])
def test_schemas_that_would_hold_the_compiler_for_seconds_are_refused(schema, where):
    refused = refusal(schema)
    assert refused.param == f"{SCHEMA_PARAM}.{where}"
    assert refused.code == "unsupported_parameter" and "too long" in str(refused)


def test_the_compile_bounds_still_take_what_clients_send():
    many = {f"p{i}": {"type": "integer"} for i in range(500)}
    check_json_schema({"type": "object", "properties": many, "required": list(many)})
    check_json_schema({"type": "object", "properties": dict(list(many.items())[:128])})
    check_json_schema({"type": "string", "pattern": "^[a-z]{2,30}-[0-9]{4}$"})
