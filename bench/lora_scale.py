"""A thousand adapters over one base model: throughput against the base model alone, cold
loads from the adapter store, and how often a request finds its adapter already resident.

Workload (each configuration, each round): ``--requests`` requests queued at once, prompts
32-256 tokens, 64 output tokens, greedy, EOS ignored, spread over 16 tenants. With adapters,
each request's adapter is drawn from N distinct rank-16 adapters (all seven projections,
seeded random weights, PEFT layout, stored as uploads are) by Zipf popularity (s = 1.1).
The peer is the same workload on the base model alone, rounds interleaved.

The engine runs as it would serve many adapters: as many device slots as it runs sequences
(``--slots``), ``--host`` adapters in host memory, the rest in the store and loaded on a
request's first use. Round 1 of each N starts with nothing loaded (cold); later rounds draw
new requests from the same popularity, so the popular adapters are resident and the tail
still loads.

Figures:
- ``overhead_vs_base``: the base model's tokens/s over the adapters' run's, minus 1;
- ``floor``: the FLOPs the adapters add per token over those of the projections they
  adapt, r(d_in + d_out) / (d_in d_out) summed over the seven projections;
  ``floor_whole_model`` counts the base model's lm_head too;
- ``overhead_vs_floor_8``: overhead at 8 adapters over the floor;
- ``throughput_ratio_1000``: tokens/s at 1,000 adapters over the base model's;
- ``cold_load_*``: reading a rank-16 adapter from local disk (its pages dropped from the
  page cache first), checking and converting it, and copying it into a device slot;
- ``slot_hit_rate``: request starts whose adapter was already in a device slot (copied
  there beside an earlier step for a waiting request counts: ``slot_staged`` such copies);
- ``adapters_phase_s``: seconds the steps waited for adapter copies into slots before their
  forward pass, over the rounds; at the largest N, ``lora_N_unstaged`` runs the same rounds
  on an engine that stages nothing (every copy made before the step that needs it);
  ``host_hit_rate``: requests whose adapter was in host memory when they arrived.

    .venv/bin/python bench/lora_scale.py [--requests 256] [--adapters 8 128 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import BenchRequest, percentile, run_queued, write_result  # noqa: E402
from engine import protocol  # noqa: E402
from tests.engine.lora_testing import random_adapter  # noqa: E402

OUTPUT_TOKENS = 64
TENANTS = 16
ZIPF_S = 1.1


def zipf_choices(n: int, k: int, rng: random.Random) -> list[int]:
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(n)]
    return rng.choices(range(n), weights=weights, k=k)


def workload(n: int, vocab: range, adapters: list[str] | None, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    picks = zipf_choices(len(adapters), n, rng) if adapters else [None] * n
    reqs = []
    for i, pick in enumerate(picks):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(32, 256))]
        req = BenchRequest(request_id=f"s{seed}-r{i}", prompt_token_ids=prompt,
                           max_tokens=OUTPUT_TOKENS, arrival_s=0.0)
        req.tenant_id = adapters[pick] if pick is not None else ""  # the adapter's hash
        reqs.append(req)
    return reqs


def run_engine(engine, reqs: list[BenchRequest]) -> dict:
    """The run's summary, and the seconds its steps spent copying adapters into slots
    before their forward pass (``adapters_phase_s``)."""
    phases = engine.metrics.clock.seconds
    before = phases.get("adapters", 0.0)
    result = run_queued(engine, [protocol.EngineRequest(
        request_id=r.request_id, model="bench", prompt_token_ids=r.prompt_token_ids,
        tenant_id=f"tenant-{i % TENANTS}", cache_salt=r.request_id,
        adapter=r.tenant_id[:12] or None, adapter_hash=r.tenant_id or None,
        sampling=protocol.SamplingSpec(max_tokens=r.max_tokens, temperature=0.0,
                                       ignore_eos=True)) for i, r in enumerate(reqs)])
    result["adapters_phase_s"] = round(phases.get("adapters", 0.0) - before, 4)
    return result


def flop_floor(model_dir: Path, rank: int) -> tuple[float, float]:
    config = json.loads((model_dir / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    base = sum(i * o for i, o in shapes) * config["num_hidden_layers"]
    added = sum(rank * (i + o) for i, o in shapes) * config["num_hidden_layers"]
    return added / base, added / (base + h * config["vocab_size"])


def drop_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_loads(engine, store, hashes: list[str]) -> list[float]:
    """Seconds from the store to a device slot for each adapter, one at a time."""
    lifecycle = engine.adapters
    times = []
    for adapter_hash in hashes:
        drop_page_cache(store.path(adapter_hash))
        started = time.perf_counter()
        adapter = lifecycle.cache._load(adapter_hash)  # noqa: SLF001 - the loader's own path
        engine.runner.copy_adapter(0, adapter)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--adapters", type=int, nargs="+", default=[8, 128, 1000])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--host", type=int, default=256, help="adapters kept in host memory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold-samples", type=int, default=100)
    parser.add_argument("--out", default="lora_scale")
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.demo_model import build_model
    from engine.llm_engine import LLMEngine
    from engine.lora.store import AdapterStore

    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(tmp / "model", size="demo")
    store = AdapterStore(tmp / "store")
    started = time.monotonic()
    hashes = [store.put(random_adapter(model_dir, tmp / "peft" / str(i), seed=i, r=args.rank))
              for i in range(max(args.adapters))]
    print(f"{len(hashes)} adapters written in {time.monotonic() - started:.1f} s", flush=True)

    def fresh_engine():
        return LLMEngine(EngineConfig(model_dir=model_dir, adapter_store=store.root,
                                      max_loras=args.slots, max_lora_rank=args.rank,
                                      max_cpu_loras=args.host))

    base_engine = fresh_engine()
    vocab = range(10, base_engine.vocab_size)
    run_engine(base_engine, workload(8, vocab, None, seed=999))  # warm-up
    results: dict = {}
    base_runs: list[dict] = []
    for n in args.adapters:
        engine = fresh_engine()  # nothing loaded: round 1 is cold
        adapters = hashes[:n]
        runs = []
        for round_ in range(args.rounds):
            seed = 100 * round_ + n
            base_runs.append(run_engine(base_engine, workload(args.requests, vocab, None, seed)))
            runs.append(run_engine(engine, workload(args.requests, vocab, adapters, seed)))
            print(f"n={n} round {round_ + 1}: base {base_runs[-1]['output_tokens_per_s']} "
                  f"lora {runs[-1]['output_tokens_per_s']} tok/s", flush=True)
        if n == max(args.adapters):
            # The same rounds on an engine that copies every adapter into its slot before
            # the step that needs it (no staging beside earlier steps).
            unstaged = fresh_engine()
            unstaged.adapters.stage_per_step = 0
            unstaged_runs = [run_engine(unstaged, workload(args.requests, vocab, adapters,
                                                           100 * round_ + n))
                             for round_ in range(args.rounds)]
            results[f"lora_{n}_unstaged"] = {
                "output_tokens_per_s": statistics.median(
                    r["output_tokens_per_s"] for r in unstaged_runs),
                "rounds_tokens_per_s": [r["output_tokens_per_s"] for r in unstaged_runs],
                "adapters_phase_s": round(sum(r["adapters_phase_s"] for r in unstaged_runs), 3),
                "slot_hit_rate": round(unstaged.adapters.slots.hits / max(
                    1, unstaged.adapters.slots.hits + unstaged.adapters.slots.misses), 4)}
            print(f"n={n} unstaged:", results[f"lora_{n}_unstaged"], flush=True)
        slots, lifecycle = engine.adapters.slots, engine.adapters
        base_tps = statistics.median(r["output_tokens_per_s"] for r in base_runs[-args.rounds:])
        tps = statistics.median(r["output_tokens_per_s"] for r in runs)
        results[f"lora_{n}"] = {
            "output_tokens_per_s": tps,
            "rounds_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
            "base_tokens_per_s": base_tps,
            "base_rounds_tokens_per_s": [r["output_tokens_per_s"]
                                         for r in base_runs[-args.rounds:]],
            "overhead_vs_base": round(base_tps / tps - 1, 4),
            "throughput_ratio": round(tps / base_tps, 4),
            "cold_round_tokens_per_s": runs[0]["output_tokens_per_s"],
            "ttft_ms": runs[len(runs) // 2]["ttft_ms"],
            "slot_hit_rate": round(slots.hits / max(1, slots.hits + slots.misses), 4),
            "host_hit_rate": round(lifecycle.host_hits
                                   / max(1, lifecycle.host_hits + lifecycle.host_misses), 4),
            "slot_evictions": slots.evictions,
            "slot_staged": slots.staged,
            "adapters_phase_s": round(sum(r["adapters_phase_s"] for r in runs), 3),
        }
        print(f"n={n}:", results[f"lora_{n}"], flush=True)
        if n == max(args.adapters):
            cold = cold_loads(engine, store, hashes[-args.cold_samples:])
            results["cold_load"] = {"samples": len(cold),
                                    "p50_s": round(percentile(cold, 50), 4),
                                    "p99_s": round(percentile(cold, 99), 4),
                                    "max_s": round(max(cold), 4)}
            print("cold loads:", results["cold_load"], flush=True)
    floor, floor_whole = flop_floor(model_dir, args.rank)
    summary = {"floor": round(floor, 4), "floor_whole_model": round(floor_whole, 4)}
    if 8 in args.adapters:
        summary["overhead_vs_floor_8"] = round(results["lora_8"]["overhead_vs_base"] / floor, 3)
    if 1000 in args.adapters:
        summary["throughput_ratio_1000"] = results["lora_1000"]["throughput_ratio"]
    if "cold_load" in results:
        summary["cold_load_p50_s"] = results["cold_load"]["p50_s"]
        summary["cold_load_p99_s"] = results["cold_load"]["p99_s"]
    print(summary, flush=True)
    path = write_result(args.out, {
        "checkpoint": "demo (random-weight adapters; EOS ignored, every request runs to "
                      "max_tokens)",
        "workload": {"requests": args.requests, "prompt_len": [32, 256],
                     "output_tokens": OUTPUT_TOKENS, "rank": args.rank, "slots": args.slots,
                     "host_adapters": args.host, "zipf_s": ZIPF_S, "tenants": TENANTS,
                     "rounds": args.rounds},
        **summary, **results})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
