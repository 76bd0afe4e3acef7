"""Every authenticated request is logged when it ends, through the real API path."""

from __future__ import annotations

import json

import httpx
import pytest

from requestlogs.models import RequestLog
from requestlogs.services import log_policy_update
from tenants.access import SYSTEM
from tenants.models import Tenant
from tests.inference.slow_engine import slow_factory
from tests.live import start_engine
from tests.requestlogs.conftest import wait_for_logs

CARD = "4111 1111 1111 1111"


def _post(api_server, key, path, body, **kwargs):
    return httpx.post(f"{api_server}{path}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}, **kwargs)


def _keep_bodies(tenant_key) -> None:
    log_policy_update(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), actor=SYSTEM,
                      log_bodies=True)


def test_a_completed_request_is_logged_with_its_metadata_and_no_bodies_by_default(
        api_server, tenant_key, served_model, echo_engine):
    r = _post(api_server, tenant_key.key, "/v1/chat/completions", {
        "model": served_model, "max_tokens": 64,
        "messages": [{"role": "user", "content": f"my card is {CARD}"}]})
    assert r.status_code == 200
    [entry] = wait_for_logs(1)
    assert entry.request_id == r.headers["x-request-id"]
    usage = r.json()["usage"]
    assert (entry.tenant_id, entry.api_key_id) == (tenant_key.tenant_id, tenant_key.key_id)
    assert entry.api_key_prefix == tenant_key.key[:12]
    assert (entry.endpoint, entry.transport, entry.model, entry.stream) == (
        "chat", "http", served_model, False)
    assert (entry.status, entry.error_code, entry.finish_reason) == (200, "", "length")
    assert entry.prompt_tokens == usage["prompt_tokens"]
    assert entry.completion_tokens == usage["completion_tokens"]
    assert entry.ttft_ms is not None and entry.total_ms is not None and entry.latency_ms >= 0
    assert entry.prompt is None and entry.completion is None


def test_kept_bodies_are_redacted_and_structured(api_server, tenant_key, served_model,
                                                 echo_engine):
    _keep_bodies(tenant_key)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"charge {CARD} and mail bob@example.com"}]
    r = _post(api_server, tenant_key.key, "/v1/chat/completions",
              {"model": served_model, "max_tokens": 256, "messages": messages})
    assert r.status_code == 200 and CARD in r.json()["choices"][0]["message"]["content"]
    [entry] = wait_for_logs(1)
    assert entry.prompt == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "charge [CARD] and mail [EMAIL]"}]
    assert "[CARD]" in entry.completion and CARD not in entry.completion
    assert "bob@example.com" not in entry.completion


def test_a_streamed_completion_is_logged_whole(api_server, tenant_key, served_model,
                                              echo_engine):
    _keep_bodies(tenant_key)
    with httpx.stream("POST", f"{api_server}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {tenant_key.key}"},
                      json={"model": served_model, "prompt": f"pay {CARD} now",
                            "max_tokens": 64, "stream": True}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    [entry] = wait_for_logs(1)
    assert entry.stream and entry.endpoint == "completion" and entry.status == 200
    assert entry.prompt == "pay [CARD] now"
    assert CARD in text and entry.completion == text.replace(CARD, "[CARD]")


def test_token_id_prompts_are_decoded_before_redaction(api_server, tenant_key, served_model,
                                                      echo_engine):
    from core.served_models import served_models

    _keep_bodies(tenant_key)
    ids = served_models()[served_model].encode_prompt(f"card {CARD}")
    for prompt in (ids, [ids]):
        r = _post(api_server, tenant_key.key, "/v1/completions",
                  {"model": served_model, "prompt": prompt, "max_tokens": 64})
        assert r.status_code == 200
    flat, nested = wait_for_logs(2)
    assert isinstance(flat.prompt, str) and "[CARD]" in flat.prompt
    assert nested.prompt == [flat.prompt]
    assert CARD not in json.dumps([flat.prompt, nested.prompt])
    assert not any(str(t) in json.dumps(nested.prompt) for t in ids if t > 999)


