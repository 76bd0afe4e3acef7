"""Calling LoRA adapters by name through the official `openai` client, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import APIStatusError, OpenAI

from tests.engine.lora_testing import peft_greedy, train_adapter
from tests.live import make_tenant_key, start_engine


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {"sql": train_adapter(tiny_model_path, root / "sql", seed=11, r=8),
            "poet": train_adapter(tiny_model_path, root / "poet", seed=12, r=16,
                                  targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture
def store(adapter_store) -> Path:
    return adapter_store


@pytest.fixture
def lora_engine(served_model, tiny_model_path, store, redis_client):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    running = start_engine(tiny_model_path, served_model, "lora-engine", engine_factory=lambda d:
                           LLMEngine(EngineConfig(model_dir=d, adapter_store=store, max_loras=2)))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def register(tenant_slug: str, name: str, folder: Path, model_dir: Path, public=False):
    from adapters.services import adapter_register
    from tenants.models import Tenant

    return adapter_register(tenant=Tenant.objects.get(slug=tenant_slug), name=name,
                            source_dir=folder, base_model="tiny-llama", base_model_dir=model_dir,
                            public=public)


def client(api_server, key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=key, max_retries=0, timeout=60)


def _greedy_text(model_dir, folder, prompt_ids, n):
    from tokenizers import Tokenizer

    out = peft_greedy(model_dir, folder, [prompt_ids], n)[0]
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(
        out, skip_special_tokens=True)


def test_a_tenant_calls_its_adapter_and_gets_what_peft_generates(
        api_server, lora_engine, tenant_key, trained, tiny_model_path):
    from core.served_models import served_models

    register(tenant_key.slug, "sql", trained["sql"], tiny_model_path)
    register(tenant_key.slug, "poet", trained["poet"], tiny_model_path)
    openai = client(api_server, tenant_key.key)
    prompt = "The quick brown fox"
    ids = served_models()["tiny-llama"].encode_prompt(prompt)
    for name in ("sql", "poet"):
        res = openai.completions.create(model=f"tiny-llama:{name}", prompt=prompt,
                                        max_tokens=10, temperature=0)
        assert res.model == f"tiny-llama:{name}"
        assert res.choices[0].text == _greedy_text(tiny_model_path, trained[name], ids, 10)
    base = openai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10,
                                     temperature=0)
    assert base.choices[0].text == _greedy_text(tiny_model_path, None, ids, 10)
    assert base.choices[0].text != res.choices[0].text
    stream = openai.chat.completions.create(
        model="tiny-llama:sql@1", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens >= 1
    assert {c.model for c in chunks} == {"tiny-llama:sql@1"}


def test_models_lists_own_and_public_adapters_only(api_server, tenant_key, trained,
                                                   tiny_model_path, store):
    other = make_tenant_key("globex")
    third = make_tenant_key("initech")
    register(tenant_key.slug, "sql", trained["sql"], tiny_model_path)
    register(tenant_key.slug, "sql", trained["poet"], tiny_model_path)  # version 2
    register(other.slug, "secret", trained["poet"], tiny_model_path)
    register(third.slug, "shared", trained["sql"], tiny_model_path, public=True)
    ids = [m.id for m in client(api_server, tenant_key.key).models.list()]
    assert ids == ["tiny-llama", "tiny-llama:sql", "tiny-llama:initech/shared"]
    assert "tiny-llama:secret" not in [m.id for m in client(api_server, third.key).models.list()]
    detail = client(api_server, tenant_key.key).models.retrieve("tiny-llama:sql@1")
    assert detail.owned_by == tenant_key.slug
    base = client(api_server, tenant_key.key).models.retrieve("tiny-llama")
    assert detail.model_extra["context_window"] == base.model_extra["context_window"]
    assert detail.model_extra["capabilities"] == base.model_extra["capabilities"]


@pytest.mark.parametrize("model", [
    "tiny-llama:secret",  # another tenant's private adapter: indistinguishable from unknown
    "tiny-llama:globex/secret",
    "tiny-llama:nope",
    "tiny-llama:sql@9",
    "tiny-llama:../../etc",
    "other-model:sql",
])
def test_unknown_or_foreign_adapters_are_404(api_server, tenant_key, trained, tiny_model_path,
                                             store, model):
    other = make_tenant_key("globex")
    register(other.slug, "secret", trained["poet"], tiny_model_path)
    register(tenant_key.slug, "sql", trained["sql"], tiny_model_path)
    with pytest.raises(APIStatusError) as err:
        client(api_server, tenant_key.key).completions.create(model=model, prompt="x",
                                                              max_tokens=2)
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found"


def test_a_not_ready_adapter_is_409_with_its_reason(api_server, tenant_key):
    from adapters.models import Adapter, AdapterStatus
    from tenants.models import Tenant

    Adapter.objects.create(tenant=Tenant.objects.get(slug=tenant_key.slug), name="half",
                           version=1, base_model="tiny-llama", status=AdapterStatus.FAILED,
                           failure_reason="rank 256 is above the maximum of 64")
    with pytest.raises(APIStatusError) as err:
        client(api_server, tenant_key.key).completions.create(model="tiny-llama:half",
                                                              prompt="x", max_tokens=2)
    assert err.value.status_code == 409
    assert err.value.body["code"] == "adapter_not_ready"
    assert "rank 256" in err.value.body["message"]


def test_a_public_adapter_is_callable_by_other_tenants(api_server, lora_engine, tenant_key,
                                                       trained, tiny_model_path):
    owner = make_tenant_key("initech")
    register(owner.slug, "shared", trained["sql"], tiny_model_path, public=True)
    res = client(api_server, tenant_key.key).completions.create(
        model="tiny-llama:initech/shared", prompt="Hello", max_tokens=4, temperature=0)
    assert res.usage.completion_tokens >= 1


def test_registration_refuses_a_bad_adapter_and_records_nothing(tenant_key, trained,
                                                                tiny_model_path, store,
                                                                tmp_path):
    import json
    import shutil

    from adapters.models import Adapter
    from adapters.services import AdapterRejected

    bad = tmp_path / "bad"
    shutil.copytree(trained["sql"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 500}))
    with pytest.raises(AdapterRejected, match="above"):
        register(tenant_key.slug, "bad", bad, tiny_model_path)
    with pytest.raises(AdapterRejected, match="names"):
        register(tenant_key.slug, "Bad Name!", trained["sql"], tiny_model_path)
    assert not Adapter.objects.exists()
    assert not store.exists() or not any(store.iterdir())


def test_an_adapter_serves_structured_output_tools_logprobs_and_n(
        api_server, lora_engine, tenant_key, trained, tiny_model_path):
    import json

    import jsonschema

    register(tenant_key.slug, "sql", trained["sql"], tiny_model_path)
    openai = client(api_server, tenant_key.key)
    model, messages = "tiny-llama:sql", [{"role": "user", "content": "Give me a row"}]
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                      "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}
    res = openai.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=1.0, seed=2, n=3,
        logprobs=True, top_logprobs=2, response_format={
            "type": "json_schema", "json_schema": {"name": "row", "schema": schema}})
    assert res.model == model and len(res.choices) == 3
    for choice in res.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert len(choice.logprobs.content) >= 1
    tool = {"type": "function", "function": {"name": "fetch_row", "parameters": schema}}
    called = openai.chat.completions.create(
        model=model, messages=messages, max_tokens=40, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "fetch_row"}})
    (call,) = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
