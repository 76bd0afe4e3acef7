"""/v1/embeddings through the official `openai` client, against a live server and real
engines: an embedding model in the sentence-transformers layout (equal to
sentence-transformers' encode on the same checkpoint), a generative model with embeddings
turned on and one without; billed at the embedding price, logged, and what is malformed
or not served is refused by name."""

from __future__ import annotations

import base64
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI

from core.served_models import served_models
from tests.live import start_engine

EMBEDDER = "tiny-embed"
TEXTS = ["The old fox sleeps by the river.", "Bread and butter", "A quiet village on the "
         "hill watches the boats come home every evening, one after another."]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory) -> Path:
    from engine.demo_model import build_embedding_model

    return build_embedding_model(tmp_path_factory.mktemp("embedder") / EMBEDDER, size="tiny")


@pytest.fixture
def served_model(settings, tiny_model_path, embedding_dir):  # tests/live.py's, with two
    settings.ATRIUM_MODEL = ""
    settings.ATRIUM_MODELS = {"tiny-llama": str(tiny_model_path), EMBEDDER: str(embedding_dir)}
    settings.ATRIUM_EMBEDDING_MODELS = frozenset()
    served_models.cache_clear()
    yield "tiny-llama"
    served_models.cache_clear()


@pytest.fixture
def embedding_engine(embedding_dir, redis_client):
    running = start_engine(embedding_dir, EMBEDDER, "embedding-engine")
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def _encode(model_dir: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_numpy=True)


def test_embeddings_equal_sentence_transformers_single_and_batched_float_and_base64(
        client, embedding_engine, embedding_dir):
    expected = _encode(embedding_dir, TEXTS)
    batched = client.embeddings.create(model=EMBEDDER, input=TEXTS)
    assert [d.index for d in batched.data] == [0, 1, 2]
    assert np.abs(np.array([d.embedding for d in batched.data]) - expected).max() < 1e-5
    single = client.embeddings.create(model=EMBEDDER, input=TEXTS[0])
    assert np.abs(np.array(single.data[0].embedding) - expected[0]).max() < 1e-5
    raw = client.embeddings.with_raw_response.create(model=EMBEDDER, input=TEXTS,
                                                     encoding_format="base64")
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
               for d in raw.http_response.json()["data"]]
    assert np.abs(np.array(vectors) - expected).max() < 1e-5
    assert raw.headers["x-request-id"].startswith("embd-")
    # Token ids embed as the text they spell.
    ids = served_models()[EMBEDDER].encode_prompt(TEXTS[1])
    by_ids = client.embeddings.create(model=EMBEDDER, input=[ids])
    assert np.abs(np.array(by_ids.data[0].embedding) - expected[1]).max() < 1e-5
    assert batched.usage.prompt_tokens == sum(
        len(served_models()[EMBEDDER].encode_prompt(t)) for t in TEXTS)
    assert batched.usage.total_tokens == batched.usage.prompt_tokens


def test_an_embedding_is_billed_at_the_embedding_price_and_logged(
        client, embedding_engine, tenant_key, redis_client):
    from billing.ingest import drain
    from billing.models import UsageRecord
    from billing.pricing import quotes_forget
    from billing.services import price_create
    from requestlogs.services import log_policy_update
    from tenants.access import SYSTEM
    from tenants.models import Tenant
    from tests.requestlogs.conftest import wait_for_logs

    price_create(model=EMBEDDER, input_per_million=Decimal(1),
                 cached_input_per_million=Decimal(1), output_per_million=Decimal(2),
                 embedding_per_million=Decimal(1000))
    quotes_forget()
    log_policy_update(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), actor=SYSTEM,
                      log_bodies=True)
    inputs = [TEXTS[0], "write to bob@example.com"]
    raw = client.embeddings.with_raw_response.create(model=EMBEDDER, input=inputs)
    request_id, tokens = raw.headers["x-request-id"], raw.parse().usage.prompt_tokens
    [log] = wait_for_logs(1, request_id=request_id)
    assert log.endpoint == "embedding" and log.status == 200 and log.prompt_tokens == tokens
    assert log.prompt == [TEXTS[0], "write to [EMAIL]"]  # redacted; the vectors not kept
    deadline = time.monotonic() + 30
    while not UsageRecord.objects.filter(request_id=request_id).exists():
        assert time.monotonic() < deadline, "the embedding was never billed"
        drain(redis_client)
        time.sleep(0.1)
    record = UsageRecord.objects.get(request_id=request_id)
    assert record.price_class == "embedding" and record.completion_tokens == 0
    assert record.prompt_tokens == tokens
    assert record.cost == Decimal(tokens) / 1000  # 1,000 a million tokens: 0.001 each


def test_a_generative_model_embeds_only_when_turned_on(
        api_server, tenant_key, settings, tiny_model_path, served_model, redis_client):
    import torch
    from transformers import AutoModel

    sdk = OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model=served_model, input="hello")
    assert refused.value.body["param"] == "model"
    assert refused.value.body["code"] == "model_not_supported"
    assert served_model in refused.value.body["message"]
    settings.ATRIUM_EMBEDDING_MODELS = frozenset({served_model})
    served_models.cache_clear()
    running = start_engine(tiny_model_path, served_model, "generative-embedder",
                           engine_factory=_embedding_engine)
    try:
        got = sdk.embeddings.create(model=served_model, input=TEXTS[0]).data[0].embedding
    finally:
        running.stop.set()
        running.thread.join(timeout=30)
    ids = served_models()[served_model].encode_prompt(TEXTS[0])
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32)(
            torch.tensor([ids])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(hidden, dim=-1).numpy()
    assert np.abs(np.array(got) - expected).max() < 1e-5


def _embedding_engine(model_dir: Path):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=model_dir, embeddings=True))


def test_an_embedding_model_answers_no_chat_and_lists_itself_so(client, embedding_engine):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=EMBEDDER, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["param"] == "model"
    listed = {m.id: m.model_extra["capabilities"] for m in client.models.list()}
    assert listed[EMBEDDER]["embeddings"] and not listed[EMBEDDER]["completions"]
    assert not listed["tiny-llama"]["embeddings"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input[0]"),
    ({"input": [-1]}, "input"),
    ({"input": ["x"] * 257}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 7}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "stream": True}, "stream"),
    ({"input": "x " * 5000}, "input[0]"),
    ({"input": "x", "model": "tiny-llama:acme/none"}, "model"),
])
def test_what_is_malformed_or_not_served_is_refused_by_name(api_server, tenant_key,
                                                            embedding_engine, body, param):
    import httpx

    answer = httpx.post(f"{api_server}/v1/embeddings", timeout=30,
                        headers={"Authorization": f"Bearer {tenant_key.key}"},
                        json={"model": EMBEDDER, **body})
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.json()["error"]["param"] == param, answer.text
