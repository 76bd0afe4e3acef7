"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client against a
live server, a real engine and real Redis: answers and streams, the same tokens and text as
chat completions, tools, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from tests.factories import key_factory, plan_factory, tenant_factory
from tests.requestlogs.conftest import wait_for_logs

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
               "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK no longer names temperature; it is still sent


def claude(api_server: str, key: str, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api_server, api_key=key, max_retries=0, timeout=60,
                               **kwargs)


@pytest.fixture
def client(api_server, tenant_key) -> anthropic.Anthropic:
    return claude(api_server, tenant_key.key)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_a_message_in_anthropics_shape(client, served_model, engine_worker):
    raw = client.messages.with_raw_response.create(
        model=served_model, max_tokens=12, messages=[{"role": "user", "content": "Hello"}],
        extra_body=GREEDY)
    message = raw.parse()
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == served_model
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 0
    assert usage.cache_creation_input_tokens == 0 and 0 < usage.output_tokens <= 12
    assert raw.headers["request-id"] == raw.headers["x-request-id"] == message.id
    assert message._request_id == message.id
    assert "x-ratelimit-remaining-requests" in raw.headers


def test_stream_deltas_join_to_the_created_text_and_end_with_usage(client, served_model,
                                                                   engine_worker):
    kwargs = dict(model=served_model, max_tokens=16, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Tell me a story"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    assert final.id.startswith("msg_") and final.id != whole.id
    events = [event.type for event in client.messages.create(**kwargs, stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1:-2] == ["content_block_start", *["content_block_delta"] * (
        len(events) - 5), "content_block_stop"]


def test_greedy_text_and_billed_tokens_equal_chat_completions(client, api_server, tenant_key,
                                                              served_model, engine_worker):
    system, user = "You answer briefly.", "Name three colours."
    chat = OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60).chat.completions.create(
        model=served_model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    message = client.messages.create(model=served_model, max_tokens=12, system=system,
                                     messages=[{"role": "user", "content": user}],
                                     extra_body=GREEDY)
    assert text_of(message) == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    [chat_log] = wait_for_logs(1, endpoint="chat")
    [log] = wait_for_logs(1, endpoint="messages")
    assert log.request_id == message.id and log.status == 200
    assert (log.prompt_tokens, log.completion_tokens) == \
        (chat_log.prompt_tokens, chat_log.completion_tokens)
    assert log.cached_tokens == usage.cache_read_input_tokens


def _stop_within(client, model: str) -> tuple[str, str]:
    """A prompt, and three characters its greedy answer holds past its start."""
    free = text_of(client.messages.create(model=model, max_tokens=24, messages=ASK,
                                          extra_body=GREEDY))
    if len(free) < 6:
        pytest.fail(f"the test model must produce some text, got {free!r}")
    return free, free[3:6]


def test_stop_sequences_end_the_text_before_them(client, served_model, engine_worker):
    free, stop = _stop_within(client, served_model)
    message = client.messages.create(model=served_model, max_tokens=24, messages=ASK,
                                     stop_sequences=[stop], extra_body=GREEDY)
    assert text_of(message) == free[:free.index(stop)]
    assert message.stop_reason in ("stop_sequence", "end_turn")


def test_a_stop_sequence_is_named_in_stop_reason_and_stop_sequence(client, served_model,
                                                                   engine_worker):
    _, stop = _stop_within(client, served_model)
    message = client.messages.create(model=served_model, max_tokens=24, messages=ASK,
                                     stop_sequences=[stop], extra_body=GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_a_deadline_mid_stream_is_an_error_event(client, served_model, slow_engine, settings):
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    seen = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        for event in client.messages.create(model=served_model, max_tokens=400, messages=ASK,
                                            stream=True):
            seen.append(event.type)
    assert seen[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert "message_stop" not in seen
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "timeout_error"
    assert "deadline" in body["error"]["message"]
    assert body["request_id"].startswith("msg_")


def test_a_deadline_before_the_answer_is_a_gateway_timeout(client, served_model, slow_engine,
                                                           settings):
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    with pytest.raises(anthropic.GatewayTimeoutError) as caught:
        client.messages.create(model=served_model, max_tokens=400, messages=ASK)
    assert error_of(caught)["type"] == "timeout_error"
    assert caught.value.response.headers["request-id"].startswith("msg_")


def test_a_client_leaving_mid_stream_stops_the_engine(client, served_model, slow_engine,
                                                      redis_client):
    texts = 0
    with client.messages.stream(model=served_model, max_tokens=400, messages=ASK) as stream:
        for event in stream:
            texts += event.type == "text"
            if texts >= 3:
                break
        request_id = stream.current_message_snapshot.id
    [log] = wait_for_logs(1, endpoint="messages")
    assert log.request_id == request_id and log.status == 499
    assert log.error_code == "client_closed"
    assert texts <= log.completion_tokens <= texts + 10, log.completion_tokens


def test_a_named_tool_is_called_with_json_input_and_its_result_sent_back(client, served_model,
                                                                         engine_worker):
    first = client.messages.create(model=served_model, max_tokens=60, messages=ASK,
                                   tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    second = client.messages.create(
        model=served_model, max_tokens=8, tools=[WEATHER], extra_body=GREEDY, messages=[
            *ASK, {"role": "assistant", "content": first.content},  # as the SDK hands it
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "18 degrees, sunny"}]}])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_streamed_tool_call_builds_the_same_input(client, served_model, engine_worker):
    kwargs = dict(model=served_model, max_tokens=150, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        deltas = [event.delta.partial_json for event in stream
                  if event.type == "content_block_delta"
                  and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    whole_call, call = whole.content[-1], final.content[-1]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert call.type == "tool_use" and call.input == whole_call.input
    assert json.loads("".join(deltas)) == call.input


def test_count_tokens_equals_the_prompt_a_create_reports(client, served_model, engine_worker):
    body = dict(model=served_model, system="Be exact.", tools=[WEATHER], messages=[
        {"role": "user", "content": f"Count me {uuid.uuid4().hex}"}])
    counted = client.messages.count_tokens(**body)
    created = client.messages.create(**body, max_tokens=2)
    assert counted.input_tokens == \
        created.usage.input_tokens + created.usage.cache_read_input_tokens
    plain = client.messages.count_tokens(model=served_model, messages=body["messages"])
    assert plain.input_tokens < counted.input_tokens  # the tools reach the prompt


def test_count_tokens_takes_no_quota_and_is_not_logged(client, served_model, engine_worker):
    for _ in range(3):
        assert client.messages.count_tokens(model=served_model, messages=ASK).input_tokens
    raw = client.messages.with_raw_response.create(model=served_model, max_tokens=2,
                                                   messages=ASK)
    limit = int(raw.headers["x-ratelimit-limit-requests"])
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == limit - 1
    [log] = wait_for_logs(1)
    assert log.request_id == raw.parse().id


def test_both_x_api_key_and_bearer_authenticate(api_server, tenant_key, served_model,
                                                monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    by_header = anthropic.Anthropic(base_url=api_server, max_retries=0,
                                    default_headers={"x-api-key": tenant_key.key})
    for client in (by_header, claude(api_server, tenant_key.key),  # Bearer, as this SDK sends
                   anthropic.Anthropic(base_url=api_server, auth_token=tenant_key.key,
                                       max_retries=0)):
        assert client.messages.count_tokens(model=served_model, messages=ASK).input_tokens


def test_x_api_key_wins_over_authorization(api_server, tenant_key, served_model):
    client = claude(api_server, tenant_key.key, default_headers={"x-api-key": "atr_live_no"})
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.count_tokens(model=served_model, messages=ASK)


def test_any_anthropic_version_is_accepted(api_server, tenant_key, served_model):
    client = claude(api_server, tenant_key.key,
                    default_headers={"anthropic-version": "1999-12-31",
                                     "anthropic-beta": "no-such-beta"})
    assert client.messages.count_tokens(model=served_model, messages=ASK).input_tokens


def error_of(caught: pytest.ExceptionInfo) -> dict:
    body = caught.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def test_a_missing_max_tokens_is_a_bad_request(client, served_model):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=served_model, messages=ASK, max_tokens=anthropic.omit)
    assert error_of(caught) == {"type": "invalid_request_error",
                                "message": "max_tokens: Field required"}


def test_a_bad_key_is_an_authentication_error(api_server, served_model):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude(api_server, "atr_live_nope").messages.create(model=served_model,
                                                            max_tokens=4, messages=ASK)
    assert error_of(caught)["type"] == "authentication_error"
    anonymous = claude(api_server, "unused", default_headers={"Authorization": anthropic.omit})
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anonymous.messages.count_tokens(model=served_model, messages=ASK)
    assert "x-api-key" in error_of(caught)["message"]


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=ASK)
    assert error_of(caught)["type"] == "not_found_error"
    assert "claude-nonexistent" in error_of(caught)["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nonexistent", messages=ASK)


def test_a_key_without_the_inference_scope_is_a_permission_error(api_server, served_model):
    key = key_factory(tenant_factory(), scopes=("usage",))
    with pytest.raises(anthropic.PermissionDeniedError) as caught:
        claude(api_server, key.plaintext).messages.create(model=served_model, max_tokens=4,
                                                          messages=ASK)
    assert error_of(caught)["type"] == "permission_error"


@pytest.mark.parametrize("kwargs, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"thinking": {"type": "adaptive"}}, "thinking"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"container": "container_1"}, "container"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "https://mcp.example",
                                      "name": "x"}]}}, "mcp_servers"),
    ({"speed": "fast"}, "speed"),
    ({"inference_geo": "eu"}, "inference_geo"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}, "messages[0].content[0].type"),
    ({"extra_body": {"frequency_penalty": 1.0}}, "frequency_penalty"),
])
def test_each_unsupported_parameter_is_a_400_naming_it(client, served_model, kwargs, param):
    kwargs = {"messages": ASK, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=served_model, max_tokens=4, **kwargs)
    error = error_of(caught)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")


