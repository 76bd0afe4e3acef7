"""Continuous batching vs Hugging Face `generate` in static batches, same model, one run.

Mixed workload (prompts 16-1024 tokens, outputs 16-256, Poisson arrivals), greedy,
EOS ignored so both sides produce exactly the requested tokens. Reports throughput
and TTFT / TPOT / ITL percentiles the way vLLM's serving benchmark does.

    .venv/bin/python bench/engine_throughput.py [--requests 64] [--rate 16] [--hf-batch 8 16 32]

The rate is chosen to saturate the engine on a 2-core CPU, so throughput measures
capacity, not the arrival rate. The peer runs at each static batch size given and
the ratio is taken against its best.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import (  # noqa: E402
    BenchRequest,
    Trace,
    poisson_workload,
    summarize,
    write_result,
)
from engine import protocol  # noqa: E402


def engine_request(req: BenchRequest) -> protocol.EngineRequest:
    return protocol.EngineRequest(
        request_id=req.request_id, model="bench", prompt_token_ids=req.prompt_token_ids,
        sampling=protocol.SamplingSpec(max_tokens=req.max_tokens, temperature=0.0,
                                       ignore_eos=True),
        tenant_id=req.tenant_id, cache_salt=req.tenant_id)


def run_engine(engine, workload: list[BenchRequest]) -> dict:
    """Replays arrivals in real time against an EngineCore and records token times."""
    trace, pending = Trace(), sorted(workload, key=lambda r: r.arrival_s)
    started = time.monotonic()
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.monotonic() - started
        while i < len(pending) and pending[i].arrival_s <= now:
            trace.arrival[pending[i].request_id] = started + pending[i].arrival_s
            engine.add_request(engine_request(pending[i]))
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i].arrival_s - now))
            continue
        outputs = engine.step()
        when = time.monotonic()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            if out.token_ids:
                trace.token(out.request_id, when, len(out.token_ids))
    return summarize(trace, started, time.monotonic())


class _StepClock:
    """A logits processor that only notes when each decoding step happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.monotonic())
        return scores


def run_hf_static(model_dir: Path, workload: list[BenchRequest], batch_size: int) -> dict:
    """Static batches in arrival order: a batch starts when its last member has arrived
    and the previous batch is done, and runs until its longest request is done."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 0
    trace = Trace()
    ordered = sorted(workload, key=lambda r: r.arrival_s)
    started = time.monotonic()
    for b in range(0, len(ordered), batch_size):
        batch = ordered[b:b + batch_size]
        for r in batch:
            trace.arrival[r.request_id] = started + r.arrival_s
        wait = started + batch[-1].arrival_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        steps = max(r.max_tokens for r in batch)
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=False, eos_token_id=None,
                           pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        done = time.monotonic()
        # Token k of every row exists once step k's logits are processed; the last at `done`.
        token_times = clock.times[1:] + [done]
        for r in batch:
            for k in range(r.max_tokens):
                trace.token(r.request_id, token_times[k])
    return summarize(trace, started, time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second")
    parser.add_argument("--hf-batch", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--size", default="demo", help="demo model size to build")
    parser.add_argument("--model-dir", type=Path, help="a checkpoint instead of the demo model")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.demo_model import build_model
    from engine.llm_engine import LLMEngine

    torch.manual_seed(0)
    model_dir = args.model_dir or build_model(Path(tempfile.mkdtemp()) / "m", size=args.size)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_batched_tokens))
    vocab = range(10, engine.vocab_size)
    workload = poisson_workload(n=args.requests, rate=args.rate, prompt_len=(16, 1024),
                                output_len=(16, 256), vocab=vocab, seed=0)
    # Warm both paths once so neither pays first-call costs inside the measurement.
    warm = poisson_workload(n=2, rate=0, prompt_len=(32, 32), output_len=(4, 4), vocab=vocab,
                            seed=1)
    run_engine(engine, warm)
    ours = run_engine(engine, workload)
    print("engine", ours, flush=True)
    peers = {}
    for size in args.hf_batch:
        peers[size] = run_hf_static(model_dir, workload, size)
        print(f"hf static batch {size}", peers[size], flush=True)
    best = max(peers, key=lambda size: peers[size]["output_tokens_per_s"])
    ratio = ours["output_tokens_per_s"] / peers[best]["output_tokens_per_s"]
    path = write_result("engine_throughput", {
        "workload": {"requests": args.requests, "rate_per_s": args.rate,
                     "prompt_len": [16, 1024], "output_len": [16, 256]},
        "model_dir": str(model_dir), "engine_config": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_batched_tokens},
        "engine": ours, "hf_static": {str(k): v for k, v in peers.items()},
        "best_hf_batch_size": best, "throughput_ratio_vs_best": round(ratio, 2)})
    print(f"throughput ratio vs the best static batch ({best}): {ratio:.2f}x -> {path}")


if __name__ == "__main__":
    main()
