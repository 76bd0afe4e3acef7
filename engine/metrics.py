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

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


@dataclass(slots=True)
class EngineMetrics:
    prompt_tokens: int = 0  # prompt tokens run through the model (recomputation included)
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    prompt_rate: RateWindow = field(default_factory=RateWindow)
    generation_rate: RateWindow = field(default_factory=RateWindow)

    def record_step(self, *, prompt_tokens: int, generation_tokens: int,
                    now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.prompt_rate.add(prompt_tokens, now)
        self.generation_rate.add(generation_tokens, now)

    def record_finish(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1


_GAUGES = (  # (name, snapshot key, help)
    ("queue_depth", "waiting", "Requests waiting in the engine."),
    ("running_sequences", "running", "Sequences in the running batch."),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks held by sequences."),
    ("kv_blocks_free", "kv_blocks_free", "KV cache blocks free (cached ones included)."),
    ("prompt_tokens_per_second", "prompt_tokens_per_s", "Prompt tokens/s over the last 10 s."),
    ("generation_tokens_per_second", "generation_tokens_per_s",
     "Generated tokens/s over the last 10 s."),
)
_COUNTERS = (  # (name, snapshot key, help); the exposition appends _total
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    ("preemptions", "preemptions", "Sequences preempted for KV space."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens computed."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
)
_HISTOGRAMS = (  # (name, snapshot key, help)
    ("time_to_first_token_seconds", "ttft", "Time to first token."),
    ("inter_token_latency_seconds", "itl", "Time between output tokens."),
)


class SnapshotCollector:
    """One engine's metrics for prometheus_client, read from its latest snapshot at each scrape.

    NOTE: a collector over the snapshot, not Counter/Gauge objects updated in place: the
    engine thread keeps the values and a scrape runs on another thread; the snapshot is
    replaced whole, never mutated, so a scrape reads one consistent moment without a lock.
    """

    def __init__(self, latest: Callable[[], dict[str, Any] | None],
                 labels: dict[str, str]) -> None:
        self._latest = latest
        self._names = sorted(labels)
        self._values = [str(labels[name]) for name in self._names]

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        if snapshot is None:
            return
        names, values = self._names, self._values
        for name, key, help_text in _GAUGES:
            gauge = GaugeMetricFamily(f"atrium_{name}", help_text, labels=names)
            gauge.add_metric(values, snapshot[key])
            yield gauge
        for name, key, help_text in _COUNTERS:
            counter = CounterMetricFamily(f"atrium_{name}", help_text, labels=names)
            counter.add_metric(values, snapshot[key])
            yield counter
        finished = CounterMetricFamily("atrium_requests_finished",
                                       "Requests ended, by finish reason.",
                                       labels=[*names, "finish_reason"])
        for reason, count in sorted(snapshot["requests_finished"].items()):
            finished.add_metric([*values, reason], count)
        yield finished
        for name, key, help_text in _HISTOGRAMS:
            hist = snapshot[key]
            bounds = [*map(floatToGoString, hist["buckets"]), "+Inf"]
            family = HistogramMetricFamily(f"atrium_{name}", help_text, labels=names)
            family.add_metric(values, list(zip(bounds, accumulate(hist["counts"]), strict=True)),
                              hist["sum"])
            yield family


def engine_registry(latest: Callable[[], dict[str, Any] | None],
                    labels: dict[str, str]) -> CollectorRegistry:
    """A registry of one engine's own, never the process-wide default: engines in one
    process (the tests run several) each export only themselves."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(latest, labels))
    return registry


def render_prometheus(snapshot: dict[str, Any], labels: dict[str, str]) -> str:
    """The Prometheus text format of one engine's ``snapshot``."""
    return generate_latest(engine_registry(lambda: snapshot, labels)).decode()
