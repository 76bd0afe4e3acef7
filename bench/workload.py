"""Deterministic serving workloads and latency statistics shared by the benchmarks."""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run
    tenant_id: str = "bench"


@dataclass(slots=True)
class Trace:
    """When each request arrived and when each of its output tokens appeared."""

    arrival: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)

    def token(self, request_id: str, when: float, count: int = 1) -> None:
        self.token_times.setdefault(request_id, []).extend([when] * count)


def poisson_workload(*, n: int, rate: float, prompt_len: tuple[int, int],
                     output_len: tuple[int, int], vocab: range, seed: int = 0,
                     shared_prefix: list[int] | None = None) -> list[BenchRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        length = rng.randint(*prompt_len)
        prompt = [rng.choice(vocab) for _ in range(length)]
        if shared_prefix:
            prompt = shared_prefix + prompt
        out.append(BenchRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                max_tokens=rng.randint(*output_len), arrival_s=t))
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of values, nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(trace: Trace, started: float, finished: float) -> dict[str, Any]:
    """vLLM-serving-benchmark style: TTFT, TPOT, ITL percentiles (ms) and throughput."""
    ttft, tpot, itl, total = [], [], [], 0
    for rid, times in trace.token_times.items():
        if not times:
            continue
        total += len(times)
        ttft.append(times[0] - trace.arrival[rid])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(b - a for a, b in zip(times, times[1:], strict=False) if b > a)

    def stats(values: list[float]) -> dict[str, float]:
        return {"mean": round(1000 * statistics.fmean(values), 2) if values else float("nan"),
                **{f"p{q}": round(1000 * percentile(values, q), 2) for q in (50, 95, 99)}}

    duration = finished - started
    return {"requests": len(trace.token_times), "output_tokens": total,
            "duration_s": round(duration, 3),
            "output_tokens_per_s": round(total / duration, 2),
            "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl)}


def run_queued(engine: Any, requests: list[Any]) -> dict[str, Any]:
    """Queues every engine request at once and steps the engine until all have ended; their
    summary. An output with an error ends the run."""
    trace = Trace()
    started = time.monotonic()
    for request in requests:
        trace.arrival[request.request_id] = started
        engine.add_request(request)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.error:
                raise RuntimeError(out.error)
            if out.token_ids:
                trace.token(out.request_id, now, len(out.token_ids))
    return summarize(trace, started, time.monotonic())


def machine() -> dict[str, Any]:
    import os

    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    result = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), **result}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path

