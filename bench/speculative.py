"""Speculative decoding on and off in one run (issue 21; docs/speculative.md).

Two workloads on the demo checkpoint, greedy:

- **grounded**: each prompt holds its answer: a paragraph of the demo corpus, what the
  model says after it, then the paragraph again (the n-gram proposer's case: an edit, a
  summary or an extraction quoting its source; the demo model cannot copy on request);
- **open**: each prompt is a fresh paragraph; nothing forces the answer to repeat it.

Two loads: **batch 1** (one request at a time; the figure is the inter-token latency,
the time from a request's first token to its last over the tokens between) and
**saturation** (every request of the workload at once; the figure is output tokens per
second). The same engine configuration runs with ``speculative="off"``, ``"ngram"`` and
``"draft:PATH"`` (the demo's draft model: ``demo-draft``, a quarter of its width, half
its depth, trained on the same corpus with the same tokenizer), in alternating order in
one process; every figure is the median round, and ``spread`` gives the lowest and the
highest round's ratio to off. Every greedy output with speculation is compared with the
one without.

    .venv/bin/python bench/speculative.py [--rounds 3] [--requests 8] [--max-tokens 96]

Writes bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import write_result  # noqa: E402

MODES = ("off", "ngram", "draft")


def _prompts(tokenizer, *, count: int, seed: int) -> list[list[int]]:
    from engine.demo_corpus import paragraph

    rng = random.Random(seed)
    return [tokenizer.encode(paragraph(rng, 6)).ids for _ in range(count)]


def _grounded(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prompts whose answer is in them: a paragraph, what the model says after it, then the
    paragraph again. NOTE: the demo model was never trained to copy, so "quote this" is
    built from its own answer (a regenerated draft, an edit of a text in the prompt)."""
    answers = _run(engine, prompts, max_tokens, one_at_a_time=False)["outputs"]
    return [p + a + p for p, a in zip(prompts, answers, strict=True)]


def _request(rid: str, prompt: list[int], max_tokens: int):
    from engine import protocol

    return protocol.EngineRequest(
        request_id=rid, model="demo", prompt_token_ids=prompt, tenant_id="bench",
        sampling=protocol.SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True))


