"""What one web process takes on purpose: its open-request limit (503 with Retry-After,
logged) and SSE keep-alives while a stream waits, on the real ASGI app and a real engine
worker whose model is a clock (bench/paced_engine.py)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from bench.paced_engine import PacedEngine
from tests.live import start_engine


@pytest.fixture
def paced_engine(served_model, tiny_model_path, redis_client):
    """One token every two seconds: long waits between a stream's events."""
    running = start_engine(tiny_model_path, served_model, "paced-engine",
                           engine_factory=lambda _: PacedEngine(tokens_per_s=0.5))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


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
        with caplog.at_level(logging.WARNING, logger="inference.relay"):
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
