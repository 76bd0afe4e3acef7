"""Fuzzing the whole HTTP API from its own OpenAPI document (/api/schema/), management and
inference routes alike, on the live server with an engine: schema-valid and schema-breaking
cases (schemathesis), each answered without a 5xx and in JSON (issue 16)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.factories import key_factory, tenant_factory

# Per operation and mode: a CI-sized sweep; ATRIUM_FUZZ_EXAMPLES=100 for a long one.
EXAMPLES = int(os.environ.get("ATRIUM_FUZZ_EXAMPLES", "8"))
STREAMED = ("text/event-stream",)


def _bad(response, case) -> str | None:
    kind = (response.headers.get("content-type") or [""])[0]  # each header: its values
    if response.status_code >= 500:
        return f"{response.status_code}"
    if response.status_code == 204 or kind.startswith(STREAMED):
        return None
    if not kind.startswith("application/json"):
        return f"{response.status_code} answered {kind!r}"
    try:
        json.loads(response.content)
    except ValueError:
        return f"{response.status_code} answered JSON that does not parse"
    return None


@pytest.mark.slow
def test_every_operation_answers_json_without_a_5xx(api_server, engine_worker, settings):
    settings.ATRIUM_MAX_OUTPUT_TOKENS = 8  # valid generations stay short
    tenant = tenant_factory("fuzz")
    key = key_factory(tenant, scopes=("inference", "adapters", "usage", "billing", "admin"))
    headers = {"Authorization": f"Bearer {key.plaintext}"}
    raw = httpx.get(f"{api_server}/api/schema/?format=json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    seen: dict[str, int] = {}
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                                 phases=[Phase.generate],
                                 suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=api_server, headers=headers, timeout=30)
                label = case.operation.label
                seen[label] = seen.get(label, 0) + 1
                problem = _bad(response, case)
                if problem:
                    failures.append(f"{label}: {problem}: {case.body!r:.300}")

            try:
                run()
            except Unsatisfiable:
                continue  # nothing to break: an operation without parameters or body
    print(json.dumps({"operations": len(seen), "cases": sum(seen.values())}))
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/tokenize",
            "POST /detokenize"} <= set(seen)
    assert not failures, failures[:20]
