"""Tool calling through the official `openai` client against a live server and a real engine:
forced and required calls, a full round trip, streamed deltas the SDK reassembles, the
model's template, and redacted request logs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from requestlogs.services import log_policy_update
from tenants.access import SYSTEM
from tenants.models import Tenant
from tests.requestlogs.conftest import wait_for_logs


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: str = Field(json_schema_extra={"enum": ["c", "f"]})


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                   "required": ["tz"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client, served_model,
                                                                   engine_worker):
    schema = WEATHER["function"]["parameters"]
    for seed in range(8):
        res = client.chat.completions.create(model=served_model, messages=MESSAGES,
                                             tools=[WEATHER, TIME], tool_choice=NAMED,
                                             max_tokens=60, temperature=1.0, seed=seed)
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert choice.message.content is None


def test_parse_gives_typed_arguments(client, served_model, engine_worker):
    res = client.chat.completions.parse(model=served_model, messages=MESSAGES,
                                        tools=[WEATHER], tool_choice=NAMED, max_tokens=60,
                                        temperature=0)
    (call,) = res.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_required_calls_one_of_the_tools_and_honours_parallel_tool_calls(client, served_model,
                                                                          engine_worker):
    names = set()
    for seed in range(6):
        res = client.chat.completions.create(
            model=served_model, messages=MESSAGES, tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=False, max_tokens=80,
            temperature=1.0, seed=seed)
        calls = res.choices[0].message.tool_calls
        assert len(calls) == 1 and res.choices[0].finish_reason == "tool_calls"
        names.add(calls[0].function.name)
        json.loads(calls[0].function.arguments)
    assert names <= {"get_weather", "get_time"}


def test_streamed_tool_call_deltas_are_openais_and_the_sdk_reassembles_them(
        client, served_model, engine_worker):
    kwargs = dict(model=served_model, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED,
                  max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            deltas.extend(choice.delta.tool_calls or [])
            reasons.append(choice.finish_reason)
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert reasons[-1] == "tool_calls"
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.arguments == whole.function.arguments
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_tool_round_trip(client, served_model, engine_worker):
    first = client.chat.completions.create(model=served_model, messages=MESSAGES,
                                           tools=[WEATHER], tool_choice=NAMED, max_tokens=60,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model=served_model, messages=follow_up,
                                            tools=[WEATHER], max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    from core.served_models import served_models

    rendered = served_models()[served_model].render_chat(
        [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}],
        tools=[WEATHER])
    assert "<tool_response>" in rendered and "18 degrees, sunny" in rendered
    assert "get_weather" in rendered and call.function.arguments.split(":")[0] in rendered


def test_tools_reach_the_prompt_and_auto_answers_text_when_no_call_is_made(
        client, served_model, engine_worker):
    plain = client.chat.completions.create(model=served_model, messages=MESSAGES,
                                           max_tokens=4, temperature=0)
    auto = client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=4,
                                          temperature=0, tools=[WEATHER])
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=4,
                                          temperature=0, tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "not": {}}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.a.not"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_fields_are_400s_naming_them(client, served_model, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=4,
                                       **extra)
    assert err.value.body["param"] == param


def test_tool_arguments_are_redacted_in_the_request_log(client, served_model, engine_worker,
                                                        tenant_key):
    log_policy_update(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), actor=SYSTEM,
                      log_bodies=True)
    mail = {"type": "function", "function": {"name": "send_mail", "parameters": {
        "type": "object", "properties": {"to": {"const": "alice.secret@example.com"}},
        "required": ["to"], "additionalProperties": False}}}
    res = client.chat.completions.create(
        model=served_model, messages=MESSAGES, tools=[mail], max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "send_mail"}})
    arguments = res.choices[0].message.tool_calls[0].function.arguments
    assert "alice.secret@example.com" in arguments
    [entry] = wait_for_logs(1)
    assert "[tool_call send_mail]" in entry.completion
    assert "alice.secret@example.com" not in entry.completion
