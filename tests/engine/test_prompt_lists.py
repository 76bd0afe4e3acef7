"""Several prompts in one request (extra_prompts): prompt p's sample i is choice p * n + i,
each prompt prefilled once (engine/parallel.py). The oracle for choice k is an n=1 request on
prompt k // n seeded with ``choice_seed(seed, k)``, run alone on a roomy engine."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from engine_testing import cancel, make_request, read_events, submit, two_choices_on_the_wire
from test_llm_engine import drain, request, tokens
from test_parallel_sampling import assert_all_free, choices, engine

from engine import protocol
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.reference import ReferenceEngine, generate_reference
from engine.seeds import choice_seed

PROMPTS = [[(7 * i + 40 + 13 * p) % 1400 for i in range(21 - 4 * p)] for p in range(3)]
SEEDED = dict(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


def prompts_request(rid: str, prompts: list[list[int]], **sampling) -> protocol.EngineRequest:
    return dataclasses.replace(request(rid, prompts[0], **sampling), extra_prompts=prompts[1:])


def run(eng: LLMEngine, rid: str, prompts: list[list[int]], **sampling) -> list[RequestOutput]:
    eng.add_request(prompts_request(rid, prompts, **sampling))
    return drain(eng)[rid]


def oracle(model_dir: Path, prompts: list[list[int]], n: int, **sampling) -> list[list[int]]:
    """What n=1 requests on each choice's prompt, seeded with its choice seed, generate alone."""
    eng = engine(model_dir)
    seed = sampling.pop("seed")
    return [tokens(run(eng, f"o{k}", [prompts[k // n]], seed=choice_seed(seed, k), **sampling))
            for k in range(len(prompts) * n)]


# -- what the choices generate ----------------------------------------------------------------

def test_three_greedy_prompts_each_equal_their_n1_output_and_transformers(tiny_model_dir):
    eng = engine(tiny_model_dir)
    alone = [tokens(run(eng, f"one{p}", [prompt], max_tokens=16))
             for p, prompt in enumerate(PROMPTS)]
    outs = run(eng, "three", PROMPTS, max_tokens=16)
    assert choices(outs, 3) == alone
    assert alone == generate_reference(tiny_model_dir, PROMPTS, 16)
    assert [c["index"] for c in outs[-1].choices] == [0, 1, 2]
    assert_all_free(eng)


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 4, "num_kv_blocks": 20, "max_num_batched_tokens": 16},  # forces preemption
    {"max_num_seqs": 2},  # one prompt's two choices at a time
], ids=["roomy", "preempting", "two-seats"])
def test_each_choice_samples_as_an_n1_request_on_its_prompt_with_its_choice_seed(
        tiny_model_dir, options):
    prompts = PROMPTS[:2]
    expected = oracle(tiny_model_dir, prompts, 2, **SEEDED)
    eng = engine(tiny_model_dir, **options)
    outs = run(eng, "a", prompts, n=2, **SEEDED)
    assert {o.index for o in outs} == {0, 1, 2, 3}
    assert choices(outs, 4) == expected
    assert len({tuple(c) for c in expected}) == 4
    if "num_kv_blocks" in options:
        assert eng.scheduler.num_preemptions > 0
    assert_all_free(eng)


def test_a_request_of_several_prompts_never_runs_more_than_max_num_seqs(tiny_model_dir):
    eng = engine(tiny_model_dir, max_num_seqs=3)
    eng.add_request(prompts_request("a", PROMPTS, n=2, **SEEDED))
    eng.add_request(request("b", PROMPTS[0], **SEEDED))
    running = []
    while eng.has_unfinished():
        eng.step()
        running.append(eng.num_running())
    assert max(running) == 3
    assert_all_free(eng)


def test_usage_sums_the_prompts_once_each_and_every_choices_output(tiny_model_dir):
    eng = engine(tiny_model_dir, enable_prefix_caching=False)
    outs = run(eng, "a", PROMPTS, n=2, **SEEDED)
    final = outs[-1]
    assert [o.finished for o in outs].count(True) == 1 and final.finished
    assert final.usage.prompt_tokens == sum(map(len, PROMPTS)) == eng.metrics.prompt_tokens
    assert final.usage.completion_tokens == 6 * 16 == sum(len(o.token_ids) for o in outs)
    assert final.usage.cached_tokens == 0
    assert final.usage.ttft_s is not None and final.usage.total_s >= final.usage.ttft_s
    assert [(c["index"], c["finish_reason"]) for c in final.choices] == [
        (k, "length") for k in range(6)]


def test_every_choice_has_a_cumulative_logprob_with_one_sample_per_prompt(tiny_model_dir):
    outs = run(engine(tiny_model_dir), "a", PROMPTS, logprobs=0, **SEEDED)
    sums = [0.0] * 3
    for o in outs:
        sums[o.index] += sum(lp.logprob for lp in o.logprobs or [])
    assert [c["cumulative_logprob"] for c in outs[-1].choices] == pytest.approx(sums, abs=1e-4)
    assert all(s < 0 for s in sums)


def test_two_prompts_sharing_a_long_prefix_hit_the_prefix_cache(tiny_model_dir):
    prefix = PROMPTS[0] + PROMPTS[1]  # 38 tokens: four whole blocks of 8
    eng = engine(tiny_model_dir)
    outs = run(eng, "a", [prefix + [5, 6], prefix + [7]], max_tokens=4)
    assert outs[-1].usage.cached_tokens == 32
    assert outs[-1].usage.prompt_tokens == 2 * len(prefix) + 3
    other = run(eng, "b", [prefix + [5, 6], prefix + [7]], max_tokens=4, tenant="other")
    assert other[-1].usage.cached_tokens == 32  # the second prompt hits the first, not "a"


def test_each_prompt_answers_its_own_schema_state(tiny_model_dir):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    eng = engine(tiny_model_dir)
    outs = run(eng, "a", PROMPTS[:2], n=2, temperature=1.0, seed=3, max_tokens=40,
               grammar={"type": "json_schema", "schema": schema})
    texts = [""] * 4
    for o in outs:
        texts[o.index] += o.text_delta
    assert all(set(json.loads(t)) == {"ok"} for t in texts)
    assert_all_free(eng)


def test_two_prompts_with_a_lora_adapter_follow_the_adapter(tiny_model_dir, tmp_path):
    from lora_testing import peft_greedy, train_adapter

    from engine.lora.store import AdapterStore

    folder = train_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    adapter_hash = AdapterStore(tmp_path / "store").put(folder)
    eng = engine(tiny_model_dir, adapter_store=tmp_path / "store")
    outs = run(eng, "a", PROMPTS[:2], max_tokens=12, adapter="a1", adapter_hash=adapter_hash)
    assert choices(outs, 2) == peft_greedy(tiny_model_dir, folder, PROMPTS[:2], 12)
    assert eng.scheduler.slots.users == {}
    assert_all_free(eng)


# -- ending early: everything at once, every block back ---------------------------------------

def test_an_abort_mid_way_ends_every_prompts_choices_and_frees_every_block(tiny_model_dir):
    eng = engine(tiny_model_dir, max_num_seqs=4)
    eng.add_request(prompts_request("a", PROMPTS, n=2, **{**SEEDED, "max_tokens": 200}))
    outs = eng.step()  # prompts 0 and 1 run and fork; prompt 2 waits for seats
    assert eng.num_running() == 4 and eng.num_waiting() == 1
    outs += eng.step()
    final = eng.abort_request("a", protocol.FINISH_CANCELLED)
    assert final.finished and final.finish_reason == "cancelled"
    assert [c["finish_reason"] for c in final.choices] == ["cancelled"] * 6
    assert [c["cumulative_logprob"] for c in final.choices][4:] == [0.0, 0.0]
    assert final.usage.completion_tokens == sum(len(o.token_ids) for o in outs) == 8
    assert final.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert eng.abort_request("a", protocol.FINISH_CANCELLED) is None
    assert_all_free(eng)


def test_a_deadline_ends_every_prompt(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(prompts_request("a", PROMPTS[:2], deadline=time.time() + 3600,
                                    **{**SEEDED, "max_tokens": 200}))
    eng.step()
    (final,) = eng.scheduler.expire(now=time.time() + 7200)
    assert final.request_id == "a" and final.finish_reason == "deadline"
    assert [c["finish_reason"] for c in final.choices] == ["deadline"] * 2
    assert_all_free(eng)


# -- what is refused --------------------------------------------------------------------------

@pytest.mark.parametrize(("bad", "match"), [
    ([], "prompt 1 is empty"),
    ([5, 10**6], "prompt 1's token ids must be integers"),
    ("abc", "prompt 1 must be an array"),
    ([5] * 2048, "prompt 1 has 2048 tokens; this model's context holds 2048"),
])
def test_one_prompt_that_cannot_run_refuses_the_whole_request(tiny_model_dir, bad, match):
    eng = engine(tiny_model_dir)
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompts_request("a", [PROMPTS[0], bad, PROMPTS[2]]))
    assert not eng.has_unfinished()


def test_a_prompt_too_long_for_the_kv_cache_refuses_the_whole_request(tiny_model_dir):
    eng = engine(tiny_model_dir, block_size=4, num_kv_blocks=12)  # 48 tokens
    with pytest.raises(ValueError, match="prompt 1 and its output, 56 tokens, need more KV"):
        eng.add_request(prompts_request("a", [PROMPTS[0], PROMPTS[0] * 2], max_tokens=14))
    assert not eng.has_unfinished() and not eng.scheduler.groups


def test_more_than_sixteen_prompts_or_sixty_four_choices_are_refused(tiny_model_dir):
    eng = engine(tiny_model_dir)
    with pytest.raises(ValueError, match="17 prompts exceed the 16"):
        eng.add_request(prompts_request("a", [PROMPTS[0]] * 17))
    with pytest.raises(ValueError, match="make 80 choices; a request may have at most 64"):
        eng.add_request(prompts_request("a", [PROMPTS[0]] * 5, n=16))
    eng.add_request(prompts_request("a", [PROMPTS[0]] * 16, n=4, max_tokens=1))
    assert len(drain(eng)["a"][-1].choices) == 64


def test_a_request_id_naming_another_prompts_choice_is_refused(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(prompts_request("a", PROMPTS[:2], n=2, **SEEDED))
    with pytest.raises(ValueError, match="choice of request a"):
        eng.add_request(request("a#3", PROMPTS[0]))
    eng.add_request(request("b#1", PROMPTS[0], max_tokens=2))
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(prompts_request("b", PROMPTS[:2]))


def test_the_reference_engine_refuses_extra_prompts(tiny_model_dir):
    with pytest.raises(ValueError, match="one prompt per request"):
        ReferenceEngine(tiny_model_dir).add_request(prompts_request("a", PROMPTS[:2]))


# -- on the wire ------------------------------------------------------------------------------

def test_the_event_stream_of_two_prompts(start_worker, redis_client, tokenizer):
    start_worker()
    req = make_request(PROMPTS[0], max_tokens=6, ignore_eos=True, extra_prompts=[PROMPTS[1]])
    submit(redis_client, req)
    two_choices_on_the_wire(read_events(redis_client, req.request_id), tokenizer,
                            prompt_tokens=len(PROMPTS[0]) + len(PROMPTS[1]), tokens_each=6)


def test_a_request_of_two_prompts_cancelled_before_it_starts_reports_every_choice(
        start_worker, redis_client):
    req = make_request(PROMPTS[0], n=2, max_tokens=6, extra_prompts=[PROMPTS[1]])
    cancel(redis_client, req)
    submit(redis_client, req)
    start_worker()
    (final,) = read_events(redis_client, req.request_id)
    assert final.data["finish_reason"] == "cancelled"
    assert [c["index"] for c in final.data["choices"]] == [0, 1, 2, 3]
