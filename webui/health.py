"""The operator's service-health page: the service-level objectives and their error budget,
latency and throughput per model, and what a million tokens bills and costs.

Two sources, one shape. With ``ATRIUM_PROMETHEUS_URL`` set, every figure is a query over
the metrics the dashboards and alert rules read (deploy/observability/): latency and
throughput over the last five minutes, the objectives over thirty days. Without it (one
machine under ``atrium up``), the same histograms and counters are read where they live:
the engines' heartbeats and this host's web metrics, since each process started. A
Prometheus that does not answer falls back to those, and the page says why.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import httpx
from django.conf import settings

from billing import selectors as billing
from core import metrics as web_metrics
from engine import protocol
from webui.selectors import engine_heartbeats

# The objectives of deploy/observability/prometheus/atrium-rules.yml (a test keeps them equal).
AVAILABILITY_TARGET = 0.999
TTFT_TARGET = 0.99
TTFT_THRESHOLD_S = 2.5
SLO_WINDOW = "30d"
RATE_WINDOW = "5m"
QUANTILE = 0.95

_ERRORS = 'atrium_inference_requests_total{status=~"5.."}'
_TTFT = "vllm:time_to_first_token_seconds"
_TIER_TTFT = "atrium_engine_tier_time_to_first_token_seconds"
_TIER_QUEUE = "atrium_engine_tier_queue_time_seconds"
TIER_QUANTILE = 0.99


class PrometheusUnavailable(Exception):
    """Prometheus could not be asked, or refused a query."""


@dataclass(frozen=True, slots=True)
class Objective:
    name: str
    promise: str  # what a good request is
    target: float  # the share of good requests promised
    good: float | None  # the share measured over the window; None without traffic
    burn_rate: float | None = None  # the last hour's error rate over the budget's

    @property
    def budget_left(self) -> float | None:
        """The share of the window's error budget not yet spent (negative: overspent)."""
        if self.good is None:
            return None
        return 1.0 - (1.0 - self.good) / (1.0 - self.target)

    @property
    def status(self) -> str:
        left = self.budget_left
        if left is None:
            return "no traffic"
        if left <= 0:
            return "budget spent"
        if self.burn_rate is not None and self.burn_rate > 1:
            return "burning"
        return "met"


@dataclass(frozen=True, slots=True)
class ModelHealth:
    model: str
    engines: int
    ttft_p95_s: float | None
    itl_p95_s: float | None
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    input_price: Decimal | None = None  # the price book's, per million tokens
    output_price: Decimal | None = None
    billed_per_million: Decimal | None = None  # at this traffic's prompt/output mix
    cost_per_million: Decimal | None = None  # engine time at ATRIUM_ENGINE_HOUR_COST


@dataclass(frozen=True, slots=True)
class TierHealth:
    """One service tier (docs/tiers.md): its latency and its share of the TTFT objective."""

    tier: str
    ttft_p99_s: float | None
    queue_p99_s: float | None
    ttft_good: float | None  # the share of first tokens within TTFT_THRESHOLD_S
    preemptions: float  # its requests preempted, over the latency window

    @property
    def objective(self) -> Objective:
        return Objective(name=self.tier, promise=f"first token within {TTFT_THRESHOLD_S:g} s",
                         target=TTFT_TARGET, good=self.ttft_good)


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    source: str  # "prometheus" or "processes"
    latency_window: str
    slo_window: str
    objectives: list[Objective]
    models: list[ModelHealth]
    firing: list[str]  # Atrium alerts firing now (Prometheus only)
    problem: str = ""  # why Prometheus was not used, when it was configured
    tiers: list[TierHealth] = field(default_factory=list)


def service_health() -> ServiceHealth:
    url = settings.ATRIUM_PROMETHEUS_URL
    if url:
        try:
            return _priced(from_prometheus(Prometheus(url)))
        except PrometheusUnavailable as exc:
            return _priced(from_processes(problem=f"Prometheus at {url} did not answer: {exc}"))
    return _priced(from_processes())


# --- from Prometheus -----------------------------------------------------------------------

