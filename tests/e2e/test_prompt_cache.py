"""Prompt caching as a tenant uses it under the real `atrium up` (which runs its engine with
a host tier here, ATRIUM_KV_HOST_MIB): OpenAI's prompt_cache_key and prompt_cache_retention
through the openai package, the cached tokens it reports, and the tier on the engine's
metrics endpoint."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import Atrium
from tests.e2e.test_metrics import _endpoints, _scrape, _value

SYSTEM = ("You are the support assistant of a bicycle shop. Answer in one short sentence. "
          "The shop sells road, gravel and city bikes, repairs any brand, and opens at nine. ")


def test_a_prompt_cache_key_and_retention_through_the_sdk(atrium: Atrium):
    client = atrium.openai()
    asked = []
    for question in ("Do you fix brakes?", "When do you open?"):
        asked.append(client.chat.completions.create(
            model=atrium.model, max_tokens=4, prompt_cache_key="support-bot",
            prompt_cache_retention="in_memory",
            messages=[{"role": "system", "content": SYSTEM * 4},
                      {"role": "user", "content": question}]))
    # The second turn found the shared system prompt cached.
    assert asked[1].usage.prompt_tokens_details.cached_tokens > 0
    response = client.responses.create(model=atrium.model, input="Hello", store=False,
                                       max_output_tokens=16, prompt_cache_key="support-bot")
    assert response.status in ("completed", "incomplete")  # its answer, or 16 tokens of it
    with pytest.raises(openai.BadRequestError) as refused:  # the demo plan does not sell it
        client.chat.completions.create(model=atrium.model, max_tokens=2,
                                       prompt_cache_retention="24h",
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "prompt_cache_retention"


def test_the_engine_reports_its_host_tier(atrium: Atrium):
    engine = _scrape(_endpoints(atrium)["engine"])
    assert _value(engine, "atrium_engine_kv_host_blocks_total") > 0
    assert ("vllm:external_prefix_cache_queries_total" in {name for name, _ in engine})
