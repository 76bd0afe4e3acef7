"""Service tiers under the real `atrium up` (docs/tiers.md), driven as users drive them:
an operator sells the priority tier on a plan and prices the demo model in the console, a
tenant's developer asks for each tier through the openai SDK, and the usage API shows each
request billed at its tier's price; a plan without a tier refuses it, and a flex request
whose client cannot wait is a 429 that costs nothing."""

from __future__ import annotations

import re
import time
from decimal import Decimal

import openai
import pytest

from tests.e2e.conftest import Atrium, console_post, operator_console, wait_for

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _ledger_row(atrium: Atrium, key: str, tenant: str, request_id: str) -> dict:
    with atrium.http(key) as http:
        return wait_for(lambda: (answer := http.get(
            f"/api/v1/tenants/{tenant}/usage/requests/{request_id}")).status_code == 200
            and answer.json(), timeout=60)


def _tenant_on_a_plan_with_priority(atrium: Atrium) -> tuple[str, str]:
    """A new tenant on a new plan offering every tier, made in the console; its slug and
    a key with the inference and usage scopes."""
    suffix = f"{atrium.setup}-{time.monotonic_ns()}"
    plan, tenant = f"tiers-{suffix}", f"tiered-{suffix}"
    console = operator_console(atrium)
    made = console_post(console, "/console/operator/plans", {
        "slug": plan, "name": "All tiers", "priority": "5", "requests_per_minute": "600",
        "tokens_per_minute": "1000000", "max_concurrent_requests": "16",
        "service_tiers": ["default", "flex", "priority"], "default_service_tier": "default",
        "fair_weight": "1"})
    assert made.status_code == 302 and made.headers["location"].endswith("/plans"), made.text
    assert atrium.cli("create-tenant", "Tiered", "--slug", tenant).returncode == 0
    moved = console_post(console, f"/console/operator/tenants/{tenant}/plan", {"plan": plan},
                         page=f"/console/operator/tenants/{tenant}")
    assert moved.status_code == 302, moved.text
    # The demo model's price: the same for every token class, so that tokens served from
    # the prefix cache cost what the others do, and a row's cost says its tier.
    priced = console_post(console, "/console/operator/prices", {
        "model": atrium.model, "input_per_million": "1000",
        "cached_input_per_million": "1000", "output_per_million": "1000"})
    assert priced.status_code == 302, priced.text
    created = atrium.cli("create-key", tenant, "--scopes", "inference,usage")
    assert created.returncode == 0, created.stderr
    return tenant, re.search(r"atr_\w+", created.stdout).group(0)


def test_each_tier_is_served_named_and_billed_at_its_price(atrium: Atrium):
    tenant, key = _tenant_on_a_plan_with_priority(atrium)
    client = atrium.openai(key)
    rows = {}
    for tier in ("default", "flex", "priority"):
        raw = client.chat.completions.with_raw_response.create(
            model=atrium.model, messages=MESSAGES, max_tokens=8, temperature=0,
            service_tier=tier)
        answer = raw.parse()
        assert answer.service_tier == tier
        rows[tier] = _ledger_row(atrium, key, tenant, raw.headers["x-request-id"])
        rows[tier]["tokens"] = answer.usage.total_tokens
    assert {t: r["price_class"] for t, r in rows.items()} == {
        "default": "interactive", "flex": "flex", "priority": "priority"}
    # The same prompt, greedy: the same tokens, at 1,000 a million, times the tier's ratio.
    assert len({r["tokens"] for r in rows.values()}) == 1
    cost = {t: Decimal(r["amount"]["value"]) for t, r in rows.items()}
    assert cost["default"] == Decimal(rows["default"]["tokens"]) / 1000
    assert cost["flex"] * 2 == cost["default"] and cost["priority"] == 2 * cost["default"]


def test_a_tier_the_plan_does_not_offer_is_refused_naming_it(atrium: Atrium):
    # The demo tenant's plan is the default one: default and flex.
    with pytest.raises(openai.BadRequestError) as refused:
        atrium.openai().chat.completions.create(model=atrium.model, messages=MESSAGES,
                                                max_tokens=4, service_tier="priority")
    assert refused.value.body["param"] == "service_tier"


def test_a_flex_request_its_client_cannot_wait_for_is_a_429_billed_nothing(atrium: Atrium):
    # The SDK tells the server its timeout; a second of it is kept for the answer, so a
    # client that waits one second leaves a flex request no time to wait for an engine.
    client = openai.OpenAI(base_url=f"{atrium.base}/v1", api_key=atrium.key, max_retries=0,
                           timeout=1.0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=atrium.model, messages=MESSAGES, max_tokens=4,
                                       service_tier="flex")
    assert refused.value.code == "resource_unavailable"
    row = _ledger_row(atrium, atrium.key, "demo", refused.value.response.headers["x-request-id"])
    assert row["price_class"] == "flex"
    assert (row["input_tokens"], row["output_tokens"]) == (0, 0)
    assert Decimal(row["amount"]["value"]) == 0
