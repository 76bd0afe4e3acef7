"""Engine metrics: counters, gauges and histograms, for the heartbeat and for Prometheus.

Plain Python. The engine updates them each step; ``snapshot`` is what the heartbeat
carries, and ``render_prometheus`` is the text exposition format a scraper reads.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
    preemptions: int = 0
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


def render_prometheus(snapshot: dict[str, Any], labels: dict[str, str]) -> str:
    """The text exposition format (version 0.0.4) of one engine's ``snapshot``."""
    base = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float,
               extra: dict[str, str] | None = None) -> None:
        if not any(line.startswith(f"# TYPE atrium_{name} ") for line in lines):
            lines.append(f"# HELP atrium_{name} {help_text}")
            lines.append(f"# TYPE atrium_{name} {kind}")
        tags = base + "".join(f',{k}="{_escape(v)}"' for k, v in (extra or {}).items())
        lines.append(f"atrium_{name}{{{tags}}} {value}")

    metric("queue_depth", "gauge", "Requests waiting in the engine.", snapshot["waiting"])
    metric("running_sequences", "gauge", "Sequences in the running batch.", snapshot["running"])
    metric("kv_blocks_used", "gauge", "KV cache blocks held by sequences.",
           snapshot["kv_blocks_used"])
    metric("kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).",
           snapshot["kv_blocks_free"])
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix "
           "cache.", snapshot["prefix_cache_queries"])
    metric("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
           snapshot["prefix_cache_hits"])
    metric("preemptions_total", "counter", "Sequences preempted for KV space.",
           snapshot["preemptions"])
    metric("prompt_tokens_total", "counter", "Prompt tokens computed.", snapshot["prompt_tokens"])
    metric("generation_tokens_total", "counter", "Tokens generated.",
           snapshot["generation_tokens"])
    metric("prompt_tokens_per_second", "gauge", "Prompt tokens/s over the last 10 s.",
           snapshot["prompt_tokens_per_s"])
    metric("generation_tokens_per_second", "gauge", "Generated tokens/s over the last 10 s.",
           snapshot["generation_tokens_per_s"])
    for reason, count in sorted(snapshot["requests_finished"].items()):
        metric("requests_finished_total", "counter", "Requests ended, by finish reason.", count,
               {"finish_reason": reason})
    for name, help_text in (("time_to_first_token_seconds", "Time to first token."),
                            ("inter_token_latency_seconds", "Time between output tokens.")):
        hist = snapshot["ttft" if name.startswith("time") else "itl"]
        lines.append(f"# HELP atrium_{name} {help_text}")
        lines.append(f"# TYPE atrium_{name} histogram")
        cumulative = 0
        for bound, count in zip([*hist["buckets"], "+Inf"], hist["counts"], strict=True):
            cumulative += count
            lines.append(f'atrium_{name}_bucket{{{base},le="{bound}"}} {cumulative}')
        lines.append(f"atrium_{name}_sum{{{base}}} {hist['sum']}")
        lines.append(f"atrium_{name}_count{{{base}}} {hist['count']}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
