"""Logprobs, penalties, logit_bias and the token controls through the official `openai` client,
against a live server and a real engine on the tiny checkpoint, checked against transformers."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)  # [outputs, vocab]


MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def _chat_ids(served_model: str) -> list[int]:
    from core.served_models import served_models

    return served_models()[served_model].encode_chat(MESSAGES)


def test_chat_logprobs_are_the_models_log_softmax(client, served_model, engine_worker, hf_model):
    from core.served_models import served_models
    from inference.logprobs import TokenTexts

    model = served_models()[served_model]
    res = client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=4,
                                         extra_body={"ignore_eos": True})
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 8
    # Each entry's bytes name its token: the tokens decode to the answer's text.
    texts = TokenTexts(model.tokenizer)
    by_bytes = {texts.get(i)[1]: i for i in range(model.vocab_size())}
    output_ids = [by_bytes[bytes(e.bytes)] for e in content]
    assert model.tokenizer.decode(output_ids) == res.choices[0].message.content
    expected = _hf_logprobs(hf_model, _chat_ids(served_model), output_ids)
    for i, entry in enumerate(content):
        assert abs(entry.logprob - float(expected[i].max())) < 1e-3  # greedy: the top one
        assert len(entry.top_logprobs) == 4
        top = torch.topk(expected[i], 4).values.tolist()
        assert all(abs(t.logprob - e) < 1e-3 for t, e in zip(entry.top_logprobs, top, strict=True))
        assert entry.top_logprobs[0].token == entry.token


def test_streamed_chat_logprobs_equal_the_whole_answers(client, served_model, engine_worker):
    kwargs = dict(model=served_model, messages=MESSAGES, max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == \
        [(e.token, round(e.logprob, 5)) for e in whole]


def test_completion_logprobs_use_the_legacy_shape(client, served_model, engine_worker):
    res = client.completions.create(model=served_model, prompt="The quick brown fox",
                                    max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == res.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(tl, abs=1e-5)
               for top, tl in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    plain = client.completions.create(model=served_model, prompt="The quick brown fox",
                                      max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == res.choices[0].text


def test_logit_bias_and_penalties_change_the_output(client, served_model, engine_worker):
    from core.served_models import served_models

    tokenizer = served_models()[served_model].tokenizer
    token = tokenizer.encode(" sea", add_special_tokens=False).ids[0]
    forced = client.completions.create(model=served_model, prompt="Once", max_tokens=4,
                                       temperature=0, logit_bias={str(token): 100})
    assert tokenizer.encode(forced.choices[0].text, add_special_tokens=False).ids == [token] * 4
    kwargs = dict(model=served_model, prompt="the the the", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    penalised = client.completions.create(frequency_penalty=2, presence_penalty=2,
                                          **kwargs).choices[0].text
    assert penalised != plain
    assert len(set(penalised.split())) >= len(set(plain.split()))


def test_stop_token_ids_and_min_tokens(client, served_model, engine_worker):
    from core.served_models import served_models

    tokenizer = served_models()[served_model].tokenizer
    token = tokenizer.encode(" sea", add_special_tokens=False).ids[0]
    res = client.completions.create(model=served_model, prompt="Once", max_tokens=10,
                                    temperature=0, logit_bias={str(token): 100},
                                    extra_body={"stop_token_ids": [token]})
    assert (res.choices[0].text, res.choices[0].finish_reason) == ("", "stop")
    assert res.choices[0].stop_reason == token  # vLLM's extension: what stop ended it
    assert res.usage.completion_tokens == 1
    eos = tokenizer.token_to_id(served_models()[served_model].eos_token)
    res = client.completions.create(model=served_model, prompt="Once", max_tokens=10,
                                    temperature=0, logit_bias={str(eos): 100},
                                    extra_body={"min_tokens": 3})
    assert (res.usage.completion_tokens, res.choices[0].finish_reason) == (4, "stop")


def test_a_stop_string_is_named_in_stop_reason_answered_and_streamed(client, served_model,
                                                                   engine_worker):
    kwargs = dict(model=served_model, max_tokens=12, temperature=0,
                  messages=[{"role": "user", "content": "Tell me a story"}],
                  extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = text[len(text) // 2:][:3]
    assert stop.strip()
    cut = client.chat.completions.create(stop=[stop, "never-said"], **kwargs).choices[0]
    assert cut.message.content == text[:text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    *_, last = (c for c in client.chat.completions.create(stop=[stop], stream=True, **kwargs)
                if c.choices)
    assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", stop)
    ran_out = client.chat.completions.create(**kwargs).choices[0]
    assert (ran_out.finish_reason, ran_out.stop_reason) == ("length", None)


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids"),
    ({"extra_body": {"min_tokens": 50}}, "min_tokens"),
])
def test_token_ids_past_the_vocabulary_are_refused(client, served_model, engine_worker, extra,
                                                   param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=served_model, prompt="Once", max_tokens=10, **extra)
    assert err.value.body["param"] == param


def test_echo_puts_the_prompt_before_the_completion(client, served_model, engine_worker):
    kwargs = dict(model=served_model, prompt="The quick brown fox", max_tokens=5,
                  temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs).choices[0].text
    assert echoed == "The quick brown fox" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        echo=True, stream=True, **kwargs) if c.choices)
    assert streamed == echoed


def test_n_choices_are_distinct_at_temperature_1_and_billed_once_for_the_prompt(
        client, served_model, engine_worker):
    kwargs = dict(model=served_model, messages=[{"role": "user", "content": "Hello"}],
                  max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    one = client.chat.completions.create(**kwargs)
    four = client.chat.completions.create(n=4, **kwargs)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in four.choices}) == 4
    assert four.choices[0].message.content == one.choices[0].message.content
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * 12
    streamed: dict[int, str] = {}
    finishes = {}
    for chunk in client.chat.completions.create(n=4, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (
                choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.message.content for c in four.choices}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_best_of_returns_the_most_likely_choices(client, served_model, engine_worker):
    kwargs = dict(model=served_model, prompt="The sea", max_tokens=6, temperature=1.0,
                  seed=3, logprobs=0, extra_body={"ignore_eos": True})
    # The same seed gives the same choices whatever n: best_of=5 ranks these five.
    many = client.completions.create(n=5, **kwargs).choices
    best = client.completions.create(n=2, best_of=5, **kwargs)
    ranked = sorted(many, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.usage.completion_tokens == 5 * 6  # every choice generated is billed


def test_the_request_log_keeps_every_choice(client, served_model, engine_worker, tenant_key):
    from requestlogs.services import log_policy_update
    from tenants.access import SYSTEM
    from tenants.models import Tenant
    from tests.requestlogs.conftest import wait_for_logs

    log_policy_update(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), actor=SYSTEM,
                      log_bodies=True)
    res = client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Hello"}], n=3,
        max_tokens=6, temperature=1.0, seed=1, stream=True)
    texts: dict[int, str] = {}
    for chunk in res:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    [entry] = wait_for_logs(1)
    assert entry.completion == "\n".join(f"[choice {i}]\n{texts[i]}" for i in range(3))
    assert 3 <= entry.completion_tokens <= 18


def test_a_list_of_prompts_gets_n_choices_each_in_one_response(client, served_model,
                                                              engine_worker):
    prompts = ["The quick brown fox", "Once upon a time", "The sea"]
    singles = [client.completions.create(model=served_model, prompt=p, max_tokens=5,
                                         temperature=0) for p in prompts]
    res = client.completions.create(model=served_model, prompt=prompts, max_tokens=5,
                                    temperature=0, n=2, echo=True)
    assert [c.index for c in res.choices] == list(range(6))
    for k, choice in enumerate(res.choices):
        single = singles[k // 2].choices[0]
        assert choice.text == prompts[k // 2] + single.text
        assert choice.finish_reason == single.finish_reason
    assert res.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert res.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=served_model, prompt=prompts, max_tokens=5,
                                           temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {p: singles[p].choices[0].text for p in range(3)}


def test_every_prompt_in_a_list_must_fit(client, served_model, engine_worker):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=served_model, prompt=["ok", "x " * 5000],
                                  max_tokens=5)
    assert err.value.body["code"] == "context_length_exceeded"
