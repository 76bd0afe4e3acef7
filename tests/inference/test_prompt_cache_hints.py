"""OpenAI's prompt-cache hints: ``prompt_cache_key`` places a tenant's requests that share a
prefix on one engine (as a conversation), ``prompt_cache_retention`` "24h" is a plan's to
offer (inference/prompt_cache.py)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import REGISTRY

from tests.live import make_tenant_key


def _placed_by_session() -> float:
    return REGISTRY.get_sample_value("atrium_routing_placements_total",
                                     {"policy": "scored", "reason": "session"}) or 0.0


def _post(api_server: str, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{api_server}{path}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def _chat(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            **extra}


def test_a_prompt_cache_key_places_chat_completions_and_responses(
        api_server, tenant_key, served_model, engine_worker):
    before = _placed_by_session()
    for path, body in (
            ("/v1/chat/completions", _chat(served_model, prompt_cache_key="agent-7")),
            ("/v1/completions", {"model": served_model, "prompt": "hi", "max_tokens": 2,
                                 "prompt_cache_key": "agent-7"}),
            ("/v1/responses", {"model": served_model, "input": "hi", "max_output_tokens": 16,
                               "store": False, "prompt_cache_key": "agent-7",
                               "prompt_cache_retention": "in_memory"})):
        answer = _post(api_server, tenant_key.key, path, body)
        assert answer.status_code == 200, answer.text
    assert _placed_by_session() == before + 3


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"prompt_cache_retention": "24h"}),
    ("/v1/chat/completions", {"prompt_cache_retention": "1h"}),
    ("/v1/responses", {"prompt_cache_retention": "24h"}),
    ("/v1/chat/completions", {"prompt_cache_key": "k" * 257}),
])
def test_a_retention_the_plan_lacks_or_a_bad_hint_is_400_naming_it(
        api_server, tenant_key, served_model, path, body):
    base = _chat(served_model) if path.endswith("completions") else {
        "model": served_model, "input": "hi", "store": False}
    answer = _post(api_server, tenant_key.key, path, {**base, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == next(iter(body))


def test_a_plan_with_extended_caching_sends_the_day_to_the_engine(transactional_db,
                                                                   served_model):
    from inference import service
    from tenants.models import ApiKey, Plan
    from tenants.selectors import principal_for_key

    tenant = make_tenant_key("keeper")
    Plan.objects.filter(tenants__id=tenant.tenant_id).update(extended_prompt_cache=True)
    principal = principal_for_key(ApiKey.objects.select_related("tenant__plan")
                                  .get(pk=tenant.key_id))
    kept = service.prepare(principal=principal, kind="chat",
                           body=_chat(served_model, prompt_cache_retention="24h"))
    plain = service.prepare(principal=principal, kind="chat", body=_chat(served_model))
    assert kept.engine_request.cache_retention_s == 24 * 3600
    assert plain.engine_request.cache_retention_s == 0
