"""Prefix cache: TTFT of a request whose 1,000-token system prompt is cached vs not.

Each tenant has its own 1,000-token system prompt. Per tenant, a first request
(cold) and a second with a different user turn (warm) run alone, so TTFT is
the prefill time. The same requests through an engine with prefix caching off
are the peer. A request from another tenant with the same system prompt must
not hit (its salt differs), and is reported too.

    .venv/bin/python bench/prefix_cache.py [--tenants 4] [--prefix 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import write_result  # noqa: E402
from engine import protocol  # noqa: E402


def ttft(engine, request_id: str, prompt: list[int], salt: str) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the engine served from cache."""
    started = time.monotonic()
    engine.add_request(protocol.EngineRequest(
        request_id=request_id, model="bench", prompt_token_ids=prompt, tenant_id=salt,
        cache_salt=salt, sampling=protocol.SamplingSpec(max_tokens=1, temperature=0.0,
                                                        ignore_eos=True)))
    first, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and first is None:
                first = time.monotonic() - started
            if out.finished:
                cached = out.usage.cached_tokens
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--suffix", type=int, default=24)
    parser.add_argument("--size", default="demo")
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.demo_model import build_model
    from engine.llm_engine import LLMEngine

    model_dir = args.model_dir or build_model(Path(tempfile.mkdtemp()) / "m", size=args.size)
    cached_engine = LLMEngine(EngineConfig(model_dir=model_dir, enable_prefix_caching=True,
                                           max_num_batched_tokens=2048))
    plain_engine = LLMEngine(EngineConfig(model_dir=model_dir, enable_prefix_caching=False,
                                          max_num_batched_tokens=2048))
    rng = random.Random(0)
    vocab = range(10, cached_engine.vocab_size)
    rows = []
    for engine in (cached_engine, plain_engine):  # warm-up: first-call costs
        ttft(engine, "warmup", [rng.choice(vocab) for _ in range(64)], "warmup")
    for t in range(args.tenants):
        system = [rng.choice(vocab) for _ in range(args.prefix)]
        turns = [[rng.choice(vocab) for _ in range(args.suffix)] for _ in range(3)]
        salt = f"tenant-{t}"
        cold, cold_cached = ttft(cached_engine, f"cold-{t}", system + turns[0], salt)
        warm, warm_cached = ttft(cached_engine, f"warm-{t}", system + turns[1], salt)
        other, other_cached = ttft(cached_engine, f"other-{t}", system + turns[2], salt + "x")
        off, _ = ttft(plain_engine, f"off-{t}", system + turns[1], salt)
        rows.append({"tenant": salt, "cold_s": cold, "warm_s": warm, "cache_off_s": off,
                     "other_tenant_s": other, "warm_cached_tokens": warm_cached,
                     "cold_cached_tokens": cold_cached, "other_tenant_cached_tokens": other_cached})
        print(rows[-1], flush=True)
    cold = statistics.median(r["cold_s"] for r in rows)
    warm = statistics.median(r["warm_s"] for r in rows)
    off = statistics.median(r["cache_off_s"] for r in rows)
    result = {"prefix_tokens": args.prefix, "suffix_tokens": args.suffix, "rows": rows,
              "median_cold_ttft_ms": round(cold * 1000, 2),
              "median_warm_ttft_ms": round(warm * 1000, 2),
              "median_cache_off_ttft_ms": round(off * 1000, 2),
              "warm_over_cold": round(warm / cold, 3)}
    path = write_result("prefix_cache", result)
    print(f"warm/cold TTFT {warm / cold:.3f} -> {path}")


if __name__ == "__main__":
    main()
