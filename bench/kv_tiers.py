"""The prefix cache's host tier (issue 40): bench/results/kv_tiers.json.

The real engine (engine/llm_engine.py) on the demo checkpoint, in one process (no Redis and
no web tier: what is measured is the cache), its pool sized so that only 4 of 32 tenants'
long prefixes fit. Each tenant holds a conversation whose every turn re-sends the same
prefix (its system prompt and tools: ``PREFIX`` tokens) and a new question; turns go
round-robin over the 32 tenants, ``IN_FLIGHT`` at a time, so by a tenant's next turn the
pool has evicted its prefix. Ours: the host tier sized for every tenant's prefix
(``--kv-host-mib``); the peer, in the same run: the same engine and pool without it (today's
engine: an evicted prefix is computed again).

- ``ttft_speedup_restored``: the p50 time to first token of turns whose prefix the pool
  had evicted, the peer's over ours (goal >= 5);
- ``hit_rate``: prompt tokens served from either tier over prompt tokens, on every turn
  after each tenant's first (goal >= 0.9);
- ``uncached_throughput_ratio``: output tokens/s of requests with no reusable prefix (each
  prompt new, so every block the pool evicts is saved to the host tier and never read
  back: the tier's cost alone), ours over the peer's, in alternating blocks (goal >= 0.98);
  short blocks, many of them, each side first in turn, and their median: this machine's
  speed drifts by 10 % and more between one block and the next;
- ``uncached_step_path_share``: the seconds the tier adds to the steps' path in those
  blocks (copies made before a forward pass, and waits for those made beside one) over
  the steps' seconds: the part of its cost that does not depend on the machine's drift.

Answers run to their max_tokens (ignore_eos: the trained demo model would stop early).

    .venv/bin/python bench/kv_tiers.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
from bench.workload import percentile  # noqa: E402
from engine import protocol  # noqa: E402
from engine.prefix_hash import cache_scope, prompt_keys  # noqa: E402

TENANTS, FITTING = 32, 4
PREFIX, QUESTION, OUTPUT = 1984, 24, 16  # 2,024 tokens at most: the demo's window is 2,048
BLOCK = 16
IN_FLIGHT = 2
UNCACHED_PROMPT, UNCACHED_OUTPUT, UNCACHED_IN_FLIGHT = 512, 32, 8


def engine_for(model_dir: Path, *, host_mib: int):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    prefix_blocks = PREFIX // BLOCK + 2  # the question and the answer's blocks too
    return LLMEngine(EngineConfig(model_dir=model_dir, block_size=BLOCK,
                                  num_kv_blocks=FITTING * prefix_blocks + 8,
                                  kv_host_bytes=host_mib * 2**20))


def request(rid: str, tenant: str, prompt: list[int], output: int) -> protocol.EngineRequest:
    return protocol.EngineRequest(
        request_id=rid, model="demo", tenant_id=tenant, cache_salt=tenant,
        prompt_token_ids=prompt,
        sampling=protocol.SamplingSpec(max_tokens=output, temperature=0.0, ignore_eos=True))


def run_closed(engine, jobs: list[tuple[str, list[int], int]], in_flight: int) -> list[dict]:
    """Runs ``jobs`` (tenant, prompt, output tokens) in order, ``in_flight`` at a time; each
    one's TTFT, its cached tokens, and whether the pool held its whole prefix when it
    arrived."""
    pending, running, done = list(reversed(jobs)), {}, []
    while pending or running:
        while pending and len(running) < in_flight:
            tenant, prompt, output = pending.pop()
            rid = f"{tenant}-{len(done) + len(running)}-{random.random():.6f}"
            keys = prompt_keys(prompt, BLOCK, cache_scope(tenant, tenant, None))
            # NOTE: whole: the pool evicts a tenant's blocks from a prompt's tail, so its
            # first blocks may stay while the rest of its prefix is gone.
            running[rid] = {"tenant": tenant, "prompt_tokens": len(prompt),
                            "in_pool": bool(keys) and all(engine.kv.pool.lookup(k)
                                                          for k in keys),
                            "arrived": time.monotonic(), "ttft": None, "tokens": 0}
            engine.add_request(request(rid, tenant, prompt, output))
        for out in engine.step():
            job = running[out.request_id]
            if out.token_ids and job["ttft"] is None:
                job["ttft"] = time.monotonic() - job["arrived"]
            job["tokens"] += len(out.token_ids)
            if out.finished:
                job["cached_tokens"] = out.usage.cached_tokens
                job["ended"] = time.monotonic()
                done.append(running.pop(out.request_id))
    return done


def conversations(engine, prefixes: dict[str, list[int]], rounds: int,
                  rng: random.Random) -> dict:
    """A first turn for every tenant (all computed), then ``rounds`` more each."""
    vocab = engine.vocab_size

    def turns() -> list[tuple[str, list[int], int]]:
        return [(t, p + [rng.randrange(10, vocab) for _ in range(QUESTION)], OUTPUT)
                for t, p in prefixes.items()]

    run_closed(engine, turns(), IN_FLIGHT)
    later = [job for _ in range(rounds) for job in run_closed(engine, turns(), IN_FLIGHT)]
    evicted = [j["ttft"] for j in later if not j["in_pool"]]
    prompt = sum(j["prompt_tokens"] for j in later)
    return {"turns": len(later), "turns_evicted_from_the_pool": len(evicted),
            "ttft_p50_evicted_s": round(percentile(evicted, 50), 5) if evicted else None,
            "ttft_p99_evicted_s": round(percentile(evicted, 99), 5) if evicted else None,
            "hit_rate": round(sum(j["cached_tokens"] for j in later) / prompt, 4)}


def uncached_tokens_per_s(engine, rng: random.Random, requests: int) -> float:
    """Output tokens/s of ``requests`` new prompts, ``UNCACHED_IN_FLIGHT`` at a time (a
    fixed amount of work, timed)."""
    vocab = engine.vocab_size
    jobs = [(f"u{i % 8}", [rng.randrange(10, vocab) for _ in range(UNCACHED_PROMPT)],
             UNCACHED_OUTPUT) for i in range(requests)]
    start = time.monotonic()
    made = sum(j["tokens"] for j in run_closed(engine, jobs, UNCACHED_IN_FLIGHT))
    return made / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns per tenant after the first")
    parser.add_argument("--blocks", type=int, default=16,
                        help="alternating blocks of the uncached throughput comparison")
    parser.add_argument("--block-requests", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_tiers.json")
    args = parser.parse_args()

    import torch

    from engine.demo_model import ensure_demo_model

    torch.manual_seed(0)
    model_dir = ensure_demo_model()
    from engine.models.model_config import ModelConfig

    shape = ModelConfig.from_dir(model_dir)
    block_bytes = 2 * shape.num_layers * BLOCK * shape.num_kv_heads * shape.head_dim * 4
    host_mib = TENANTS * (PREFIX // BLOCK + 2) * block_bytes // 2**20 + 8
    ours, peer = engine_for(model_dir, host_mib=host_mib), engine_for(model_dir, host_mib=0)
    assert ours.kv.host is not None and ours.kv.host.num_slots >= TENANTS * (PREFIX // BLOCK)
    rng = random.Random(5)
    prefixes = {f"tenant{i:02d}": [rng.randrange(10, ours.vocab_size) for _ in range(PREFIX)]
                for i in range(TENANTS)}
    results: dict = {}
    for name, engine in (("ours", ours), ("peer", peer)):
        results[name] = conversations(engine, prefixes, args.rounds, random.Random(9))
        print(name, results[name], flush=True)
    results["ttft_speedup_restored"] = round(
        results["peer"]["ttft_p50_evicted_s"] / results["ours"]["ttft_p50_evicted_s"], 2)
    results["hit_rate"] = results["ours"]["hit_rate"]
    results["host_tier"] = {k: v for k, v in ours.snapshot().items()
                            if k.startswith(("kv_host", "external_prefix"))}
    results["restore_seconds_total"] = round(
        ours.metrics.clock.seconds.get("kv_host", 0.0), 4)

    for engine in (ours, peer):  # each step shape once before the comparison
        uncached_tokens_per_s(engine, random.Random(99), UNCACHED_IN_FLIGHT * 2)
    clock = ours.metrics.clock.seconds
    before = dict(clock)
    ratios = []
    for block in range(args.blocks):  # alternating, each side first in turn
        order = (ours, peer) if block % 2 == 0 else (peer, ours)
        rates = {id(e): uncached_tokens_per_s(e, random.Random(block), args.block_requests)
                 for e in order}
        ratios.append(rates[id(ours)] / rates[id(peer)])
        print(f"uncached block {block}: ours/peer {ratios[-1]:.3f}", flush=True)
    results["uncached_throughput_ratio"] = round(statistics.median(ratios), 3)
    results["uncached_throughput_ratio_blocks"] = [round(r, 3) for r in ratios]
    spent = {phase: clock[phase] - before.get(phase, 0.0) for phase in clock}
    results["uncached_step_path_share"] = round(
        (spent.get("kv_host", 0.0) + spent.get("kv_host_wait", 0.0)) / sum(spent.values()), 4)
    results["uncached_step_seconds"] = {k: round(v, 3) for k, v in spent.items()}
    results["setup"] = {
        "checkpoint": "the demo checkpoint (engine/demo_model.py), ignore_eos",
        "tenants": TENANTS, "prefixes_the_pool_holds": FITTING, "prefix_tokens": PREFIX,
        "question_tokens": QUESTION, "output_tokens": OUTPUT, "in_flight": IN_FLIGHT,
        "pool_blocks": ours.kv.num_blocks, "block_size": BLOCK, "host_tier_mib": host_mib,
        "rounds": args.rounds,
        "uncached": {"prompt_tokens": UNCACHED_PROMPT, "output_tokens": UNCACHED_OUTPUT,
                     "in_flight": UNCACHED_IN_FLIGHT, "blocks": args.blocks,
                     "block_requests": args.block_requests},
        "peer": "the same engine and pool without the host tier, in the same run",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip()}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("ttft_speedup_restored", "hit_rate",
                                              "uncached_throughput_ratio",
                                              "uncached_step_path_share")}, indent=2))


if __name__ == "__main__":
    main()
