"""Metrics as an operator's Prometheus reads them from a running `atrium up`: every
process's endpoint printed at start, on loopback, and counting what users do."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Atrium, wait_for


def _endpoints(up: Atrium) -> dict[str, str]:
    found = dict(re.findall(r"^  (web|engine|worker) +(http://\S+/metrics)$", up.output, re.M))
    assert set(found) == {"web", "engine", "worker"}, up.output[-3000:]
    return found


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    reply = httpx.get(url, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def test_every_process_serves_metrics_on_loopback_and_they_count_requests(atrium: Atrium):
    urls = _endpoints(atrium)
    assert all(url.startswith("http://127.0.0.1:") for url in urls.values())
    web, engine = _scrape(urls["web"]), _scrape(urls["engine"])

    chunks = list(atrium.openai().chat.completions.create(
        model=atrium.model, stream=True, max_tokens=4,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "count me"}]))
    completion = chunks[-1].usage.completion_tokens
    with atrium.http(key="atr_not_a_key") as client:
        assert client.get("/v1/models").status_code == 401

    chat = {"endpoint": "chat", "model": atrium.model, "transport": "http", "status": "200"}

    def counted() -> dict | None:
        # NOTE: counted once the request's log entry is made, just after the stream ends.
        now = _scrape(urls["web"])
        before = _value(web, "atrium_inference_requests_total", **chat)
        return now if _value(now, "atrium_inference_requests_total", **chat) > before else None

    web_after = wait_for(counted, timeout=30, interval=0.5,
                         what="the web process to count the request")
    assert _value(web_after, "atrium_inference_tokens_total", model=atrium.model,
                  kind="completion") - _value(web, "atrium_inference_tokens_total",
                                              model=atrium.model, kind="completion") \
        == completion
    assert _value(web_after, "atrium_http_requests_total", route="v1/models", status="401") \
        == _value(web, "atrium_http_requests_total", route="v1/models", status="401") + 1
    assert _value(web_after, "atrium_tenant_requests_total", tenant="demo") > 0
    assert _value(web_after, "atrium_auth_seconds_count") > _value(web, "atrium_auth_seconds_count")
    assert _value(web_after, "atrium_admission_seconds_count") \
        > _value(web, "atrium_admission_seconds_count")
    assert ("atrium_open_streams", frozenset({("transport", "sse")})) in web_after
    # What the fleet's shared state says, read at the scrape.
    assert _value(web_after, "atrium_engines_alive") >= 1
    assert ("atrium_billing_dead_letters", frozenset()) in web_after
    assert ("atrium_celery_queue_depth", frozenset({("queue", "celery")})) in web_after

    # The engine, under vLLM's names (as of its next heartbeat).
    served = {"model_name": atrium.model}
    engine_after = wait_for(
        lambda: (now := _scrape(urls["engine"])) and _value(
            now, "vllm:request_success_total", **served) > _value(
            engine, "vllm:request_success_total", **served) and now,
        timeout=30, interval=0.5, what="the engine's metrics to count the request")
    assert _value(engine_after, "vllm:generation_tokens_total", **served) \
        - _value(engine, "vllm:generation_tokens_total", **served) >= completion
    assert _value(engine_after, "vllm:request_success_total", **served) \
        > _value(engine, "vllm:request_success_total", **served)
    assert _value(engine_after, "vllm:time_to_first_token_seconds_count", **served) \
        > _value(engine, "vllm:time_to_first_token_seconds_count", **served)
    assert any(name == "vllm:kv_cache_usage_perc" and dict(labels)["model_name"] == atrium.model
               and dict(labels)["engine"] for name, labels in engine_after)

    # The Celery worker's child process wrote the request's usage to the ledger.
    wait_for(lambda: _value(_scrape(urls["worker"]), "atrium_billing_usage_events_total",
                            outcome="written") > 0,
             timeout=60, interval=0.5, what="the worker to count the usage it ingested")
