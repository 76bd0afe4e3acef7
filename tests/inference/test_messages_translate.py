"""Anthropic's Messages body → a Chat Completions body (inference/protocols/messages.py),
and a chat answer → a Message and its stream events (messages_views.MessageEncoder), without
a server."""

from __future__ import annotations

import json

import pytest

from inference.errors import InvalidRequest
from inference.params import parse_chat
from inference.protocols import edge
from inference.protocols.messages import (
    anthropic_call_id,
    chat_call_id,
    translate,
    translate_count,
)
from inference.protocols.messages_views import MessageEncoder

BASE = {"model": "tiny-llama", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hello"}]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        translate(body)
    assert caught.value.status == 400
    return caught.value


def test_a_plain_request_becomes_the_chat_body_it_asks_for():
    chat = translate({**BASE, "system": "Be brief.", "stop_sequences": ["\n\n"],
                      "temperature": 0.5, "top_p": 0.9, "top_k": 40,
                      "metadata": {"user_id": "end-user-7"}})
    assert chat == {"model": "tiny-llama", "max_completion_tokens": 16, "stop": ["\n\n"],
                    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "user": "end-user-7",
                    "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hello"}]}
    parse_chat(chat)  # the chat validation takes what the translation makes


def test_a_streamed_request_asks_chat_for_its_usage():
    chat = translate({**BASE, "stream": True})
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_system_text_blocks_join_and_cache_control_is_accepted():
    chat = translate({**BASE, "cache_control": {"type": "ephemeral"}, "system": [
        {"type": "text", "text": "One. ", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Two."}]})
    assert chat["messages"][0] == {"role": "system", "content": "One. Two."}


def test_a_tool_round_trip_becomes_tool_calls_and_a_tool_message():
    body = {**BASE, "tools": [WEATHER], "tool_choice": {"type": "auto"}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_abc123", "name": "get_weather",
             "input": {"city": "Paris", "note": "été"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_abc123",
             "content": [{"type": "text", "text": "18 degrees"}]},
            {"type": "text", "text": "And tomorrow?"}]}]}
    chat = translate(body)
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER["input_schema"]}}]
    assert chat["tool_choice"] == "auto"
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_abc123", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Paris","note":"été"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    parse_chat(chat)


def test_an_error_result_is_told_to_the_model():
    body = {**BASE, "messages": [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "timed out", "is_error": True}]}]}
    assert translate(body)["messages"][-1] == {"role": "tool", "tool_call_id": "call_1",
                                               "content": "Error: timed out"}


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "tool", "name": "get_weather"},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "any", "disable_parallel_tool_use": True},
     {"tool_choice": "required", "parallel_tool_calls": False}),
])
def test_tool_choice_maps_to_chats(choice, expected):
    chat = translate({**BASE, "tools": [WEATHER], "tool_choice": choice})
    assert {k: chat[k] for k in expected} == expected
    parse_chat(chat)


def test_tool_ids_map_both_ways():
    assert anthropic_call_id("call_XyZ") == "toolu_XyZ"
    assert chat_call_id("toolu_XyZ") == "call_XyZ"
    assert chat_call_id(anthropic_call_id("call_q-1_")) == "call_q-1_"
    assert chat_call_id("my_own_id") == "my_own_id"


def test_output_config_format_becomes_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = translate({**BASE, "output_config": {"format": {"type": "json_schema",
                                                           "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}


def test_count_body_is_the_create_body_without_generation_parameters():
    count = translate_count({"model": "tiny-llama", "system": "Be brief.",
                             "messages": BASE["messages"], "tools": [WEATHER]})
    create = translate({**BASE, "system": "Be brief.", "tools": [WEATHER]})
    assert count == {k: v for k, v in create.items() if k != "max_completion_tokens"}
    with pytest.raises(InvalidRequest, match="max_tokens: Extra inputs"):
        translate_count(BASE)


@pytest.mark.parametrize("extra, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"container": "container_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    ({"speed": "fast"}, "speed"),
    ({"inference_geo": "us"}, "inference_geo"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "Rome"}]}]},
     "tools[0].input_examples"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x",
                                        "media_type": "text/plain"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]},
        {"role": "user", "content": "Go on"}]}, "messages[1].content[0].type"),
])
def test_what_atrium_does_not_serve_is_a_400_naming_it(extra, param):
    error = refused({**BASE, **extra})
    assert error.param == param and error.code == "unsupported_parameter"
    assert error.message.startswith(f"{param}: ")


