"""vLLM's /tokenize and /detokenize (inference/tokenizing.py) against a live server: the ids
are the tokenizer's and the chat template's, the same a chat request is admitted with;
round trips give the text back; each call is one of the key's requests per minute, not
billed, not logged; and what is malformed or not the caller's is refused by name."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.factories import key_factory, plan_factory, tenant_factory
from tests.live import make_tenant_key

pytestmark = pytest.mark.live

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour, please."}]


def http(api_server: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=api_server, timeout=30,
                        headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_a_prompt_is_the_tokenizers_ids_and_comes_back_as_its_text(
        api_server, tenant_key, served_model, tiny_model_path, prefix):
    tokenizer = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    text = "The old fox runs to the river. Ünïcödé and 12345!"
    with http(api_server, tenant_key.key) as client:
        answer = client.post(f"{prefix}/tokenize", json={"model": served_model, "prompt": text,
                                                          "return_token_strs": True})
        bare = client.post(f"{prefix}/tokenize", json={"prompt": text,
                                                        "add_special_tokens": False})
        assert answer.status_code == 200 and bare.status_code == 200
        ids = tokenizer.encode(text).ids
        assert answer.json() == {"count": len(ids), "max_model_len": answer.json()[
            "max_model_len"], "tokens": ids, "token_strs": [tokenizer.id_to_token(i)
                                                           for i in ids]}
        assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids
        assert bare.json()["token_strs"] is None
        back = client.post(f"{prefix}/detokenize", json={"model": served_model, "tokens": ids})
    assert back.status_code == 200
    assert back.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def test_messages_are_the_templates_ids_that_a_chat_is_admitted_with(
        api_server, tenant_key, served_model, engine_worker, tiny_model_path):
    template = AutoTokenizer.from_pretrained(str(tiny_model_path))
    expected = template.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    with http(api_server, tenant_key.key) as client:
        answer = client.post("/tokenize", json={"model": served_model, "messages": MESSAGES})
        chat = client.post("/v1/chat/completions", json={
            "model": served_model, "messages": MESSAGES, "max_tokens": 2})
    assert answer.status_code == 200
    assert answer.json()["tokens"] == list(expected)
    assert answer.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_a_tokenize_counts_against_requests_per_minute_but_is_neither_billed_nor_logged(
        api_server, served_model, redis_client):
    from requestlogs.models import RequestLog

    key = key_factory(tenant_factory(plan=plan_factory(requests_per_minute=3,
                                                       max_concurrent_requests=1)))
    with http(api_server, key.plaintext) as client:
        statuses = [client.post("/tokenize", json={"prompt": "hi"}) for _ in range(4)]
    assert [s.status_code for s in statuses] == [200, 200, 200, 429]
    assert [s.headers["x-ratelimit-remaining-requests"] for s in statuses[:3]] == \
        ["2", "1", "0"]
    assert statuses[3].json()["error"]["type"] == "rate_limit_error" or \
        statuses[3].json()["error"]["code"] == "rate_limit_exceeded"
    assert RequestLog.objects.count() == 0
    assert not any(k.startswith(b"atrium:usage") for k in redis_client.keys("atrium:usage*"))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "no-such-model"}, "model"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "temperature": 1}, "temperature"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/detokenize", {}, "tokens"),
])
def test_what_is_malformed_is_a_400_naming_it(api_server, tenant_key, served_model, path,
                                              body, param):
    with http(api_server, tenant_key.key) as client:
        answer = client.post(path, json=body)
    assert answer.status_code in (400, 404), answer.text
    assert answer.json()["error"]["param"] == param


def test_no_key_another_tenants_adapter_and_a_get_are_refused(api_server, served_model):
    other = make_tenant_key("intruder")
    with httpx.Client(base_url=api_server, timeout=30) as client:
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.post("/detokenize", content=b"{",
                           headers={"Authorization": f"Bearer {other.key}"}
                           ).json()["error"]["code"] == "invalid_json"
        refused = client.post("/tokenize", json={"model": f"{served_model}:acme/secret",
                                                 "prompt": "x"},
                              headers={"Authorization": f"Bearer {other.key}"})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
        assert client.get("/v1/tokenize").status_code == 405
