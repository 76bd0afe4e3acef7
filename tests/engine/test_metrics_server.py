"""The engine's metrics endpoint: loopback unless an operator says otherwise, and what a
Prometheus scraper reads there (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from engine_testing import make_request
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics_server import serve_metrics
from engine.options import add_engine_arguments


def _flags(monkeypatch, **env: str) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args([])


@contextmanager
def _served(latest: Callable[[], dict[str, Any] | None], *, model_name: str = "tiny",
            engine: str = "e1", health: Callable[[], tuple[bool, bool]] = lambda: (True, True)
            ) -> Iterator[int]:
    server = serve_metrics(latest, health, port=0, model_name=model_name, engine=engine)
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain;")
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_metrics_listen_on_loopback_by_default(monkeypatch):
    monkeypatch.delenv("ATRIUM_METRICS_HOST", raising=False)
    assert _flags(monkeypatch).metrics_host == "127.0.0.1"
    server = serve_metrics(lambda: None, lambda: (True, True), port=0, model_name="tiny",
                           engine="e1")
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("live, ready", [(True, True), (True, False), (False, False)])
def test_the_probes_answer_what_the_worker_says_of_its_health(live, ready):
    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    with _served(lambda: None, health=lambda: (live, ready)) as port:
        assert (status("/livez"), status("/readyz")) == (200 if live else 503,
                                                         200 if ready else 503)
        assert status("/nothing") == 404


def test_an_operator_may_open_metrics_to_other_hosts(monkeypatch):
    assert _flags(monkeypatch, ATRIUM_METRICS_HOST="0.0.0.0").metrics_host == "0.0.0.0"


def test_served_counters_move_when_the_engine_serves_a_request(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    latest = {"snapshot": engine.snapshot()}  # what the worker's heartbeat replaces
    with _served(lambda: latest["snapshot"], model_name="tiny", engine="e1") as port:
        before = _scrape(port)
        engine.add_request(make_request([11, 12, 13, 14, 15], max_tokens=4, ignore_eos=True))
        engine.step()
        latest["snapshot"] = engine.snapshot()
        during = _scrape(port)
        began = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        stepping = time.perf_counter() - began
        latest["snapshot"] = engine.snapshot()
        after = _scrape(port)
    # vLLM's names and labels: what dashboards and the inference extension read.
    assert all(s.labels.items() >= {"model_name": "tiny", "engine": "e1"}.items()
               for s in after)
    assert _value(during, "vllm:num_requests_running") == 1
    assert _value(during, "vllm:num_requests_waiting") == 0
    assert 0 < _value(during, "vllm:kv_cache_usage_perc") <= 1
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:kv_cache_usage_perc") == 0
    assert _value(before, "vllm:generation_tokens_total") == 0
    assert _value(after, "vllm:generation_tokens_total") == 4
    assert _value(before, "vllm:prompt_tokens_total") == 0
    assert _value(after, "vllm:prompt_tokens_total") == 5
    assert _value(after, "vllm:prefix_cache_queries_total") == 5
    assert _value(after, "vllm:prefix_cache_hits_total") == 0
    assert _value(after, "vllm:num_preemptions_total") == 0
    assert _value(before, "vllm:request_success_total", finished_reason="length") is None
    assert _value(after, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(before, "vllm:time_to_first_token_seconds_count") == 0
    assert _value(after, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(after, "vllm:inter_token_latency_seconds_bucket", le="+Inf") == 3
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert _value(during, f"{name}_count") == 0
        assert _value(after, f"{name}_count") == 1
    e2e, queue, ttft = (_value(after, f"{name}_sum") for name in (
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:time_to_first_token_seconds"))
    assert 0 <= queue <= ttft <= e2e
    assert _value(after, "atrium_engine_steps_total") == 4
    # The step's breakdown: each phase of the engine's own, and no more time than it took.
    phase = "atrium_engine_step_phase_seconds_total"
    for name in ("admit", "schedule", "inputs", "forward", "sample", "postprocess"):
        assert _value(during, phase, phase=name) > 0, name
        assert _value(after, phase, phase=name) > _value(during, phase, phase=name), name
    assert _value(after, phase, phase="draft") is None  # no draft model: no such phase
    assert 0 < sum(s.value for s in after if s.name == phase) \
        - sum(s.value for s in during if s.name == phase) <= stepping
    # An engine without LoRA says nothing of adapters.
    assert _value(after, "vllm:lora_requests_info") is None


def test_each_engine_in_a_process_exports_only_its_own_metrics(tiny_model_dir):
    snapshot = LLMEngine(EngineConfig(model_dir=tiny_model_dir)).snapshot()
    with (_served(lambda: snapshot, model_name="tiny", engine="e1") as port_1,
          _served(lambda: snapshot, model_name="tiny", engine="e2") as port_2):
        for port, engine_id in ((port_1, "e1"), (port_2, "e2")):
            samples = _scrape(port)
            assert samples and {s.labels["engine"] for s in samples} == {engine_id}


def test_metrics_answer_503_until_the_first_heartbeat():
    with _served(lambda: None) as port, pytest.raises(urllib.error.HTTPError) as caught:
        _scrape(port)
    assert caught.value.code == 503
