"""The operator's service-health page from the processes' own figures (the engines'
heartbeats, the web's counters) and when Prometheus does not answer. The page read from a
real Prometheus is in tests/e2e/test_dashboards.py."""

from __future__ import annotations

import re
import socket
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter

from billing.models import Price
from engine import protocol
from engine.metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S
from webui import health

MODEL = "tiny-llama"
RULES = Path(__file__).parents[2] / "deploy/observability/prometheus/atrium-rules.yml"


def _hist(buckets: tuple[float, ...], at: dict[float, int], over: int = 0) -> dict:
    """A heartbeat histogram with ``at[bound]`` observations in each bucket, ``over`` in +Inf."""
    counts = [at.get(b, 0) for b in buckets] + [over]
    return {"buckets": list(buckets), "counts": counts, "sum": 0.0, "count": sum(counts)}


def _beat(redis_client, engine_id: str, *, ttft: dict, itl: dict, prompt_tps: float,
          output_tps: float, model: str = MODEL) -> None:
    now = time.time()
    beat = protocol.EngineHeartbeat(
        engine_id=engine_id, model=model, started_at=now - 60, sent_at=now, stats={"engine": {
            "ttft": ttft, "itl": itl, "prompt_tokens_per_s": prompt_tps,
            "generation_tokens_per_s": output_tps}})
    redis_client.zadd(protocol.ENGINES_ZSET, {engine_id: now})
    redis_client.set(protocol.engine_key(engine_id), beat.encode(), ex=5)


def _page(user) -> tuple[int, str]:
    client = Client()
    client.force_login(user)
    reply = client.get(reverse("webui:op-health"))
    return reply.status_code, reply.content.decode()


def _cell(html: str, row: str, field: str) -> str:
    found = re.search(rf'<tr data-(?:model|objective)="{re.escape(row)}">.*?'
                      rf'data-field="{field}">(.*?)</td>', html, re.S)
    assert found, f"no {field} for {row}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _web_requests(monkeypatch, ok: int, failed: int) -> None:
    """This host's web counters as atrium_inference_requests would hold them."""
    registry = CollectorRegistry()
    requests = Counter("atrium_inference_requests", "", ["endpoint", "model", "transport",
                                                         "status"], registry=registry)
    requests.labels("chat", MODEL, "http", "200").inc(ok)
    requests.labels("chat", MODEL, "http", "503").inc(failed)
    monkeypatch.setattr(health.web_metrics, "registry", lambda: registry)


def test_quantiles_interpolate_within_their_bucket_as_prometheus_does():
    hist = _hist((0.1, 0.2, 0.4), {0.1: 50, 0.2: 50})
    assert health.quantile(hist, 0.5) == pytest.approx(0.1)
    assert health.quantile(hist, 0.95) == pytest.approx(0.19)  # 45 of the 50 in (0.1, 0.2]
    assert health.quantile(_hist((0.1, 0.2), {}, over=3), 0.95) == 0.2  # in +Inf: top bound
    assert health.quantile(_hist((0.1,), {}), 0.95) is None
    assert health.share_within(hist, 0.1) == 0.5
    assert health.share_within(hist, 0.15) is None  # not a bucket bound: not guessed


def test_histograms_with_other_buckets_are_not_summed_into_wrong_bounds():
    merged = health.merge_histograms([_hist((1.0, 2.0), {1.0: 2}), None,
                                      _hist((1.0, 2.0), {2.0: 2}), _hist((5.0,), {5.0: 9})])
    assert merged["counts"] == [2, 2, 0] and merged["count"] == 4


def test_the_page_shows_each_models_latency_throughput_price_and_cost(
        world, redis_client, settings, monkeypatch):
    settings.ATRIUM_PROMETHEUS_URL = ""
    settings.ATRIUM_ENGINE_HOUR_COST = Decimal("3.60")
    Price.objects.create(model=MODEL, input_per_million=Decimal("1.00"),
                         cached_input_per_million=Decimal("0.50"),
                         output_per_million=Decimal("3.00"),
                         effective_from=timezone.now() - timedelta(days=1))
    # 1,000 first tokens: 995 within 2.5 s (99.5%, half the 1% budget), 5 in 5 s.
    _beat(redis_client, "engine-a", ttft=_hist(TTFT_BUCKETS_S, {0.1: 600, 2.5: 95, 5.0: 5}),
          itl=_hist(ITL_BUCKETS_S, {0.01: 1000}), prompt_tps=400.0, output_tps=100.0)
    _beat(redis_client, "engine-b", ttft=_hist(TTFT_BUCKETS_S, {0.1: 300}),
          itl=_hist(ITL_BUCKETS_S, {0.01: 900, 0.025: 100}), prompt_tps=200.0, output_tps=300.0)
    _web_requests(monkeypatch, ok=9_995, failed=5)  # 99.95%: half the 0.1% budget

    status, html = _page(world.staff)

    assert status == 200
    assert "ATRIUM_PROMETHEUS_URL" in html and 'id="health-problem"' not in html
    assert _cell(html, MODEL, "engines") == "2"
    # TTFT p95: rank 950 of 1,000 falls in (1.0, 2.5] s, 900 below it and 95 in it.
    assert _cell(html, MODEL, "ttft") == "1.79 s"
    assert _cell(html, MODEL, "itl") == "10.0 ms"  # rank 1,900 of 2,000 tops (5, 10] ms
    assert _cell(html, MODEL, "prompt-tps") == "600.0"
    assert _cell(html, MODEL, "output-tps") == "400.0"
    assert _cell(html, MODEL, "price") == "1.00 / 3.00"
    assert _cell(html, MODEL, "billed") == "1.80"  # (600 x 1 + 400 x 3) / 1,000
    assert _cell(html, MODEL, "cost") == "2.00"  # 2 engines x 3.60 / 3,600 s / 1,000 tok/s
    assert _cell(html, "Availability", "good") == "99.950%"
    assert _cell(html, "Availability", "budget") == "50.0%"
    assert _cell(html, "Time to first token", "good") == "99.500%"
    assert _cell(html, "Time to first token", "budget") == "50.0%"
    assert _cell(html, "Time to first token", "status") == "met"


