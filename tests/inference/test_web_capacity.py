"""What one web process takes on purpose: its open-request limit (503 with Retry-After,
logged), SSE keep-alives while a stream waits, a client that stops reading cut; on the
real ASGI app and a real engine worker whose model is a clock (bench/paced_engine.py)."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading

import httpx
import pytest

from bench.paced_engine import PacedEngine
from tests.inference.test_streaming_lifecycle import _usage_report
from tests.live import start_engine


def _serving(model_path, model, engine_id, engine):
    """``engine`` under the real worker loop, until the test ends."""
    running = start_engine(model_path, model, engine_id, engine_factory=lambda _: engine)
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


@pytest.fixture
def paced_engine(served_model, tiny_model_path, redis_client):
    """One token every two seconds: long waits between a stream's events."""
    yield from _serving(tiny_model_path, served_model, "paced-engine",
                        PacedEngine(tokens_per_s=0.5))


def _stream(api_server, key, model, max_tokens):
    return httpx.stream("POST", f"{api_server}/v1/chat/completions", timeout=30,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": model, "stream": True, "max_tokens": max_tokens,
                              "messages": [{"role": "user", "content": "wait"}]})


def test_a_stream_waiting_for_tokens_gets_keep_alive_comments(
        settings, api_server, tenant_key, served_model, paced_engine):
    settings.ATRIUM_SSE_KEEPALIVE_S = 0.2
    with _stream(api_server, tenant_key.key, served_model, max_tokens=2) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    contents = [i for i, line in enumerate(lines) if line.startswith("data: {")
                and json.loads(line[6:])["choices"]
                and json.loads(line[6:])["choices"][0]["delta"].get("content")]
    assert len(contents) == 2 and lines[-1] == "data: [DONE]"
    # Two seconds between the tokens: comment lines kept the connection busy meanwhile.
    between = lines[contents[0] + 1:contents[1]]
    assert between and set(between) == {": keep-alive"}


def test_past_the_process_limit_a_request_gets_503_with_retry_after(
        settings, api_server, tenant_key, served_model, paced_engine, caplog):
    settings.ATRIUM_MAX_OPEN_REQUESTS = 2
    with _stream(api_server, tenant_key.key, served_model, 2) as first, \
            _stream(api_server, tenant_key.key, served_model, 2) as second:
        assert first.status_code == second.status_code == 200
        with caplog.at_level(logging.WARNING, logger="inference.event_hub"):
            refused = httpx.post(
                f"{api_server}/v1/chat/completions", timeout=30,
                headers={"Authorization": f"Bearer {tenant_key.key}"},
                json={"model": served_model, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "one more"}]})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert "ATRIUM_MAX_OPEN_REQUESTS" in caplog.text
        for response in (first, second):
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
    # The two ended: their places are free again.
    again = httpx.post(f"{api_server}/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {tenant_key.key}"},
                       json={"model": served_model, "max_tokens": 1,
                             "messages": [{"role": "user", "content": "now"}]})
    assert again.status_code == 200, again.text


class _BigChunks(PacedEngine):
    """4 KB a token: a client that does not read fills its connection's buffers fast."""

    def step(self):
        outputs = super().step()
        for out in outputs:
            out.text_delta = " " * 4000 + out.text_delta
        return outputs


@pytest.fixture
def fast_engine(served_model, tiny_model_path, redis_client):
    yield from _serving(tiny_model_path, served_model, "fast-engine",
                        _BigChunks(tokens_per_s=200))


def test_a_client_that_stops_reading_is_cut_and_its_work_stopped(
        settings, api_server, tenant_key, served_model, fast_engine, redis_client):
    settings.ATRIUM_STREAM_STALL_S = 1.0
    max_tokens = 2000  # ten seconds of tokens
    host, port = api_server.removeprefix("http://").split(":")
    body = json.dumps({"model": served_model, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "flood"}]}).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    stalled.connect((host, int(port)))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer " + tenant_key.key.encode() + b"\r\n"
                    b"Content-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = b""
    while b"\r\n\r\n" not in head:
        head += stalled.recv(1)
    request_id = re.search(rb"x-request-id: (\S+)", head, re.I).group(1).decode()
    # ... and then reads nothing. Another client's stream meanwhile is not held up.
    with _stream(api_server, tenant_key.key, served_model, max_tokens=20) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    # The stalled one was cut: its engine work stopped well before max_tokens (the
    # engine's own count, as billed), and its connection is closed before [DONE].
    report = _usage_report(redis_client, request_id)
    assert report.usage["completion_tokens"] < max_tokens, report.usage
    stalled.settimeout(30)
    received = b""
    try:
        while chunk := stalled.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # cut: what was buffered for it was dropped
    assert b"[DONE]" not in received
    stalled.close()


def test_inference_requests_start_no_thread_each(api_server, tenant_key, monkeypatch):
    """Django's per-request thread-sensitive context starts a thread for each request that
    calls anything thread-sensitive (its request_started receivers: all of them); the
    inference API's requests run outside it."""
    headers = {"Authorization": f"Bearer {tenant_key.key}"}
    with httpx.Client(base_url=api_server, headers=headers, timeout=30) as client:
        assert client.get("/v1/models").status_code == 200  # whatever starts once
        started = []
        real_start = threading.Thread.start

        def counting_start(thread):
            started.append(thread.name)
            return real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", counting_start)
        for _ in range(10):
            assert client.get("/v1/models").status_code == 200
    assert len(started) <= 2, started
