from __future__ import annotations

import json

import pytest

from engine import protocol


def _request() -> protocol.EngineRequest:
    return protocol.EngineRequest(
        request_id="r1", model="tiny", prompt_token_ids=[1, 2], tenant_id="t1",
        sampling=protocol.SamplingSpec(max_tokens=3, stop=["\n"]), deadline=1e9)


def _decode_with(**changes) -> protocol.EngineRequest:
    raw = json.loads(_request().encode()["data"])
    for name, value in changes.items():
        if name in ("stop", "temperature", "max_tokens"):
            raw["sampling"][name] = value
        else:
            raw[name] = value
    return protocol.EngineRequest.decode({b"data": json.dumps(raw).encode()})


def test_an_encoded_request_decodes_to_itself():
    request = _request()
    assert protocol.EngineRequest.decode(request.encode()) == request


def test_whole_numbers_are_taken_for_floats():
    assert _decode_with(temperature=1, deadline=2).sampling.temperature == 1


@pytest.mark.parametrize("changes, message", [
    (dict(stop=None), "sampling.stop must be an array, not null"),
    (dict(tenant_id=None), "request.tenant_id must be a string, not null"),
    (dict(max_tokens=True), "sampling.max_tokens must be an integer, not a boolean"),
    (dict(deadline="soon"), "request.deadline must be a number or null"),
    (dict(sampling=[1]), "sampling must be a JSON object"),
    (dict(surprise=1), "unknown fields: surprise"),
    (dict(max_resident_adapters=-1), "max_resident_adapters must be from 0 to 100000"),
    (dict(max_resident_adapters=1.5), "max_resident_adapters must be an integer"),
])
def test_a_mistyped_field_is_a_value_error_naming_it(changes, message):
    with pytest.raises(ValueError, match=message):
        _decode_with(**changes)


def test_a_missing_field_is_a_value_error_naming_it():
    raw = json.loads(_request().encode()["data"])
    del raw["tenant_id"]
    with pytest.raises(ValueError, match="lacks tenant_id"):
        protocol.EngineRequest.decode({"data": json.dumps(raw)})


def test_n_defaults_to_one_and_travels():
    assert protocol.SamplingSpec(max_tokens=1).n == 1
    raw = json.loads(_request().encode()["data"])
    raw["sampling"]["n"] = 3
    assert protocol.EngineRequest.decode({"data": json.dumps(raw)}).sampling.n == 3


def test_the_task_travels_and_an_earlier_message_without_it_is_a_generate_request():
    embed = protocol.EngineRequest.decode(_decode_with(task="embed").encode())
    assert embed.task == protocol.TASK_EMBED
    raw = json.loads(_request().encode()["data"])
    del raw["task"]
    assert protocol.EngineRequest.decode({"data": json.dumps(raw)}).task == "generate"


def test_an_unknown_task_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="request.task must be one of generate, embed"):
        _decode_with(task="rerank")


def test_an_embed_request_may_have_more_extra_inputs_than_a_generate_request():
    assert protocol.max_extra_prompts(protocol.TASK_EMBED) == protocol.MAX_EMBED_INPUTS == 255
    assert protocol.max_extra_prompts(protocol.TASK_GENERATE) == protocol.MAX_EXTRA_PROMPTS


def test_a_plans_adapter_limit_travels_and_is_left_out_when_there_is_none():
    assert _decode_with(max_resident_adapters=3).max_resident_adapters == 3
    # Left out at 0, as an engine of the release before it expects: it refuses unknown fields.
    assert "max_resident_adapters" not in json.loads(_request().encode()["data"])
    assert protocol.EngineRequest.decode(_request().encode()).max_resident_adapters == 0