def _run(engine, prompts: list[list[int]], max_tokens: int, *, one_at_a_time: bool) -> dict:
    """Runs the prompts (all at once, or each alone); tokens per request, and timings."""
    outputs: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    drafts0, proposed0, accepted0 = (engine.metrics.spec_drafts, engine.metrics.spec_draft_tokens,
                                     engine.metrics.spec_accepted_tokens)
    began, n = time.perf_counter(), 0
    for batch in batches:
        for prompt in batch:
            engine.add_request(_request(f"q{n}", prompt, max_tokens))
            n += 1
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                if out.token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    elapsed = time.perf_counter() - began
    itl = [(last[r] - first[r]) / (len(outputs[r]) - 1) for r in outputs if len(outputs[r]) > 1]
    m = engine.metrics
    return {"outputs": [outputs[f"q{i}"] for i in range(n)],
            "itl_s": statistics.mean(itl),
            "output_tokens_per_s": sum(len(t) for t in outputs.values()) / elapsed,
            "drafts": m.spec_drafts - drafts0, "draft_tokens": m.spec_draft_tokens - proposed0,
            "accepted_tokens": m.spec_accepted_tokens - accepted0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="prompts per workload")
    parser.add_argument("--saturation", type=int, default=32, help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--model-dir", type=Path, help="a checkpoint instead of the demo model")
    parser.add_argument("--draft-dir", type=Path,
                        help="the draft model (default: the demo's, built: demo-draft)")
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer

    from engine.config import EngineConfig
    from engine.demo_model import DEMO_SEED, build_model, ensure_demo_model
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or ensure_demo_model(tempfile.mkdtemp(prefix="atrium-spec-"))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    draft_dir = args.draft_dir or build_model(
        Path(tempfile.mkdtemp(prefix="atrium-draft-")) / "demo-draft", size="demo-draft",
        seed=DEMO_SEED)
    specs = {"off": "off", "ngram": "ngram", "draft": f"draft:{draft_dir}"}
    engines = {mode: LLMEngine(EngineConfig(
        model_dir=model_dir, speculative=spec, num_speculative_tokens=args.tokens,
        max_num_seqs=64, max_num_batched_tokens=512)) for mode, spec in specs.items()}
    workloads = {
        "grounded": _grounded(engines["off"], _prompts(tokenizer, count=args.requests, seed=1),
                              args.max_tokens),
        "open": _prompts(tokenizer, count=args.requests, seed=2)}
    saturated = (workloads["grounded"] + workloads["open"]) * (
        -(-args.saturation // (2 * args.requests)))
    saturated = saturated[:args.saturation]
    for engine in engines.values():  # warm both: first calls, allocator
        _run(engine, workloads["open"][:2], 8, one_at_a_time=False)

    runs: dict[str, dict[str, list[dict]]] = {}
    identical = True
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for case, prompts, alone in [("grounded_batch1", workloads["grounded"], True),
                                     ("open_batch1", workloads["open"], True),
                                     ("saturated", saturated, False)]:
            got = {}
            for mode in order:
                got[mode] = _run(engines[mode], prompts, args.max_tokens, one_at_a_time=alone)
                row = {k: v for k, v in got[mode].items() if k != "outputs"}
                runs.setdefault(case, {}).setdefault(mode, []).append(row)
                print(case, mode, row, flush=True)
            identical &= got["off"]["outputs"] == got["ngram"]["outputs"] \
                == got["draft"]["outputs"]

    def median(case: str, mode: str, key: str) -> float:
        return statistics.median(row[key] for row in runs[case][mode])

    def acceptance(case: str, mode: str = "ngram") -> float:
        rows = runs[case][mode]
        return sum(r["accepted_tokens"] for r in rows) / max(1, sum(r["draft_tokens"]
                                                                    for r in rows))

    def spread(case: str, mode: str) -> list[float]:
        """The lowest and highest of the rounds' ratios to off (each round's own)."""
        if case == "saturated":
            ratios = [m["output_tokens_per_s"] / o["output_tokens_per_s"]
                      for o, m in zip(runs[case]["off"], runs[case][mode], strict=True)]
        else:
            ratios = [o["itl_s"] / m["itl_s"]
                      for o, m in zip(runs[case]["off"], runs[case][mode], strict=True)]
        return [round(min(ratios), 3), round(max(ratios), 3)]

    result = {
        "spread": {case: {mode: spread(case, mode) for mode in ("ngram", "draft")}
                   for case in ("grounded_batch1", "open_batch1", "saturated")},
        "itl_speedup_batch1": round(median("grounded_batch1", "off", "itl_s")
                                    / median("grounded_batch1", "ngram", "itl_s"), 3),
        "itl_speedup_batch1_open": round(median("open_batch1", "off", "itl_s")
                                         / median("open_batch1", "ngram", "itl_s"), 3),
        "throughput_ratio_saturated": round(median("saturated", "ngram", "output_tokens_per_s")
                                            / median("saturated", "off", "output_tokens_per_s"),
                                            3),
        "acceptance_rate": round(acceptance("grounded_batch1"), 3),
        "acceptance_rate_open": round(acceptance("open_batch1"), 3),
        "greedy_identical": identical,
        "proposer": "ngram",
        "draft": {
            "itl_speedup_batch1": round(median("grounded_batch1", "off", "itl_s")
                                        / median("grounded_batch1", "draft", "itl_s"), 3),
            "itl_speedup_batch1_open": round(median("open_batch1", "off", "itl_s")
                                             / median("open_batch1", "draft", "itl_s"), 3),
            "throughput_ratio_saturated": round(
                median("saturated", "draft", "output_tokens_per_s")
                / median("saturated", "off", "output_tokens_per_s"), 3),
            "acceptance_rate": round(acceptance("grounded_batch1", "draft"), 3),
            "acceptance_rate_open": round(acceptance("open_batch1", "draft"), 3),
            "model": str(draft_dir)},
        "itl_ms_batch1": {case: {mode: round(1000 * median(case, mode, "itl_s"), 3)
                                 for mode in MODES}
                          for case in ("grounded_batch1", "open_batch1")},
        "output_tokens_per_s_saturated": {mode: round(median("saturated", mode,
                                                             "output_tokens_per_s"), 1)
                                          for mode in MODES},
        "config": {"rounds": args.rounds, "requests": args.requests,
                   "saturation": args.saturation, "max_tokens": args.max_tokens,
                   "num_speculative_tokens": args.tokens, "speculative_max_batch": 4,
                   "torch_threads": args.threads, "model": str(model_dir)},
        "runs": runs,
    }
    path = write_result("speculative", result)
    print({k: v for k, v in result.items() if k not in ("runs", "config")}, "->", path)


if __name__ == "__main__":
    main()
