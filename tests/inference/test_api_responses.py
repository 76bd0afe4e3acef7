"""OpenAI's Responses API through the official `openai` client, against a live server, a
real engine and real Redis: create (answered, streamed, parsed), tools over two turns,
stored responses and their conversations, background responses, and what is refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.inference.test_rate_limits import slow_engine  # noqa: F401
from tests.live import make_tenant_key
from tests.waiting import wait_for

pytestmark = pytest.mark.live


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def test_a_response_says_what_the_same_chat_says_and_bills_the_same_tokens(
        client, served_model, engine_worker):
    chat = client.chat.completions.create(
        model=served_model, temperature=0, max_completion_tokens=24,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": "Tell me a story"}])
    res = client.responses.create(model=served_model, temperature=0, max_output_tokens=24,
                                  instructions="Be brief.", input="Tell me a story")
    assert res.id.startswith("resp_")
    assert res.object == "response"
    assert res.output_text == chat.choices[0].message.content
    assert res.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                          else "completed")
    assert res.usage.input_tokens == chat.usage.prompt_tokens
    assert res.usage.output_tokens == chat.usage.completion_tokens
    assert res.usage.total_tokens == chat.usage.total_tokens


def test_a_streamed_response_numbers_its_events_and_ends_as_the_answered_one(
        client, served_model, engine_worker):
    kwargs = dict(model=served_model, temperature=0, max_output_tokens=20,
                  input=[{"role": "user", "content": "Count to ten"}])
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


class City(BaseModel):
    name: str = Field(max_length=12)
    sunny: bool


def test_parse_gives_the_pydantic_model_answered_and_streamed(client, served_model,
                                                             engine_worker):
    kwargs = dict(model=served_model, input="A city, as JSON", text_format=City,
                  max_output_tokens=64, temperature=0)
    res = client.responses.parse(**kwargs)
    assert res.status == "completed"
    assert isinstance(res.output_parsed, City)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == res.output_parsed


LONG_ANSWER = {"type": "json_schema", "name": "essay", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["essay"],
    "properties": {"essay": {"type": "string", "minLength": 2000}}}}
FORECAST = {"type": "function", "name": "get_forecast", "description": "A city's weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 10}},
                           "required": ["city"], "additionalProperties": False}}


def test_a_function_tool_over_two_turns(client, served_model, engine_worker):
    first = client.responses.create(model=served_model, input="Weather in Paris?",
                                    tools=[FORECAST], max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_forecast"})
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_forecast"
    assert set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(
        model=served_model, tools=[FORECAST], max_output_tokens=16,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"sunny": True})}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # The same conversation sent whole, as a client without storage does, reads the same.
    whole = client.responses.create(
        model=served_model, tools=[FORECAST], max_output_tokens=16, store=False, input=[
            {"role": "user", "content": "Weather in Paris?"}, *first.output,
            {"type": "function_call_output", "call_id": call.call_id,
             "output": json.dumps({"sunny": True})}])
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_stored_responses_are_retrieved_listed_continued_and_deleted(
        client, served_model, engine_worker):
    first = client.responses.create(model=served_model, input="My name is Ada.",
                                    max_output_tokens=16, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "My name is Ada."
    second = client.responses.create(model=served_model, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=16)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=served_model, input="again",
                                previous_response_id=first.id, max_output_tokens=16)
    unstored = client.responses.create(model=served_model, input="x", store=False,
                                       max_output_tokens=16)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_another_tenants_response_is_not_found(client, api_server, served_model,
                                               engine_worker):
    mine = client.responses.create(model=served_model, input="secret", max_output_tokens=16)
    other = OpenAI(base_url=f"{api_server}/v1", api_key=make_tenant_key("other").key,
                   max_retries=0)
    for attempt in (lambda: other.responses.retrieve(mine.id),
                    lambda: other.responses.input_items.list(mine.id),
                    lambda: other.responses.delete(mine.id),
                    lambda: other.responses.cancel(mine.id),
                    lambda: other.responses.create(model=served_model, input="go on",
                                                   previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client.responses.retrieve(mine.id).id == mine.id


def test_a_background_response_is_polled_and_its_stream_read_after_any_event(
        client, served_model, engine_worker, redis_client):
    from inference.protocols.responses_flow import events_key

    res = client.responses.create(model=served_model, input="Tell me a long story",
                                  background=True, max_output_tokens=40, temperature=0)
    assert res.status in ("queued", "in_progress") and res.background
    done = wait_for(lambda: (r := client.responses.retrieve(res.id)).status not in
                    ("queued", "in_progress") and r, timeout=60)
    assert done.usage.output_tokens > 0
    everything = list(client.responses.retrieve(res.id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert everything[-1].response.output_text == done.output_text
    tail = list(client.responses.retrieve(res.id, stream=True, starting_after=3))
    assert tail == everything[4:]
    redis_client.delete(events_key(res.id))  # as an hour after its end
    with pytest.raises(openai.NotFoundError):
        list(client.responses.retrieve(res.id, stream=True))
    assert client.responses.retrieve(res.id).output_text == done.output_text


def test_a_background_response_is_cancelled_mid_generation(client, served_model,
                                                           slow_engine):  # noqa: F811
    # A forced JSON answer: text from the first token on, whatever the sampled tokens.
    res = client.responses.create(model=served_model, input="Tell me a long story",
                                  background=True, max_output_tokens=200,
                                  text={"format": LONG_ANSWER})
    seen = []
    for event in client.responses.retrieve(res.id, stream=True):
        seen.append(event)
        if event.type == "response.output_text.delta":
            break  # it is generating
    cancelled = client.responses.cancel(res.id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < 2000
    assert client.responses.retrieve(res.id).status == cancelled.status


def test_a_cancel_holds_when_the_running_process_does_not_stop_in_time(
        client, served_model, slow_engine, monkeypatch):  # noqa: F811
    """A loaded server whose running process says nothing within the cancel's wait: the
    cancel answers cancelled all the same, and the process's own end (here it never saw
    the cancel and finished) stays cancelled, with what it made."""
    from inference.protocols import responses_flow, responses_views

    monkeypatch.setattr(responses_flow, "_CANCEL_POLL_S", 3600.0)  # the flag goes unseen
    monkeypatch.setattr(responses_views, "CANCEL_WAIT_S", 0.3)
    res = client.responses.create(model=served_model, input="Tell me a long story",
                                  background=True, max_output_tokens=40,
                                  text={"format": LONG_ANSWER})
    for event in client.responses.retrieve(res.id, stream=True):
        if event.type == "response.output_text.delta":
            break  # it is generating
    assert client.responses.cancel(res.id).status == "cancelled"
    events = list(client.responses.retrieve(res.id, stream=True))  # to its end
    assert events[-1].type == "response.incomplete"  # it ran on to its max_output_tokens
    ended = client.responses.retrieve(res.id)
    assert ended.status == "cancelled"
    assert ended.output_text == events[-1].response.output_text != ""


def test_a_background_responses_end_is_written_again_when_the_database_refused_it(
        client, served_model, slow_engine, monkeypatch):  # noqa: F811
    """A write of its end that fails (SQLite busy past its timeout) is retried: the response
    does not stay "in_progress" for every later poll."""
    from django.db import OperationalError

    from inference.protocols import response_store

    write, refused, written = response_store._write_in_thread, [], []

    def busy_at_the_end(changes):
        ending = any(c.response["status"] == "cancelled" for c in changes)
        if ending and len(refused) < 2:
            refused.append(len(changes))
            raise OperationalError("database is locked")
        outcomes = write(changes)
        if ending and all(outcome is None for outcome in outcomes):
            written.append(len(changes))
        return outcomes

    monkeypatch.setattr(response_store, "_write_in_thread", busy_at_the_end)
    res = client.responses.create(model=served_model, input="Tell me a long story",
                                  background=True, max_output_tokens=200,
                                  text={"format": LONG_ANSWER})
    for event in client.responses.retrieve(res.id, stream=True):
        if event.type == "response.output_text.delta":
            break  # it is generating
    assert client.responses.cancel(res.id).status == "cancelled"
    # Its process's own end, refused twice, is written on the third try, with its text (the
    # cancel's own 5-s fallback may mark it cancelled first: that write is not this one).
    wait_for(lambda: written, timeout=60, what="the response's end to be written")
    ended = client.responses.retrieve(res.id)
    assert ended.status == "cancelled" and ended.output_text and len(refused) == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"conversation": "c"}, "conversation"),
    ({"service_tier": "scale"}, "service_tier"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"background": True, "store": False}, "store"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"nonsense": 1}, "nonsense"),
])
def test_what_is_not_served_is_refused_naming_the_parameter(api_server, tenant_key,
                                                            served_model, body, param):
    answer = httpx.post(f"{api_server}/v1/responses", json={
        "model": served_model, "input": "hi", **body},
        headers={"Authorization": f"Bearer {tenant_key.key}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": "x"}] * 5000},
    {"input": [[[]]]},
    {"input": [{"type": "function_call"}]},
    {"input": "x", "previous_response_id": "resp_" + "0" * 200},
    {"input": "x" * 10, "metadata": {"k" * 100: "v"}},
    "not an object",
])
def test_hostile_bodies_are_4xx(api_server, tenant_key, served_model, body):
    if isinstance(body, dict):
        body = {"model": served_model, **body}
    answer = httpx.post(f"{api_server}/v1/responses", json=body,
                        headers={"Authorization": f"Bearer {tenant_key.key}"}, timeout=30)
    assert 400 <= answer.status_code < 500, answer.text
    assert "error" in answer.json()


def test_the_websocket_carries_the_same_numbered_events(client, api_server, tenant_key,
                                                        served_model, engine_worker):
    from websockets.sync.client import connect

    body = {"model": served_model, "input": "Count to ten", "max_output_tokens": 20,
            "temperature": 0}
    over_http = [e.model_dump(exclude_none=True)
                 for e in client.responses.create(stream=True, **body)]
    url = api_server.replace("http", "ws") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "r1", "endpoint": "responses",
                            "body": body}))
        events = []
        while (message := json.loads(ws.recv(timeout=30)))["type"] == "chunk":
            events.append(message["data"])
        assert message == {"type": "done", "id": "r1"}
        ws.send(json.dumps({"type": "request", "id": "r2", "endpoint": "responses",
                            "body": {**body, "background": True}}))
        refused = json.loads(ws.recv(timeout=30))
        assert refused["type"] == "error" and refused["error"]["param"] == "background"
    assert [e["type"] for e in events] == [e["type"] for e in over_http]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e.get("delta", "") for e in events if e["type"].endswith("text.delta"))
    assert text == "".join(e["delta"] for e in over_http if e["type"].endswith("text.delta"))


def test_a_stored_response_holds_no_secret_and_expires(client, tenant_key, served_model,
                                                       engine_worker):
    from django.utils import timezone

    from requestlogs.facade import stored_response_get
    from requestlogs.models import StoredResponse
    from requestlogs.tasks import request_logs_expire_task

    res = client.responses.create(model=served_model, max_output_tokens=16,
                                  input="Mail ada@example.com, card 4111 1111 1111 1111")
    (item,) = client.responses.input_items.list(res.id).data
    assert item.content[0].text == "Mail [EMAIL], card [CARD]"
    row = StoredResponse.objects.get(response_id=res.id)
    assert "ada@example.com" not in json.dumps([row.input_items, row.history, row.response])
    StoredResponse.objects.filter(pk=row.pk).update(expires_at=timezone.now())
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    request_logs_expire_task()
    assert stored_response_get(tenant_id=tenant_key.tenant_id, response_id=res.id) is None
    assert not StoredResponse.objects.filter(pk=row.pk).exists()


def test_a_plan_that_keeps_no_responses_stores_none_and_refuses_store(
        client, tenant_key, served_model, engine_worker):
    from tenants.access import SYSTEM
    from tenants.models import Plan
    from tenants.services import plan_update

    plan = Plan.objects.get(tenants__pk=tenant_key.tenant_id)
    plan_update(actor=SYSTEM, plan=plan, changes={"response_retention_days": 0})
    res = client.responses.create(model=served_model, input="hi", max_output_tokens=16)
    assert res.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    for refused in ({"store": True}, {"background": True}):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=served_model, input="hi", max_output_tokens=16,
                                    **refused)
        assert error.value.body["param"] == "store"


def test_truncation_auto_drops_the_oldest_turns_to_fit(client, served_model, engine_worker):
    from core.served_models import served_models

    window = served_models()[served_model].context_window
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 40}
             for i in range(window // 20)]
    turns.append({"role": "user", "content": "And now?"})
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=served_model, input=turns, max_output_tokens=16)
    assert error.value.body["param"] == "input"
    fitted = client.responses.create(model=served_model, input=turns, max_output_tokens=16,
                                     truncation="auto")
    assert fitted.truncation == "auto"
    assert fitted.usage.input_tokens + 16 <= window


def test_a_background_response_whose_server_died_reads_as_failed(client, tenant_key,
                                                                 served_model):
    from django.conf import settings

    from requestlogs.facade import ResponseWrite, stored_responses_write

    started = int(__import__("time").time() - settings.ATRIUM_REQUEST_TIMEOUT_S - 120)
    lost = {"id": "resp_lost", "object": "response", "created_at": started,
            "status": "in_progress", "background": True, "model": served_model,
            "output": [], "error": None, "incomplete_details": None, "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {}}
    stored_responses_write(writes=[ResponseWrite(
        tenant_id=tenant_key.tenant_id, response=lost, history_before=[], turn=[],
        retention_days=30)])
    seen = client.responses.retrieve("resp_lost")
    assert seen.status == "failed" and seen.error.code == "server_error"
    assert client.responses.cancel("resp_lost").status == "failed"


def test_a_continued_conversation_hits_the_prefix_cache_and_is_logged_as_responses(
        client, served_model, engine_worker):
    from requestlogs.models import RequestLog

    story = "Once upon a time there was a lighthouse keeper who counted ships. " * 4
    first = client.responses.create(model=served_model, input=story, max_output_tokens=16,
                                    temperature=0)
    second = client.responses.create(model=served_model, input="And then?",
                                     previous_response_id=first.id, max_output_tokens=16)
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    logs = wait_for(lambda: len(got := list(RequestLog.objects.filter(
        request_id__in=[first.id, second.id]).order_by("id"))) == 2 and got, timeout=30)
    assert [log.endpoint for log in logs] == ["responses", "responses"]
    assert [log.request_id for log in logs] == [first.id, second.id]
    assert logs[1].cached_tokens == second.usage.input_tokens_details.cached_tokens


def test_a_deadline_mid_stream_is_an_error_then_a_failed_response(
        client, served_model, slow_engine, settings):  # noqa: F811
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    events = list(client.responses.create(model=served_model, input="Tell me a story",
                                          max_output_tokens=400, stream=True))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2].code == "timeout"
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "timeout"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_conversation_chains_at_most_max_depth_responses(client, tenant_key, served_model):
    from requestlogs.facade import MAX_DEPTH, ResponseWrite, stored_responses_write

    deep = {"id": "resp_deep", "object": "response", "created_at": 0, "status": "completed",
            "model": served_model, "output": []}
    stored_responses_write(writes=[ResponseWrite(
        tenant_id=tenant_key.tenant_id, response=deep, history_before=[],
        turn=[{"role": "user", "content": "hi"}], retention_days=30, depth=MAX_DEPTH - 1)])
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=served_model, input="more", max_output_tokens=16,
                                previous_response_id="resp_deep")
    assert refused.value.body["param"] == "previous_response_id"
