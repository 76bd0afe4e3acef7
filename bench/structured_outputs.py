"""Structured outputs (issue 17): what a json_schema grammar costs a batch, and its compile time.

Throughput: 32 chat prompts given at once to one engine on the demo checkpoint, sampled at
temperature 1 with a seed each, EOS ending them, in four forms that alternate over the
rounds (C, W, L, U, then U, L, W, C, ...: the place in a round lands on every side):

- C, constrained: response_format json_schema, the schema the openai SDK's ``.parse()``
  sends for a six-field pydantic model (bounded strings, an enum, a bounded integer, a
  boolean, an array of enums); an answer ends when its JSON closes.
- W, what-if: C with the length-bounded strings' character compiled as one character class
  (no escapes) instead of engine/grammar.py's alternation (a JSON character or an escape),
  by setting that module's constant in this process for that one compile (no engine file
  changes). It shows what the alternation costs.
- L, the peer, length-matched: the same requests unconstrained, each with max_tokens set to
  the length its constrained answer had (EOS ignored, so it makes exactly that many), so both
  sides generate the same tokens per request and the ratio is the mask's cost alone.
- U, unconstrained: the same requests, same max_tokens, no grammar (answers end at EOS or
  max_tokens, so their lengths differ from C's).

Reported per side: output tokens/s, CPU ms per output token, mean tokens per answer, and
the wall time of a decode step with all 32 rows in it. Then one run each of C, W and L under
cProfile, split into the grammar's parts.

Compile time: submit -> result on a fresh ``Grammars`` (cold) and again (cached), medians,
for the typical schema, json_object, and 100 optional integer properties (cold).

    .venv/bin/python bench/structured_outputs.py [--rounds 8] [--requests 32]

Writes bench/results/structured_outputs.json; one torch thread (the engine's default on
the development VM is all cores; one makes the figures steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import write_result  # noqa: E402
from engine import protocol  # noqa: E402

MAX_TOKENS = 256  # above the longest answer the schema admits, so C always ends on its own
# NOTE: the what-if's character for length-bounded strings: one character class, which
# xgrammar precomputes token masks for, in place of engine.grammar's alternation (a JSON
# character or an escape), which it checks token by token at every step. It admits no escape.
WHAT_IF_CHARS = r'[^\0-\x1f\"\\]'


@contextlib.contextmanager
def string_character(chars: str):
    """engine.grammar's character for length-bounded strings, swapped in this process only."""
    import engine.grammar as grammar_module

    if not hasattr(grammar_module, "_JSON_CHARS"):
        # NOTE: the what-if patches this constant; without it W would silently equal C.
        raise RuntimeError("engine.grammar._JSON_CHARS is gone: update the what-if side")
    saved = grammar_module._JSON_CHARS
    grammar_module._JSON_CHARS = chars
    try:
        yield
    finally:
        grammar_module._JSON_CHARS = saved


def typical_schema() -> dict[str, Any]:
    """What ``client.beta.chat.completions.parse(response_format=Ticket)`` sends."""
    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Ticket(BaseModel):
        title: str = Field(max_length=32)
        customer: str = Field(max_length=16)
        priority: Literal["low", "normal", "high", "urgent"]
        severity: int = Field(ge=1, le=5)
        escalate: bool
        tags: list[Literal["billing", "login", "bug", "feature", "outage"]] = Field(
            max_length=3)

    return to_strict_json_schema(Ticket)


def large_schema(n: int = 100) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i}": {"type": "integer"} for i in range(n)}}


