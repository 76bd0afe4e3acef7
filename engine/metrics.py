"""Engine metrics: counters, gauges and histograms, for the heartbeat and for Prometheus.

Plain Python. The engine updates them each step; its ``snapshot`` is what the heartbeat
carries, and ``SnapshotCollector`` hands a snapshot to prometheus_client, which writes
the exposition a scraper reads.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from engine import protocol

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A whole request, or its wait in the queue: seconds to minutes.
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                     600.0)
ADAPTER_LOAD_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts),
                "sum": round(self.total, 6), "count": self.count}


class RateWindow:
    """Events per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float) -> None:
        if n:
            self._events.append((now, n))

    def rate(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(n for _, n in self._events) / self.window_s


class PhaseClock:
    """Seconds the engine's loop spent in each of its phases, summed since start: the
    decode step's breakdown (docs/observability.md), at two clock reads a phase.

    ``start`` marks the beginning of timed work; ``lap(phase)`` adds the time since the
    last mark to ``phase`` and marks again. NOTE: on a GPU, a phase that only queues
    kernels looks short and the one that waits for them (sampling's copy to the host)
    carries their time.
    """

    __slots__ = ("seconds", "_mark")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._mark)
        self._mark = now


@dataclass(slots=True)
class EngineMetrics:
    prompt_tokens: int = 0  # prompt tokens run through the model (recomputation included)
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS_S))
    prompt_rate: RateWindow = field(default_factory=RateWindow)
    generation_rate: RateWindow = field(default_factory=RateWindow)
    # Speculative decoding: drafts verified, their tokens, those accepted, and accepted by
    # position in the draft (0: the first draft token).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    clock: PhaseClock = field(default_factory=PhaseClock)  # the step's phases
    tiers: dict[str, TierMetrics] = field(default_factory=dict)  # by service tier
    # Tokens computed for each (tenant, tier): prompt tokens run and tokens generated,
    # recomputation and prefix-cache hits not counted (engine/fair_share.py).
    served: dict[tuple[str, str], int] = field(default_factory=dict)

    def tier(self, name: str) -> TierMetrics:
        if name not in self.tiers:
            self.tiers[name] = TierMetrics()
        return self.tiers[name]

    def record_first_token(self, ttft_s: float, tier: str) -> None:
        self.ttft.observe(ttft_s)
        self.tier(tier).ttft.observe(ttft_s)

    def record_preemption(self, tier: str) -> None:
        self.tier(tier).preemptions += 1

    def record_service(self, tenant: str, tier: str, tokens: int) -> None:
        if tokens:
            self.served[tenant, tier] = self.served.get((tenant, tier), 0) + tokens

    def served_snapshot(self) -> list[list[Any]]:
        """[tenant, tier, tokens] rows, for the exposition (not the heartbeat)."""
        return [[tenant, tier, n] for (tenant, tier), n in sorted(self.served.items())]

    def tiers_snapshot(self) -> dict[str, Any]:
        return {name: t.to_dict() for name, t in sorted(self.tiers.items())}

    def record_draft(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was verified; its first ``accepted`` were kept."""
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_per_pos) < proposed:
            self.spec_accepted_per_pos += [0] * (proposed - len(self.spec_accepted_per_pos))
        for position in range(accepted):
            self.spec_accepted_per_pos[position] += 1

    def record_step(self, *, prompt_tokens: int, generation_tokens: int,
                    now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.prompt_rate.add(prompt_tokens, now)
        self.generation_rate.add(generation_tokens, now)

    def record_finish(self, reason: str, *, total_s: float, queue_s: float,
                      tier: str = protocol.TIER_DEFAULT) -> None:
        """A request ended: ``total_s`` from arrival to its end, ``queue_s`` of it waiting
        for its first step."""
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        self.e2e.observe(total_s)
        self.queue.observe(queue_s)
        self.tier(tier).queue.observe(queue_s)


@dataclass(slots=True)
class TierMetrics:
    """One service tier's time to first token, wait in the queue and preemptions."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS_S))
    preemptions: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"ttft": self.ttft.to_dict(), "queue": self.queue.to_dict(),
                "preemptions": self.preemptions}


# Each engine's series carry these labels, as vLLM's do: the model served and the engine.
LABELS = ("model_name", "engine")

