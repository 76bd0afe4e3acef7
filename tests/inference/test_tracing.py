"""One trace from the caller's traceparent through the web tier, across Redis, into the
engine, with the SDK's in-memory exporter."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import tracing
from tests.inference.test_rate_limits import make_caller

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)


def _wait_for(exporter: InMemorySpanExporter, *names: str) -> list:
    """The finished spans once every one of ``names`` is among them. NOTE: the web span
    ends when the request is logged, which may come after the engine's spans."""
    deadline = time.monotonic() + 20
    while not set(names) <= {s.name for s in exporter.get_finished_spans()}:
        assert time.monotonic() < deadline, [s.name for s in exporter.get_finished_spans()]
        time.sleep(0.05)
    return list(exporter.get_finished_spans())


def _described(finished: list) -> list:
    return [(s.name, dict(s.attributes or {})) for s in finished]


def test_one_trace_holds_the_web_request_and_the_engines_work(api_server, served_model,
                                                              engine_worker, spans):
    caller = make_caller()
    reply = httpx.post(f"{api_server}/v1/chat/completions", timeout=60, headers={
        "Authorization": f"Bearer {caller.key}",
        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}, json={
        "model": served_model, "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "trace me"}]})
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    finished = _wait_for(spans, "POST /v1/chat/completions", "engine.request")
    by_name = {s.name: s for s in finished}
    web, engine = by_name["POST /v1/chat/completions"], by_name["engine.request"]
    # Everything is in the caller's trace.
    assert {format(s.context.trace_id, "032x") for s in finished} == {CALLER_TRACE}
    assert format(web.parent.span_id, "016x") == CALLER_SPAN and web.parent.is_remote
    assert web.attributes["http.response.status_code"] == 200
    # NOTE: the spans in the message: CI once saw 1 here, not reproduced since.
    assert web.attributes["gen_ai.usage.output_tokens"] == 4, _described(finished)
    assert web.attributes["atrium.auth_ms"] > 0 and web.attributes["atrium.admission_ms"] > 0
    # The engine's spans hang from the web request, across Redis.
    assert engine.parent.span_id == web.context.span_id and engine.parent.is_remote
    assert engine.attributes["gen_ai.usage.output_tokens"] == 4, _described(finished)
    phases = [by_name[name] for name in ("engine.queue", "engine.prefill", "engine.decode")]
    assert all(p.parent.span_id == engine.context.span_id for p in phases)
    assert engine.start_time <= phases[0].start_time <= phases[1].start_time \
        <= phases[2].start_time <= phases[2].end_time <= engine.end_time


def test_without_a_callers_context_the_web_span_starts_a_trace(api_server, served_model,
                                                               engine_worker, spans):
    caller = make_caller()
    reply = httpx.post(f"{api_server}/v1/completions", timeout=60, headers={
        "Authorization": f"Bearer {caller.key}", "traceparent": "not a traceparent"},
        json={"model": served_model, "max_tokens": 2, "prompt": "hi"})
    assert reply.status_code == 200
    finished = _wait_for(spans, "POST /v1/completions", "engine.request")
    web = next(s for s in finished if s.name == "POST /v1/completions")
    assert web.parent is None
    assert next(s for s in finished if s.name == "engine.request").context.trace_id \
        == web.context.trace_id


def test_tracing_is_off_unless_an_endpoint_is_configured(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure_from_env("test") is False and not tracing.enabled()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.configure_from_env("test") is False and not tracing.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    try:
        assert tracing.configure_from_env("test") is True and tracing.enabled()
    finally:
        tracing.use_provider(None)


def _sampled(count: int, parent: dict | None = None) -> int:
    return sum(tracing.tracer().start_span("s", context=tracing.context_from(parent or {}))
               .is_recording() for _ in range(count))


def test_one_new_trace_in_ten_is_kept_unless_a_sampler_is_chosen(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    caller = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    try:
        assert tracing.configure_from_env("test")
        assert 50 < _sampled(1000) < 150  # 100 expected; 5 standard deviations either way
        assert _sampled(100, caller) == 100  # a sampled caller's trace is always followed
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        assert tracing.configure_from_env("test")
        assert _sampled(100) == 100
    finally:
        tracing.use_provider(None)