def prompts(model_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts through the demo model's template: a system line, a user's complaint."""
    from jinja2 import Environment
    from tokenizers import Tokenizer

    from engine import demo_corpus
    from engine.demo_model import BOS
    from engine.demo_template import CHAT_TEMPLATE

    template = Environment().from_string(CHAT_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "File the user's message as a support "
                                                  "ticket, in JSON."},
                    {"role": "user", "content": demo_corpus.paragraph(rng, rng.randint(2, 6))}]
        text = template.render(messages=messages, bos_token=BOS, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def requests(side: str, prompt_ids: list[list[int]], grammars: dict[str, dict[str, Any]],
             lengths: list[int] | None) -> list[protocol.EngineRequest]:
    """The same prompts and seeds for every side; ``grammars`` maps a side to its format."""
    out = []
    for i, prompt in enumerate(prompt_ids):
        spec = protocol.SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i)
        if side in grammars:
            spec.grammar = grammars[side]
        elif side == "length_matched":
            spec.max_tokens, spec.ignore_eos = lengths[i], True
        out.append(protocol.EngineRequest(request_id=f"{side}-{i}", model="bench",
                                          prompt_token_ids=prompt, sampling=spec,
                                          tenant_id="bench", cache_salt="bench"))
    return out


def run_batch(engine, batch: list[protocol.EngineRequest], rows: int) -> dict[str, Any]:
    """Gives all requests at once and steps until they are done; times every step."""
    scheduled: list[Any] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.append(out)
        return out

    engine.scheduler.schedule = recording_schedule  # the bench's own wrapper, removed below
    tokens: dict[str, list[int]] = {r.request_id: [] for r in batch}
    texts: dict[str, str] = {r.request_id: "" for r in batch}
    reasons: dict[str, str | None] = {}
    full_decode_steps: list[float] = []
    steps = 0
    try:
        cpu, started = time.process_time(), time.perf_counter()
        for r in batch:
            engine.add_request(r)
        while engine.has_unfinished():
            scheduled.clear()
            t0 = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - t0
            steps += 1
            if scheduled and len(scheduled[-1].requests) == rows and all(
                    q.is_decode for q in scheduled[-1].requests):
                full_decode_steps.append(elapsed)
            for out in outputs:
                if out is None:
                    continue
                if out.error:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                tokens[out.request_id] += out.token_ids
                texts[out.request_id] += out.text_delta
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        engine.scheduler.schedule = schedule
    lengths = [len(tokens[r.request_id]) for r in batch]
    total = sum(lengths)
    return {"output_tokens": total, "duration_s": round(wall, 4),
            "output_tokens_per_s": round(total / wall, 2),
            "cpu_ms_per_output_token": round(1000 * cpu / total, 4),
            "mean_tokens_per_answer": round(total / len(batch), 2),
            "steps": steps, "full_decode_steps": len(full_decode_steps),
            "ms_per_full_decode_step": round(1000 * statistics.median(full_decode_steps), 3)
            if full_decode_steps else None,
            "finish_reasons": {k: list(reasons.values()).count(k) for k in set(reasons.values())},
            "lengths": lengths, "texts": [texts[r.request_id] for r in batch]}


def valid_answers(texts: list[str], schema: dict[str, Any]) -> int:
    import jsonschema

    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


# (label, file suffix, function name): the grammar's parts and the sampler around them.
PROFILE_PARTS = [
    ("GrammarState.fill (xgrammar fill_next_token_bitmask)", "engine/grammar.py", "fill"),
    ("GrammarState.accept (xgrammar accept_token)", "engine/grammar.py", "accept"),
    ("GrammarState.is_terminated", "engine/grammar.py", "is_terminated"),
    ("apply_grammars (whole)", "engine/grammar.py", "apply_grammars"),
    ("xgr.allocate_token_bitmask", "xgrammar/matcher.py", "allocate_token_bitmask"),
    ("xgr.apply_token_bitmask_inplace", "xgrammar/matcher.py", "apply_token_bitmask_inplace"),
    ("sampler.sample_batch (whole)", "engine/sampler.py", "sample_batch"),
    ("sampler.sample (per-row path)", "engine/sampler.py", "sample"),
    ("scheduler.postprocess", "engine/scheduler.py", "postprocess"),
    ("LLMEngine.step (whole)", "engine/llm_engine.py", "step"),
]


def profile_batch(engine, batch, rows) -> dict[str, Any]:
    profiler = cProfile.Profile()
    profiler.enable()
    result = run_batch(engine, batch, rows)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
    total = result["duration_s"]
    parts = {}
    for label, suffix, func in PROFILE_PARTS:
        hits = [v for (f, _, name), v in stats.items()
                if name == func and f.replace("\\", "/").endswith(suffix)]
        calls = sum(v[1] for v in hits)
        cum = sum(v[3] for v in hits)
        parts[label] = {"calls": calls, "cum_s": round(cum, 4),
                        "us_per_call": round(1e6 * cum / calls, 2) if calls else None,
                        "share_of_run": round(cum / total, 4)}
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    return {"duration_s_profiled": total, "output_tokens": result["output_tokens"],
            "parts": parts,
            "top_tottime": [{"function": f"{Path(f).name}:{line}:{name}", "calls": v[1],
                             "tottime_s": round(v[2], 4)} for (f, line, name), v in top]}


def engine_revision() -> dict[str, Any]:
    """The commit of the tree the engine was imported from, and whether engine/ differed."""
    import subprocess

    import engine

    tree = Path(engine.__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *argv], capture_output=True,
                              text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "engine_uncommitted_changes": bool(git("status", "--porcelain", "engine"))}


def compile_times(model_dir: Path, vocab_size: int, eos: list[int], reps: int
                  ) -> dict[str, Any]:
    from engine.grammar import Grammars

    def one(spec: dict[str, Any]) -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        grammars = Grammars(model_dir, vocab_size, eos)
        t1 = time.perf_counter()
        grammars.submit(spec).result()
        t2 = time.perf_counter()
        grammars.submit(spec).result()
        t3 = time.perf_counter()
        assert grammars.misses == 1 and grammars.hits == 1
        inside = grammars.last_compile_seconds
        grammars.close()
        return t1 - t0, t2 - t1, t3 - t2, inside

    typical = {"type": "json_schema", "schema": typical_schema()}
    specs = {"typical json_schema": (typical, reps, None),
             "typical json_schema, what-if string character": (typical, reps, WHAT_IF_CHARS),
             "json_object": ({"type": "json_object"}, reps, None),
             "100 optional integer properties": (
                 {"type": "json_schema", "schema": large_schema()}, max(3, reps // 4), None)}
    one(specs["json_object"][0])  # imports and first-call costs, outside the figures
    out = {}
    for name, (spec, n, chars) in specs.items():
        with string_character(chars) if chars else contextlib.nullcontext():
            runs = [one(spec) for _ in range(n)]
        med = [statistics.median(r[k] for r in runs) for k in range(4)]
        out[name] = {"repetitions": n, "grammars_init_ms": round(1000 * med[0], 3),
                     "cold_ms": round(1000 * med[1], 3),
                     "cold_ms_max": round(1000 * max(r[1] for r in runs), 3),
                     "compile_only_ms": round(1000 * med[3], 3),
                     "cached_ms": round(1000 * med[2], 4)}
        print(f"compile {name}: cold {out[name]['cold_ms']:.2f} ms, cached "
              f"{out[name]['cached_ms']:.4f} ms ({n} reps)", flush=True)
    return out


SIDES = ("constrained", "what_if", "length_matched", "unconstrained")
FIELDS = ("output_tokens_per_s", "cpu_ms_per_output_token", "mean_tokens_per_answer",
          "ms_per_full_decode_step")


def make_engine(model_dir: Path):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    # NOTE: prefix caching off: every round prefills its prompts, as new requests would, and
    # no side runs on KV an earlier side left behind.
    return LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=64,
                                  max_num_batched_tokens=512, enable_prefix_caching=False))


def precompile_what_if(engine, schema: dict[str, Any]) -> dict[str, Any]:
    """The what-if format: the schema under another title (so another cache key), compiled
    into the engine's grammar cache while engine.grammar's string character is the character
    class. Only this process's module constant changes, and only for this compile."""
    spec = {"type": "json_schema", "schema": {**schema, "title": "TicketWhatIf"}}
    with string_character(WHAT_IF_CHARS):
        engine.grammars().submit(spec).result()
    return spec


def compare(engine, num_rounds: int, prompt_ids: list[list[int]], schema: dict[str, Any],
            grammars: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Calibrates the constrained lengths, then runs every side in alternating order."""
    n = len(prompt_ids)
    # Calibration (and warm-up of every path): the constrained answers' lengths.
    calib = run_batch(engine, requests("constrained", prompt_ids, grammars, None), n)
    lengths = calib["lengths"]
    for side in SIDES[1:]:
        run_batch(engine, requests(side, prompt_ids, grammars, lengths), n)
    print(f"constrained answers: {statistics.fmean(lengths):.1f} tokens on average "
          f"({min(lengths)}-{max(lengths)}), {valid_answers(calib['texts'], schema)}/{n} valid",
          flush=True)
    rounds: dict[str, list[dict]] = {s: [] for s in SIDES}
    valid = {s: 0 for s in SIDES}
    drift = {s: 0 for s in grammars}  # answers whose length differed from the calibration
    for i in range(num_rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            result = run_batch(engine, requests(side, prompt_ids, grammars, lengths), n)
            valid[side] += valid_answers(result.pop("texts"), schema)
            if side in grammars:
                drift[side] += sum(a != b for a, b in zip(result["lengths"], lengths,
                                                          strict=True))
            if side != "unconstrained":
                result.pop("lengths")
            rounds[side].append(result)
            print(f"round {i + 1} {side}: {result['output_tokens_per_s']:.1f} tok/s, "
                  f"{result['cpu_ms_per_output_token']:.3f} CPU ms/token, "
                  f"{result['ms_per_full_decode_step']} ms per {n}-row decode step", flush=True)

    def med(side: str, field: str) -> float | None:
        values = [r[field] for r in rounds[side] if r[field] is not None]
        return statistics.median(values) if values else None  # None: no 32-row decode step

    medians = {s: {f: med(s, f) for f in FIELDS} for s in SIDES}
    for s in SIDES:
        medians[s]["valid_json_answers"] = f"{valid[s]}/{n * num_rounds}"
    peer = medians["length_matched"]
    ratios: dict[str, Any] = {}
    for side in grammars:
        m = medians[side]
        ratios[side] = {
            "tokens_per_s_over_length_matched": round(
                m["output_tokens_per_s"] / peer["output_tokens_per_s"], 4),
            "cpu_per_token_over_length_matched": round(
                m["cpu_ms_per_output_token"] / peer["cpu_ms_per_output_token"], 4),
            "decode_step_over_length_matched": round(
                m["ms_per_full_decode_step"] / peer["ms_per_full_decode_step"], 4),
            "tokens_per_s_over_unconstrained": round(
                m["output_tokens_per_s"] / medians["unconstrained"]["output_tokens_per_s"], 4),
        }
        # Paired within each round (each side runs once in it), so drift between rounds
        # cancels: the median of these is the headline.
        for field, name in (("output_tokens_per_s", "tokens_per_s"),
                            ("cpu_ms_per_output_token", "cpu_per_token")):
            paired = [round(a[field] / b[field], 4)
                      for a, b in zip(rounds[side], rounds["length_matched"], strict=True)]
            ratios[side][f"{name}_over_length_matched_per_round"] = paired
            ratios[side][f"{name}_over_length_matched_median_of_rounds"] = round(
                statistics.median(paired), 4)
    return {"lengths": lengths, "length_drift": drift, "rounds": rounds, "medians": medians,
            "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--compile-reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--model-dir", type=Path,
                        help="a checkpoint instead of the demo model ($ATRIUM_HOME's cache)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()

    from engine.demo_model import ensure_demo_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = args.model_dir or ensure_demo_model()
    engine = make_engine(model_dir)
    schema = typical_schema()
    grammars = {"constrained": {"type": "json_schema", "schema": schema},
                "what_if": precompile_what_if(engine, schema)}
    prompt_ids = prompts(model_dir, args.requests)
    n = args.requests

    run = compare(engine, args.rounds, prompt_ids, schema, grammars)
    lengths, medians, ratios = run["lengths"], run["medians"], run["ratios"]

    profile = None
    if not args.no_profile:
        profile = {side: profile_batch(engine, requests(side, prompt_ids, grammars, lengths), n)
                   for side in ("constrained", "what_if", "length_matched")}

    compiles = compile_times(model_dir, engine.vocab_size, sorted(engine.eos_token_ids),
                             args.compile_reps)

    path = write_result("structured_outputs", {
        "engine_revision": engine_revision(),
        "model": str(model_dir.name), "vocab_size": engine.vocab_size,
        "workload": {"requests": n, "prompt_tokens_mean": round(
            statistics.fmean(len(p) for p in prompt_ids), 1), "temperature": 1.0,
            "max_tokens": MAX_TOKENS, "rounds": args.rounds,
            "order": "C, W, L, U / U, L, W, C", "torch_threads": args.threads,
            "prefix_caching": False, "constrained_lengths": lengths,
            "answers_whose_length_changed_in_rounds": run["length_drift"],
            "what_if_string_character": WHAT_IF_CHARS},
        "schema": schema, "medians": medians, "ratios": ratios, "rounds": run["rounds"],
        "profile": profile, "compile": compiles})

    print()
    print(f"| side | tokens/s | CPU ms/token | tokens/answer | ms per {n}-row decode step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in SIDES:
        m, step = medians[s], medians[s]["ms_per_full_decode_step"]
        print(f"| {s} | {m['output_tokens_per_s']:.1f} | {m['cpu_ms_per_output_token']:.3f} | "
              f"{m['mean_tokens_per_answer']:.1f} | "
              f"{'—' if step is None else f'{step:.2f}'} |")
    for side, r in ratios.items():
        print(f"{side} / length-matched: tokens/s "
              f"{r['tokens_per_s_over_length_matched_median_of_rounds']:.3f} (median of rounds; "
              f"of medians {r['tokens_per_s_over_length_matched']:.3f}), CPU per token "
              f"{r['cpu_per_token_over_length_matched_median_of_rounds']:.3f}, decode step "
              f"{r['decode_step_over_length_matched']:.3f}; / unconstrained tokens/s "
              f"{r['tokens_per_s_over_unconstrained']:.3f}")
    if profile:
        for side in ("constrained", "what_if"):
            for label, part in profile[side]["parts"].items():
                print(f"  profile {side} {label}: {part['calls']} calls, {part['cum_s']:.3f} s "
                      f"({100 * part['share_of_run']:.1f}% of the run)")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
