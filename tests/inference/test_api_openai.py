"""The official `openai` client against a live server, a real engine and real Redis."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from engine import protocol

# NOTE: imported here, before any fixture starts an engine thread: transformers' lazy
# module fails an import racing another thread's first import of it.
from engine.reference import generate_reference
from tests.live import request_streams


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def _expected_text(model_dir, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, str]:
    """Greedy text and finish reason from Hugging Face `generate` on the same checkpoint."""
    out = generate_reference(model_dir, [prompt_ids], max_new_tokens)[0]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    import json

    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    finish = "length"
    if out and out[-1] in eos_ids:
        out, finish = out[:-1], "stop"
    return tokenizer.decode(out, skip_special_tokens=True), finish


def test_models_lists_the_served_model(client, served_model):
    assert [m.id for m in client.models.list()] == [served_model]
    assert client.models.retrieve(served_model).id == served_model


def test_a_model_says_what_a_client_plans_with_and_its_limits_hold(
        api_server, served_model, engine_worker):
    """Its context window, the output it may ask for (under this key's plan) and what it
    supports, in fields the SDK keeps as extras; a request at the limit is served, one
    above it refused."""
    from django.conf import settings

    from core.served_models import served_models
    from tests.factories import key_factory, plan_factory, tenant_factory

    window = served_models()[served_model].context_window
    capped = key_factory(tenant_factory(plan=plan_factory(max_output_tokens=7)))
    for key, most in ((capped.plaintext, 7),
                      (key_factory(tenant_factory()).plaintext,
                       min(settings.ATRIUM_MAX_OUTPUT_TOKENS, window - 1))):
        sdk = OpenAI(base_url=f"{api_server}/v1", api_key=key, max_retries=0)
        listed = sdk.models.list().data[0].model_extra
        assert listed == sdk.models.retrieve(served_model).model_extra
        assert listed["context_window"] == listed["max_model_len"] == window
        assert listed["max_output_tokens"] == most
        assert listed["capabilities"] == {
            "completions": True, "chat_completions": True, "responses": True,
            "messages": True, "tools": True, "tool_choice_required": True,
            "structured_outputs": True, "logprobs": True, "max_top_logprobs": 20,
            "embeddings": False}
    sdk = OpenAI(base_url=f"{api_server}/v1", api_key=capped.plaintext, max_retries=0)
    answer = sdk.completions.create(model=served_model, prompt="Hello", max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 7
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model=served_model, prompt="Hello", max_tokens=8)
    assert refused.value.body["param"] == "max_tokens"


def test_completion_matches_transformers_greedy(client, served_model, engine_worker,
                                                tiny_model_path):
    from core.served_models import served_models

    prompt = "The quick brown fox"
    res = client.completions.create(model=served_model, prompt=prompt, max_tokens=12,
                                    temperature=0)
    ids = served_models()[served_model].encode_prompt(prompt)
    text, finish = _expected_text(tiny_model_path, ids, 12)
    assert res.object == "text_completion"
    assert res.choices[0].text == text
    assert res.choices[0].finish_reason == finish
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens


def test_chat_completion_uses_the_chat_template(client, served_model, engine_worker,
                                                tiny_model_path):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    res = client.chat.completions.create(model=served_model, messages=messages,
                                         max_tokens=10, temperature=0)
    hf_ids = AutoTokenizer.from_pretrained(tiny_model_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text, finish = _expected_text(tiny_model_path, list(hf_ids), 10)
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == text
    assert res.choices[0].finish_reason == finish
    assert res.usage.prompt_tokens == len(hf_ids)


def test_streamed_chat_equals_unstreamed_and_ends_with_usage(client, served_model,
                                                             engine_worker):
    kwargs = dict(model=served_model, max_tokens=16, temperature=0,
                  messages=[{"role": "user", "content": "Tell me a story"}])
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == \
        whole.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_without_usage_option_has_no_usage_chunk(client, served_model,
                                                                    engine_worker):
    chunks = list(client.completions.create(model=served_model, prompt="Once upon",
                                            max_tokens=8, temperature=0, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_same_seed_gives_same_sample(client, served_model, engine_worker):
    kwargs = dict(model=served_model, prompt="A sample", max_tokens=12, temperature=1.0,
                  top_p=0.9)
    a = client.completions.create(**kwargs, seed=7).choices[0].text
    b = client.completions.create(**kwargs, seed=7).choices[0].text
    assert a == b


def test_stop_string_ends_the_completion_without_being_emitted(client, served_model,
                                                               engine_worker):
    free = client.completions.create(model=served_model, prompt="The sea", max_tokens=24,
                                     temperature=0).choices[0].text
    if len(free) < 6:
        pytest.fail(f"the test model must produce some text, got {free!r}")
    stop = free[3:6]
    res = client.completions.create(model=served_model, prompt="The sea", max_tokens=24,
                                    temperature=0, stop=[stop])
    assert res.choices[0].text == free[:free.index(stop)]
    assert res.choices[0].finish_reason == "stop"


def test_nothing_is_left_in_redis_after_a_request(client, served_model, engine_worker,
                                                  redis_client):
    client.completions.create(model=served_model, prompt="hi", max_tokens=4)
    streams = request_streams(redis_client, served_model)
    assert len(streams) == 2  # the shared one and the engine's own
    for stream in streams:
        assert redis_client.xlen(stream) == 0
        assert redis_client.xpending(stream, protocol.ENGINE_GROUP)["pending"] == 0
    assert list(redis_client.scan_iter(match=f"{protocol.KEY_PREFIX}:events:*")) == []
