"""Speculative decoding (engine/speculative.py): the n-gram proposer, the draft length,
and the engine with it on: the same greedy output, fewer steps, its metrics."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import protocol
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import render_prometheus
from engine.speculative import (
    MAX_NGRAM,
    SequenceDrafts,
    accepted_prefix,
    parse_mode,
    verify_row,
    verify_sampled,
)
from tests.engine.engine_testing import make_request, read_events, submit
from tests.engine.test_llm_engine import (
    drain,
    finished_before_the_quiet_tenant,
    request,
    tokens,
)


def _oracle(tokens: list[int], k: int) -> list[int]:
    """The proposal by brute force: the longest suffix (4 down to 1 tokens) found earlier,
    its latest occurrence, what followed it."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_the_proposer_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    def propose(tokens: list[int], k: int) -> list[int]:
        return SequenceDrafts(4).propose(tokens, k)

    tokens_ = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred before as "2 3 7 8 ..." (the latest one), not "2 3 9".
    assert propose(tokens_, 3) == [7, 8, 5]
    assert propose([4, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # the 3-gram wins
    assert propose([1, 2, 3], 4) == []  # nothing repeats
    assert propose([5, 5], 3) == [5]  # what follows, however little
    assert propose([1, 2, 1, 2], 0) == []


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1,
                max_size=6), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_the_index_proposes_what_a_full_scan_finds_as_the_sequence_grows(chunks, k):
    drafts, tokens_ = SequenceDrafts(4), []
    for chunk in chunks:  # tokens arrive a few at a time, as steps append them
        tokens_ += chunk
        assert drafts.propose(tokens_, k) == _oracle(tokens_, k)


def test_a_draft_keeps_its_tokens_while_the_model_chooses_them():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_prefix([4], [7, 1]) == 0


def test_the_draft_length_follows_acceptance():
    drafts = SequenceDrafts(4)
    assert drafts.length == 4
    drafts.update(4, 1)
    assert drafts.length == 2  # what was accepted, plus one
    drafts.update(2, 2)
    drafts.update(3, 3)
    assert drafts.length == 4  # grows by one per full acceptance, up to the limit
    drafts.update(4, 4)
    assert drafts.length == 4
    drafts.update(0, 0)  # nothing proposed: unchanged
    assert drafts.length == 4


def test_only_operators_modes_are_accepted(tiny_model_dir):
    assert parse_mode("NGRAM") == "ngram" and parse_mode("") == "off"
    assert parse_mode(" Draft:/models/small ") == "draft:/models/small"
    with pytest.raises(ValueError, match="one of off, ngram"):
        parse_mode("medusa")
    with pytest.raises(ValueError, match="needs the draft checkpoint"):
        parse_mode("draft:")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model_dir=tiny_model_dir, speculative="ngram", num_speculative_tokens=0)


def _run(tiny_model_dir, prompts, **options) -> tuple[LLMEngine, dict]:
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, **options))
    for i, (prompt, sampling) in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt, **sampling))
    return engine, drain(engine)


@pytest.fixture(scope="module")
def grounded() -> list[int]:
    """A prompt that quotes itself: its second half repeats its first."""
    rng = random.Random(7)
    text = [rng.randrange(10, 1400) for _ in range(48)]
    return text + text[:24]


def test_one_grounded_request_takes_fewer_steps_for_the_same_tokens(tiny_model_dir, grounded):
    plain, expected = _run(tiny_model_dir, [(grounded, {"max_tokens": 48})])
    fast, got = _run(tiny_model_dir, [(grounded, {"max_tokens": 48})], speculative="ngram")
    assert tokens(got["r0"]) == tokens(expected["r0"])
    assert "".join(o.text_delta for o in got["r0"]) == "".join(
        o.text_delta for o in expected["r0"])
    assert got["r0"][-1].usage.completion_tokens == expected["r0"][-1].usage.completion_tokens
    assert got["r0"][-1].finish_reason == expected["r0"][-1].finish_reason
    assert fast.metrics.spec_accepted_tokens > 0
    assert fast.metrics.steps < plain.metrics.steps
    assert fast.kv.num_free_blocks == fast.kv.num_blocks  # rejected drafts' blocks returned