class Prometheus:
    """Instant queries against Prometheus's HTTP API."""

    def __init__(self, url: str, *, timeout_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s or settings.ATRIUM_PROMETHEUS_TIMEOUT_S

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of each series of an instant vector; NaN results dropped."""
        try:
            reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr},
                              timeout=self.timeout_s)
            body = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusUnavailable(str(exc) or type(exc).__name__) from exc
        if reply.status_code != 200 or body.get("status") != "success":
            raise PrometheusUnavailable(body.get("error") or f"HTTP {reply.status_code}")
        rows = []
        for series in body["data"]["result"]:
            value = float(series["value"][1])
            if math.isfinite(value):
                rows.append((series["metric"], value))
        return rows

    def scalar(self, expr: str) -> float | None:
        rows = self.query(expr)
        return rows[0][1] if rows else None

    def by_model(self, expr: str) -> dict[str, float]:
        return {labels.get("model_name", ""): value for labels, value in self.query(expr)}


def _error_ratio(window: str) -> str:
    return (f"(sum(rate({_ERRORS}[{window}])) or vector(0))"
            f" / sum(rate(atrium_inference_requests_total[{window}]))")


def _ttft_slow_ratio(window: str) -> str:
    return (f"(sum(rate({_TTFT}_count[{window}]))"
            f' - sum(rate({_TTFT}_bucket{{le="{TTFT_THRESHOLD_S}"}}[{window}])))'
            f" / sum(rate({_TTFT}_count[{window}]))")


def _p95(family: str) -> str:
    return (f"histogram_quantile({QUANTILE}, sum by (model_name, le) "
            f"(rate({family}_bucket[{RATE_WINDOW}])))")


def from_prometheus(prom: Prometheus) -> ServiceHealth:
    objectives = [
        _objective_from(prom, "Availability", "ended without a server error",
                        AVAILABILITY_TARGET, _error_ratio),
        _objective_from(prom, "Time to first token", f"first token within {TTFT_THRESHOLD_S:g} s",
                        TTFT_TARGET, _ttft_slow_ratio)]
    engines = prom.by_model("count by (model_name) (vllm:num_requests_running)")
    ttft, itl = prom.by_model(_p95(_TTFT)), prom.by_model(_p95("vllm:inter_token_latency_seconds"))
    prompt = prom.by_model(f"sum by (model_name) (rate(vllm:prompt_tokens_total[{RATE_WINDOW}]))")
    generated = prom.by_model(
        f"sum by (model_name) (rate(vllm:generation_tokens_total[{RATE_WINDOW}]))")
    models = [ModelHealth(model=name, engines=int(engines.get(name, 0)), ttft_p95_s=ttft.get(name),
                          itl_p95_s=itl.get(name), prompt_tokens_per_s=prompt.get(name, 0.0),
                          generation_tokens_per_s=generated.get(name, 0.0))
              for name in sorted(set(engines) | set(prompt) | set(generated))]
    firing = sorted({labels.get("alertname", "") for labels, _ in prom.query(
        'ALERTS{alertstate="firing", alertname=~"Atrium.*"}')})
    return ServiceHealth(source="prometheus", latency_window="the last 5 minutes",
                         slo_window="the last 30 days", objectives=objectives, models=models,
                         firing=firing, tiers=_tiers_from(prom))


def _tiers_from(prom: Prometheus) -> list[TierHealth]:
    def by_tier(expr: str) -> dict[str, float]:
        return {labels.get("service_tier", ""): value for labels, value in prom.query(expr)}

    def p99(family: str) -> dict[str, float]:
        return by_tier(f"histogram_quantile({TIER_QUANTILE}, sum by (service_tier, le) "
                       f"(rate({family}_bucket[{RATE_WINDOW}])))")

    ttft, queue = p99(_TIER_TTFT), p99(_TIER_QUEUE)
    good = by_tier(f'sum by (service_tier) (rate({_TIER_TTFT}_bucket{{le="{TTFT_THRESHOLD_S}"}}'
                   f"[{SLO_WINDOW}])) / sum by (service_tier) (rate({_TIER_TTFT}_count"
                   f"[{SLO_WINDOW}]))")
    preempted = by_tier("sum by (service_tier) "
                        f"(increase(atrium_engine_tier_preemptions_total[{RATE_WINDOW}]))")
    return [TierHealth(tier=t, ttft_p99_s=ttft.get(t), queue_p99_s=queue.get(t),
                       ttft_good=good.get(t), preemptions=preempted.get(t, 0.0))
            for t in _tier_order(set(ttft) | set(queue) | set(preempted))]


def _tier_order(tiers: set[str]) -> list[str]:
    return sorted(tiers, key=lambda t: (protocol.TIERS.index(t) if t in protocol.TIERS
                                        else len(protocol.TIERS), t))


def _objective_from(prom: Prometheus, name: str, promise: str, target: float, bad_ratio
                    ) -> Objective:
    bad, last_hour = prom.scalar(bad_ratio(SLO_WINDOW)), prom.scalar(bad_ratio("1h"))
    return Objective(name=name, promise=promise, target=target,
                     good=None if bad is None else 1.0 - bad,
                     burn_rate=None if last_hour is None else last_hour / (1.0 - target))


# --- from the processes themselves ---------------------------------------------------------

def from_processes(*, problem: str = "") -> ServiceHealth:
    """The live engines' heartbeat histograms and this host's web counters."""
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for beat in engine_heartbeats():
        by_model[beat.model].append((beat.stats or {}).get("engine") or {})
    models, ttfts = [], []
    for name, snapshots in sorted(by_model.items()):
        ttft = merge_histograms(s.get("ttft") for s in snapshots)
        itl = merge_histograms(s.get("itl") for s in snapshots)
        ttfts.append(ttft)
        models.append(ModelHealth(
            model=name, engines=len(snapshots), ttft_p95_s=quantile(ttft, QUANTILE),
            itl_p95_s=quantile(itl, QUANTILE),
            prompt_tokens_per_s=sum(float(s.get("prompt_tokens_per_s") or 0) for s in snapshots),
            generation_tokens_per_s=sum(float(s.get("generation_tokens_per_s") or 0)
                                        for s in snapshots)))
    objectives = [
        Objective(name="Availability", promise="ended without a server error",
                  target=AVAILABILITY_TARGET, good=_web_good_ratio()),
        Objective(name="Time to first token",
                  promise=f"first token within {TTFT_THRESHOLD_S:g} s", target=TTFT_TARGET,
                  good=share_within(merge_histograms(ttfts), TTFT_THRESHOLD_S))]
    return ServiceHealth(source="processes", latency_window="since each engine started",
                         slo_window="since the processes started", objectives=objectives,
                         models=models, firing=[], problem=problem,
                         tiers=_tiers_of([s for snaps in by_model.values() for s in snaps]))


def _tiers_of(snapshots: list[dict[str, Any]]) -> list[TierHealth]:
    """Each tier's figures summed over the engines' heartbeats."""
    by_tier: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for snapshot in snapshots:
        for tier, figures in (snapshot.get("tiers") or {}).items():
            by_tier[tier].append(figures)
    out = []
    for tier in _tier_order(set(by_tier)):
        ttft = merge_histograms(f.get("ttft") for f in by_tier[tier])
        queue = merge_histograms(f.get("queue") for f in by_tier[tier])
        out.append(TierHealth(tier=tier, ttft_p99_s=quantile(ttft, TIER_QUANTILE),
                              queue_p99_s=quantile(queue, TIER_QUANTILE),
                              ttft_good=share_within(ttft, TTFT_THRESHOLD_S),
                              preemptions=float(sum(f.get("preemptions", 0)
                                                    for f in by_tier[tier]))))
    return out


def _web_good_ratio() -> float | None:
    """The share of this host's inference requests that ended without a 5xx."""
    total = errors = 0.0
    for family in web_metrics.registry().collect():
        if family.name != "atrium_inference_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                total += sample.value
                errors += sample.value if sample.labels.get("status", "").startswith("5") else 0
    return None if total <= 0 else 1.0 - errors / total


def merge_histograms(histograms: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The sum of heartbeat histograms with the same buckets (others are skipped)."""
    merged: dict[str, Any] | None = None
    for hist in histograms:
        if not hist or not hist.get("buckets"):
            continue
        if merged is None:
            merged = {"buckets": list(hist["buckets"]), "counts": list(hist["counts"]),
                      "count": hist["count"]}
        elif list(hist["buckets"]) == merged["buckets"]:
            merged["counts"] = [a + b for a, b in zip(merged["counts"], hist["counts"],
                                                      strict=True)]
            merged["count"] += hist["count"]
    return merged


def quantile(hist: Mapping[str, Any] | None, q: float) -> float | None:
    """The q-quantile of a heartbeat histogram, interpolated within its bucket as
    Prometheus's histogram_quantile does; the largest finite bound when it falls in +Inf."""
    if not hist or not hist.get("count"):
        return None
    bounds, counts = list(hist["buckets"]), list(hist["counts"])
    rank, seen = q * hist["count"], 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            lower = float(bounds[i - 1]) if i else 0.0
            return lower + (float(bounds[i]) - lower) * (rank - seen) / count
        seen += count
    return float(bounds[-1])


def share_within(hist: Mapping[str, Any] | None, bound: float) -> float | None:
    """The share of observations at most ``bound``, which must be a bucket's bound."""
    if not hist or not hist.get("count"):
        return None
    bounds = list(hist["buckets"])
    i = bisect.bisect_left(bounds, bound)
    if i == len(bounds) or bounds[i] != bound:
        return None
    return sum(hist["counts"][:i + 1]) / hist["count"]


# --- what a million tokens bills and costs -------------------------------------------------

MILLION = Decimal(1_000_000)
HOUR = Decimal(3600)
MICRO = Decimal("0.000001")


def _priced(health: ServiceHealth) -> ServiceHealth:
    """Each model with its price book prices, the bill per million tokens at its traffic's
    mix, and what a million tokens costs in engine time."""
    prices = billing.base_prices_now({m.model for m in health.models},
                                     currency=settings.ATRIUM_BILLING_CURRENCY)
    hour_cost = settings.ATRIUM_ENGINE_HOUR_COST
    models = []
    for m in health.models:
        price = prices.get(m.model)
        prompt = Decimal(str(round(m.prompt_tokens_per_s, 6)))
        generated = Decimal(str(round(m.generation_tokens_per_s, 6)))
        tokens = prompt + generated
        billed = cost = None
        if price is not None and tokens > 0:
            billed = ((prompt * price.input_per_million
                       + generated * price.output_per_million) / tokens).quantize(MICRO)
        if hour_cost is not None and tokens > 0 and m.engines:
            cost = (hour_cost * m.engines / HOUR / tokens * MILLION).quantize(MICRO)
        models.append(replace(
            m, input_price=price.input_per_million if price else None,
            output_price=price.output_per_million if price else None,
            billed_per_million=billed, cost_per_million=cost))
    return replace(health, models=models)
