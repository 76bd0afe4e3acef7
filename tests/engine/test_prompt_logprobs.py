"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs): each prompt token's
raw log-softmax given the tokens before it, its rank and the top k there, checked against
transformers on the same checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from engine_testing import make_request, read_events, submit
from test_llm_engine import drain, request
from test_prompt_lists import prompts_request

from engine import protocol
from engine.batch import PromptLogprob
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.reference import ReferenceEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

PROMPT = [random.Random(7).randrange(10, 1400) for _ in range(70)]
OTHER = [random.Random(8).randrange(10, 1400) for _ in range(23)]
K = 3


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def chunked(model_dir: Path, **options) -> LLMEngine:
    """An engine whose 24-token budget prefills PROMPT in three chunks."""
    options = {"block_size": 8, "num_kv_blocks": 256, "max_num_batched_tokens": 24, **options}
    return LLMEngine(EngineConfig(model_dir=model_dir, **options))


def expected(hf_model, prompt: list[int], k: int = K
             ) -> list[tuple[float, int, list[int], list[float]]]:
    """transformers' (logprob, rank, top-k ids, top-k logprobs) of each prompt token after
    the first."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()  # [len, vocab]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    out = []
    for p, token in enumerate(prompt[1:]):
        value = logprobs[p, token]
        top = torch.topk(logprobs[p], k)
        out.append((float(value), int((logprobs[p] > value).sum()) + 1,
                    top.indices.tolist(), top.values.tolist()))
    return out


def assert_matches(got: list[PromptLogprob], want: list) -> None:
    assert len(got) == len(want)
    for lp, (value, rank, ids, values) in zip(got, want, strict=True):
        assert abs(lp.logprob - value) < 1e-4
        assert lp.rank == rank
        assert [t for t, _ in lp.top] == ids
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(lp.top, values, strict=True))


def carried(outs: list[RequestOutput]) -> list[RequestOutput]:
    return [o for o in outs if o.prompt_logprobs is not None]


# -- against transformers --------------------------------------------------------------------

def test_a_prompt_prefilled_in_chunks_gets_transformers_logprobs_ranks_and_top_k(
        tiny_model_dir, hf_model):
    eng = chunked(tiny_model_dir)
    eng.add_request(request("a", PROMPT, max_tokens=3, prompt_logprobs=K))
    steps = 0
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
        steps += 1
    assert steps >= 3 + 2  # three prompt chunks, then the decodes
    (first,) = carried(outs)
    assert first is outs[0]  # on the request's first output, with its first token
    assert_matches(first.prompt_logprobs, expected(hf_model, PROMPT))


def test_no_request_gets_prompt_logprobs_unless_it_asks(tiny_model_dir):
    eng = chunked(tiny_model_dir)
    eng.add_request(request("a", PROMPT, max_tokens=2))
    assert not carried(drain(eng)["a"])


def test_zero_gives_logprob_and_rank_and_no_top(tiny_model_dir, hf_model):
    eng = chunked(tiny_model_dir)
    eng.add_request(request("a", OTHER, max_tokens=1, prompt_logprobs=0))
    (out,) = carried(drain(eng)["a"])
    want = expected(hf_model, OTHER)
    assert [lp.top for lp in out.prompt_logprobs] == [[]] * len(want)
    assert all(abs(lp.logprob - w[0]) < 1e-4 and lp.rank == w[1]
               for lp, w in zip(out.prompt_logprobs, want, strict=True))


def test_a_one_token_prompt_gets_an_empty_list(tiny_model_dir):
    eng = chunked(tiny_model_dir)
    eng.add_request(request("a", [42], max_tokens=2, prompt_logprobs=K))
    outs = drain(eng)["a"]
    assert [o.prompt_logprobs for o in carried(outs)] == [[]]
    assert outs[0].prompt_logprobs == []


def test_the_reference_engine_gives_the_same_prompt_logprobs(tiny_model_dir, hf_model):
    ref = ReferenceEngine(tiny_model_dir)
    ref.add_request(request("a", PROMPT, max_tokens=2, prompt_logprobs=K))
    outs = []
    while ref.has_unfinished():
        outs += ref.step()
    (out,) = carried(outs)
    assert_matches(out.prompt_logprobs, expected(hf_model, PROMPT))


# -- prefix cache --------------------------------------------------------------------------

def test_a_prompt_the_cache_holds_is_computed_again_for_its_prompt_logprobs(tiny_model_dir,
                                                                             hf_model):
    eng = chunked(tiny_model_dir)
    eng.add_request(request("warm", PROMPT, max_tokens=1))
    assert drain(eng)["warm"][-1].usage.cached_tokens == 0
    eng.add_request(request("again", PROMPT, max_tokens=1, prompt_logprobs=K))
    outs = drain(eng)["again"]
    assert outs[-1].usage.cached_tokens == 0
    (out,) = carried(outs)
    assert_matches(out.prompt_logprobs, expected(hf_model, PROMPT))
    # Its blocks were still cached: a plain request on the same prompt hits them.
    eng.add_request(request("hit", PROMPT, max_tokens=1))
    assert drain(eng)["hit"][-1].usage.cached_tokens > 0


def test_a_sequence_gathering_prompt_logprobs_finds_nothing_in_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Sequence("a", list(range(10)), 10, SamplingParams(max_tokens=1), seed=0)
    assert kv.allocate_slots(first, 10)
    kv.cache_full_blocks(first, 10)
    asks = Sequence("b", list(range(10)), 10, SamplingParams(max_tokens=1, prompt_logprobs=1),
                    seed=0)
    assert kv.get_computed_blocks(asks) == ([], 0)
    asks.prompt_logprobs = [PromptLogprob(-1.0, 1, [])] * 9  # all in: reads it again
    assert kv.get_computed_blocks(asks)[1] == 8


# -- several prompts and choices ------------------------------------------------------------

def test_each_prompt_gets_its_own_list_on_its_first_choice(tiny_model_dir, hf_model):
    eng = chunked(tiny_model_dir)
    eng.add_request(prompts_request("a", [PROMPT, OTHER, [42]], n=2, max_tokens=3,
                                    temperature=1.0, seed=3, prompt_logprobs=K))
    outs = drain(eng)["a"]
    with_lists = carried(outs)
    assert [o.index for o in with_lists] == sorted(o.index for o in with_lists)
    by_index = {o.index: o.prompt_logprobs for o in with_lists}
    assert sorted(by_index) == [0, 2, 4] and len(with_lists) == 3
    assert_matches(by_index[0], expected(hf_model, PROMPT))
    assert_matches(by_index[2], expected(hf_model, OTHER))
    assert by_index[4] == []
    for o in with_lists:  # the first output of its choice
        assert o is next(x for x in outs if x.index == o.index)


# -- preemption ---------------------------------------------------------------------------

def test_a_preempted_sequence_recomputed_from_its_start_does_not_gather_twice(
        tiny_model_dir, hf_model, monkeypatch):
    eng = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=24, block_size=4,
                                 max_num_batched_tokens=16))
    gathered_at_preemption: list[int] = []
    real = eng.scheduler._preempt

    def preempt(seq):
        gathered_at_preemption.append(len(seq.prompt_logprobs))
        real(seq)

    monkeypatch.setattr(eng.scheduler, "_preempt", preempt)
    prompts = [[random.Random(100 + i).randrange(10, 1400) for _ in range(20 + 3 * i)]
               for i in range(5)]
    for i, prompt in enumerate(prompts):
        eng.add_request(request(f"r{i}", prompt, max_tokens=24, ignore_eos=True,
                                prompt_logprobs=2))
    outputs = drain(eng)
    assert any(gathered_at_preemption), gathered_at_preemption  # some had gathered already
    for i, prompt in enumerate(prompts):
        (out,) = carried(outputs[f"r{i}"])
        assert_matches(out.prompt_logprobs, expected(hf_model, prompt, 2))


def test_entries_a_sequence_holds_are_not_taken_again():
    seq = Sequence("a", list(range(6)), 6, SamplingParams(max_tokens=1, prompt_logprobs=0),
                   seed=0)
    lp = [PromptLogprob(-float(j), 1, []) for j in range(1, 6)]  # tokens 1..5
    seq.add_prompt_logprobs(1, lp[:2])
    seq.add_prompt_logprobs(1, lp[:3])  # recomputed from the start, one chunk further
    seq.add_prompt_logprobs(4, lp[3:])
    assert seq.prompt_logprobs == lp and seq.prompt_logprobs_due
    with pytest.raises(ValueError, match="gap"):
        Sequence("b", list(range(6)), 6, seq.params, seed=0).add_prompt_logprobs(3, lp[2:])


# -- the request and the wire -------------------------------------------------------------

def test_prompt_logprobs_travel_and_old_requests_decode_without_them():
    req = make_request(PROMPT, prompt_logprobs=5)
    assert protocol.EngineRequest.decode(req.encode()).sampling.prompt_logprobs == 5
    raw = json.loads(make_request(PROMPT).encode()["data"])
    del raw["sampling"]["prompt_logprobs"]
    assert protocol.EngineRequest.decode({"data": json.dumps(raw)}).sampling.prompt_logprobs \
        is None
    assert SamplingParams.from_spec(req.sampling).prompt_logprobs == 5


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=1, prompt_logprobs=bad)


def test_the_first_delta_carries_them_as_logprob_rank_and_top_pairs(
        start_worker, redis_client, hf_model):
    start_worker()
    req = make_request(OTHER, max_tokens=3, prompt_logprobs=2)
    submit(redis_client, req)
    events = read_events(redis_client, req.request_id)
    deltas = [e for e in events if e.type == protocol.EV_DELTA]
    assert "prompt_logprobs" in deltas[0].data
    assert all("prompt_logprobs" not in e.data for e in deltas[1:])
    wire = deltas[0].data["prompt_logprobs"]
    assert_matches([PromptLogprob(value, rank, [tuple(pair) for pair in top])
                    for value, rank, top in wire], expected(hf_model, OTHER, 2))
