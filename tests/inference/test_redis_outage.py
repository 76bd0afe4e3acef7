"""Redis dies mid-stream and comes back (issue 16, docs/protocol.md "When Redis is
unreachable"): against a real redis-server that the test kills with SIGKILL and restarts on
the same port, with and without persistence, under the real ASGI app and an engine.

What must hold: every in-flight SSE stream ends with an OpenAI-shaped error event (not a
cut connection) and every websocket stream with an error message; admission meanwhile
answers 503 with retry-after; once Redis is back, requests succeed with no process
restarted; no in-flight slot is left taken; the ledger bills what the engine generated,
never less than the client received.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import redis as redis_lib
from django.conf import settings

from inference import admission as quota
from tests.inference.slow_engine import slow_factory
from tests.live import start_engine
from tests.redis_server import RedisServer
from tests.waiting import heartbeat_since

SSE_STREAMS = 3
MAX_TOKENS = 300


@pytest.fixture(params=[False, True], ids=["no-persistence", "aof"])
def killable_redis(request, settings, tmp_path) -> Iterator[RedisServer]:
    from core import redis as core_redis

    server = RedisServer(tmp_path, persistent=request.param)
    server.start()
    settings.REDIS_URL = server.url
    core_redis.sync_client.cache_clear()
    core_redis._async_clients.clear()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.process.kill()
        server.process.wait(timeout=10)
    core_redis.sync_client.cache_clear()
    core_redis._async_clients.clear()


@dataclass
class StreamResult:
    chunks: int = 0
    ended: str = ""  # "done", or the error that ended it
    started: threading.Event = field(default_factory=threading.Event)
    ids: list[str] = field(default_factory=list)


def _sse(client: openai.OpenAI, model: str, result: StreamResult) -> None:
    try:
        stream = client.completions.create(model=model, prompt="hello", max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        for chunk in stream:
            result.ids.append(chunk.id)
            result.chunks += 1
            if result.chunks == 3:
                result.started.set()
        result.ended = "done"
    except openai.APIError as exc:
        result.ended = f"{type(exc).__name__}: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - a cut connection lands here: the failure mode
        result.ended = f"CUT {type(exc).__name__}: {exc}"
    finally:
        result.started.set()


def _ws(url: str, key: str, model: str, result: StreamResult, messages: list[dict]) -> None:
    from websockets.sync.client import connect

    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "w", "endpoint": "completions",
                            "body": {"model": model, "prompt": "hi", "max_tokens": MAX_TOKENS,
                                     "temperature": 0}}))
        while True:
            message = json.loads(ws.recv(timeout=60))
            messages.append(message)
            if message["type"] == "chunk":
                result.ids.append(message["data"]["id"])
                result.chunks += 1
                if result.chunks == 3:
                    result.started.set()
                continue
            result.ended = message["type"]
            result.started.set()
            return


def _first_success_after(api_server: str, key: str, model: str,
                         limit_s: float) -> tuple[float, list[str]]:
    """Seconds until a request succeeds again, and the error codes answered before that."""
    start, codes = time.monotonic(), []
    while time.monotonic() - start < limit_s:
        answer = httpx.post(f"{api_server}/v1/completions", timeout=30,
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": model, "prompt": "again", "max_tokens": 2})
        if answer.status_code == 200:
            return time.monotonic() - start, codes
        codes.append(answer.json()["error"]["code"])
        time.sleep(0.2)
    raise AssertionError(f"no success within {limit_s} s: {codes}")


def test_redis_killed_mid_stream_ends_every_stream_cleanly_and_recovers(
        killable_redis, api_server, served_model, tiny_model_path, tenant_key):
    engine = start_engine(tiny_model_path, served_model, "outage-engine",
                          engine_factory=slow_factory(0.05))
    try:
        client = openai.OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key,
                               max_retries=0, timeout=60)
        sse = [StreamResult() for _ in range(SSE_STREAMS)]
        ws_result, ws_messages = StreamResult(), []
        threads = [threading.Thread(target=_sse, args=(client, served_model, r))
                   for r in sse]
        threads.append(threading.Thread(target=_ws, args=(
            api_server.replace("http://", "ws://") + "/v1/stream", tenant_key.key,
            served_model, ws_result, ws_messages)))
        for t in threads:
            t.start()
        for r in [*sse, ws_result]:
            assert r.started.wait(30)

        killable_redis.kill()
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        ended_s = time.monotonic() - killed

        # Admission while Redis is away: 503, fail closed, retry-after, OpenAI's shape.
        refused = httpx.post(f"{api_server}/v1/completions", timeout=30,
                             headers={"Authorization": f"Bearer {tenant_key.key}"},
                             json={"model": served_model, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
        assert refused.json()["error"]["type"] == "server_error"

        killable_redis.start()
        recovered_s, codes = _first_success_after(api_server, tenant_key.key, served_model,
                                                  30)
        billed, generated = _billed_and_generated(tenant_key.tenant_id, "outage-engine",
                                                  [r.ids[0] for r in [*sse, ws_result]])
    finally:
        engine.stop.set()
        engine.thread.join(timeout=30)

    print(json.dumps({"persistent": killable_redis.persistent, "streams_ended_s": ended_s,
                      "recovered_s": recovered_s, "refused_while_recovering": codes,
                      "sse": [(r.chunks, r.ended) for r in sse],
                      "ws": (ws_result.chunks, ws_result.ended), "billed": billed,
                      "generated": generated}))
    for r in sse:
        assert r.ended.startswith("APIError: ") and "Redis is unreachable" in r.ended, r.ended
        assert 3 <= r.chunks < MAX_TOKENS
    assert ws_result.ended == "error"
    assert (ws_messages[-1]["status"], ws_messages[-1]["error"]["code"]) == \
        (503, "service_unavailable")
    assert ended_s < 10
    # Redis is back: the key cache and admission answer at once (pooled connections that
    # died with the old server are replaced); only the engine may take a heartbeat to
    # show up again.
    assert set(codes) <= {"engine_unavailable"}, codes

    # No slot outlives its request: whatever Redis kept, nothing is left in flight.
    live = redis_lib.Redis.from_url(settings.REDIS_URL)
    deadline = time.time() + 15
    while live.zcard(quota.quota_key(tenant_key.tenant_id, "inflight")) and \
            time.time() < deadline:
        time.sleep(0.2)
    assert live.zcard(quota.quota_key(tenant_key.tenant_id, "inflight")) == 0
    assert live.zcard(quota.quota_key(tenant_key.tenant_id, "inflight",
                                      api_key_id=tenant_key.key_id)) == 0

    # The ledger bills what the engine generated, and never less than a client received.
    for r in [*sse, ws_result]:
        assert billed[r.ids[0]] >= r.chunks, (billed, r.chunks)
    assert sum(billed.values()) == generated, (billed, generated)


def _billed_and_generated(tenant_id: int, engine_id: str,
                          cut: list[str]) -> tuple[dict[str, int], int]:
    """Completion tokens in the ledger by request, once the cut requests are in it, and the
    tokens the engine says it generated (its first heartbeat after they are)."""
    from billing.models import UsageRecord
    from billing.tasks import usage_ingest

    live = redis_lib.Redis.from_url(settings.REDIS_URL)
    deadline = time.time() + 20
    while True:
        usage_ingest()
        billed = dict(UsageRecord.objects.filter(tenant_id=tenant_id)
                      .values_list("request_id", "completion_tokens"))
        if set(cut) <= set(billed) or time.time() > deadline:
            break
        time.sleep(0.3)
    assert set(cut) <= set(billed), (cut, billed)
    beat = heartbeat_since(live, engine_id, since=time.time())
    return billed, beat.stats["tokens_generated"]