@pytest.mark.parametrize("sampling", [
    {"presence_penalty": 0.4, "frequency_penalty": 0.3},
    {"repetition_penalty": 1.02},
    {"logit_bias": {"300": 0.05, "301": -0.05}},
    {"min_tokens": 20},
    {"logprobs": 2},
], ids=["presence-frequency", "repetition", "logit-bias", "min-tokens", "logprobs"])
def test_shaped_logits_and_logprobs_speculate_with_the_same_output(tiny_model_dir, grounded,
                                                                     sampling):
    """Each draft position is shaped with the draft before it in the history, so penalties,
    bias and min_tokens act as they do one token at a time; logprobs come per token."""
    sampling = {"max_tokens": 32, **sampling}
    _, expected = _run(tiny_model_dir, [(grounded, sampling)])
    engine, got = _run(tiny_model_dir, [(grounded, sampling)], speculative="ngram")
    assert tokens(got["r0"]) == tokens(expected["r0"])
    assert engine.metrics.spec_drafts > 0
    if "logprobs" in sampling:
        ours = [lp for o in got["r0"] for lp in o.logprobs or []]
        theirs = [lp for o in expected["r0"] for lp in o.logprobs or []]
        assert len(ours) == len(theirs) == len(tokens(got["r0"]))
        for a, b in zip(ours, theirs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_choices_of_one_prompt_speculate_and_match_without(tiny_model_dir, grounded):
    sampling = {"max_tokens": 24, "n": 2}
    _, expected = _run(tiny_model_dir, [(grounded, sampling)])
    engine, got = _run(tiny_model_dir, [(grounded, sampling)], speculative="ngram")
    for index in (0, 1):  # the choices' deltas interleave differently; each is the same
        assert [t for o in got["r0"] if o.index == index for t in o.token_ids] == \
            [t for o in expected["r0"] if o.index == index for t in o.token_ids]
    assert engine.metrics.spec_accepted_tokens > 0


def test_a_busy_batch_does_not_speculate(tiny_model_dir, grounded):
    engine, _ = _run(tiny_model_dir, [(grounded, {"max_tokens": 8})] * 1
                     + [(grounded[:40], {"max_tokens": 8})] * 5,
                     speculative="ngram", speculative_max_batch=2)
    assert engine.metrics.spec_drafts == 0  # six decoding at once, above the limit of two


def test_the_metrics_use_vllms_spec_decode_names(tiny_model_dir, grounded):
    engine, _ = _run(tiny_model_dir, [(grounded, {"max_tokens": 32})], speculative="ngram")
    text = render_prometheus(engine.snapshot(), model_name="tiny", engine="e1")
    m = engine.metrics
    assert f'vllm:spec_decode_num_drafts_total{{engine="e1",model_name="tiny"}} ' \
           f'{float(m.spec_drafts)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{engine="e1",model_name="tiny"}} ' \
           f'{float(m.spec_accepted_tokens)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="e1",model_name="tiny",' \
           'position="0"}' in text
    assert m.spec_accepted_per_pos[0] >= m.spec_accepted_per_pos[-1]
    assert sum(m.spec_accepted_per_pos) == m.spec_accepted_tokens <= m.spec_draft_tokens


def _chi_square_same(a: list[int], b: list[int]) -> tuple[float, float]:
    """Pearson's chi-square statistic of two samples being drawn from one distribution
    (categories seen fewer than 10 times in all pooled), and its 0.1% critical value
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rows = [[ca[t], cb[t]] for t in common]
    rows.append([len(a) - sum(r[0] for r in rows), len(b) - sum(r[1] for r in rows)])
    rows = [r for r in rows if sum(r)]
    total, sizes = len(a) + len(b), (len(a), len(b))
    stat = sum((r[g] - sum(r) * sizes[g] / total) ** 2 / (sum(r) * sizes[g] / total)
               for r in rows for g in (0, 1))
    df, z = max(1, len(rows) - 1), 3.0902  # z of the 0.999 quantile
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_rejection_sampling_keeps_each_positions_distribution():
    """Draws through verify_sampled and through the sampler without speculation, from the
    same logits: the first token, and the second given the first kept the draft's, have
    the same distribution (chi-square tests at 0.1%)."""
    import torch

    from engine.sampler import sample
    from engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen) * 2.0  # [draft + 1, vocab]
    draft = [int(torch.argsort(logits[0])[-2]), int(torch.argmax(logits[1]))]  # 2nd, 1st
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=30)
    count = 6000
    spec = [verify_sampled(logits, draft, params, seed, 5) for seed in range(count)]
    plain = [sample(logits[0], params, seed, 5) for seed in range(count, 2 * count)]
    kept = [out for out in spec if out[0] == draft[0]]
    assert 0.05 < len(kept) / count < 0.95  # the draft was kept at times, rejected at times
    assert all(len(out) == 1 for out in spec if out[0] != draft[0])  # a rejection ends it
    stat, critical = _chi_square_same([out[0] for out in spec], plain)
    assert stat < critical, ("first token", stat, critical)
    after = [sample(logits[1], params, seed, 6) for seed in range(2 * count, 3 * count)]
    stat, critical = _chi_square_same([out[1] for out in kept], after)
    assert stat < critical, ("second token", stat, critical)


def test_unseeded_sampling_speculates_in_the_engine_and_seeded_does_not(tiny_model_dir,
                                                                         grounded, monkeypatch):
    # NOTE: the engine seeds an unseeded request at random; fixed here, so whether its
    # sampled tokens meet an n-gram of the prompt is the same every run.
    seeds = iter(range(1, 10**6))
    monkeypatch.setattr("engine.llm_engine.secrets.randbits", lambda bits: next(seeds))
    sampling = {"max_tokens": 12, "temperature": 0.8}
    engine, outputs = _run(tiny_model_dir, [(grounded, sampling)] * 8,
                           speculative="ngram", speculative_max_batch=64)
    assert engine.metrics.spec_drafts > 0
    assert all(o[-1].usage.completion_tokens == len(tokens(o)) for o in outputs.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    seeded, _ = _run(tiny_model_dir, [(grounded, {**sampling, "seed": 4})] * 8,
                     speculative="ngram", speculative_max_batch=64)
    assert seeded.metrics.spec_drafts == 0  # its tokens must not depend on the batch


def test_each_draft_position_is_shaped_with_the_draft_before_it():
    """A presence penalty at draft position 1 counts draft token 0 as already output: the
    token the model prefers by a little at both positions is kept once, not twice."""
    import torch

    from engine.batch import ScheduledRequest
    from engine.sampling_params import SamplingParams

    a, b = 7, 8
    logits = torch.zeros(3, 16)
    logits[:, a], logits[:, b] = 1.0, 0.5  # a over b by less than the penalty
    params = SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=2.0)
    history = [3, 4, 5]
    req = ScheduledRequest(request_id="r", token_ids=[5, a, a], start_pos=2,
                           block_table=[0], sample=True, sampling=params, history=history,
                           num_prompt_tokens=len(history), draft=[a, a])
    assert verify_row(logits, req).tokens == [a, b]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constrained_drafts_are_cut_where_the_grammar_refuses_and_stay_valid(
        tiny_model_dir, temperature, monkeypatch):
    """A grammar masks every draft position; drafts end where the grammar refuses a token,
    and its state advances only with the tokens kept. Greedy output is unchanged, every
    sampled answer is valid JSON of its schema."""
    import jsonschema

    from engine.speculative import SpeculationGovernor

    # NOTE: drafting every step: on this CPU the governor may find sampled, constrained
    # drafts slower and try them only now and then, and this test is about their output.
    monkeypatch.setattr(SpeculationGovernor, "wants_drafts", lambda self: True)
    from tests.engine.test_structured_engine import CLOSED, prompt

    grammar = {"type": "json_schema", "schema": CLOSED}
    jobs = [(prompt(seed) * 3, {"max_tokens": 120, "temperature": temperature,
                                "grammar": grammar}) for seed in range(6)]
    _, expected = _run(tiny_model_dir, jobs)
    engine, got = _run(tiny_model_dir, jobs, speculative="ngram", speculative_max_batch=64)
    assert engine.metrics.spec_accepted_tokens > 0
    for i in range(len(jobs)):
        answer = "".join(o.text_delta for o in got[f"r{i}"])
        jsonschema.validate(json.loads(answer), CLOSED)
        if temperature == 0.0:
            assert tokens(got[f"r{i}"]) == tokens(expected[f"r{i}"])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_engine_worker_told_by_its_operator_speculates_and_streams_the_same(
        start_worker, redis_client, tokenizer, grounded, monkeypatch):
    """ATRIUM_SPECULATIVE=ngram, as `atrium engine` reads it: the request's events carry
    the same tokens and text as without, several tokens a delta at times, and the
    heartbeat reports the drafts."""
    def stream(engine_id: str) -> tuple[list[protocol.Event], dict]:
        worker = start_worker(engine_id=engine_id)
        request = make_request(grounded, max_tokens=40, ignore_eos=True)
        submit(redis_client, request)
        events = read_events(redis_client, request.request_id)

        deadline = time.monotonic() + 10
        while True:  # the first heartbeat after the request's last token
            raw = redis_client.get(protocol.engine_key(engine_id))
            reported = json.loads(raw)["stats"].get("engine", {}) if raw else {}
            if reported.get("generation_tokens", 0) >= 40:
                break
            assert time.monotonic() < deadline, "no heartbeat after the request"
            time.sleep(0.1)
        worker.shutdown()
        return [e for e in events if e.type == protocol.EV_DELTA], reported

    plain, _ = stream("engine-plain")
    monkeypatch.setenv("ATRIUM_SPECULATIVE", "ngram")
    fast, stats = stream("engine-fast")
    ids = [t for e in fast for t in e.data["token_ids"]]
    assert ids == [t for e in plain for t in e.data["token_ids"]]
    assert "".join(e.data["text"] for e in fast) == tokenizer.decode(ids)
    assert max(len(e.data["token_ids"]) for e in fast) > 1
    assert stats["spec_decode_num_accepted_tokens"] > 0


# --- the draft-model proposer -----------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with one layer's weights perturbed: the same tokenizer, a model
    that agrees with the target often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "tiny-draft"
    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name] + 0.02 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_draft_model_speculates_and_greedy_output_equals_transformers(
        tiny_model_dir, draft_dir):
    from engine.reference import generate_reference

    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1400) for _ in range(n)] for n in (5, 17, 40, 90)]
    expected = generate_reference(tiny_model_dir, prompts, 24)
    engine, got = _run(tiny_model_dir, [(p, {"max_tokens": 24}) for p in prompts],
                       speculative=f"draft:{draft_dir}", speculative_max_batch=64)
    for i in range(len(prompts)):
        assert tokens(got[f"r{i}"]) == expected[i], i
    m = engine.metrics
    assert 0 < m.spec_accepted_tokens < m.spec_draft_tokens  # agrees often, not always
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.drafter.kv.num_free_blocks == engine.drafter.kv.num_blocks  # its own, too
    assert engine.drafter.views == {}


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_model_dir, grounded):
    _, expected = _run(tiny_model_dir, [(grounded, {"max_tokens": 30})])
    engine, got = _run(tiny_model_dir, [(grounded, {"max_tokens": 30})],
                       speculative=f"draft:{tiny_model_dir}")
    assert tokens(got["r0"]) == tokens(expected["r0"])
    m = engine.metrics
    assert m.spec_accepted_tokens == m.spec_draft_tokens > 0
    assert m.steps < 30  # several tokens a step


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from engine.demo_model import build_model

    other = build_model(tmp_path / "other", size="tiny", seed=9)  # another vocabulary
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLMEngine(EngineConfig(model_dir=tiny_model_dir, speculative=f"draft:{other}"))


def test_a_draft_model_under_preemption_keeps_the_output(tiny_model_dir, draft_dir, prompts8):
    options = {"num_kv_blocks": 40, "block_size": 8, "max_num_batched_tokens": 64,
               "speculative_max_batch": 64}
    _, expected = _run(tiny_model_dir, [(p, {"max_tokens": 24}) for p in prompts8], **options)
    engine, got = _run(tiny_model_dir, [(p, {"max_tokens": 24}) for p in prompts8],
                       speculative=f"draft:{draft_dir}", **options)
    assert engine.scheduler.num_preemptions > 0
    for i in range(len(prompts8)):
        assert tokens(got[f"r{i}"]) == tokens(expected[f"r{i}"]), i
    assert engine.drafter.views == {}


@pytest.fixture(scope="module")
def prompts8() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(10, 1400) for _ in range(n)] for n in (30, 45, 60, 33, 50, 41, 70, 25)]


def test_a_failing_draft_model_costs_only_its_drafts(tiny_model_dir, draft_dir, grounded):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, speculative=f"draft:{draft_dir}"))

    def broken(batch):
        raise RuntimeError("the draft model's device fell over")

    engine.drafter.runner.run = broken
    engine.add_request(request("r0", grounded, max_tokens=12))
    outputs = drain(engine)
    assert len(tokens(outputs["r0"])) == 12 and outputs["r0"][-1].error is None
    assert engine.metrics.spec_drafts == 0
    assert engine.drafter.kv.num_free_blocks == engine.drafter.kv.num_blocks


def test_a_flooding_tenant_does_not_starve_a_quiet_one_while_speculating(tiny_model_dir,
                                                                          grounded):
    """The fair queue decides who runs; speculation only changes how many tokens a running
    sequence gets a step."""
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=4,
                                    speculative="ngram"))
    assert finished_before_the_quiet_tenant(engine, grounded, 32) <= 4
    assert engine.metrics.spec_accepted_tokens > 0


def test_the_governor_keeps_whichever_way_yields_more_and_tries_the_other_ever_less():
    from engine.speculative import SpeculationGovernor

    governor = SpeculationGovernor()
    choices, spent, change = [], 0.0, 2500
    for step in range(4000):
        drafting = governor.wants_drafts()
        choices.append(drafting)
        pays = step >= change
        # Until the change speculating yields 2 tokens a step in 3 times as long (a net
        # loss); from then on 3 tokens in 1.2 times as long.
        seconds = (0.012 if pays else 0.03) if drafting else 0.01
        governor.record(drafting=drafting, rows=1, tokens=(3 if pays else 2) if drafting else 1,
                        seconds=seconds)
        spent += seconds if 6 <= step < change else 0.0
        if step == change - 1:
            assert not governor.on
    # After 6 steps of learning, the losing way is tried ever less often, each probe long
    # enough after the last that it cost 1% of what never trying it would have.
    assert 3 <= sum(choices[6:change]) <= 8
    assert spent / (0.01 * (change - 6)) - 1 <= 0.015
    # When it starts to pay, the next probe sees it.
    assert governor.on
    assert sum(choices[change + SpeculationGovernor.PROBE_MOST + 2:]) >= 400
    gainful = SpeculationGovernor()
    for _ in range(200):
        drafting = gainful.wants_drafts()
        gainful.record(drafting=drafting, rows=1, tokens=3 if drafting else 1, seconds=0.012)
    assert gainful.on


def test_a_draft_model_slower_than_it_saves_is_turned_off(tiny_model_dir, draft_dir,
                                                          grounded, monkeypatch):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, speculative=f"draft:{draft_dir}"))
    propose = engine.drafter.propose

    def slow(wanted):
        time.sleep(0.02)  # as if each proposal cost several passes of the target
        return propose(wanted)

    monkeypatch.setattr(engine.drafter, "propose", slow)
    engine.add_request(request("r0", grounded, max_tokens=200, ignore_eos=True))
    drain(engine)
    assert not engine.governor.on
    # Three tries each way, then fewer and fewer.
    assert engine.metrics.spec_drafts < engine.metrics.steps / 10
