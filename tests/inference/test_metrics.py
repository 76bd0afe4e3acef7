"""The web tier's metrics (core/metrics.py) move with what the live API does."""

from __future__ import annotations

import time

import openai
import pytest
from prometheus_client import REGISTRY

from core import metrics
from tests.inference.test_rate_limits import chat, client_for, make_caller


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_refusal_is_counted_by_the_limit_that_refused_it(api_server, served_model,
                                                           redis_client):
    caller = make_caller(requests_per_minute=1)
    client = client_for(api_server, caller)
    no_engine = _value("atrium_admission_rejections_total", reason="no_engine", level="model")
    per_minute = _value("atrium_admission_rejections_total", reason="requests_per_minute",
                        level="tenant")
    with pytest.raises(openai.APIStatusError) as unavailable:  # no engine is up
        client.chat.completions.create(**chat(served_model, max_tokens=2))
    assert unavailable.value.status_code == 503
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**chat(served_model, max_tokens=2))
    assert _value("atrium_admission_rejections_total", reason="no_engine",
                  level="model") == no_engine + 1
    assert _value("atrium_admission_rejections_total", reason="requests_per_minute",
                  level="tenant") == per_minute + 1


def test_requests_and_tokens_are_counted_by_model_and_tenant(api_server, served_model,
                                                             engine_worker, monkeypatch):
    monkeypatch.setattr(metrics, "_tenants", set())  # earlier tests' tenants took the labels
    caller = make_caller()
    slug = caller.tenant.slug
    ok = {"endpoint": "chat", "model": served_model, "transport": "http", "status": "200"}
    before = _value("atrium_inference_requests_total", **ok)
    before_tenant = _value("atrium_tenant_tokens_total", tenant=slug, kind="completion")
    streams = _value("atrium_open_streams", transport="sse")
    client = client_for(api_server, caller)
    stream = client.chat.completions.create(**chat(
        served_model, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    next(stream)
    assert _value("atrium_open_streams", transport="sse") == streams + 1
    usage = list(stream)[-1].usage
    deadline = time.monotonic() + 10
    while _value("atrium_inference_requests_total", **ok) == before:
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.05)
    assert _value("atrium_inference_requests_total", **ok) == before + 1
    assert _value("atrium_tenant_tokens_total", tenant=slug, kind="completion") \
        == before_tenant + usage.completion_tokens
    # NOTE: the stream's slot is given back as its response closes, which may come just
    # after the run's end counted the request: waited for, not read at once.
    while _value("atrium_open_streams", transport="sse") != streams:
        assert time.monotonic() < deadline, "the stream was never closed"
        time.sleep(0.05)


def test_tenant_labels_stop_at_the_configured_number(monkeypatch):
    monkeypatch.setattr(metrics, "_tenants", set())
    monkeypatch.setenv("ATRIUM_METRICS_TENANTS", "2")
    assert [metrics.tenant_label(t) for t in ("a", "b", "c", "a", "d")] == \
        ["a", "b", "other", "a", "other"]
    monkeypatch.setattr(metrics, "_tenants", set())
    monkeypatch.setenv("ATRIUM_METRICS_TENANTS", "0")
    assert metrics.tenant_label("a") == "other"