def test_a_refused_translation_is_logged_with_the_body_as_sent(client, served_model):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=served_model, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 2048})
    [log] = wait_for_logs(1, endpoint="messages")
    assert log.status == 400 and log.request_id.startswith("msg_")
    assert log.error_code == "unsupported_parameter"


def test_what_the_chat_pipeline_refuses_is_said_in_anthropics_names(api_server, served_model):
    key = key_factory(tenant_factory(plan=plan_factory(max_output_tokens=8)))
    client = claude(api_server, key.plaintext)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=served_model, max_tokens=20, messages=ASK)
    message = error_of(caught)["message"]
    assert "'max_tokens' is too large" in message and "max_completion" not in message


def test_a_429_keeps_its_retry_and_rate_limit_headers(api_server, served_model):
    key = key_factory(tenant_factory(plan=plan_factory(requests_per_minute=1)))
    client = claude(api_server, key.plaintext)
    # No engine is up: the admitted request is a 503 (overloaded), the next one a 429.
    with pytest.raises(anthropic.ServiceUnavailableError) as unavailable:
        client.messages.create(model=served_model, max_tokens=2, messages=ASK)
    assert error_of(unavailable)["type"] == "overloaded_error"
    assert unavailable.value.response.headers["request-id"].startswith("msg_")
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model=served_model, max_tokens=2, messages=ASK)
    assert error_of(limited)["type"] == "rate_limit_error"
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "1"


