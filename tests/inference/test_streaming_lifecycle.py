"""Cancellation, disconnects, deadlines and dead engines, observed on the engine's side."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from django.conf import settings

from engine import protocol
from tests.inference.slow_engine import slow_factory
from tests.live import queued_requests, start_engine
from tests.waiting import wait_for

MAX_TOKENS = 400


@pytest.fixture
def slow_engine(served_model, tiny_model_path, redis_client):
    running = start_engine(tiny_model_path, served_model, "slow-engine",
                           engine_factory=slow_factory(0.03))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def _usage_report(redis_client, request_id: str) -> protocol.UsageReport:
    """The engine's own account of a request it settled (its final event's usage)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        for _, fields in (entry for stream in protocol.usage_streams(redis_client)
                          for entry in redis_client.xrange(stream)):
            report = protocol.UsageReport.decode(fields)
            if report.request_id == request_id:
                return report
        time.sleep(0.05)
    raise AssertionError(f"the engine never reported the usage of {request_id}")


def test_client_disconnect_stops_the_engine_within_a_few_tokens(
        api_server, tenant_key, served_model, slow_engine, redis_client):
    received = 0
    with httpx.stream("POST", f"{api_server}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {tenant_key.key}"},
                      json={"model": served_model, "stream": True, "max_tokens": MAX_TOKENS,
                            "messages": [{"role": "user", "content": "Go on and on"}]}) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                received += bool(delta.get("content"))
            if received >= 3:
                break
    report = _usage_report(redis_client, request_id)
    assert report.finish_reason == protocol.FINISH_CANCELLED
    generated = report.usage["completion_tokens"]
    assert received <= generated <= received + 10, generated


def test_websocket_runs_two_requests_and_cancels_one(
        api_server, tenant_key, served_model, slow_engine, redis_client):
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    body = {"model": served_model, "messages": [{"role": "user", "content": "Hi"}]}
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"},
                 open_timeout=10) as ws:
        ws.send(json.dumps({"type": "request", "id": "a", "endpoint": "chat.completions",
                            "body": {**body, "max_tokens": 6}}))
        ws.send(json.dumps({"type": "request", "id": "b", "endpoint": "chat.completions",
                            "body": {**body, "max_tokens": MAX_TOKENS}}))
        seen: dict[str, list[dict]] = {"a": [], "b": []}
        ends: dict[str, str] = {}
        b_request_id = None
        b_chunks_before_a_ended = None
        while len(ends) < 2:
            message = json.loads(ws.recv(timeout=30))
            cid = message["id"]
            if cid == "a" and message["type"] != "chunk":
                b_chunks_before_a_ended = len(seen["b"])
            if message["type"] == "chunk":
                seen[cid].append(message["data"])
                if cid == "b":
                    b_request_id = message["data"]["id"]
                    if len(seen["b"]) == 3:
                        ws.send(json.dumps({"type": "cancel", "id": "b"}))
            else:
                ends[cid] = message["type"]
    assert ends == {"a": "done", "b": "cancelled"}
    assert b_chunks_before_a_ended >= 2  # both generated at once, in one engine batch
    assert seen["a"][-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in seen["a"] + seen["b"])
    report = _usage_report(redis_client, b_request_id)
    assert report.finish_reason == protocol.FINISH_CANCELLED
    assert report.usage["completion_tokens"] < 20


def test_websocket_refuses_a_bad_key_with_an_error(api_server, served_model):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": "Bearer nope"}) as ws:
        message = json.loads(ws.recv(timeout=10))
        assert message["type"] == "error" and message["status"] == 401
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert ws.close_code == 4401


def test_websocket_refuses_a_foreign_origin(api_server, tenant_key):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with pytest.raises(InvalidStatus) as err:
        connect(url, origin="https://evil.example",
                additional_headers={"Authorization": f"Bearer {tenant_key.key}"})
    assert err.value.response.status_code == 403


def test_a_websocket_message_over_the_body_limit_closes_the_socket(api_server, tenant_key,
                                                                   settings):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"},
                 max_size=None) as ws:
        ws.send("x" * (settings.ATRIUM_MAX_BODY_BYTES + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big


def test_websocket_reports_bad_requests_per_id(api_server, tenant_key, served_model,
                                               engine_worker):
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"}) as ws:
        for junk in ("not json", "[" * 100_000 + "]" * 100_000):
            ws.send(junk)
            assert json.loads(ws.recv(timeout=10))["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "request", "id": "x", "endpoint": "chat.completions",
                            "body": {"model": "nope", "messages": []}}))
        message = json.loads(ws.recv(timeout=10))
        assert (message["id"], message["status"]) == ("x", 400)
        for bad, param in (({"type": "request", "id": ""}, "id"),
                           ({"type": "poke", "id": "y"}, "type"),
                           ({"type": "request", "id": "z", "endpoint": ["chat"]}, "endpoint")):
            ws.send(json.dumps(bad))
            error = json.loads(ws.recv(timeout=10))["error"]
            assert (error["param"], error["code"]) == (param, "invalid_value")
        # None of that cost the socket: a good request still runs on it.
        ws.send(json.dumps({"type": "request", "id": "ok", "endpoint": "completions",
                            "body": {"model": served_model, "prompt": "hi", "max_tokens": 2}}))
        while (message := json.loads(ws.recv(timeout=30)))["type"] == "chunk":
            pass
        assert (message["type"], message["id"]) == ("done", "ok")


