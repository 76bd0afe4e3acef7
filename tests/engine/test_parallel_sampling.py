"""n > 1: one request, n choices, its prompt prefilled once and its KV blocks shared
copy-on-write (engine/parallel.py). The oracle for choice i is an n=1 request seeded with
``choice_seed(seed, i)``, run alone on a roomy engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from engine_testing import cancel, make_request, read_events, submit, two_choices_on_the_wire
from test_llm_engine import drain, request, text, tokens

from engine import protocol
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.reference import ReferenceEngine, generate_reference
from engine.seeds import choice_seed

PROMPT = [(7 * i + 40) % 1400 for i in range(21)]  # 21: not a multiple of any block size
SEEDED = dict(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


def engine(model_dir: Path, **options) -> LLMEngine:
    options.setdefault("block_size", 8)
    options.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(model_dir=model_dir, **options))


def choices(outs: list[RequestOutput], n: int) -> list[list[int]]:
    """Each choice's output token ids, from one request's outputs."""
    out: list[list[int]] = [[] for _ in range(n)]
    for o in outs:
        out[o.index] += o.token_ids
    return out


def run(eng: LLMEngine, rid: str, prompt: list[int], **sampling) -> list[RequestOutput]:
    eng.add_request(request(rid, prompt, **sampling))
    return drain(eng)[rid]


def oracle(model_dir: Path, prompt: list[int], n: int, **sampling) -> list[list[int]]:
    """What n=1 requests seeded with each choice's seed generate, alone."""
    eng = engine(model_dir)
    seed = sampling.pop("seed")
    return [tokens(run(eng, f"o{i}", prompt, seed=choice_seed(seed, i), **sampling))
            for i in range(n)]


def assert_all_free(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    assert not eng.kv.tables and not eng.scheduler.groups


# -- what the choices generate ----------------------------------------------------------------

def test_four_choices_at_temperature_one_differ_and_repeat_with_the_seed(tiny_model_dir):
    first = choices(run(engine(tiny_model_dir), "a", PROMPT, n=4, **SEEDED), 4)
    again = choices(run(engine(tiny_model_dir), "a", PROMPT, n=4, **SEEDED), 4)
    assert len({tuple(c) for c in first}) == 4
    assert first == again
    other = choices(run(engine(tiny_model_dir), "a", PROMPT, n=4, **{**SEEDED, "seed": 1}), 4)
    assert other != first


def test_greedy_choices_all_equal_the_n1_output_and_transformers(tiny_model_dir):
    eng = engine(tiny_model_dir)
    alone = tokens(run(eng, "one", PROMPT, max_tokens=16))
    outs = run(eng, "four", PROMPT, n=4, max_tokens=16)
    assert choices(outs, 4) == [alone] * 4
    assert alone == generate_reference(tiny_model_dir, [PROMPT], 16)[0]


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 4, "num_kv_blocks": 20, "max_num_batched_tokens": 16},  # forces preemption
    {"enable_prefix_caching": False, "block_size": 16},
    {"use_triton": True, "block_size": 16},  # the Triton decode kernel (interpreted on CPU)
], ids=["roomy", "preempting", "no-prefix-cache", "triton"])
def test_each_choice_samples_as_an_n1_request_with_its_choice_seed(tiny_model_dir, options):
    expected = oracle(tiny_model_dir, PROMPT, 4, **SEEDED)
    eng = engine(tiny_model_dir, **options)
    outs = run(eng, "a", PROMPT, n=4, **SEEDED)
    assert choices(outs, 4) == expected
    assert choice_seed(SEEDED["seed"], 0) == SEEDED["seed"]
    if options.get("num_kv_blocks") == 20:
        assert eng.scheduler.num_preemptions > 0
    assert_all_free(eng)


def test_a_preempted_choice_finishes_and_usage_counts_the_prompt_once(tiny_model_dir):
    eng = engine(tiny_model_dir, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16)
    outs = run(eng, "a", PROMPT, n=4, **{**SEEDED, "max_tokens": 24})
    assert eng.scheduler.num_preemptions > 0
    final = outs[-1]
    assert [o.finished for o in outs].count(True) == 1 and final.finished
    assert [c["finish_reason"] for c in final.choices] == ["length"] * 4
    assert [len(c) for c in choices(outs, 4)] == [24] * 4
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.usage.completion_tokens == 4 * 24
    assert_all_free(eng)


