"""n = 4 in one request vs the same 4 choices as 4 separate requests, same engine, one run.

Each round submits a batch of prompts twice: once as requests with n = 4, once as 4
requests per prompt with the seeds the engine gives choices 1..3 (engine/seeds.py), so
both sides generate exactly the same tokens (EOS ignored). The peer runs with the prefix
cache on (it shares the prompt's full blocks, but prefills each request's last partial
block and sampling row itself) and off (every request prefills the whole prompt). Sides
alternate A, B, B, A, ... across rounds in fresh engines, so drift lands on both.

    .venv/bin/python bench/parallel_sampling.py [--rounds 4] [--prompts 8] [--prompt-len 500]

Reports output tokens per second, prompt tokens the engine ran (its own counter), and the
ratio n=4 / peer; writes bench/results/parallel_sampling.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import write_result  # noqa: E402
from engine import protocol  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.seeds import choice_seed  # noqa: E402

N = 4


def _request(rid: str, prompt: list[int], seed: int, n: int, max_tokens: int
             ) -> protocol.EngineRequest:
    return protocol.EngineRequest(
        request_id=rid, model="bench", prompt_token_ids=prompt, tenant_id="bench",
        cache_salt="bench", sampling=protocol.SamplingSpec(
            max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True))


def run_side(model_dir: Path, prompts: list[list[int]], max_tokens: int, side: str) -> dict:
    caching = side != "separate, no prefix cache"
    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=64,
                                    max_num_batched_tokens=2048,
                                    enable_prefix_caching=caching))
    for i, prompt in enumerate(prompts):
        if side == "n=4":
            engine.add_request(_request(f"r{i}", prompt, seed=i, n=N, max_tokens=max_tokens))
        else:
            for k in range(N):
                engine.add_request(_request(f"r{i}-{k}", prompt, seed=choice_seed(i, k), n=1,
                                            max_tokens=max_tokens))
    prompt_before = engine.metrics.prompt_tokens
    started, cpu = time.monotonic(), time.process_time()
    tokens, outputs = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            key = (out.request_id.split("-")[0], out.index if side == "n=4"
                   else int(out.request_id.split("-")[1]))
            outputs.setdefault(key, []).extend(out.token_ids)
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    return {"side": side, "output_tokens": tokens, "seconds": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1),
            "cpu_ms_per_output_token": round(1000 * cpu / tokens, 4),
            "prompt_tokens_run": engine.metrics.prompt_tokens - prompt_before,
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine.demo_model import build_model

    model_dir = build_model(Path(tempfile.mkdtemp()) / "m", size="demo", seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1500) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    sides = ["n=4", "separate, prefix cache", "separate, no prefix cache"]
    rounds: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            result = run_side(model_dir, prompts, args.max_tokens, side)
            rounds[side].append(result)
            print(f"round {r + 1} {side}: {result['output_tokens_per_s']} tok/s, "
                  f"prompt tokens run {result['prompt_tokens_run']}", flush=True)
    same = all(rounds["n=4"][0]["outputs"] == rounds[s][0]["outputs"] for s in sides[1:])
    summary = {}
    for side in sides:
        runs = rounds[side]
        summary[side] = {
            "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in runs),
            "cpu_ms_per_output_token": statistics.median(x["cpu_ms_per_output_token"]
                                                         for x in runs),
            "prompt_tokens_run": runs[0]["prompt_tokens_run"],
            "output_tokens": runs[0]["output_tokens"]}
    base = summary["n=4"]["output_tokens_per_s"]
    ratios = {f"n=4 / {s}": round(base / summary[s]["output_tokens_per_s"], 3)
              for s in sides[1:]}
    for side in sides:
        for run in rounds[side]:
            run.pop("outputs")
    path = write_result("parallel_sampling", {
        "config": vars(args), "identical_outputs": same, "summary": summary,
        "throughput_ratios": ratios, "rounds": rounds})
    print(f"identical outputs on every side: {same}")
    for side, row in summary.items():
        print(f"{side:28s} {row['output_tokens_per_s']:8.1f} tok/s  "
              f"prompt tokens run {row['prompt_tokens_run']}")
    print(ratios, "->", path)


if __name__ == "__main__":
    main()