def test_a_spent_budget_and_a_model_without_price_or_hour_cost_say_so(
        world, redis_client, settings, monkeypatch):
    settings.ATRIUM_PROMETHEUS_URL = ""
    settings.ATRIUM_ENGINE_HOUR_COST = None
    _beat(redis_client, "engine-a", ttft=_hist(TTFT_BUCKETS_S, {0.1: 1}),
          itl=_hist(ITL_BUCKETS_S, {}), prompt_tps=0.0, output_tps=0.0, model="unpriced")
    _web_requests(monkeypatch, ok=90, failed=10)

    status, html = _page(world.staff)

    assert status == 200
    assert _cell(html, "unpriced", "price") == "no price"
    assert _cell(html, "unpriced", "billed") == "—" and _cell(html, "unpriced", "cost") == "—"
    assert _cell(html, "unpriced", "itl") == "—"  # no second token yet
    assert "needs <code>ATRIUM_ENGINE_HOUR_COST</code>" in html
    assert _cell(html, "Availability", "budget") == "none"
    assert _cell(html, "Availability", "status") == "budget spent"


def test_a_prometheus_that_does_not_answer_falls_back_and_says_why(
        world, redis_client, settings, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once it closes
    settings.ATRIUM_PROMETHEUS_URL = f"http://127.0.0.1:{port}"
    settings.ATRIUM_PROMETHEUS_TIMEOUT_S = 2
    _beat(redis_client, "engine-a", ttft=_hist(TTFT_BUCKETS_S, {0.1: 3}),
          itl=_hist(ITL_BUCKETS_S, {0.01: 3}), prompt_tps=10.0, output_tps=5.0)
    _web_requests(monkeypatch, ok=1, failed=0)

    status, html = _page(world.staff)

    assert status == 200
    assert f"Prometheus at http://127.0.0.1:{port} did not answer" in html
    assert _cell(html, MODEL, "engines") == "1"  # the engines' own figures instead


def test_only_operators_see_service_health(world):
    assert _page(world.people["owner"])[0] == 403
    assert Client().get(reverse("webui:op-health")).status_code == 302  # to sign in


def test_the_page_and_the_alert_rules_hold_the_same_objectives():
    rules = yaml.safe_load(RULES.read_text())
    exprs = {rule.get("alert") or rule.get("record"): rule["expr"]
             for group in rules["groups"] for rule in group["rules"]}
    budget = f"{1 - health.AVAILABILITY_TARGET:.3g}"
    assert f"(14.4 * {budget})" in exprs["AtriumAvailabilityBudgetBurnFast"]
    assert f"(14.4 * {1 - health.TTFT_TARGET:.3g})" in exprs["AtriumTTFTBudgetBurnFast"]
    assert f'le="{health.TTFT_THRESHOLD_S}"' in exprs["atrium:ttft_slow:ratio_rate1h"]


def test_the_page_shows_each_service_tiers_latency_and_objective(world, redis_client, settings,
                                                                  monkeypatch):
    from engine.metrics import REQUEST_BUCKETS_S

    settings.ATRIUM_PROMETHEUS_URL = ""
    _web_requests(monkeypatch, ok=10, failed=0)
    now = time.time()
    # Two engines; priority: 200 first tokens, all within 0.1 s; default: 100, 10 past 2.5 s.
    for engine_id, priority, default in (("engine-a", 150, 60), ("engine-b", 50, 40)):
        slow = 10 if engine_id == "engine-a" else 0
        tiers = {
            "priority": {"ttft": _hist(TTFT_BUCKETS_S, {0.1: priority}),
                         "queue": _hist(REQUEST_BUCKETS_S, {0.05: priority}), "preemptions": 0},
            "default": {"ttft": _hist(TTFT_BUCKETS_S, {0.5: default - slow, 5.0: slow}),
                        "queue": _hist(REQUEST_BUCKETS_S, {1.0: default}), "preemptions": 3}}
        beat = protocol.EngineHeartbeat(engine_id=engine_id, model=MODEL, started_at=now - 60,
                                        sent_at=now, stats={"engine": {"tiers": tiers}})
        redis_client.zadd(protocol.ENGINES_ZSET, {engine_id: now})
        redis_client.set(protocol.engine_key(engine_id), beat.encode(), ex=5)

    status, html = _page(world.staff)

    assert status == 200
    rows = re.findall(r'<tr data-tier="([a-z]+)">', html)
    assert rows == ["priority", "default"]  # in the order the scheduler serves them

    def cell(tier: str, field: str) -> str:
        found = re.search(rf'<tr data-tier="{tier}">.*?data-field="{field}">(.*?)</td>', html,
                          re.S)
        return re.sub(r"<[^>]+>", "", found.group(1)).strip()

    assert cell("priority", "good") == "100.000%"
    assert cell("default", "good") == "90.000%"  # 10 of 100 first tokens past 2.5 s
    assert cell("default", "budget") == "none"
    assert cell("default", "preemptions") == "6"
    assert cell("priority", "ttft") == "99.5 ms"  # rank 198 of 200, 0.05 + 0.05 x 198 / 200 s