def test_deadline_gives_504_and_stops_the_engine(api_server, tenant_key, served_model,
                                                 slow_engine, redis_client, settings):
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    client = openai.OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=served_model, prompt="slow", max_tokens=MAX_TOKENS)
    assert err.value.status_code == 504
    assert err.value.body["code"] == "timeout"
    assert time.monotonic() - started < 5
    wait_for(lambda: queued_requests(redis_client, served_model) == 0, timeout=10,
             what="the timed-out request to leave the engines' streams")


def test_deadline_mid_stream_ends_the_stream_with_an_error(api_server, tenant_key,
                                                           served_model, slow_engine, settings):
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    client = openai.OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0)
    stream = client.completions.create(model=served_model, prompt="slow", stream=True,
                                       max_tokens=MAX_TOKENS)
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "deadline" in str(err.value)


def test_engine_killed_mid_request_does_not_leave_the_client_hanging(
        api_server, tenant_key, served_model, tiny_model_path, redis_client):
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL}
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine.worker", "--redis-url", settings.REDIS_URL,
         "--model-dir", str(tiny_model_path), "--model-name", served_model,
         "--engine-id", "doomed"], env=env)
    try:
        deadline = time.time() + 60
        while redis_client.zscore(protocol.ENGINES_ZSET, "doomed") is None:
            assert time.time() < deadline and engine.poll() is None
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key,
                               max_retries=0, timeout=60)
        stream = client.completions.create(model=served_model, prompt="The end", stream=True,
                                           max_tokens=1500)
        started = None
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                if started is None:
                    engine.send_signal(signal.SIGKILL)
                    started = time.monotonic()
        assert started is not None, "the engine finished before it could be killed"
        assert "stopped responding" in str(err.value)
        assert time.monotonic() - started < protocol.HEARTBEAT_TTL_S + 3
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait()


class _CountingEngine:
    """The slow engine, tallying every token its steps generate, per request: the count
    the engine itself made, independent of any report."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.generated: dict[str, int] = {}

    def step(self):
        outputs = self.inner.step()
        for out in outputs:
            if out is not None:
                self.generated[out.request_id] = (self.generated.get(out.request_id, 0)
                                                  + len(out.token_ids))
        return outputs

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counting_engine(served_model, tiny_model_path, redis_client):
    engines: list[_CountingEngine] = []

    def factory(model_dir):
        engines.append(_CountingEngine(slow_factory(0.03)(model_dir)))
        return engines[-1]

    running = start_engine(tiny_model_path, served_model, "counting-engine",
                           engine_factory=factory)
    yield engines[0]
    running.stop.set()
    running.thread.join(timeout=30)


def _ledger_row(redis_client, request_id: str):
    from billing.ingest import drain
    from billing.models import UsageRecord

    deadline = time.time() + 15
    while True:
        drain(redis_client)
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row is not None or time.time() > deadline:
            assert row is not None, "the usage report never reached the ledger"
            return row
        time.sleep(0.1)


def _cancel_over_websocket(api_server, key, body) -> tuple[str, int]:
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"},
                 open_timeout=10) as ws:
        ws.send(json.dumps({"type": "request", "id": "c", "endpoint": "chat.completions",
                            "body": body}))
        delivered, response_id = 0, None
        while True:
            message = json.loads(ws.recv(timeout=30))
            if message["type"] != "chunk":
                break
            response_id = message["data"]["id"]
            delivered += bool(message["data"]["choices"][0]["delta"].get("content"))
            if delivered == 3:
                ws.send(json.dumps({"type": "cancel", "id": "c"}))
    assert message["type"] == "cancelled"
    return response_id, delivered


def _cancel_and_hang_up_over_websocket(api_server, key, body) -> tuple[str, int]:
    """A cancel, and the socket closed at once: the request's cleanup is cancelled twice."""
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"},
                 open_timeout=10) as ws:
        ws.send(json.dumps({"type": "request", "id": "c", "endpoint": "chat.completions",
                            "body": body}))
        delivered = 0
        while delivered < 3:
            message = json.loads(ws.recv(timeout=30))
            delivered += bool(message["data"]["choices"][0]["delta"].get("content"))
        ws.send(json.dumps({"type": "cancel", "id": "c"}))
    return message["data"]["id"], delivered


def _disconnect_over_sse(api_server, key, body) -> tuple[str, int]:
    delivered = 0
    with httpx.stream("POST", f"{api_server}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                delivered += bool(chunk["choices"][0]["delta"].get("content"))
            if delivered == 3:
                break
    return chunk["id"], delivered


@pytest.mark.parametrize("cancel", [_cancel_over_websocket, _cancel_and_hang_up_over_websocket,
                                    _disconnect_over_sse],
                         ids=["websocket cancel", "websocket cancel and close", "sse disconnect"])
def test_a_request_cut_short_has_one_token_count_in_its_log_and_the_ledger(
        api_server, tenant_key, served_model, counting_engine, redis_client, cancel):
    from tests.requestlogs.conftest import wait_for_logs

    response_id, delivered = cancel(api_server, tenant_key.key, {
        "model": served_model, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "On and on"}]})
    report = _usage_report(redis_client, response_id)
    [log] = wait_for_logs(1)
    ledger = _ledger_row(redis_client, response_id)
    made = counting_engine.generated[response_id]
    assert report.finish_reason == protocol.FINISH_CANCELLED and made >= delivered
    assert (log.request_id, log.status) == (response_id, 499)
    assert log.completion_tokens == ledger.completion_tokens == made
    assert report.usage["completion_tokens"] == made
    assert log.prompt_tokens == ledger.prompt_tokens == report.usage["prompt_tokens"] > 0
