"""Multi-LoRA throughput: N distinct adapters in one workload vs the base model alone vs PEFT.

The same workload (prompts 32-256 tokens, 64 output tokens, greedy, EOS ignored, all
requests queued at once) runs through:
- the engine on the base model alone (the reference for LoRA overhead);
- the engine with the requests spread over N adapters (N = 1, 8, 32, 128; the engine has
  32 slots, so 128 goes beyond them and adapters take turns);
- PEFT's mixed-adapter batch generation (`generate(adapter_names=...)`), static batches
  of 16 in arrival order, with the same N adapters loaded.

Adapters are rank 16 on all seven projections with random (non-zero) weights, in PEFT
format, stored and loaded the way uploaded ones are.

Each engine configuration runs three rounds, interleaved, and reports its median.

    .venv/bin/python bench/lora_throughput.py [--requests 64] [--adapters 1 8 32 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import (  # noqa: E402
    BenchRequest,
    Trace,
    run_queued,
    summarize,
    write_result,
)
from engine import protocol  # noqa: E402

OUTPUT_TOKENS = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(n):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
        folders.append(out / f"adapter-{i}")
        peft_model.save_pretrained(folders[-1])
    return folders


def workload(n: int, vocab: range, adapters: list[str | None]) -> list[BenchRequest]:
    rng = random.Random(0)
    reqs = []
    for i in range(n):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(32, 256))]
        req = BenchRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                           max_tokens=OUTPUT_TOKENS, arrival_s=0.0)
        req.tenant_id = adapters[i % len(adapters)] or "base"  # reused as the adapter name
        reqs.append(req)
    return reqs


def run_engine(engine, reqs: list[BenchRequest], hashes: dict[str, str]) -> dict:
    return run_queued(engine, [protocol.EngineRequest(
        request_id=r.request_id, model="bench", prompt_token_ids=r.prompt_token_ids,
        tenant_id="bench", cache_salt=r.request_id,
        adapter=r.tenant_id if r.tenant_id != "base" else None,
        adapter_hash=hashes.get(r.tenant_id),
        sampling=protocol.SamplingSpec(max_tokens=r.max_tokens, temperature=0.0,
                                       ignore_eos=True)) for r in reqs])


def run_peft(model_dir: Path, folders: list[Path], reqs: list[BenchRequest],
             batch_size: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folders[0], adapter_name="adapter-0")
    for folder in folders[1:]:
        model.load_adapter(folder, adapter_name=folder.name)
    model.eval()
    trace = Trace()
    started = time.monotonic()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
            trace.arrival[r.request_id] = started
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=OUTPUT_TOKENS,
                           min_new_tokens=OUTPUT_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=None, adapter_names=[r.tenant_id for r in batch])
        done = time.monotonic()
        for r in batch:  # only the batch's end is observed: throughput, not latency
            trace.token(r.request_id, done, OUTPUT_TOKENS)
    return summarize(trace, started, time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--peft-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each configuration; the median is reported")
    parser.add_argument("--peft-adapters", type=int, nargs="+", default=[8],
                        help="adapter counts to run the (slow) PEFT peer at")
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.demo_model import build_model
    from engine.llm_engine import LLMEngine
    from engine.lora.store import AdapterStore

    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(tmp / "model", size="demo")
    store = AdapterStore(tmp / "store")
    folders = make_adapters(model_dir, tmp / "peft", max(args.adapters), args.rank)
    hashes = {f.name: store.put(f) for f in folders}
    engine = LLMEngine(EngineConfig(model_dir=model_dir, adapter_store=store.root,
                                    max_loras=args.slots, max_lora_rank=args.rank,
                                    max_cpu_loras=max(args.adapters)))
    vocab = range(10, engine.vocab_size)
    run_engine(engine, workload(4, vocab, [None, "adapter-0"]), hashes)  # warm-up
    # Each configuration runs once per round, the rounds interleaved so that a slow
    # moment of the machine falls on all of them; each reports its median round.
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        runs.setdefault("base", []).append(
            run_engine(engine, workload(args.requests, vocab, [None]), hashes))
        for n in args.adapters:
            names = [f.name for f in folders[:n]]
            # Warm the host cache, as a serving engine would be; slots still turn over.
            run_engine(engine, workload(n, vocab, names), hashes)
            runs.setdefault(f"lora_{n}", []).append(
                run_engine(engine, workload(args.requests, vocab, names), hashes))
        print(f"round {round_ + 1}:", {k: v[-1]["output_tokens_per_s"] for k, v in runs.items()},
              flush=True)
    results: dict = {}
    for name, done in runs.items():
        ranked = sorted(done, key=lambda r: r["output_tokens_per_s"])
        results[name] = {**ranked[len(ranked) // 2],
                         "rounds_tokens_per_s": [r["output_tokens_per_s"] for r in done]}
    base_tps = results["base"]["output_tokens_per_s"]
    print("base", results["base"], flush=True)
    for n in args.adapters:
        ours = results[f"lora_{n}"]
        ours["overhead_vs_base"] = round(1 - ours["output_tokens_per_s"] / base_tps, 3)
        print(f"lora x{n}", ours, flush=True)
    for n in args.peft_adapters:
        peer = run_peft(model_dir, folders[:n], workload(args.requests, vocab,
                                                          [f.name for f in folders[:n]]),
                        args.peft_batch)
        peer["engine_speedup"] = round(
            results[f"lora_{n}"]["output_tokens_per_s"] / peer["output_tokens_per_s"], 2)
        results[f"peft_{n}"] = peer
        print(f"peft x{n}", peer, flush=True)
    path = write_result("lora_throughput", {
        "workload": {"requests": args.requests, "prompt_len": [32, 256],
                     "output_tokens": OUTPUT_TOKENS, "rank": args.rank, "slots": args.slots,
                     "peft_batch": args.peft_batch, "rounds": args.rounds}, **results})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