def test_choices_that_stop_early_leave_the_request_running_until_the_last(tiny_model_dir):
    eng = engine(tiny_model_dir)
    # A quarter of the vocabulary stops a choice: they end early, each at its own length.
    outs = run(eng, "a", PROMPT, n=8, temperature=1.0, seed=5, max_tokens=40,
               stop_token_ids=list(range(300)))
    final = outs[-1]
    lengths = [len(c) for c in choices(outs, 8)]
    reasons = [c["finish_reason"] for c in final.choices]
    assert "stop" in reasons and len(set(lengths)) > 1, (reasons, lengths)
    assert all(not o.finished for o in outs[:-1]) and final.finished
    assert final.finish_reason == reasons[0]  # choice 0's
    assert final.usage.completion_tokens == sum(lengths)
    assert_all_free(eng)


def test_cumulative_logprob_sums_each_choices_token_logprobs(tiny_model_dir):
    eng = engine(tiny_model_dir)
    outs = run(eng, "a", PROMPT, n=3, logprobs=2, **SEEDED)
    sums = [0.0, 0.0, 0.0]
    for o in outs:
        sums[o.index] += sum(lp.logprob for lp in o.logprobs or [])
    final = outs[-1].choices
    assert [c["index"] for c in final] == [0, 1, 2]
    assert [c["cumulative_logprob"] for c in final] == pytest.approx(sums, abs=1e-4)
    assert all(s < 0 for s in sums)
    assert run(eng, "b", PROMPT, **SEEDED)[-1].choices is None  # n == 1: no choices


def test_three_choices_under_a_grammar_are_three_valid_json_answers(tiny_model_dir):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    eng = engine(tiny_model_dir)
    outs = run(eng, "a", PROMPT, n=3, temperature=1.0, seed=3, max_tokens=40,
               grammar={"type": "json_schema", "schema": schema})
    texts = ["", "", ""]
    for o in outs:
        texts[o.index] += o.text_delta
    answers = [json.loads(t) for t in texts]
    assert all(set(a) == {"ok", "n"} for a in answers)
    assert [c["finish_reason"] for c in outs[-1].choices] == ["stop"] * 3
    assert_all_free(eng)


def test_two_choices_with_a_lora_adapter_follow_the_adapter(tiny_model_dir, tmp_path):
    from lora_testing import peft_greedy, train_adapter

    from engine.lora.store import AdapterStore

    folder = train_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    adapter_hash = AdapterStore(tmp_path / "store").put(folder)
    eng = engine(tiny_model_dir, adapter_store=tmp_path / "store")
    outs = run(eng, "a", PROMPT, n=2, max_tokens=12, adapter="a1", adapter_hash=adapter_hash)
    expected = peft_greedy(tiny_model_dir, folder, [PROMPT], 12)[0]
    assert choices(outs, 2) == [expected, expected]
    assert expected != tokens(run(eng, "base", PROMPT, max_tokens=12))
    assert eng.scheduler.slots.users == {}  # each choice gave back its slot reference
    assert_all_free(eng)


# -- the prompt runs once; its blocks are shared copy-on-write --------------------------------

def test_the_prompt_is_prefilled_once_for_all_choices(tiny_model_dir):
    prompt = PROMPT + PROMPT[:16]  # 37 tokens, one chunk
    forked = engine(tiny_model_dir, enable_prefix_caching=False)
    run(forked, "a", prompt, n=4, max_tokens=8)
    separate = engine(tiny_model_dir, enable_prefix_caching=False)
    for i in range(4):
        separate.add_request(request(f"r{i}", prompt, max_tokens=8))
    drain(separate)
    assert forked.metrics.prompt_tokens == len(prompt) == 37
    assert separate.metrics.prompt_tokens == 4 * len(prompt)
    assert forked.metrics.generation_tokens == separate.metrics.generation_tokens == 32


def _record_batches(eng: LLMEngine) -> list:
    batches, real = [], eng.runner.run

    def spy(batch):
        batches.append(batch)
        return real(batch)

    eng.runner.run = spy
    return batches


def _garbage_kv(eng: LLMEngine) -> LLMEngine:
    """Fills the KV cache with loud noise: a position read before it was written shows."""
    for k_cache, v_cache in eng.runner.kv_caches:
        k_cache.normal_(0, 30)
        v_cache.normal_(0, 30)
    return eng


