"""Keys, quotas and priority on the live inference API, seen through the `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from django.conf import settings

from engine import protocol
from inference import admission as quota
from tests.factories import key_factory, plan_factory, tenant_factory
from tests.inference.slow_engine import slow_factory
from tests.live import free_port, queued_requests, start_engine
from tests.waiting import wait_for

RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")


@dataclass
class Caller:
    tenant_id: int
    key_id: int
    key: str
    tenant: object


def make_caller(slug: str | None = None, *, scopes=("inference",), **plan) -> Caller:
    tenant = tenant_factory(slug, plan=plan_factory(**plan))
    key = key_factory(tenant, scopes=scopes)
    return Caller(tenant_id=tenant.pk, key_id=key.id, key=key.plaintext, tenant=tenant)


def client_for(api_server: str, caller: Caller) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server}/v1", api_key=caller.key, max_retries=0,
                         timeout=60)


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def post(api_server: str, caller: Caller, body: dict, path="/v1/chat/completions",
         timeout: float = 30):
    return httpx.post(f"{api_server}{path}", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {caller.key}"})


def tokens_held(redis_client, caller: Caller, limit: int) -> float:
    """Tokens the tenant's tokens/min bucket is holding right now."""
    tat = redis_client.get(quota.quota_key(caller.tenant_id, "tpm"))
    if tat is None:
        return 0.0
    return max(0.0, float(tat) - time.time() * 1000) / (60_000 / limit)


def in_flight(redis_client, caller: Caller) -> int:
    return redis_client.zcard(quota.quota_key(caller.tenant_id, "inflight"))


@pytest.fixture
def slow_engine(served_model, tiny_model_path, redis_client):
    running = start_engine(tiny_model_path, served_model, "slow-engine",
                           engine_factory=slow_factory(0.03))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


# --- headers and 429s ----------------------------------------------------------------------

def test_every_inference_response_carries_rate_limit_headers(api_server, served_model,
                                                             engine_worker):
    caller = make_caller(requests_per_minute=100, tokens_per_minute=50_000)
    client = client_for(api_server, caller)
    raw = client.completions.with_raw_response.create(model=served_model, prompt="Hi",
                                                      max_tokens=4)
    assert raw.parse().choices[0].text is not None
    for name in RATE_HEADERS:
        assert raw.headers[name], name
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert raw.headers["x-ratelimit-remaining-requests"] == "99"
    assert raw.headers["x-ratelimit-limit-tokens"] == "50000"
    streamed = client.chat.completions.with_raw_response.create(
        **chat(served_model, max_tokens=4, stream=True))
    assert streamed.headers["x-ratelimit-remaining-requests"] == "98"
    assert all(streamed.headers.get(name) for name in RATE_HEADERS)
    assert list(streamed.parse())


@pytest.mark.parametrize("body, status", [
    ({"messages": [{"role": ["user"], "content": "x"}]}, 400),
    ({"model": "no-such-model"}, 404),
    ({"max_tokens": 10**9}, 400),
])
def test_a_refusal_after_authentication_carries_the_keys_rate_limits_and_an_id(
        api_server, served_model, body, status):
    caller = make_caller(requests_per_minute=100, tokens_per_minute=50_000)
    answer = post(api_server, caller, {**chat(served_model), **body})
    assert answer.status_code == status, answer.text
    assert answer.headers["x-request-id"]
    for name in RATE_HEADERS:
        assert answer.headers[name], name
    assert answer.headers["x-ratelimit-limit-requests"] == "100"


