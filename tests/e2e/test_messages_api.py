"""Anthropic's Messages API on the real `atrium up` and its demo model, through the official
`anthropic` package as a user would point it at Atrium: a message, its stream, a token
count, and a tool round trip with the SDK's own objects sent back."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e.conftest import Atrium

ASK = [{"role": "user", "content": "Plan a trip to the sea."}]
FORECAST = {"name": "get_forecast", "description": "The weather forecast for a city.",
            "input_schema": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": False}}


def claude(atrium: Atrium) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=atrium.base, api_key=atrium.key, max_retries=0,
                               timeout=120)


def test_a_message_its_stream_and_its_token_count(atrium: Atrium):
    client = claude(atrium)
    kwargs = dict(model=atrium.model, max_tokens=24, system="Answer in one line.",
                  messages=ASK, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    assert message.id.startswith("msg_") and message.model == atrium.model
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens
    counted = client.messages.count_tokens(model=atrium.model, system="Answer in one line.",
                                           messages=ASK)
    assert counted.input_tokens == \
        final.usage.input_tokens + final.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 2048})


@pytest.mark.setups("embedded")  # the translation is the same on either setup
def test_a_streamed_tool_round_trip(atrium: Atrium):
    client = claude(atrium)
    with client.messages.stream(model=atrium.model, max_tokens=64, messages=ASK,
                                tools=[FORECAST],
                                tool_choice={"type": "tool", "name": "get_forecast"}) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.input["unit"] in ("c", "f") and len(call.input["city"]) <= 12
    answer = client.messages.create(model=atrium.model, max_tokens=16, tools=[FORECAST],
                                    messages=[*ASK, {"role": "assistant",
                                                     "content": first.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result",
                                                   "tool_use_id": call.id,
                                                   "content": "21 degrees"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
