"""The prompt's logprobs through the official `openai` client, against a live server and a
real engine on the tiny checkpoint: OpenAI's echo with logprobs and vLLM's
``prompt_logprobs`` equal transformers' log-softmax over the prompt, for each prompt of a
request, whatever the prefix cache holds; what cannot be served is refused by name."""

from __future__ import annotations

import openai
import pytest
import torch
from openai import OpenAI

PROMPTS = ["The quick brown fox jumps over the lazy dog by the river bank",
           "Once upon a time there was a baker"]


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _prompt_ids(served_model: str, text: str) -> list[int]:
    from core.served_models import served_models

    return served_models()[served_model].encode_prompt(text)


def _expected(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row j is the distribution token j + 1 was read from."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(
        client, served_model, engine_worker, hf_model):
    from core.served_models import served_models
    from inference.logprobs import TokenTexts

    texts = TokenTexts(served_models()[served_model].tokenizer)
    ids = _prompt_ids(served_model, PROMPTS[0])
    expected = _expected(hf_model, ids)
    res = client.completions.create(model=served_model, prompt=PROMPTS[0], max_tokens=3,
                                    temperature=0, echo=True, logprobs=2,
                                    extra_body={"ignore_eos": True})
    choice = res.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPTS[0])
    assert len(logprobs.tokens) == len(ids) + 3 == len(logprobs.token_logprobs)
    assert logprobs.tokens[:len(ids)] == [texts.get(i)[0] for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for j, token in enumerate(ids[1:]):
        assert abs(logprobs.token_logprobs[j + 1] - float(expected[j][token])) < 1e-3
        top = torch.topk(expected[j], 2)
        assert [round(v, 3) for v in logprobs.top_logprobs[j + 1].values()] == \
            [round(v, 3) for v in top.values.tolist()]
    # The completion's tokens follow, with their offsets in the echoed text.
    assert logprobs.text_offset[len(ids)] == len(PROMPTS[0])
    assert choice.text[logprobs.text_offset[-1]:] == logprobs.tokens[-1]


def test_vllms_prompt_logprobs_for_each_prompt_and_choice_whatever_is_cached(
        client, served_model, engine_worker, hf_model):
    kwargs = dict(model=served_model, prompt=PROMPTS, max_tokens=2, n=2, temperature=0,
                  extra_body={"prompt_logprobs": 3, "ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)  # every prompt block is cached by now
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert len(first.choices) == 4
    for res in (first, again):
        for choice in res.choices:
            text = PROMPTS[choice.index // 2]
            ids = _prompt_ids(served_model, text)
            expected = _expected(hf_model, ids)
            got = choice.model_extra["prompt_logprobs"]
            assert got[0] is None and len(got) == len(ids)
            for j, token in enumerate(ids[1:]):
                entry = got[j + 1]
                assert abs(entry[str(token)]["logprob"] - float(expected[j][token])) < 1e-3
                rank = int((expected[j] > expected[j][token]).sum()) + 1
                assert entry[str(token)]["rank"] == rank
                top = torch.topk(expected[j], 3).indices.tolist()
                assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]
                assert len(entry) == 3 + (token not in top)
    assert [c.model_extra["prompt_logprobs"] for c in first.choices] == \
        [c.model_extra["prompt_logprobs"] for c in again.choices]


def test_a_completion_without_them_says_nothing_of_the_prompt(client, served_model,
                                                              engine_worker):
    res = client.completions.create(model=served_model, prompt=PROMPTS[1], max_tokens=2,
                                    echo=True)
    assert res.choices[0].logprobs is None
    assert "prompt_logprobs" not in (res.choices[0].model_extra or {})


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"stream": True, "echo": True, "logprobs": 1}, "stream"),
    ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "stream"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
])
def test_what_cannot_be_served_is_refused_by_name(client, served_model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=served_model, prompt="Hi", max_tokens=2, **kwargs)
    assert refused.value.body["param"] == param


def test_chat_takes_no_prompt_logprobs(client, served_model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served_model, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"prompt_logprobs": 1})
    assert refused.value.body["param"] == "prompt_logprobs"