def test_over_the_request_limit_is_429_with_retry_after_in_openais_shape(
        api_server, served_model, redis_client):
    caller = make_caller(requests_per_minute=2)
    client = client_for(api_server, caller)
    for remaining in ("1", "0"):
        # No engine is up: admitted requests are 503s, and still carry the headers.
        with pytest.raises(openai.APIStatusError) as unavailable:
            client.chat.completions.create(**chat(served_model, max_tokens=2))
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["x-ratelimit-remaining-requests"] == remaining
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**chat(served_model, max_tokens=2))
    error = refused.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded" and error.type == "requests"
    assert "requests per minute" in error.message
    headers = error.response.headers
    assert 1 <= int(headers["retry-after"]) <= 30
    assert int(headers["retry-after-ms"]) > 0
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert queued_requests(redis_client, served_model) == 0
    # Refused before its prompt is read: a body that would be a 400 once tokenized (ids
    # past the vocabulary) is still a 429, so a refused caller spends no parsing.
    refused = post(api_server, caller, {"model": served_model, "prompt": [10**9] * 50_000,
                                        "max_tokens": 2}, path="/v1/completions")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_spent_monthly_cap_is_insufficient_quota(api_server, served_model):
    caller = make_caller(monthly_token_cap=30)
    client = client_for(api_server, caller)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=served_model, prompt="Hello", max_tokens=40)
    assert refused.value.code == "insufficient_quota"
    assert refused.value.type == "insufficient_quota"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert int(refused.value.response.headers["retry-after"]) > 0


def test_plan_limits_on_prompt_and_output_length_are_400s(api_server, served_model,
                                                          redis_client):
    caller = make_caller(max_prompt_tokens=5, max_output_tokens=8)
    client = client_for(api_server, caller)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=served_model, prompt=[5] * 6, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=served_model, prompt=[5] * 5, max_tokens=9)
    assert (too_many.value.code, too_many.value.param) == ("invalid_value", "max_tokens")
    assert "at most 8" in too_many.value.message
    assert in_flight(redis_client, caller) == 0


def test_a_burst_from_one_tenant_leaves_another_tenants_limits_alone(api_server, served_model):
    noisy = make_caller("noisy", requests_per_minute=5)
    quiet = make_caller("quiet", requests_per_minute=5)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: post(api_server, noisy, chat(served_model))
                                 .status_code, range(20)))
    assert statuses.count(429) == 15
    answers = [post(api_server, quiet, chat(served_model)) for _ in range(5)]
    assert [r.status_code for r in answers] == [503] * 5  # admitted; no engine is up
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "4"


# --- reservations come back ----------------------------------------------------------------

def test_reserved_tokens_come_back_when_the_client_disconnects(api_server, served_model,
                                                               slow_engine, redis_client):
    limit = 1000
    caller = make_caller(tokens_per_minute=limit)
    with httpx.stream("POST", f"{api_server}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {caller.key}"},
                      json=chat(served_model, stream=True, max_tokens=400)) as r:
        assert r.status_code == 200
        assert tokens_held(redis_client, caller, limit) > 300  # prompt + 400 reserved
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 4:
                break
    wait_for(lambda: in_flight(redis_client, caller) == 0)
    assert tokens_held(redis_client, caller, limit) < 100


def test_reserved_tokens_come_back_when_the_request_fails(api_server, served_model,
                                                          redis_client):
    limit = 1000
    caller = make_caller(tokens_per_minute=limit, max_concurrent_requests=1)
    for _ in range(3):  # one slot: each failure must have given it back
        r = post(api_server, caller, chat(served_model, max_tokens=400))
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert in_flight(redis_client, caller) == 0
    assert tokens_held(redis_client, caller, limit) < 10


def test_reserved_tokens_come_back_after_a_deadline(api_server, served_model, slow_engine,
                                                    redis_client, settings):
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    limit = 1000
    caller = make_caller(tokens_per_minute=limit)
    r = post(api_server, caller, chat(served_model, max_tokens=400))
    assert r.status_code == 504
    assert r.headers["x-ratelimit-limit-tokens"] == str(limit)
    wait_for(lambda: in_flight(redis_client, caller) == 0)
    assert tokens_held(redis_client, caller, limit) < 100