def test_the_partly_filled_prompt_block_is_copied_before_a_choice_writes_into_it(
        tiny_model_dir):
    # block_size 8: blocks 0 and 1 full, block 2 holds the prompt's last 5 tokens
    eng = _garbage_kv(engine(tiny_model_dir))
    batches = _record_batches(eng)
    outs = run(eng, "a", PROMPT, n=4, **SEEDED)
    assert choices(outs, 4) == oracle(tiny_model_dir, PROMPT, 4, **SEEDED)
    copying = [b for b in batches if b.block_copies]
    assert len(copying) == 1
    (batch,) = copying
    # The first decode after the fork: three choices copy block 2, the last writes in place.
    assert len(batch.block_copies) == 3
    tables = [r.block_table for r in batch.requests]
    assert len({t[2] for t in tables}) == 4 and len({tuple(t[:2]) for t in tables}) == 1
    assert {dst for _, dst in batch.block_copies} <= {t[2] for t in tables}
    assert {src for src, _ in batch.block_copies} == {t[2] for t in tables} - {
        dst for _, dst in batch.block_copies}
    assert_all_free(eng)


def test_without_the_copy_the_choices_would_read_a_wrong_prompt_tail(tiny_model_dir):
    eng = _garbage_kv(engine(tiny_model_dir))
    eng.runner._copy_blocks = lambda copies: None
    outs = run(eng, "a", PROMPT, n=4, **SEEDED)
    assert choices(outs, 4) != oracle(tiny_model_dir, PROMPT, 4, **SEEDED)


def test_a_prompt_of_whole_blocks_is_shared_without_any_copy(tiny_model_dir):
    eng = engine(tiny_model_dir)
    batches = _record_batches(eng)
    prompt = PROMPT[:16]
    outs = run(eng, "a", prompt, n=4, **SEEDED)
    assert not any(b.block_copies for b in batches)
    assert choices(outs, 4) == oracle(tiny_model_dir, prompt, 4, **SEEDED)


def test_choices_leave_the_prompt_blocks_in_the_prefix_cache(tiny_model_dir):
    eng = engine(tiny_model_dir)
    run(eng, "a", PROMPT, n=3, **SEEDED)
    assert run(eng, "b", PROMPT, max_tokens=2)[-1].usage.cached_tokens == 16
    assert run(eng, "c", PROMPT, max_tokens=2, tenant="other")[-1].usage.cached_tokens == 0