@pytest.mark.parametrize("body, param, code", [
    ({k: v for k, v in BASE.items() if k != "max_tokens"}, "max_tokens",
     "missing_required_parameter"),
    ({**BASE, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**BASE, "max_tokens": "16"}, "max_tokens", "invalid_type"),
    ({**BASE, "temperature": 1.5}, "temperature", "invalid_value"),
    ({**BASE, "frequency_penalty": 1}, "frequency_penalty", "unknown_parameter"),
    ({**BASE, "messages": []}, "messages", "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": ""}]}, "messages[0].content",
     "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": 7}]}, "messages[0].content",
     "invalid_type"),
    ({**BASE, "messages": [{"role": "user", "content": [7]}]}, "messages[0].content[0]",
     "invalid_type"),
    ({**BASE, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
     "messages[0].content[0]", "invalid_type"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "a",
                                                         "colour": "red"}]}]},
     "messages[0].content[0].colour", "unknown_parameter"),
    ({**BASE, "messages": [{"role": "bot", "content": "Hi"}]}, "messages[0].role",
     "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": "a\x00b"}]},
     "messages[0].content[0].text", "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "The answer is"}]},
     "messages[1].role", "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_404"}]}]},
     "messages[0].content[0].tool_use_id", "invalid_value"),
    ({**BASE, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "bad id!", "name": "f", "input": {}}]},
        {"role": "user", "content": "x"}]}, "messages[1].content[0].id", "invalid_value"),
    ({**BASE, "tools": [{"name": "f", "input_schema": {"type": "array"}}]},
     "tools[0].input_schema", "invalid_value"),
    ({**BASE, "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]},
     "tools[0].name", "invalid_value"),
    ({**BASE, "tool_choice": {"type": "any"}}, "tool_choice", "invalid_value"),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name", "invalid_value"),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type",
     "unsupported_parameter"),
    ({**BASE, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "invalid_type"),
    ({**BASE, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences",
     "invalid_value"),
    ({**BASE, "metadata": {"user_id": "a\nb"}}, "metadata.user_id", "invalid_value"),
    ({**BASE, "metadata": {"session": "x"}}, "metadata.session", "unknown_parameter"),
])
def test_malformed_bodies_are_400s_naming_the_parameter(body, param, code):
    error = refused(body)
    assert (error.param, error.code) == (param, code)
    assert error.message.startswith(f"{param}: ")


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("body", [[1, 2], "text", None, {**BASE, "metadata": _nested(40)}])
def test_a_body_that_is_no_object_or_nests_too_deep_is_refused(body):
    refused(body)


def test_a_forced_call_with_a_schema_the_grammar_cannot_enforce_names_input_schema():
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?=lookahead)"}}}}
    auto = translate({**BASE, "tools": [tool]})  # the model writes freely: no grammar
    assert auto["tools"][0]["function"]["parameters"] == tool["input_schema"]
    error = refused({**BASE, "tools": [tool], "tool_choice": {"type": "any"}})
    assert error.param == "tools[0].input_schema.properties.a.pattern"
    assert error.code == "unsupported_parameter"


# --- the answer --------------------------------------------------------------------------


def encoder() -> MessageEncoder:
    return MessageEncoder(message_id="msg_1", model="tiny-llama", prompt_tokens=20)


def events(parts: list[edge.Part]) -> tuple[MessageEncoder, list[tuple[str, dict]]]:
    enc = encoder()
    out = enc.start()
    for part in parts:
        out += enc.feed(part)
    return enc, out


def test_text_streams_as_one_block_and_ends_with_usage():
    enc, out = events([edge.Text("Hel"), edge.Text("lo"), edge.Finished("stop"),
                       edge.Usage(prompt_tokens=20, completion_tokens=2, cached_tokens=16)])
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert out[0][1]["message"]["usage"]["input_tokens"] == 20
    assert out[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert out[3][1]["delta"] == {"type": "text_delta", "text": "lo"}
    assert out[5][1] == {"type": "message_delta",
                         "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                         "usage": {"input_tokens": 4, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 16, "output_tokens": 2}}
    message = enc.message()
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["stop_reason"] == "end_turn" and message["id"] == "msg_1"


def test_tool_calls_stream_as_tool_use_blocks_after_the_text():
    enc, out = events([
        edge.Text("Let me see."), edge.ToolCallStarted(0, "call_a1", "get_weather"),
        edge.Arguments(0, '{"city":'), edge.Arguments(0, '"Paris"}'),
        edge.ToolCallStarted(1, "call_b2", "now", "{}"), edge.Finished("tool_calls"),
        edge.Usage(10, 5, 0)])
    starts = [data for name, data in out if name == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "toolu_a1",
                                          "name": "get_weather", "input": {}}
    json_deltas = [data for name, data in out if name == "content_block_delta"
                   and data["delta"]["type"] == "input_json_delta"]
    assert [(d["index"], d["delta"]["partial_json"]) for d in json_deltas] == [
        (1, '{"city":'), (1, '"Paris"}'), (2, "{}")]
    stops = [data["index"] for name, data in out if name == "content_block_stop"]
    assert stops == [0, 1, 2]
    message = enc.message()
    assert message["stop_reason"] == "tool_use"
    assert message["content"][1:] == [
        {"type": "tool_use", "id": "toolu_a1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_b2", "name": "now", "input": {}}]


@pytest.mark.parametrize("reason, expected", [("stop", "end_turn"), ("length", "max_tokens"),
                                              ("tool_calls", "tool_use")])
def test_finish_reasons_become_stop_reasons(reason, expected):
    enc, _ = events([edge.Finished(reason), edge.Usage(1, 1, 0)])
    assert enc.message()["stop_reason"] == expected


def test_a_call_cut_short_reads_as_max_tokens_with_an_empty_input():
    enc, _ = events([edge.ToolCallStarted(0, "call_x", "f", '{"city": "Par'),
                     edge.Finished("tool_calls"), edge.Usage(1, 8, 0)])
    message = enc.message()
    assert message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "tool_use", "id": "toolu_x", "name": "f",
                                   "input": {}}]


def test_a_whole_completion_reads_as_its_stream_would():
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_q", "type": "function",
             "function": {"name": "f", "arguments": json.dumps({"x": 1})}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 0}}}
    enc = encoder()
    for part in edge.completion_parts(completion):
        enc.feed(part)
    assert enc.message() == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny-llama",
        "content": [{"type": "tool_use", "id": "toolu_q", "name": "f", "input": {"x": 1}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 9, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, "output_tokens": 4}}