# vLLM's names (docs/observability.md), so dashboards, KEDA triggers and the Gateway API
# inference extension's endpoint picker read an Atrium engine as they read vLLM.
_GAUGES = (  # (name, snapshot key, help)
    ("vllm:num_requests_running", "running", "Requests in the running batch."),
    ("vllm:num_requests_waiting", "waiting", "Requests waiting to run."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage; 1 is full."),
    ("atrium_engine_kv_blocks_total", "kv_blocks_total", "KV cache blocks."),
    ("atrium_engine_kv_blocks_used", "kv_blocks_used", "KV cache blocks held by requests."),
    ("atrium_engine_kv_host_blocks_total", "kv_host_blocks_total",
     "Blocks of the prefix cache's host tier."),
    ("atrium_engine_kv_host_blocks_used", "kv_host_blocks_used",
     "Blocks the prefix cache's host tier holds."),
    ("atrium_engine_tenants_waiting", "tenants_waiting",
     "Tenants with requests waiting (each class counts a tenant once)."),
    ("atrium_engine_requests_queued", "queued",
     "Requests placed on this engine that wait unread in its own stream."),
)
_COUNTERS = (  # (name, snapshot key, help); the exposition appends _total
    ("vllm:prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("vllm:external_prefix_cache_queries", "external_prefix_cache_queries",
     "Prompt tokens looked up in the host tier (those the KV cache did not hold)."),
    ("vllm:external_prefix_cache_hits", "external_prefix_cache_hits",
     "Prompt tokens found in the host tier and loaded back."),
    ("atrium_engine_kv_host_saves", "kv_host_saves",
     "KV blocks copied to the host tier as the cache evicted them."),
    ("atrium_engine_kv_host_loads", "kv_host_loads",
     "KV blocks loaded back from the host tier instead of recomputed."),
    ("atrium_engine_kv_host_evictions", "kv_host_evictions",
     "KV blocks the host tier gave up to make room."),
    ("vllm:num_preemptions", "preemptions", "Requests preempted for KV space."),
    ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens computed."),
    ("vllm:generation_tokens", "generation_tokens", "Tokens generated."),
    ("atrium_engine_steps", "steps", "Engine steps that ran the model."),
    ("atrium_engine_requests_stolen", "requests_stolen",
     "Requests this engine took from busy peers' streams."),
    ("atrium_engine_adapter_slot_evictions", "adapter_slot_evictions",
     "LoRA adapters moved out of a device slot to make room for another."),
    ("atrium_engine_adapter_slot_hits", "adapter_slot_hits",
     "Requests started whose LoRA adapter was in a device slot already."),
    ("atrium_engine_adapter_slot_misses", "adapter_slot_misses",
     "Requests started whose LoRA adapter was copied into a device slot for them."),
    ("atrium_engine_adapter_slot_staged", "adapter_slot_staged",
     "LoRA adapters copied into a device slot beside a step, ahead of their requests."),
    ("atrium_engine_adapter_host_hits", "adapter_host_hits",
     "Requests whose LoRA adapter was in host memory when they arrived."),
    ("atrium_engine_adapter_host_misses", "adapter_host_misses",
     "Requests whose LoRA adapter was loaded from the store for them."),
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative drafts verified."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
     "Speculative draft tokens verified."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative draft tokens the model accepted."),
)
_HISTOGRAMS = (  # (name, snapshot key, help)
    ("vllm:time_to_first_token_seconds", "ttft", "Time from arrival to the first token."),
    ("vllm:inter_token_latency_seconds", "itl", "Time between a request's output tokens."),
    ("vllm:e2e_request_latency_seconds", "e2e", "Time from arrival to the request's end."),
    ("vllm:request_queue_time_seconds", "queue", "Time from arrival to the first step."),
    ("atrium_engine_adapter_load_seconds", "adapter_load",
     "Time to load a LoRA adapter from the store into host memory."),
)


class SnapshotCollector:
    """One engine's metrics for prometheus_client, read from its latest snapshot at each scrape.

    NOTE: a collector over the snapshot, not Counter/Gauge objects updated in place: the
    engine thread keeps the values and a scrape runs on another thread; the snapshot is
    replaced whole, never mutated, so a scrape reads one consistent moment without a lock.
    """

    def __init__(self, latest: Callable[[], dict[str, Any] | None], *, model_name: str,
                 engine: str) -> None:
        self._latest = latest
        self._values = [model_name, engine]

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        if snapshot is None:
            return
        names, values = list(LABELS), self._values
        for name, key, help_text in _GAUGES:
            if key in snapshot:  # the stream figures come from the worker, not the engine
                gauge = GaugeMetricFamily(name, help_text, labels=names)
                gauge.add_metric(values, snapshot[key])
                yield gauge
        for name, key, help_text in _COUNTERS:
            if key in snapshot:
                counter = CounterMetricFamily(name, help_text, labels=names)
                counter.add_metric(values, snapshot[key])
                yield counter
        finished = CounterMetricFamily("vllm:request_success", "Requests ended, by reason.",
                                       labels=[*names, "finished_reason"])
        for reason, count in sorted(snapshot["requests_finished"].items()):
            finished.add_metric([*values, reason], count)
        yield finished
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the draft.",
            labels=[*names, "position"])
        for position, count in enumerate(snapshot.get("spec_decode_accepted_per_pos", [])):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos
        phases = CounterMetricFamily(
            "atrium_engine_step_phase_seconds",
            "Seconds the engine loop spent in each phase of its steps (docs/observability.md).",
            labels=[*names, "phase"])
        for phase, seconds in sorted(snapshot.get("step_seconds", {}).items()):
            phases.add_metric([*values, phase], seconds)
        yield phases
        for name, key, help_text in _HISTOGRAMS:
            if (hist := snapshot.get(key)) is None:
                continue
            bounds = [*map(floatToGoString, hist["buckets"]), "+Inf"]
            family = HistogramMetricFamily(name, help_text, labels=names)
            family.add_metric(values, list(zip(bounds, accumulate(hist["counts"]), strict=True)),
                              hist["sum"])
            yield family
        yield from _tier_families(snapshot, names, values)
        if (lora := snapshot.get("lora")) is not None:
            # As vLLM: one series whose labels are the adapters running and waiting now
            # (comma-separated) and whose value is when that was so; readers take the
            # newest.
            info = GaugeMetricFamily(
                "vllm:lora_requests_info", "LoRA adapters running and waiting.",
                labels=[*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([*values, str(lora["max_lora"]), ",".join(lora["running"]),
                             ",".join(lora["waiting"])], snapshot["time"])
            yield info


def _tier_families(snapshot: dict[str, Any], names: list[str],
                   values: list[str]) -> Iterator[Metric]:
    """The service tiers' series: TTFT and queue time histograms and preemptions by tier,
    tokens served by tenant and tier."""
    tiers = snapshot.get("tiers", {})
    for name, key, help_text in _TIER_HISTOGRAMS:
        family = HistogramMetricFamily(name, help_text, labels=[*names, "service_tier"])
        for tier, figures in tiers.items():
            hist = figures[key]
            bounds = [*map(floatToGoString, hist["buckets"]), "+Inf"]
            family.add_metric([*values, tier],
                              list(zip(bounds, accumulate(hist["counts"]), strict=True)),
                              hist["sum"])
        yield family
    preempted = CounterMetricFamily("atrium_engine_tier_preemptions",
                                    "Requests preempted, by the service tier of the one preempted.",
                                    labels=[*names, "service_tier"])
    for tier, figures in tiers.items():
        preempted.add_metric([*values, tier], figures["preemptions"])
    yield preempted
    served = CounterMetricFamily(
        "atrium_engine_tokens_served", "Tokens computed for each tenant in each service tier "
        "(prompt tokens run and tokens generated; recomputation and cache hits not counted).",
        labels=[*names, "tenant", "service_tier"])
    for tenant, tier, tokens in snapshot.get("served", []):
        served.add_metric([*values, tenant, tier], tokens)
    yield served


_TIER_HISTOGRAMS = (
    ("atrium_engine_tier_time_to_first_token_seconds", "ttft",
     "Time from arrival to the first token, by service tier."),
    ("atrium_engine_tier_queue_time_seconds", "queue",
     "Time from arrival to the first step, by service tier."),
)


def engine_registry(latest: Callable[[], dict[str, Any] | None], *, model_name: str,
                    engine: str) -> CollectorRegistry:
    """A registry of one engine's own, never the process-wide default: engines in one
    process (the tests run several) each export only themselves."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(latest, model_name=model_name, engine=engine))
    return registry


def render_prometheus(snapshot: dict[str, Any], *, model_name: str, engine: str) -> str:
    """The Prometheus text format of one engine's ``snapshot``."""
    return generate_latest(engine_registry(lambda: snapshot, model_name=model_name,
                                           engine=engine)).decode()