def test_an_unforked_request_holds_seats_for_all_its_choices(tiny_model_dir):
    eng = engine(tiny_model_dir, max_num_seqs=4)
    eng.add_request(request("four", PROMPT, n=4, **SEEDED))
    for i in range(3):
        eng.add_request(request(f"r{i}", PROMPT[i:], **SEEDED))
    running = []
    while eng.has_unfinished():
        eng.step()
        running.append(eng.num_running())
    assert max(running) == 4
    assert_all_free(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_block_references_stay_exact_through_forks_and_preemptions(caching):
    """The scheduler alone, a fake runner, a pool too small for everyone: every step each
    block's count equals the tables holding it (scheduling.check_invariants)."""
    from scheduling import check_invariants, fake_tokens, scheduler, seq

    from engine.batch import RunnerOutput
    from engine.parallel import start_group

    sched = scheduler(num_blocks=24, block_size=4, max_num_seqs=8, budget=16, caching=caching)
    groups = []
    for i, n in enumerate((4, 1, 3, 2)):
        s = seq(prompt_len=6 + 3 * i, max_tokens=10)
        if n > 1:
            start_group(s, n)
            groups.append(s.group)
        sched.add(s)
    finals = []
    while sched.has_unfinished():
        batch = sched.schedule()
        check_invariants(sched, batch)
        ran = fake_tokens(batch)
        for i, req in enumerate(batch.requests):
            if req.fork_seeds:
                ran.forks[i] = RunnerOutput([300 + k for k in range(len(req.fork_seeds))])
        finals += [o for o in sched.postprocess(batch, ran) if o.finished]
    assert sched.num_preemptions > 0
    assert len(finals) == 4
    for out in finals:
        assert out.usage.completion_tokens == 10 * (len(out.choices) if out.choices else 1)
    assert all(len(g.members) == g.n for g in groups)
    assert sched.kv.num_free_blocks == 24 and not sched.kv.tables


# -- ending early: every choice at once, every block back -------------------------------------

def _step_until_forked(eng: LLMEngine, n: int) -> list[RequestOutput]:
    outs = []
    while len(eng.scheduler.sequences) < n:
        outs += eng.step()
    return outs


def test_an_abort_mid_way_ends_every_choice_in_one_final_output(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(request("a", PROMPT, n=4, **{**SEEDED, "max_tokens": 200}))
    outs = _step_until_forked(eng, 4) + eng.step()
    final = eng.abort_request("a", protocol.FINISH_CANCELLED)
    assert final.finished and final.finish_reason == "cancelled"
    assert [c["finish_reason"] for c in final.choices] == ["cancelled"] * 4
    assert final.usage.completion_tokens == sum(len(o.token_ids) for o in outs) == 8
    assert final.usage.prompt_tokens == len(PROMPT)
    assert eng.abort_request("a", protocol.FINISH_CANCELLED) is None
    assert_all_free(eng)


def test_an_abort_before_the_fork_reports_every_choice(tiny_model_dir):
    eng = engine(tiny_model_dir, max_num_batched_tokens=8)
    eng.add_request(request("a", PROMPT, n=3, **SEEDED))
    eng.step()  # the first chunk of the prompt
    final = eng.abort_request("a", protocol.FINISH_CANCELLED)
    assert [c["finish_reason"] for c in final.choices] == ["cancelled"] * 3
    assert final.usage.prompt_tokens == 8 and final.usage.completion_tokens == 0
    assert_all_free(eng)


def test_a_deadline_ends_every_choice(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(request("a", PROMPT, n=4, deadline=time.time() + 3600,
                            **{**SEEDED, "max_tokens": 200}))
    _step_until_forked(eng, 4)
    (final,) = eng.scheduler.expire(now=time.time() + 7200)
    assert final.request_id == "a" and final.finish_reason == "deadline"
    assert [c["finish_reason"] for c in final.choices] == ["deadline"] * 4
    assert_all_free(eng)


def test_a_failed_choice_fails_the_whole_request(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(request("a", PROMPT, n=3, **SEEDED))
    _step_until_forked(eng, 3)
    model, real = eng.runner.model, eng.runner.model.compute_logits

    def poison_second_row(hidden):
        model.compute_logits = real
        logits = real(hidden)  # [rows, vocab]
        logits[1, 7] = float("nan")
        return logits

    model.compute_logits = poison_second_row
    outs = [o for o in drain(eng)["a"] if o.finished]
    assert len(outs) == 1 and "not finite" in outs[0].error
    assert_all_free(eng)


# -- what is refused --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_outside_one_to_sixteen_is_refused(tiny_model_dir, n):
    with pytest.raises(ValueError, match="n must be"):
        engine(tiny_model_dir).add_request(request("a", PROMPT, n=n))


def test_more_choices_than_running_sequences_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="choices exceed"):
        engine(tiny_model_dir, max_num_seqs=4).add_request(request("a", PROMPT, n=5))


def test_a_request_id_naming_a_running_choice_is_refused(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request(request("a", PROMPT, n=2, **SEEDED))
    with pytest.raises(ValueError, match="choice of request a"):
        eng.add_request(request("a#1", PROMPT))
    eng.add_request(request("b#1", PROMPT, max_tokens=2))
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(request("b", PROMPT, n=2))


def test_the_reference_engine_refuses_n_above_one(tiny_model_dir):
    with pytest.raises(ValueError, match="one choice per request"):
        ReferenceEngine(tiny_model_dir).add_request(request("a", PROMPT, n=2))


# -- on the wire ------------------------------------------------------------------------------

def test_the_event_stream_of_two_choices(start_worker, redis_client, tokenizer):
    start_worker()
    req = make_request(PROMPT, n=2, max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    submit(redis_client, req)
    final = two_choices_on_the_wire(read_events(redis_client, req.request_id), tokenizer,
                                    prompt_tokens=len(PROMPT), tokens_each=6)
    assert all(c["cumulative_logprob"] < 0 for c in final.data["choices"])
    single = make_request(PROMPT, max_tokens=3)
    submit(redis_client, single)
    events = read_events(redis_client, single.request_id)
    assert all("index" not in e.data for e in events)
    assert "choices" not in events[-1].data


def test_a_request_cancelled_before_it_starts_reports_every_choice(start_worker, redis_client):
    req = make_request(PROMPT, n=3, max_tokens=6)
    cancel(redis_client, req)
    submit(redis_client, req)
    start_worker()
    (final,) = read_events(redis_client, req.request_id)
    assert final.data["finish_reason"] == "cancelled"
    assert [c["finish_reason"] for c in final.data["choices"]] == ["cancelled"] * 3


def test_text_of_each_choice_matches_its_tokens(tiny_model_dir, tokenizer):
    outs = run(engine(tiny_model_dir), "a", PROMPT, n=3, **SEEDED)
    for index in range(3):
        mine = [o for o in outs if o.index == index]
        assert text(mine) == tokenizer.decode(tokens(mine))
