"""Forced tool choices (schema and output) and the checks on a request's tool fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from core.served_models import ServedModel, load_served_model
from inference.errors import InvalidRequest
from inference.tools import (
    MAX_TOOLS,
    ForcedToolCallStream,
    ToolRequest,
    check_tool_support,
    parse_forced,
    tool_choice_schema,
    tool_request,
)
from tests.inference.tool_testing import NOW, TOOLS, WEATHER, assemble


def test_named_tool_choice_schema_is_the_functions_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_schema(TOOLS, choice) == WEATHER["function"]["parameters"]
    now = {"type": "function", "function": {"name": "now"}}
    assert tool_choice_schema(TOOLS, now) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel, max_items", [(None, None), (True, None), (False, 1)])
def test_required_tool_choice_schema_is_an_array_of_calls(parallel, max_items):
    schema = tool_choice_schema(TOOLS, "required", parallel)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == max_items
    assert schema["items"]["anyOf"][0] == {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "parameters": WEATHER["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == [
        "get_weather", "now"]


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_free_choices_have_no_schema(choice):
    assert tool_choice_schema(TOOLS, choice, True) is None


def test_forced_output_matching_the_schema_parses_into_calls():
    jsonschema = pytest.importorskip("jsonschema")
    output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}},\n {"name": "now", ' \
             '"parameters": {}}]'
    jsonschema.validate(json.loads(output), tool_choice_schema(TOOLS, "required"))
    calls = parse_forced(output, TOOLS, "required")
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Oslo"}'), ("now", "{}")]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), tool_choice_schema(TOOLS, "required", False))


def test_a_named_forced_output_is_that_functions_arguments():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    [call] = parse_forced('{ "city" : "Zürich" }', TOOLS, choice)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Zürich"}')
    [cut] = parse_forced('{"city": "Zü', TOOLS, choice)  # cut short: the text as it stands
    assert cut.arguments == '{"city": "Zü'


@pytest.mark.parametrize("output", ['[{"name": "get_weather", "parameters": {"ci',
                                    '[{"name": "unknown", "parameters": {}}]', "{}"])
def test_a_required_output_that_does_not_parse_yields_no_calls(output):
    assert parse_forced(output, TOOLS, "required") == []


def test_the_forced_stream_sends_what_parse_forced_reads():
    stream_ = ForcedToolCallStream(TOOLS, "required")
    output = '[{"name": "now", "parameters": {"tz": "UTC"}}]'
    assert stream_.feed(output[:10]) == [] and stream_.feed(output[10:]) == []
    content, calls, ids = assemble(stream_.finish())
    assert (content, calls) == ("", [("now", '{"tz":"UTC"}')])
    assert ids == [stream_.tool_calls[0].id]
    cut = ForcedToolCallStream(TOOLS, "required")
    cut.feed('[{"na')
    assert [d.content for d in cut.finish()] == ['[{"na'] and cut.malformed


def test_valid_tool_fields_are_returned_with_their_defaults():
    assert tool_request(tools=None) is None
    assert tool_request(tools=None, tool_choice="none") is None
    assert tool_request(tools=TOOLS) == ToolRequest(TOOLS, "auto", True)
    named = {"type": "function", "function": {"name": "now"}}
    assert tool_request(tools=TOOLS, tool_choice=named, parallel_tool_calls=False) == \
        ToolRequest(TOOLS, named, False)


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize("fields, param, code", [
    ({"tools": {"a": 1}}, "tools", "invalid_type"),
    ({"tools": []}, "tools", "invalid_value"),
    ({"tools": [NOW] * (MAX_TOOLS + 1)}, "tools", "invalid_value"),
    ({"tools": ["f"]}, "tools[0]", "invalid_type"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x",
     "unknown_parameter"),
    ({"tools": [NOW, {"type": "function", "function": {}}]}, "tools[1].function.name",
     "missing_required_parameter"),
    ({"tools": [_tool(name="has space")]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [_tool(name="x" * 65)]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [_tool(name=7)]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [NOW, NOW]}, "tools[1].function.name", "invalid_value"),
    ({"tools": [_tool(description=3)]}, "tools[0].function.description", "invalid_type"),
    ({"tools": [_tool(parameters=[])]}, "tools[0].function.parameters", "invalid_type"),
    ({"tools": [_tool(strict="yes")]}, "tools[0].function.strict", "invalid_type"),
    ({"tools": [_tool(returns={})]}, "tools[0].function.returns", "unknown_parameter"),
    ({"tools": [_tool(description="a\x00b")]}, "tools[0].function.description", "invalid_value"),
    ({"tools": [_tool(parameters={"type": "object", "description": "\ud800"})]},
     "tools[0].function.parameters", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "invalid_type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "fn", "function": {"name": "now"}}},
     "tool_choice.type", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function",
     "invalid_type"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
])
def test_invalid_tool_fields_are_a_400_naming_the_parameter(fields, param, code):
    with pytest.raises(InvalidRequest) as raised:
        tool_request(**fields)
    assert (raised.value.param, raised.value.code, raised.value.status) == (param, code, 400)
    assert param in raised.value.message


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> ServedModel:
    return load_served_model(tiny_model_path, "tiny")


def test_auto_needs_a_model_with_a_tool_format(served):
    request = tool_request(tools=TOOLS)
    check_tool_support(served, request)
    with pytest.raises(InvalidRequest) as raised:
        check_tool_support(dataclasses.replace(served, tool_format=None), request)
    assert (raised.value.param, raised.value.code) == ("tool_choice", "unsupported_parameter")


@pytest.mark.parametrize("choice", ["required", "none",
                                    {"type": "function", "function": {"name": "now"}}])
def test_forced_and_none_choices_work_with_any_model(served, choice):
    no_format = dataclasses.replace(served, tool_format=None)
    check_tool_support(no_format, tool_request(tools=TOOLS, tool_choice=choice))
