"""The operator console sells service tiers (docs/tiers.md): a plan's tiers, its default
tier and fair weight on the plan forms, the tier ratios on the price form, and each
invoice line's price class on the tenant's invoice."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse

from billing.models import Price
from tenants.models import Plan
from tests.factories import plan_factory

pytestmark = pytest.mark.django_db

LIMITS = {"priority": "5", "requests_per_minute": "10", "tokens_per_minute": "500",
          "max_concurrent_requests": "2"}


def _operator(world) -> Client:
    client = Client()
    client.force_login(world.staff)
    return client


def _messages(reply) -> list[str]:
    return [str(m) for m in reply.wsgi_request._messages]


def test_an_operator_creates_a_plan_that_sells_priority_and_sees_it_listed(world):
    client = _operator(world)
    reply = client.post(reverse("webui:op-plans"), {
        "slug": "premium", "name": "Premium", **LIMITS,
        "service_tiers": ["default", "flex", "priority"], "default_service_tier": "priority",
        "fair_weight": "2.5"})
    assert reply.status_code == 302, _messages(reply)
    plan = Plan.objects.get(slug="premium")
    assert (plan.service_tiers, plan.default_service_tier, plan.fair_weight) == \
        (["default", "flex", "priority"], "priority", 2.5)
    page = client.get(reverse("webui:op-plans")).content.decode()
    listed = re.search(r'premium</span>\s*<div[^>]*data-field="tiers">(.*?)</div>', page, re.S)
    assert re.sub(r"<[^>]+>", "", listed.group(1)) == "default, flex, priority · weight 2.5"
    assert plan.extended_prompt_cache is False
    client.post(reverse("webui:op-plan", args=["premium"]),
                {"name": "Premium", **LIMITS, "extended_prompt_cache": "on"})
    plan.refresh_from_db()
    assert plan.extended_prompt_cache is True
    page = client.get(reverse("webui:op-plans")).content.decode()
    assert "weight 2.5 · prompt cache 24h" in re.sub(r"<[^>]+>", "", page)


def test_a_plan_left_without_tiers_gets_default_and_flex_and_keeps_them_when_edited(world):
    client = _operator(world)
    client.post(reverse("webui:op-plans"), {"slug": "plain", "name": "Plain", **LIMITS})
    plan = Plan.objects.get(slug="plain")
    assert (plan.service_tiers, plan.default_service_tier) == (["default", "flex"], "default")
    client.post(reverse("webui:op-plan", args=["plain"]), {"name": "Plainer", **LIMITS})
    plan.refresh_from_db()
    assert plan.name == "Plainer" and plan.service_tiers == ["default", "flex"]


def test_a_default_tier_the_plan_does_not_offer_is_refused_and_changes_nothing(world):
    plan_factory(slug="mixed")
    client = _operator(world)
    reply = client.post(reverse("webui:op-plan", args=["mixed"]), {
        "name": "Mixed", **LIMITS, "service_tiers": ["flex"], "default_service_tier": "default"})
    assert any("default_service_tier" in m for m in _messages(reply)), _messages(reply)
    assert Plan.objects.get(slug="mixed").service_tiers == ["default", "flex"]


def test_an_operator_prices_the_tiers_and_the_price_book_shows_the_ratios(world):
    client = _operator(world)
    reply = client.post(reverse("webui:op-prices"), {
        "model": "tiered", "input_per_million": "1", "cached_input_per_million": "0.5",
        "output_per_million": "2", "flex_ratio": "0.4", "priority_ratio": "2.5"})
    assert reply.status_code == 302, _messages(reply)
    price = Price.objects.get(model="tiered")
    assert (price.flex_ratio, price.priority_ratio) == (Decimal("0.4"), Decimal("2.5"))
    client.post(reverse("webui:op-prices"), {
        "model": "plain", "input_per_million": "1", "cached_input_per_million": "0.5",
        "output_per_million": "2"})
    plain = Price.objects.get(model="plain")
    assert (plain.flex_ratio, plain.priority_ratio) == (Decimal("0.5"), Decimal(2))
    page = client.get(reverse("webui:op-prices")).content.decode()
    assert "Flex ×" in page and "<td class=\"num\">0.4</td><td class=\"num\">2.5</td>" in page


def test_an_operator_caps_and_uncaps_a_plans_resident_adapters_in_the_console(world):
    client = _operator(world)
    client.post(reverse("webui:op-plans"), {"slug": "lora", "name": "Lora", **LIMITS,
                                            "max_resident_adapters": "3"})
    plan = Plan.objects.get(slug="lora")
    assert plan.max_resident_adapters == 3
    page = re.sub(r"<[^>]+>", "", client.get(reverse("webui:op-plans")).content.decode())
    assert "weight 1 · 3 adapters resident" in page
    edit = client.get(reverse("webui:op-plan", args=["lora"])).content.decode()
    assert re.search(r'name="max_resident_adapters"[^>]*value="3"', edit)
    reply = client.post(reverse("webui:op-plan", args=["lora"]),
                        {"name": "Lora", **LIMITS, "max_resident_adapters": "0"})
    assert reply.status_code == 302 and any(m.startswith("LoRA adapters of a tenant")
                                            and "greater than or equal to 1" in m
                                            for m in _messages(reply))
    plan.refresh_from_db()
    assert plan.max_resident_adapters == 3  # refused, unchanged
    client.post(reverse("webui:op-plan", args=["lora"]), {"name": "Lora", **LIMITS})
    plan.refresh_from_db()
    assert plan.max_resident_adapters is None  # left empty: no limit
