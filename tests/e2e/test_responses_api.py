"""OpenAI's Responses API against the real `atrium up` and its demo model, on both setups,
through the official `openai` package only: answered, streamed and parsed responses, a
function tool over two turns, stored responses (retrieve, input items, continue, delete),
background responses (poll, read again from any event, cancel), and the chat path's tokens
for the same generation."""

from __future__ import annotations

import json
import time

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import Atrium, wait_for


class Trip(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=30)


FORECAST = {"type": "function", "name": "get_forecast", "description": "A city's weather",
            "parameters": {"type": "object", "additionalProperties": False,
                           "required": ["city"],
                           "properties": {"city": {"type": "string", "maxLength": 12}}}}
# A schema whose answer is long whatever the model would say: a background response
# still generating when the test acts on it.
LONG = {"type": "json_schema", "name": "essay", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["essay"],
    "properties": {"essay": {"type": "string", "minLength": 1500}}}}


def test_a_response_answered_streamed_and_parsed_says_what_chat_says(atrium: Atrium):
    client = atrium.openai()
    chat = client.chat.completions.create(
        model=atrium.model, temperature=0, max_completion_tokens=32,
        messages=[{"role": "developer", "content": "Answer in one line."},
                  {"role": "user", "content": "What is a lighthouse?"}])
    kwargs = dict(model=atrium.model, temperature=0, max_output_tokens=32,
                  instructions="Answer in one line.", input="What is a lighthouse?")
    res = client.responses.create(**kwargs)
    assert res.output_text == chat.choices[0].message.content
    assert (res.usage.input_tokens, res.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == res.output_text
    parsed = client.responses.parse(model=atrium.model, input="Plan a trip to the sea.",
                                    text_format=Trip, max_output_tokens=64)
    assert isinstance(parsed.output_parsed, Trip)
    with client.responses.stream(model=atrium.model, input="Plan a trip to the sea.",
                                 text_format=Trip, max_output_tokens=64) as stream:
        assert isinstance(stream.get_final_response().output_parsed, Trip)


def test_a_tool_over_two_turns_and_a_stored_conversation(atrium: Atrium):
    client = atrium.openai()
    first = client.responses.create(model=atrium.model, input="Weather in Oslo?",
                                    tools=[FORECAST], max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_forecast"})
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert set(json.loads(call.arguments)) == {"city"}
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    (asked,) = client.responses.input_items.list(first.id).data
    assert asked.content[0].text == "Weather in Oslo?"
    second = client.responses.create(
        model=atrium.model, tools=[FORECAST], max_output_tokens=24,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"celsius": 4})}])
    assert second.usage.input_tokens > first.usage.input_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=atrium.model, input="hi",
                                tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools[0].type"


def test_a_background_response_is_polled_read_again_and_cancelled(atrium: Atrium):
    client = atrium.openai()
    done = client.responses.create(model=atrium.model, input="Name a colour.",
                                   background=True, max_output_tokens=16)
    finished = wait_for(lambda: (r := client.responses.retrieve(done.id)).status
                        not in ("queued", "in_progress") and r, timeout=120)
    events = list(client.responses.retrieve(done.id, stream=True))
    assert events[-1].response.output_text == finished.output_text
    assert list(client.responses.retrieve(done.id, stream=True, starting_after=2)) \
        == events[3:]
    long = client.responses.create(model=atrium.model, input="Write an essay.",
                                   background=True, max_output_tokens=1200,
                                   text={"format": LONG})
    for event in client.responses.retrieve(long.id, stream=True):
        if event.type == "response.output_text.delta":
            break  # generating
    asked = time.monotonic()
    cancelled = client.responses.cancel(long.id)
    if cancelled.status != "cancelled":  # what became of it, for the failure's message
        later = []
        for _ in range(30):
            time.sleep(2)
            later.append((round(time.monotonic() - asked),
                          client.responses.retrieve(long.id).status))
        said = [line for line in atrium.output.splitlines()
                if long.id in line or "Traceback" in line or "background response" in line]
        raise AssertionError(f"cancel answered {cancelled.status!r} after "
                             f"{time.monotonic() - asked:.1f} s; then: {later}; the server "
                             "said:\n" + "\n".join(said[-40:]))
    assert client.responses.retrieve(long.id).status == "cancelled"
