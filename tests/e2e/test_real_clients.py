"""What real clients send, against the real `atrium up` and its demo model on both setups:
the openai SDK's `.parse()` for structured outputs and tools, a tool round trip with streamed
deltas, and logprobs."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import Atrium


class Trip(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=30)
    by: Literal["train", "boat", "bike"]
    with_kids: bool


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


ASK = [{"role": "user", "content": "Plan a trip to the sea."}]
FORECAST = openai.pydantic_function_tool(Forecast, name="get_forecast")


@pytest.mark.setups("embedded")  # the grammar engine's work, the same on either setup
def test_parse_gives_the_model_every_time_under_many_seeds(atrium: Atrium):
    client = atrium.openai()
    for seed in range(24):
        res = client.chat.completions.parse(model=atrium.model, messages=ASK,
                                            response_format=Trip, max_tokens=96, seed=seed)
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Trip)


def test_a_streamed_tool_round_trip(atrium: Atrium):
    client = atrium.openai()
    named = {"type": "function", "function": {"name": "get_forecast"}}
    with client.chat.completions.stream(model=atrium.model, messages=ASK, tools=[FORECAST],
                                        tool_choice=named, max_tokens=64,
                                        stream_options={"include_usage": True}) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    (call,) = message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, Forecast)
    answer = client.chat.completions.create(
        model=atrium.model, tools=[FORECAST], max_tokens=16, messages=[
            *ASK, message,  # the SDK's parsed message, sent back as clients do
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > final.usage.prompt_tokens


def test_logprobs_stream_with_the_text(atrium: Atrium):
    chunks = list(atrium.openai().chat.completions.create(
        model=atrium.model, messages=ASK, max_tokens=8, stream=True, logprobs=True,
        top_logprobs=3, temperature=0))
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == text
