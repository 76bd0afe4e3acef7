"""Decode throughput on a CUDA GPU vs the memory-bandwidth bound, and vs HF `generate`.

A random-weight Llama of about 0.6B parameters (bfloat16) is built on the spot.
For batch sizes 1 and 64: prompts of 128 tokens, 128 greedy decode steps with EOS
ignored; the engine's decode-only steps are timed (prefill excluded). The bound is
bytes that one decode step must read (all weights once + the batch's KV cache) over
the device-to-device copy bandwidth measured in the same run (and the datasheet peak).

    python3 bench/gpu_decode.py [--batches 1 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import protocol  # noqa: E402

DATASHEET_TBPS = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H200": 4.8}


def build_checkpoint(out: Path, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=1536, intermediate_size=4096,
                         num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (tokenizer_dir / name).exists():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def copy_bandwidth_tbps() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * x.numel() * x.element_size() / statistics.median(times) / 1e12


def engine_decode(model_dir: Path, batch: int, prompt: int, steps: int, triton: bool) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16",
                                    max_num_seqs=max(batch, 1), use_triton=triton,
                                    max_num_batched_tokens=max(2048, batch * prompt)))
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, vocab, (prompt,), generator=g).tolist()
        engine.add_request(protocol.EngineRequest(
            request_id=f"b{batch}-{i}", model="bench", prompt_token_ids=ids, tenant_id="t",
            cache_salt=f"s{i}", sampling=protocol.SamplingSpec(
                max_tokens=steps, temperature=0.0, ignore_eos=True)))
    step_times, generated = [], 0
    while engine.has_unfinished():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        new = sum(len(o.token_ids) for o in outs)
        generated += new
        if new == batch:  # a decode step of the full batch
            step_times.append(dt)
    decode = step_times[3:]  # drop the first decode steps (allocator and kernel warm-up)
    step = statistics.median(decode)
    return {"batch": batch, "median_step_ms": round(step * 1000, 3),
            "decode_tokens_per_s": round(batch / step, 1), "steps_timed": len(decode),
            "kv_context_tokens_mid": prompt + steps // 2}


def hf_decode(model_dir: Path, batch: int, prompt: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), device="cuda")
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    per_step = (total - prefill) / (steps - 1)
    return {"batch": batch, "median_step_ms": round(per_step * 1000, 3),
            "decode_tokens_per_s": round(batch / per_step, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    from engine.demo_model import build_model

    work = Path(tempfile.mkdtemp())
    tok_dir = build_model(work / "tok", size="tiny")
    model_dir = build_checkpoint(work / "llama-0.6b", tok_dir)
    config = json.loads((model_dir / "config.json").read_text())
    params = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"])
                 .load_file(str(model_dir / "model.safetensors")).values())
    weight_bytes = 2 * params
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    measured = copy_bandwidth_tbps()
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in DATASHEET_TBPS.items() if k in name), None)
    rows = []
    for batch in args.batches:
        context = args.prompt + args.steps // 2
        step_bytes = weight_bytes + batch * context * kv_per_token
        bound_s = step_bytes / (measured * 1e12)
        row = {"batch": batch, "bytes_per_step": step_bytes,
               "bound_tokens_per_s_measured_bw": round(batch / bound_s, 1)}
        for label, triton in (("engine_triton", True), ("engine_torch", False)):
            r = engine_decode(model_dir, batch, args.prompt, args.steps, triton)
            r["fraction_of_bound"] = round(r["decode_tokens_per_s"] * bound_s / batch, 3)
            r["achieved_tbps"] = round(step_bytes / (r["median_step_ms"] / 1000) / 1e12, 3)
            row[label] = r
        row["hf_generate"] = hf_decode(model_dir, batch, args.prompt, args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "gpu_decode", "device": name, "params": params,
              "dtype": "bfloat16", "copy_bandwidth_tbps": round(measured, 3),
              "datasheet_tbps": peak, "prompt": args.prompt, "steps": args.steps, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