def test_settled_use_is_what_the_engine_reported(api_server, served_model, engine_worker,
                                                 redis_client):
    probe = client_for(api_server, make_caller())
    greedy = dict(model=served_model, prompt="The sea", temperature=0)
    free = probe.completions.create(**greedy, max_tokens=24).choices[0].text
    assert len(free) >= 6, f"the test model must produce some text, got {free!r}"
    limit = 600  # refills 10 tokens a second
    caller = make_caller(tokens_per_minute=limit)
    started = time.monotonic()
    # Reserves prompt + 500; a stop string ends it within the first 24 tokens.
    res = client_for(api_server, caller).completions.create(**greedy, max_tokens=500,
                                                            stop=[free[3:6]])
    refilled = 10 * (time.monotonic() - started)
    held = tokens_held(redis_client, caller, limit)
    assert res.usage.total_tokens < 100
    assert res.usage.total_tokens - refilled - 2 <= held <= res.usage.total_tokens + 2


# --- keys on the hot path ------------------------------------------------------------------

def test_revocation_is_immediate_although_the_key_is_cached(api_server, served_model):
    from tenants.services import api_key_revoke

    caller = make_caller()
    assert post(api_server, caller, chat(served_model)).status_code == 503  # authenticated
    api_key_revoke(tenant=caller.tenant, key_id=caller.key_id)
    r = post(api_server, caller, chat(served_model))
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


def test_a_key_rotated_past_its_grace_is_refused_and_its_successor_works(api_server,
                                                                         served_model):
    from tenants.services import api_key_rotate

    caller = make_caller()
    assert post(api_server, caller, chat(served_model)).status_code == 503
    _, successor = api_key_rotate(tenant=caller.tenant, key_id=caller.key_id, grace_seconds=0)
    r = post(api_server, caller, chat(served_model))
    assert r.status_code == 401 and "rotated" in r.json()["error"]["message"]
    caller.key = successor
    assert post(api_server, caller, chat(served_model)).status_code == 503


def test_a_key_without_the_inference_scope_is_403(api_server, served_model):
    caller = make_caller(scopes=("admin", "usage"))
    for path, body in (("/v1/chat/completions", chat(served_model)), ("/v1/models", None)):
        r = (post(api_server, caller, body, path) if body else
             httpx.get(f"{api_server}{path}", headers={"Authorization": f"Bearer {caller.key}"}))
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


def test_an_expired_key_is_401(api_server, served_model):
    from django.utils import timezone

    from tenants.access import SYSTEM
    from tenants.models import ApiKey
    from tenants.services import api_key_update

    caller = make_caller()
    soon = timezone.now() + timezone.timedelta(seconds=1)
    api_key_update(tenant=caller.tenant, key_id=caller.key_id, actor=SYSTEM, expires_at=soon)
    assert post(api_server, caller, chat(served_model)).status_code == 503
    time.sleep(max(0.0, (soon - timezone.now()).total_seconds()) + 0.05)
    r = post(api_server, caller, chat(served_model))
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    assert ApiKey.objects.get(pk=caller.key_id).revoked_at is None


def test_use_is_recorded_on_the_key(api_server, served_model):
    from tenants.models import ApiKey

    caller = make_caller()
    post(api_server, caller, chat(served_model))
    wait_for(lambda: ApiKey.objects.get(pk=caller.key_id).last_used_at is not None,
             timeout=5, what="the key's last use to be written")


def test_redis_down_is_503_never_allow(api_server, served_model, settings):
    from core import redis as core_redis

    caller = make_caller()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    core_redis._async_clients.clear()
    r = post(api_server, caller, chat(served_model))
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "service_unavailable"


# --- priority and the websocket ------------------------------------------------------------