def body(**fields) -> dict:
    return {"model": "tiny-llama", "max_tokens": 4, "messages": ASK, **fields}


HOSTILE = [
    b"{not json", b"[1, 2, 3]", b'"a string"', b"null", b"",
    body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 150_000}]),
    body(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 20_000
                    + [{"type": "text", "text": None}]}]),
    body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
    body(messages=[{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]),
    body(messages=[{"role": "user", "content": [{"type": "text", "text": {"$ne": 1}}]}]),
    body(messages=[{"role": "user", "content": "Hi"}] * 30_000 + [{"role": "user"}]),
    body(model=["tiny-llama"]),
    body(tools=[{"name": "f", "input_schema": {"type": "object"}}] * 200),
    body(tools=[{"name": "f", "input_schema": {"type": "object"}}] * 2),
    body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": "x"}}],
         tool_choice={"type": "any"}),
    body(system=[{"type": "text", "text": "\ud800"}]),
    body(messages=[{"role": "user", "content": "x" * 5_000_000}]),
]


@pytest.mark.parametrize("path, content", [
    *(("/v1/messages", content) for content in HOSTILE),
    *(("/v1/messages/count_tokens", content) for content in HOSTILE),
    ("/v1/messages", body(max_tokens=True)), ("/v1/messages", body(max_tokens=10**30)),
    ("/v1/messages", body(max_tokens=-1)), ("/v1/messages", body(stream="yes"))])
def test_hostile_input_is_a_4xx_never_a_5xx(client, served_model, content, path):
    if isinstance(content, dict):
        content = {k: v for k, v in content.items()
                   if k != "max_tokens" or path == "/v1/messages"}
        content = json.dumps(content).encode()
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.post(path, cast_to=object, content=content,
                    options={"headers": {"content-type": "application/json"}})
    assert 400 <= caught.value.status_code < 500
    if caught.value.status_code != 413:  # see test_a_413_is_in_anthropics_shape
        assert error_of(caught)["type"] == "invalid_request_error"


def test_a_body_over_the_size_limit_is_request_too_large(client, served_model):
    with pytest.raises(anthropic.ContentTooLargeError):
        client.messages.create(model=served_model, max_tokens=4, messages=[
            {"role": "user", "content": "x" * 5_000_000}])


def test_a_413_is_in_anthropics_shape(client, served_model):
    with pytest.raises(anthropic.ContentTooLargeError) as caught:
        client.messages.create(model=served_model, max_tokens=4, messages=[
            {"role": "user", "content": "x" * 5_000_000}])
    assert error_of(caught)["type"] == "request_too_large"


def test_other_methods_are_refused_in_anthropics_shape(client):
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.get("/v1/messages", cast_to=object)
    assert caught.value.status_code == 405
    assert error_of(caught)["type"] == "invalid_request_error"
