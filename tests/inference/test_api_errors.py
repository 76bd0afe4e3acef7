"""Bad input gets the right status and OpenAI error, and leaves nothing queued."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine import protocol
from tests.live import queued_requests


def _post(base: str, path: str, key: str | None, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{base}{path}", headers=headers, timeout=10, **kwargs)


def _assert_error(response: httpx.Response, status: int, code: str | None,
                  param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def _assert_nothing_queued(redis_client, model: str) -> None:
    assert queued_requests(redis_client, model) == 0
    assert list(redis_client.scan_iter(match=f"{protocol.KEY_PREFIX}:events:*")) == []


CHAT = "/v1/chat/completions"


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}


@pytest.mark.parametrize("header", [None, "Bearer", "Basic abc", "Bearer not-a-key",
                                    "Bearer atr_" + "x" * 36])
def test_missing_or_malformed_key_is_401(api_server, served_model, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.post(f"{api_server}{CHAT}", json=_chat(served_model), headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] in {"missing_api_key", "invalid_api_key"}


def test_well_formed_but_unknown_key_is_401(api_server, served_model, redis_client):
    from tenants import keys

    r = _post(api_server, CHAT, keys.generate().plaintext, json=_chat(served_model))
    _assert_error(r, 401, "invalid_api_key")
    _assert_nothing_queued(redis_client, served_model)


def test_revoked_key_is_401(api_server, served_model, tenant_key, engine_worker, redis_client):
    from tenants.models import Tenant
    from tenants.services import api_key_revoke

    ok = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model, max_tokens=2))
    assert ok.status_code == 200
    api_key_revoke(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), key_id=tenant_key.key_id)
    r = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model))
    _assert_error(r, 401, "invalid_api_key")
    _assert_nothing_queued(redis_client, served_model)


@pytest.mark.parametrize("body", [b'{"model": ', b"[" * 100_000 + b"]" * 100_000],
                         ids=["cut short", "nested past the recursion limit"])
def test_malformed_json_is_400(api_server, tenant_key, served_model, redis_client, body):
    r = _post(api_server, CHAT, tenant_key.key, content=body,
              headers={"Content-Type": "application/json"})
    _assert_error(r, 400, "invalid_json")
    _assert_nothing_queued(redis_client, served_model)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "tiny-llama"}, "messages"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
      "max_tokens": "many"}, "max_tokens"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
      "temperature": -1}, "temperature"),
])
def test_missing_or_wrong_typed_field_is_400(api_server, tenant_key, redis_client, body, param):
    r = _post(api_server, CHAT, tenant_key.key, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    _assert_nothing_queued(redis_client, "tiny-llama")


@pytest.mark.parametrize("user", ["\ud800", "a\nb", "x" * 257, "\x00", 7])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_hostile_end_user_is_a_400_naming_user_before_any_budget_reads_it(
        api_server, tenant_key, redis_client, user, path):
    body = _chat("tiny-llama", user=user) if path == CHAT else \
        {"model": "tiny-llama", "prompt": "hi", "user": user}
    # NOTE: json.dumps escapes a lone surrogate as \\ud800, as a client's JSON may hold it.
    r = _post(api_server, path, tenant_key.key, content=json.dumps(body),
              headers={"Content-Type": "application/json"})
    _assert_error(r, 400, "invalid_type" if user == 7 else "invalid_value", "user")
    _assert_nothing_queued(redis_client, "tiny-llama")
    assert list(redis_client.scan_iter(match="atrium:budget:*")) == []


def test_unknown_model_is_404(api_server, tenant_key, engine_worker, redis_client):
    r = _post(api_server, CHAT, tenant_key.key, json=_chat("gpt-17"))
    _assert_error(r, 404, "model_not_found", "model")
    _assert_nothing_queued(redis_client, "gpt-17")
    _assert_nothing_queued(redis_client, "tiny-llama")


def test_a_session_header_past_its_limit_is_400_and_queues_nothing(
        api_server, tenant_key, served_model, engine_worker, redis_client):
    r = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model, max_tokens=2),
              headers={"x-session-id": "s" * 257})
    _assert_error(r, 400, "invalid_value", "x-session-id")
    _assert_nothing_queued(redis_client, served_model)
    ok = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model, max_tokens=2),
               headers={"x-session-id": "s" * 256})
    assert ok.status_code == 200, ok.text


def test_max_tokens_beyond_the_server_limit_is_400(api_server, tenant_key, served_model,
                                                   redis_client, settings):
    r = _post(api_server, "/v1/completions", tenant_key.key,
              json={"model": served_model, "prompt": "hi",
                    "max_tokens": settings.ATRIUM_MAX_OUTPUT_TOKENS + 1})
    _assert_error(r, 400, "invalid_value", "max_tokens")
    _assert_nothing_queued(redis_client, served_model)


def test_prompt_beyond_the_context_window_is_400(api_server, tenant_key, served_model,
                                                 redis_client):
    from core.served_models import served_models

    window = served_models()[served_model].context_window
    r = _post(api_server, "/v1/completions", tenant_key.key,
              json={"model": served_model, "prompt": [5] * (window + 1), "max_tokens": 1})
    _assert_error(r, 400, "context_length_exceeded", "prompt")
    _assert_nothing_queued(redis_client, served_model)


def test_prompt_plus_max_tokens_beyond_the_window_is_400(api_server, tenant_key, served_model,
                                                         redis_client):
    from core.served_models import served_models

    window = served_models()[served_model].context_window
    r = _post(api_server, "/v1/completions", tenant_key.key,
              json={"model": served_model, "prompt": [5] * (window - 10), "max_tokens": 11})
    _assert_error(r, 400, "context_length_exceeded", "max_tokens")


def test_oversized_body_is_413(api_server, tenant_key, served_model, redis_client, settings):
    big = "a" * (settings.ATRIUM_MAX_BODY_BYTES + 1)
    r = _post(api_server, "/v1/completions", tenant_key.key,
              json={"model": served_model, "prompt": big})
    _assert_error(r, 413, "request_too_large")
    _assert_nothing_queued(redis_client, served_model)


def test_no_engine_is_503_within_a_second(api_server, tenant_key, served_model, redis_client):
    started = time.monotonic()
    r = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model, stream=True))
    elapsed = time.monotonic() - started
    _assert_error(r, 503, "engine_unavailable")
    assert elapsed < 1.0
    _assert_nothing_queued(redis_client, served_model)


def test_stale_heartbeat_counts_as_no_engine(api_server, tenant_key, served_model,
                                             redis_client):
    beat = protocol.EngineHeartbeat(engine_id="ghost", model=served_model,
                                    started_at=time.time() - 100, sent_at=time.time() - 60)
    redis_client.zadd(protocol.ENGINES_ZSET, {"ghost": beat.sent_at})
    redis_client.set(protocol.engine_key("ghost"), beat.encode())
    r = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model))
    _assert_error(r, 503, "engine_unavailable")


def test_an_engine_that_drains_takes_no_new_request(api_server, tenant_key, served_model,
                                                    redis_client):
    beat = protocol.EngineHeartbeat(engine_id="leaving", model=served_model,
                                    started_at=time.time() - 100, sent_at=time.time(),
                                    draining=True)
    redis_client.zadd(protocol.ENGINES_ZSET, {"leaving": beat.sent_at})
    redis_client.set(protocol.engine_key("leaving"), beat.encode())
    r = _post(api_server, CHAT, tenant_key.key, json=_chat(served_model))
    _assert_error(r, 503, "engine_unavailable")
    _assert_nothing_queued(redis_client, served_model)


def test_wrong_method_is_405(api_server, tenant_key):
    r = httpx.get(f"{api_server}{CHAT}", headers={"Authorization": f"Bearer {tenant_key.key}"})
    _assert_error(r, 405, "method_not_allowed")
