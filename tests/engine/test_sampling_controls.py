"""Logprobs, penalties, logit_bias, min_tokens and stop_token_ids through the batching engine,
checked against transformers on the same checkpoint and against their definitions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, eos_token_ids
from engine.llm_engine import LLMEngine
from engine.sampler import shape_logits
from engine.sampling_params import SamplingParams
from tests.engine.test_llm_engine import drain, request, text, tokens


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=256, block_size=16,
                                  max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


PROMPTS = [[random.Random(i).randrange(10, 1400) for _ in range(9 + 7 * i)] for i in range(4)]


def run(engine: LLMEngine, prompt: list[int], rid: str = "r", **sampling):
    engine.add_request(request(rid, prompt, **sampling))
    return drain(engine)[rid]


def test_logprobs_are_transformers_log_softmax_of_each_position(engine, hf_model):
    for n, prompt in enumerate(PROMPTS):
        outs = run(engine, prompt, f"lp{n}", max_tokens=6, logprobs=5, ignore_eos=True)
        out_ids = tokens(outs)
        lps = [lp for o in outs for lp in o.logprobs]
        assert len(lps) == len(out_ids) == 6
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + out_ids])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [6, vocab]
        for i, (token, lp) in enumerate(zip(out_ids, lps, strict=True)):
            assert abs(lp.logprob - float(expected[i, token])) < 1e-3
            assert len(lp.top) == 5
            top = torch.topk(expected[i], 5)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert all(abs(v - float(e)) < 1e-3
                       for (_, v), e in zip(lp.top, top.values, strict=True))
            assert lp.top[0][0] == token  # greedy takes the most likely


def test_logprobs_zero_gives_the_sampled_token_only_and_none_by_default(engine):
    outs = run(engine, PROMPTS[0], "lp0", max_tokens=3, logprobs=0, ignore_eos=True)
    assert all(len(lp.top) == 0 for o in outs for lp in o.logprobs)
    assert all(o.logprobs is None for o in run(engine, PROMPTS[0], "nolp", max_tokens=3))


def test_repetition_penalty_matches_transformers_generate(engine, hf_model, tiny_model_dir):
    eos = sorted(eos_token_ids(tiny_model_dir))
    for n, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   repetition_penalty=1.7, eos_token_id=eos, pad_token_id=eos[0])
        expected = hf[0, len(prompt):].tolist()
        got = tokens(run(engine, prompt, f"rep{n}", max_tokens=12, repetition_penalty=1.7))
        assert got == expected
    plain = tokens(run(engine, PROMPTS[3], "plain", max_tokens=12))
    assert plain != tokens(run(engine, PROMPTS[3], "rep", max_tokens=12, repetition_penalty=1.7))


def test_presence_and_frequency_penalties_follow_openais_definition():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25)
    history = [4, 4, 0, 1, 1, 1, 4]  # a prompt of 2 (4, 4), then the output 0, 1, 1, 1, 4
    shaped = shape_logits(logits.clone(), params, history, num_prompt_tokens=2)
    # token t loses presence * (count > 0) + frequency * count, counted over the output only
    assert shaped.tolist() == [1 - 0.75, 2 - 1.25, 3.0, 4.0, 5 - 0.75]


def test_a_frequency_penalty_stops_a_greedy_loop(engine):
    prompt = PROMPTS[1]
    plain = tokens(run(engine, prompt, "loop", max_tokens=24, ignore_eos=True))
    penalised = tokens(run(engine, prompt, "pen", max_tokens=24, ignore_eos=True,
                           frequency_penalty=2.0, presence_penalty=2.0))
    assert max(penalised.count(t) for t in set(penalised)) < max(plain.count(t)
                                                                  for t in set(plain))


def test_logit_bias_forces_and_forbids_tokens(engine):
    forced = tokens(run(engine, PROMPTS[0], "force", max_tokens=5, ignore_eos=True,
                        logit_bias={"777": 100}))
    assert forced == [777] * 5
    plain = tokens(run(engine, PROMPTS[0], "plain", max_tokens=5, ignore_eos=True))
    banned = tokens(run(engine, PROMPTS[0], "ban", max_tokens=5, ignore_eos=True,
                        logit_bias={str(plain[0]): -100}))
    assert plain[0] not in banned


def test_min_tokens_holds_eos_back_then_lets_it_end(engine, tiny_model_dir):
    eos = min(eos_token_ids(tiny_model_dir))
    outs = run(engine, PROMPTS[0], "min", max_tokens=20, min_tokens=5,
               logit_bias={str(eos): 100})
    out_ids = tokens(outs)
    assert len(out_ids) == 6 and out_ids[-1] == eos and eos not in out_ids[:5]
    assert outs[-1].finish_reason == "stop"


def test_a_stop_token_id_ends_like_eos_and_stays_out_of_the_text(engine, tokenizer):
    outs = run(engine, PROMPTS[0], "stopid", max_tokens=20, ignore_eos=True,
               logit_bias={"321": 100}, stop_token_ids=[321])
    assert tokens(outs) == [321] and outs[-1].finish_reason == "stop"
    assert text(outs) == ""
    assert outs[-1].usage.completion_tokens == 1


def test_the_same_controls_in_the_reference_engine(reference_engine_factory, engine):
    ref = reference_engine_factory()
    sampling = dict(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5,
                    frequency_penalty=0.5, logit_bias={"55": 3.0}, logprobs=2)
    ref.add_request(request("ref", PROMPTS[2], **sampling))
    ref_outs = drain(ref)["ref"]
    outs = run(engine, PROMPTS[2], "eng", **sampling)
    assert tokens(ref_outs) == tokens(outs)
    for a, b in zip([lp for o in ref_outs for lp in o.logprobs],
                    [lp for o in outs for lp in o.logprobs], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-3


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
    dict(repetition_penalty=0), dict(logit_bias={5: 101}), dict(logit_bias={-1: 1}),
    dict(min_tokens=-1), dict(stop_token_ids=[-3]), dict(logprobs=21), dict(logprobs=True),
])
def test_out_of_range_controls_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**({"max_tokens": 4} | bad))