def test_the_plans_priority_travels_with_the_request(api_server, served_model, redis_client):
    caller = make_caller(priority=1)
    # A heartbeat with no engine behind it: the request is queued and stays there.
    beat = protocol.EngineHeartbeat(engine_id="ghost", model=served_model,
                                    started_at=time.time(), sent_at=time.time() + 30)
    redis_client.zadd(protocol.ENGINES_ZSET, {"ghost": beat.sent_at})
    redis_client.set(protocol.engine_key("ghost"), beat.encode())

    def send() -> None:
        try:
            post(api_server, caller, chat(served_model, max_tokens=2), timeout=2)
        except httpx.ReadTimeout:
            pass  # nobody will answer it; the server cancels it when we hang up

    sender = threading.Thread(target=send)
    sender.start()
    stream = protocol.request_stream(served_model)
    wait_for(lambda: redis_client.xlen(stream) > 0, timeout=5)
    _, fields = redis_client.xrange(stream)[0]
    request = protocol.EngineRequest.decode(fields)
    sender.join()
    assert request.priority == 1
    assert request.tenant_id == str(caller.tenant_id)


def test_websocket_requests_are_admitted_and_refused_like_http(api_server, served_model):
    from websockets.sync.client import connect

    caller = make_caller(requests_per_minute=1)
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {caller.key}"}) as ws:
        for client_id in ("a", "b"):
            ws.send(json.dumps({"type": "request", "id": client_id,
                                "endpoint": "chat.completions", "body": chat(served_model)}))
            message = json.loads(ws.recv(timeout=10))
            assert message["type"] == "error" and message["id"] == client_id
            if client_id == "a":
                assert message["status"] == 503  # admitted; no engine is up
            else:
                assert message["status"] == 429
                assert message["error"]["code"] == "rate_limit_exceeded"
                assert int(message["headers"]["retry-after"]) >= 1


def test_a_key_revoked_while_its_socket_is_open_stops_working(api_server, served_model):
    from websockets.sync.client import connect

    from tenants.services import api_key_revoke

    caller = make_caller()
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {caller.key}"}) as ws:
        api_key_revoke(tenant=caller.tenant, key_id=caller.key_id)
        ws.send(json.dumps({"type": "request", "id": "x", "endpoint": "chat.completions",
                            "body": chat(served_model)}))
        message = json.loads(ws.recv(timeout=10))
        assert (message["type"], message["status"]) == ("error", 401)


# --- several web processes -----------------------------------------------------------------

def _web_process(port: int, model_dir) -> subprocess.Popen:
    from django.db import connection

    db = connection.settings_dict
    # The test database, committed to (transactional_db): PostgreSQL, or the SQLite file.
    url = (f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
           if connection.vendor == "postgresql" else f"sqlite:///{db['NAME']}")
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "ATRIUM_MODEL": str(model_dir),
           "ATRIUM_MODEL_NAME": "tiny-llama", "DATABASE_URL": url}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "atrium.asgi:application", "--port", str(port),
         "--log-level", "warning", "--lifespan", "off"], env=env)


def test_web_processes_share_one_set_of_limits(transactional_db, served_model, tiny_model_path,
                                               redis_client):
    caller = make_caller(requests_per_minute=10)
    ports = [free_port(), free_port()]
    servers = [_web_process(port, tiny_model_path) for port in ports]
    try:
        for port in ports:
            wait_for(lambda p=port: _up(p), timeout=30, what="the web process")
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(
                lambda i: post(f"http://127.0.0.1:{ports[i % 2]}", caller,
                               chat(served_model)).status_code, range(30)))
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=10)
    assert statuses.count(503) == 10 and statuses.count(429) == 20, statuses


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/livez", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_choice_counts_toward_the_token_limit(api_server, served_model):
    caller = make_caller(tokens_per_minute=1000)
    # The prompt and 4 choices of 300 cannot fit in 1000 tokens; one choice can.
    refused = post(api_server, caller, chat(served_model, max_tokens=300, n=4))
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    admitted = post(api_server, caller, chat(served_model, max_tokens=300, n=1))
    assert admitted.status_code == 503  # admitted; no engine is up
