"""The console's request logs show a Responses API or Messages API request readably: the
API by the name a tenant knows, the prompt (chat messages, as translated) turn by turn
with its tool calls and results, and the answer."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from webui.request_logs import Turn, endpoint_label, transcript

pytestmark = pytest.mark.django_db

RESPONSES_PROMPT = [
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "What is the weather in Lisbon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_weather1", "type": "function",
         "function": {"name": "get_weather", "arguments": "city Lisbon"}}]},
    {"role": "tool", "tool_call_id": "call_weather1", "content": "sunny and warm"},
]
MESSAGES_PROMPT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number above ten."},
]


@pytest.fixture
def logged(world) -> dict[str, str]:
    """A Responses and a Messages request of acme's, logged with their bodies."""
    from requestlogs.facade import RequestLogEntry, request_log_record_many
    from requestlogs.services import log_policy_update
    from tenants.access import SYSTEM

    log_policy_update(tenant=world.acme, actor=SYSTEM, log_bodies=True)
    ids = {"responses": "resp_acme0000cafe", "messages": "msg_acme0000beef"}
    common = {"tenant_id": world.acme.pk, "transport": "http", "model": "m", "status": 200,
              "finish_reason": "stop", "prompt_tokens": 20, "completion_tokens": 3}
    written = request_log_record_many(entries=[
        RequestLogEntry(request_id=ids["responses"], endpoint="responses",
                        prompt=RESPONSES_PROMPT, completion="Sunny", **common),
        RequestLogEntry(request_id=ids["messages"], endpoint="messages", stream=True,
                        prompt=MESSAGES_PROMPT, completion="Eleven", **common)])
    assert written == 2
    return ids


def _developer(world) -> Client:
    client = Client()
    client.force_login(world.people["developer"])
    return client


def test_the_list_names_each_request_by_its_api(world, logged):
    reply = _developer(world).get(reverse("webui:logs", kwargs={"slug": "acme"}))
    assert reply.status_code == 200
    assert set(logged.values()) <= {log.request_id for log in reply.context["logs"]}
    page = reply.content.decode()
    assert "responses (OpenAI)" in page and "messages (Anthropic)" in page
    assert "chat completions" in page  # the world's own chat request


def test_a_responses_request_shows_its_turns_tool_call_and_answer(world, logged):
    url = reverse("webui:log", kwargs={"slug": "acme", "request_id": logged["responses"]})
    reply = _developer(world).get(url)
    assert reply.status_code == 200
    assert [(t.role, t.text) for t in reply.context["transcript"]] == [
        ("developer", "Answer in one word."), ("user", "What is the weather in Lisbon?"),
        ("assistant", ""), ("tool", "sunny and warm")]
    page = reply.content.decode()
    for text in ("responses (OpenAI) over http", "What is the weather in Lisbon?",
                 "get_weather", "city Lisbon", "result of call_weather1", "sunny and warm",
                 '<pre class="body">Sunny</pre>'):
        assert text in page, text


def test_a_messages_request_shows_its_system_prompt_question_and_answer(world, logged):
    url = reverse("webui:log", kwargs={"slug": "acme", "request_id": logged["messages"]})
    page = _developer(world).get(url).content.decode()
    for text in ("messages (Anthropic) over http, streamed", "system", "You are terse.",
                 "Name a prime number above ten.", '<pre class="body">Eleven</pre>'):
        assert text in page, text


def test_another_tenant_cannot_read_them(world, logged):
    client = Client()
    client.force_login(world.outsider)
    url = reverse("webui:log", kwargs={"slug": "acme", "request_id": logged["responses"]})
    assert client.get(url).status_code == 404
    url = reverse("webui:log", kwargs={"slug": "other", "request_id": logged["responses"]})
    assert client.get(url).status_code == 404


def test_a_completions_prompt_is_shown_as_its_text(world):
    from requestlogs.facade import RequestLogEntry, request_log_record_many
    from requestlogs.services import log_policy_update
    from tenants.access import SYSTEM

    log_policy_update(tenant=world.acme, actor=SYSTEM, log_bodies=True)
    request_log_record_many(entries=[RequestLogEntry(
        request_id="cmpl-acme0000f00d", tenant_id=world.acme.pk, endpoint="completion",
        transport="http", model="m", status=200, prompt="Once upon a time",
        completion="there was")])
    url = reverse("webui:log", kwargs={"slug": "acme", "request_id": "cmpl-acme0000f00d"})
    reply = _developer(world).get(url)
    assert reply.context["transcript"] is None
    assert '<pre class="body">Once upon a time</pre>' in reply.content.decode()


def test_content_parts_read_as_text_and_name_what_is_not_text():
    turns = transcript([{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}}]}])
    assert turns == [Turn(role="user", text="What is this?\n[image_url]")]


def test_what_is_not_chat_messages_is_no_transcript():
    for prompt in (None, "a prompt", [], ["two", "prompts"], [{"content": "no role"}]):
        assert transcript(prompt) is None


def test_an_endpoint_the_console_does_not_know_reads_as_stored():
    assert endpoint_label("embeddings") == "embeddings"
