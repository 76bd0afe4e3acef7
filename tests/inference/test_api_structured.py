"""Structured outputs through the official `openai` client: `.parse()` with pydantic models,
json_object, streamed and not, HTTP and websocket, with the refusals a client should see."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field


class Place(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["sea", "lake", "river"]
    deep: bool
    depth: int = Field(ge=0, le=500)


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


MESSAGES = [{"role": "user", "content": "Describe a body of water as JSON."}]


def test_parse_returns_the_pydantic_model_under_many_seeds(client, served_model, engine_worker):
    for seed in range(12):
        res = client.chat.completions.parse(model=served_model, messages=MESSAGES,
                                            response_format=Place, max_tokens=80,
                                            temperature=1.0, seed=seed)
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Place)
        assert Place.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_structured_answer_is_the_same_json(client, served_model, engine_worker):
    kwargs = dict(model=served_model, messages=MESSAGES, response_format=Place, max_tokens=80,
                  temperature=0)
    whole = client.chat.completions.parse(**kwargs).choices[0].message.content
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == whole
    assert isinstance(final.choices[0].message.parsed, Place)


def test_json_object_answers_an_object(client, served_model, engine_worker):
    res = client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=200,
                                         temperature=0, response_format={"type": "json_object"})
    if res.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(res.choices[0].message.content), dict)
    else:  # free-form strings may run to max_tokens on an untrained model; still an object
        assert res.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema.properties.a.uniqueItems"),
    ({"type": "object", "patternProperties": {"^x": {}}},
     "response_format.json_schema.schema.patternProperties"),
    ({"type": "nonsense"}, "response_format.json_schema.schema.type"),
])
def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_it(client, served_model, schema,
                                                               param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=served_model, messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}})
    assert err.value.body["param"] == param


def test_structured_output_over_the_websocket(api_server, tenant_key, served_model,
                                              engine_worker):
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    body = {"model": served_model, "messages": MESSAGES, "max_tokens": 80, "temperature": 0,
            "stream": True, "response_format": {"type": "json_schema", "json_schema": {
                "name": "place", "schema": openai.lib._pydantic.to_strict_json_schema(Place),
                "strict": True}}}
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "w1", "endpoint": "chat.completions",
                            "body": body}))
        parts = []
        while True:
            message = json.loads(ws.recv(timeout=30))
            if message["type"] == "chunk":
                for choice in message["data"]["choices"]:
                    parts.append(choice["delta"].get("content") or "")
            elif message["type"] in ("done", "error"):
                break
    assert message["type"] == "done", message
    Place.model_validate_json("".join(parts))
