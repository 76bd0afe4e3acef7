"""The continuous-batching engine end to end on the tiny checkpoint, against transformers."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from engine import protocol
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

NUM_PROMPTS, MAX_NEW = 20, 24


def request(rid: str, prompt: list[int], *, tenant: str = "t1", salt: str = "s1",
            adapter: str | None = None, adapter_hash: str | None = None,
            deadline: float | None = None, **sampling) -> protocol.EngineRequest:
    sampling.setdefault("max_tokens", MAX_NEW)
    sampling.setdefault("temperature", 0.0)
    return protocol.EngineRequest(
        request_id=rid, model="tiny", prompt_token_ids=prompt, tenant_id=tenant,
        cache_salt=salt, adapter=adapter, adapter_hash=adapter_hash, deadline=deadline,
        sampling=protocol.SamplingSpec(**sampling))


def drain(engine: LLMEngine, max_steps: int = 20_000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outs)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 2, 5, 15, 16, 17, 31, 33, 47, 64, 65, 80, 96, 100, 110, 120, 127, 128, 150, 200]
    assert len(lengths) == NUM_PROMPTS
    return [[rng.randrange(10, 1400) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_outputs(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from engine.reference import generate_reference

    return generate_reference(tiny_model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("options", [
    {},  # defaults: chunked prefill, prefix caching, a roomy pool
    {"max_num_batched_tokens": 24},  # long prompts are split into many chunks
    {"num_kv_blocks": 40, "block_size": 8, "max_num_batched_tokens": 64},  # forces preemption
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
    {"enable_prefix_caching": False, "max_num_seqs": 5},
    # n-gram speculation for every decoding sequence, drafts verified in one pass each
    {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 64},
    {"speculative": "ngram", "num_speculative_tokens": 3, "speculative_max_batch": 64,
     "num_kv_blocks": 40, "block_size": 8, "max_num_batched_tokens": 64},
], ids=["default", "chunked", "preempting", "unchunked", "no-prefix-cache-5-seqs",
        "speculative", "speculative-preempting"])
def test_greedy_batch_equals_transformers(tiny_model_dir, prompts, hf_outputs, options):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, **options))
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt))
    outputs = drain(engine)
    for i in range(NUM_PROMPTS):
        assert tokens(outputs[f"r{i}"]) == hf_outputs[i], f"prompt {i} ({len(prompts[i])} tokens)"
    if "num_kv_blocks" in options and options["num_kv_blocks"] == 40:
        assert engine.scheduler.num_preemptions > 0
    if "speculative" in options:
        assert engine.metrics.spec_accepted_tokens > 0  # it speculated, and it paid off
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.slow
def test_greedy_batch_equals_transformers_with_the_triton_decode_kernel(
        tiny_model_dir, prompts, hf_outputs):
    # Interpreted on a CPU, the kernel costs seconds a step: seven prompts of the twenty
    # (1 to 200 tokens), eight tokens each, most of them decoding across a 16-token
    # block's end (15, 31 and 127 tokens) or starting a block (16, 128).
    chosen, max_new = [0, 3, 4, 6, 16, 17, 19], 8  # 1, 15, 16, 31, 127, 128, 200 tokens
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, use_triton=True,
                                    num_kv_blocks=256))
    for i in chosen:
        engine.add_request(request(f"r{i}", prompts[i], max_tokens=max_new))
    outputs = drain(engine)
    for i in chosen:
        assert tokens(outputs[f"r{i}"]) == hf_outputs[i][:max_new], \
            f"prompt {i} ({len(prompts[i])} tokens)"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_requests_arriving_mid_generation_join_the_running_batch(tiny_model_dir, prompts,
                                                                 hf_outputs):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, max_num_batched_tokens=64))
    outputs: dict[str, list[RequestOutput]] = {}
    pending = list(range(NUM_PROMPTS))
    batch_sizes = []
    while pending or engine.has_unfinished():
        if pending:  # one new arrival every step
            i = pending.pop(0)
            engine.add_request(request(f"r{i}", prompts[i]))
        batch_sizes.append(engine.num_running())
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert max(batch_sizes) > 4
    for i in range(NUM_PROMPTS):
        assert tokens(outputs[f"r{i}"]) == hf_outputs[i]


# -- prefix cache ---------------------------------------------------------------------------

def _cached(engine: LLMEngine, rid: str, prompt: list[int], **kw) -> tuple[int, list[int]]:
    engine.add_request(request(rid, prompt, max_tokens=4, **kw))
    outs = drain(engine)[rid]
    return outs[-1].usage.cached_tokens, tokens(outs)


def test_prefix_cache_hits_within_a_tenant_only(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    system = [(5 * i + 40) % 1400 for i in range(100)]
    assert _cached(engine, "a1", system + [7, 8, 9], tenant="a", salt="sa")[0] == 0
    assert _cached(engine, "a2", system + [10, 11], tenant="a", salt="sa")[0] == 96
    assert _cached(engine, "b1", system + [10, 11], tenant="b", salt="sb")[0] == 0
    # The same salt under another tenant id still misses: the engine scopes by both.
    assert _cached(engine, "b2", system + [10, 11], tenant="c", salt="sa")[0] == 0
    assert engine.snapshot()["prefix_cache_hits"] == 96


def test_no_hit_after_the_adapter_is_replaced(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    prompt = [(3 * i + 17) % 1400 for i in range(64)]
    _cached(engine, "v1", prompt, adapter="sql@hash-one")
    assert _cached(engine, "v1-again", prompt, adapter="sql@hash-one")[0] == 48
    assert _cached(engine, "v2", prompt, adapter="sql@hash-two")[0] == 0


def test_outputs_are_identical_with_the_cache_on_and_off(tiny_model_dir, prompts):
    shared = prompts[-1][:96]
    batch = [shared + p[:20] for p in prompts[:8]]
    results = []
    for caching in (True, False):
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, enable_prefix_caching=caching,
                                        max_num_batched_tokens=64))
        for i, p in enumerate(batch):
            engine.add_request(request(f"r{i}", p))
        first = drain(engine)
        for i, p in enumerate(batch):  # the second round hits what the first one cached
            engine.add_request(request(f"again{i}", p))
        second = drain(engine)
        results.append(([tokens(first[f"r{i}"]) for i in range(8)],
                         [tokens(second[f"again{i}"]) for i in range(8)],
                         sum(second[f"again{i}"][-1].usage.cached_tokens for i in range(8))))
    (on_first, on_second, on_hits), (off_first, off_second, off_hits) = results
    assert on_first == off_first == on_second == off_second
    assert on_hits > 0 and off_hits == 0


# -- sampling and stopping ------------------------------------------------------------------

def test_same_seed_same_output_whatever_shares_the_batch(tiny_model_dir, prompts):
    seeded = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    alone.add_request(request("x", prompts[5], **seeded))
    expected = tokens(drain(alone)["x"])
    crowded = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=30, block_size=8,
                                     max_num_batched_tokens=32))
    for i, p in enumerate(prompts[6:14]):
        crowded.add_request(request(f"other{i}", p, temperature=1.0))
    crowded.add_request(request("x", prompts[5], **seeded))
    assert tokens(drain(crowded)["x"]) == expected
    assert crowded.scheduler.num_preemptions > 0
    other = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    other.add_request(request("y", prompts[5], **{**seeded, "seed": 99}))
    assert tokens(drain(other)["y"]) != expected


def test_a_tiny_temperature_samples_greedily_and_fails_no_other_request(tiny_model_dir,
                                                                         prompts, hf_outputs):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("greedy", prompts[2], tenant="t1"))
    engine.add_request(request("tiny", prompts[3], tenant="t2", temperature=1e-40))
    outputs = drain(engine)
    assert [outputs[r][-1].error for r in ("greedy", "tiny")] == [None, None]
    assert tokens(outputs["greedy"]) == hf_outputs[2]
    assert tokens(outputs["tiny"]) == hf_outputs[3]


def test_a_row_with_non_finite_logits_fails_only_its_request(tiny_model_dir, prompts,
                                                             hf_outputs):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("poisoned", prompts[2], tenant="t1", temperature=0.8, seed=1))
    engine.add_request(request("bystander", prompts[3], tenant="t2"))
    model = engine.runner.model
    real = model.compute_logits

    def poison_first_row(hidden):
        model.compute_logits = real
        logits = real(hidden)  # [rows, vocab]: the first scheduled request is row 0
        logits[0, 7] = float("nan")
        return logits

    model.compute_logits = poison_first_row
    outputs = drain(engine)
    assert "not finite" in outputs["poisoned"][-1].error
    assert outputs["bystander"][-1].error is None
    assert tokens(outputs["bystander"]) == hf_outputs[3]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_stop_string_ends_the_text_before_it(tiny_model_dir, tokenizer, prompts):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("free", prompts[3], max_tokens=40, ignore_eos=True))
    full = text(drain(engine)["free"])
    assert len(full) > 10
    stop = full[6:9]
    engine.add_request(request("stopped", prompts[3], max_tokens=40, ignore_eos=True,
                               stop=[stop]))
    outs = drain(engine)["stopped"]
    assert outs[-1].finish_reason == protocol.FINISH_STOP
    assert text(outs) == full[:full.index(stop)]


def test_the_eos_token_stops_unless_ignored(tiny_model_dir, prompts, hf_outputs):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    ended = next(i for i, out in enumerate(hf_outputs) if len(out) < MAX_NEW)
    engine.add_request(request("eos", prompts[ended]))
    engine.add_request(request("ignore", prompts[ended], ignore_eos=True))
    outputs = drain(engine)
    assert outputs["eos"][-1].finish_reason == protocol.FINISH_STOP
    assert len(tokens(outputs["ignore"])) == MAX_NEW
    assert outputs["ignore"][-1].finish_reason == protocol.FINISH_LENGTH


# -- lifecycle ------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once(tiny_model_dir, prompts):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("a", prompts[-1], max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    out = engine.abort_request("a", protocol.FINISH_CANCELLED)
    assert out.finished and out.usage.completion_tokens >= 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished()


def test_deadline_stops_a_running_request(tiny_model_dir, prompts):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("late", prompts[0], max_tokens=2000, ignore_eos=True,
                               deadline=time.time() + 0.2))
    outs = drain(engine)["late"]
    assert outs[-1].finish_reason == protocol.FINISH_DEADLINE
    assert 0 < outs[-1].usage.completion_tokens < 2000


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_carries_on(tiny_model_dir,
                                                                         prompts, hf_outputs):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    engine.add_request(request("doomed", prompts[2]))
    real_run = engine.runner.run

    def broken(batch):
        engine.runner.run = real_run
        raise RuntimeError("device fell over")

    engine.runner.run = broken
    (out,) = engine.step()
    assert out.finished and "device fell over" in out.error
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.add_request(request("fine", prompts[2]))
    assert tokens(drain(engine)["fine"]) == hf_outputs[2]


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], {}, "empty"),
    ([1, 10**6], {}, "token ids"),
    ([1] * 2048, {}, "context"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"top_p": 0}, "top_p"),
])
def test_bad_requests_are_refused_before_they_queue(tiny_model_dir, prompt, sampling, message):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    with pytest.raises(ValueError, match=message):
        engine.add_request(request("bad", prompt, **sampling))
    assert not engine.has_unfinished()


def test_a_request_larger_than_the_whole_cache_is_refused(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=4, block_size=16))
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(request("huge", [5] * 60, max_tokens=10))
    engine.add_request(request("fits", [5] * 40, max_tokens=10))


def test_metrics_snapshot_and_prometheus_text(tiny_model_dir, prompts):
    from engine.metrics import render_prometheus

    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    for i in range(3):
        engine.add_request(request(f"m{i}", prompts[10], max_tokens=5, ignore_eos=True))
    drain(engine)
    snap = engine.snapshot()
    assert snap["generation_tokens"] == 15 and snap["requests_finished"] == {"length": 3}
    assert snap["ttft"]["count"] == 3 and snap["itl"]["count"] == 12
    assert snap["prefix_cache_hit_rate"] > 0
    text_format = render_prometheus(snap, model_name="tiny", engine="e1")
    assert 'vllm:generation_tokens_total{engine="e1",model_name="tiny"} 15.0' in text_format
    assert 'vllm:time_to_first_token_seconds_count{engine="e1",model_name="tiny"} 3.0' \
        in text_format
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text_format


def finished_before_the_quiet_tenant(engine: LLMEngine, prompt: list[int],
                                     max_tokens: int) -> int:
    """Forty requests of a noisy tenant, then one of a quiet one: how many requests had
    finished when the quiet one did."""
    for i in range(40):
        engine.add_request(request(f"noisy{i}", prompt, tenant="noisy", salt="n",
                                   max_tokens=max_tokens, ignore_eos=True))
    engine.add_request(request("quiet", prompt, tenant="quiet", salt="q",
                               max_tokens=max_tokens, ignore_eos=True))
    finished = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "quiet" and out.finished:
                return finished
            finished += out.finished
    raise AssertionError("the quiet tenant's request never finished")


def test_a_flooding_tenant_does_not_starve_a_quiet_one(tiny_model_dir, prompts):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=4))
    assert finished_before_the_quiet_tenant(engine, prompts[8], 8) <= 4