@pytest.mark.parametrize("keep_bodies", [False, True])
def test_a_request_carrying_ids_no_tokenizer_knows_is_still_logged(
        api_server, tenant_key, served_model, echo_engine, keep_bodies):
    # A field in a message the API ignores (function_call) is kept in the body; ids that
    # overflow the tokenizer must not cost the request its log row.
    if keep_bodies:
        _keep_bodies(tenant_key)
    r = _post(api_server, tenant_key.key, "/v1/chat/completions", {
        "model": served_model, "max_tokens": 8,
        "messages": [{"role": "user", "content": f"hi {CARD}", "function_call": [-1, 2**70]}]})
    assert r.status_code == 200
    [entry] = wait_for_logs(1)
    assert entry.status == 200 and entry.request_id == r.headers["x-request-id"]
    if keep_bodies:
        assert entry.prompt == [{"role": "user", "content": "hi [CARD]", "function_call": None}]
    else:
        assert entry.prompt is None


@pytest.mark.parametrize("body, status, code", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400,
     "invalid_value"),
    ({"model": "gpt-AKIAIOSFODNN7EXAMPLE", "messages": [{"role": "user", "content": "x"}]},
     404, "model_not_found"),
])
def test_refused_requests_are_logged_with_their_error(api_server, tenant_key, served_model,
                                                     echo_engine, body, status, code):
    body = {"model": served_model, **body}
    r = _post(api_server, tenant_key.key, "/v1/chat/completions", body)
    assert r.status_code == status
    [entry] = wait_for_logs(1)
    assert (entry.status, entry.error_code) == (status, r.json()["error"]["code"])
    assert entry.prompt_tokens == entry.completion_tokens == 0
    assert "AKIAIOSFODNN7EXAMPLE" not in entry.model


def test_a_bad_key_is_refused_and_not_logged(api_server, tenant_key, served_model, echo_engine):
    r = _post(api_server, "atr_" + "x" * 36, "/v1/chat/completions",
              {"model": served_model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    with pytest.raises(AssertionError):
        wait_for_logs(1, timeout=1.0)


def test_websocket_requests_are_logged(api_server, tenant_key, served_model, echo_engine):
    from websockets.sync.client import connect

    _keep_bodies(tenant_key)
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "a", "endpoint": "completions",
                            "body": {"model": served_model, "prompt": f"card {CARD}",
                                     "max_tokens": 32}}))
        while json.loads(ws.recv(timeout=30))["type"] != "done":
            pass
    [entry] = wait_for_logs(1)
    assert (entry.transport, entry.stream, entry.status) == ("websocket", True, 200)
    assert entry.prompt == "card [CARD]"


def test_a_client_that_goes_away_is_logged_as_499_with_what_was_made(
        api_server, tenant_key, served_model, tiny_model_path, redis_client):
    running = start_engine(tiny_model_path, served_model, "slow-engine",
                           engine_factory=slow_factory(0.03))
    try:
        with httpx.stream("POST", f"{api_server}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {tenant_key.key}"},
                          json={"model": served_model, "prompt": "Go on", "stream": True,
                                "max_tokens": 400}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 4:
                    break
        [entry] = wait_for_logs(1)
    finally:
        running.stop.set()
        running.thread.join(timeout=30)
    assert (entry.status, entry.error_code) == (499, "client_closed")
    assert 0 < entry.completion_tokens < 400
    assert RequestLog.objects.count() == 1


def test_requests_one_after_another_share_a_connection_and_a_transaction(
        api_server, tenant_key, served_model, echo_engine, monkeypatch):
    """At one request at a time each log was a connection and a transaction of its own, on
    the thread whose GIL the next request waits for; the first is written at once, and
    those that end within the writer's linger after it share the next one."""
    from django.db.backends.signals import connection_created

    from inference import requestlog

    # NOTE: longer than any of these requests takes on a loaded machine, so they all come
    # within it (0.25 s in production).
    monkeypatch.setattr(requestlog, "_LINGER_S", 3.0)
    opened: list[str] = []

    def count(sender, connection, **kwargs) -> None:
        import threading

        if threading.current_thread().name.startswith("request-log"):
            opened.append(connection.alias)

    connection_created.connect(count)
    try:
        ids = []
        for i in range(5):
            r = _post(api_server, tenant_key.key, "/v1/chat/completions", {
                "model": served_model, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"request {i}"}]})
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])
        logged = wait_for_logs(5)
    finally:
        connection_created.disconnect(count)
    assert sorted(entry.request_id for entry in logged) == sorted(ids)
    assert len(opened) == 2
