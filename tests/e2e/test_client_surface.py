"""What clients call beside generation, against the real `atrium up` and its demo model:
`/v1/models` metadata a client plans with, vLLM's /tokenize and /detokenize, and the
prompt's logprobs (echo with logprobs, vLLM's prompt_logprobs) through the openai SDK,
checked against the checkpoint read by `tokenizers` and transformers."""

from __future__ import annotations

import openai
import pytest
import torch
from tokenizers import Tokenizer

from tests.e2e.conftest import Atrium, demo_checkpoint, wait_for

TEXT = "The baker carries bread to the market in the morning."
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _checkpoint(atrium: Atrium):
    return demo_checkpoint(atrium.home)


def test_models_say_the_window_and_what_the_demo_model_supports(atrium: Atrium):
    import json

    config = json.loads((_checkpoint(atrium) / "config.json").read_text())
    models = {m.id: m.model_extra for m in atrium.openai().models.list().data}
    # The two demo models (other tests' adapters are listed after their base).
    assert {m for m in models if ":" not in m} == {atrium.model, atrium.embedding_model}
    extra = models[atrium.model]
    assert extra["context_window"] == config["max_position_embeddings"]
    assert 0 < extra["max_output_tokens"] < extra["context_window"]
    assert extra["capabilities"]["chat_completions"] and extra["capabilities"]["logprobs"]
    assert not extra["capabilities"]["embeddings"]
    embedder = models[atrium.embedding_model]["capabilities"]
    assert embedder["embeddings"] and not embedder["chat_completions"]
    assert embedder["embedding_dimensions"] == config["hidden_size"]


def test_tokenize_and_detokenize_round_trip_as_the_checkpoints_tokenizer(atrium: Atrium):
    tokenizer = Tokenizer.from_file(str(_checkpoint(atrium) / "tokenizer.json"))
    with atrium.http() as client:
        ids = client.post("/tokenize", json={"model": atrium.model, "prompt": TEXT}).json()
        chat = client.post("/v1/tokenize", json={"model": atrium.model,
                                                  "messages": MESSAGES}).json()
        back = client.post("/detokenize", json={"model": atrium.model,
                                                 "tokens": ids["tokens"]}).json()
    assert ids["tokens"] == tokenizer.encode(TEXT).ids and ids["count"] == len(ids["tokens"])
    assert back["prompt"] == tokenizer.decode(ids["tokens"], skip_special_tokens=False)
    answer = atrium.openai().chat.completions.create(model=atrium.model, messages=MESSAGES,
                                                     max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens


@pytest.mark.setups("embedded")  # the engine's arithmetic, the same on either setup
def test_the_prompts_logprobs_are_transformers_log_softmax(atrium: Atrium):
    from transformers import AutoModelForCausalLM

    checkpoint = _checkpoint(atrium)
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(TEXT).ids
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    res = atrium.openai().completions.create(
        model=atrium.model, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=1,
        extra_body={"prompt_logprobs": 1})
    choice = res.choices[0]
    echoed = choice.logprobs.token_logprobs[:len(ids)]
    vllm = choice.model_extra["prompt_logprobs"]
    assert echoed[0] is None and vllm[0] is None
    for j, token in enumerate(ids[1:]):
        assert abs(echoed[j + 1] - float(expected[j][token])) < 1e-3
        assert abs(vllm[j + 1][str(token)]["logprob"] - float(expected[j][token])) < 1e-3


@pytest.mark.setups("embedded")  # the engine's arithmetic, the same on either setup
def test_the_demo_embedding_model_answers_as_sentence_transformers_encodes(atrium: Atrium):
    import base64

    import numpy as np
    from sentence_transformers import SentenceTransformer

    texts = [TEXT, "A quiet village on the hill.", "boats"]
    expected = SentenceTransformer(str(demo_checkpoint(atrium.home, embedding=True)),
                                   device="cpu").encode(texts, convert_to_numpy=True)
    client = atrium.openai()
    batched = client.embeddings.create(model=atrium.embedding_model, input=texts)
    single = client.embeddings.create(model=atrium.embedding_model, input=texts[2])
    raw = client.embeddings.with_raw_response.create(
        model=atrium.embedding_model, input=texts, encoding_format="base64").http_response
    b64 = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
           for d in raw.json()["data"]]
    assert np.abs(np.array([d.embedding for d in batched.data]) - expected).max() < 1e-5
    assert np.abs(np.array(single.data[0].embedding) - expected[2]).max() < 1e-5
    assert np.abs(np.array(b64) - expected).max() < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=atrium.model, input="hello")
    assert refused.value.body["param"] == "model"
    # Billed once, in the embedding price class, as the usage API shows it.
    request_id = raw.headers["x-request-id"]
    with atrium.http() as http:
        row = wait_for(lambda: (answer := http.get(
            f"/api/v1/tenants/demo/usage/requests/{request_id}")).status_code == 200
            and answer.json(), timeout=60)
    assert row["price_class"] == "embedding" and row["output_tokens"] == 0
    assert row["input_tokens"] == batched.usage.prompt_tokens
