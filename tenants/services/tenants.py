"""Tenants and the plans they are on."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils.text import slugify

from core.errors import Conflict, InvalidRequest
from tenants.access import SYSTEM, Actor
from tenants.models import MAX_FAIR_WEIGHT, MAX_RESIDENT_ADAPTERS, SERVICE_TIERS, Plan, Tenant
from tenants.services.audit import audit_record
from tenants.services.key_refresh import tenant_keys_refresh
from tenants.services.quotas import PLAN_LIMIT_FIELDS, validated_plan_limits

DEFAULT_PLAN: dict[str, Any] = {
    "slug": "default", "name": "Default", "priority": 5,
    "requests_per_minute": 600, "tokens_per_minute": 1_000_000,
    "max_concurrent_requests": 64,
}


class TenantError(InvalidRequest):
    """A tenant cannot be created as asked (operator commands print the message)."""


def _plan_snapshot(plan: Plan) -> dict[str, Any]:
    return {"slug": plan.slug, "name": plan.name, "priority": plan.priority,
            **{f: getattr(plan, f) for f in (*PLAN_LIMIT_FIELDS, *_SERVICE_FIELDS)}}


# How a plan's requests are served: the tiers offered, the one "auto" picks, the fair weight,
# whether its prompts' cache may be kept longer, and how many of its adapters engines hold.
_SERVICE_FIELDS = ("service_tiers", "default_service_tier", "fair_weight",
                   "extended_prompt_cache", "max_resident_adapters")


def _validated_service(tiers: list[str], default: str, weight: float,
                       resident_adapters: int | None) -> None:
    if not tiers or not isinstance(tiers, list) or len(set(tiers)) != len(tiers) \
            or not set(tiers) <= set(SERVICE_TIERS):
        raise InvalidRequest("'service_tiers' must list distinct tiers of "
                             f"{', '.join(SERVICE_TIERS)}", param="service_tiers",
                             code="invalid_value")
    if default not in tiers:
        raise InvalidRequest(f"'default_service_tier' must be one of the plan's service_tiers "
                             f"({', '.join(tiers)})", param="default_service_tier",
                             code="invalid_value")
    if not 0 < weight <= MAX_FAIR_WEIGHT:
        raise InvalidRequest(f"'fair_weight' must be above 0 and at most {MAX_FAIR_WEIGHT:g}",
                             param="fair_weight", code="invalid_value")
    if resident_adapters is not None and not (
            type(resident_adapters) is int and 1 <= resident_adapters <= MAX_RESIDENT_ADAPTERS):
        raise InvalidRequest("'max_resident_adapters' must be empty (no limit) or from 1 to "
                             f"{MAX_RESIDENT_ADAPTERS}", param="max_resident_adapters",
                             code="invalid_value")


def plan_get_default() -> Plan:
    plan, _ = Plan.objects.get_or_create(slug=DEFAULT_PLAN["slug"], defaults=DEFAULT_PLAN)
    return plan


@transaction.atomic
def plan_create(*, actor: Actor, slug: str, name: str, priority: int,
                requests_per_minute: int, tokens_per_minute: int, max_concurrent_requests: int,
                max_prompt_tokens: int | None = None, max_output_tokens: int | None = None,
                monthly_token_cap: int | None = None, max_files: int | None = None,
                max_file_bytes: int | None = None, max_active_batches: int | None = None,
                response_retention_days: int | None = None,
                resume_grace_s: int | None = None, service_tiers: list[str] | None = None,
                default_service_tier: str = "default", fair_weight: float = 1.0,
                extended_prompt_cache: bool = False,
                max_resident_adapters: int | None = None) -> Plan:
    if Plan.objects.filter(slug=slug).exists():
        raise Conflict(f"plan '{slug}' already exists", param="slug")
    validated_plan_limits({
        "requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
        "max_concurrent_requests": max_concurrent_requests,
        "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens,
        "monthly_token_cap": monthly_token_cap, "max_files": max_files,
        "max_file_bytes": max_file_bytes, "max_active_batches": max_active_batches,
        "response_retention_days": response_retention_days, "resume_grace_s": resume_grace_s})
    service_tiers = ["default", "flex"] if service_tiers is None else service_tiers
    _validated_service(service_tiers, default_service_tier, fair_weight, max_resident_adapters)
    plan = Plan.objects.create(
        slug=slug, name=name, priority=priority, requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute, max_concurrent_requests=max_concurrent_requests,
        max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
        monthly_token_cap=monthly_token_cap, max_files=max_files,
        max_file_bytes=max_file_bytes, max_active_batches=max_active_batches,
        response_retention_days=response_retention_days, resume_grace_s=resume_grace_s,
        service_tiers=service_tiers, default_service_tier=default_service_tier,
        fair_weight=fair_weight, extended_prompt_cache=extended_prompt_cache,
        max_resident_adapters=max_resident_adapters)
    audit_record(tenant=None, actor=actor, action="plan.create", target_type="plan",
                 target_id=plan.slug, after=_plan_snapshot(plan))
    return plan


_PLAN_FIELDS = ("name", "priority", *PLAN_LIMIT_FIELDS, *_SERVICE_FIELDS)


@transaction.atomic
def plan_update(*, actor: Actor, plan: Plan, changes: dict[str, Any]) -> Plan:
    plan = Plan.objects.select_for_update().get(pk=plan.pk)
    before = _plan_snapshot(plan)
    for field in changes:
        if field not in _PLAN_FIELDS:
            raise InvalidRequest(f"'{field}' cannot be changed", param=field,
                                 code="invalid_value")
    validated_plan_limits({f: v for f, v in changes.items() if f in PLAN_LIMIT_FIELDS})
    service = {f: changes.get(f, getattr(plan, f)) for f in _SERVICE_FIELDS}
    _validated_service(service["service_tiers"], service["default_service_tier"],
                       service["fair_weight"], service["max_resident_adapters"])
    for field, value in changes.items():
        setattr(plan, field, value)
    plan.save()
    audit_record(tenant=None, actor=actor, action="plan.update", target_type="plan",
                 target_id=plan.slug, before=before, after=_plan_snapshot(plan))
    tenant_keys_refresh(Tenant.objects.filter(plan=plan))
    return plan


def tenant_create(*, name: str, slug: str | None = None, plan: Plan | None = None,
                  actor: Actor = SYSTEM) -> Tenant:
    slug = slug or slugify(name)
    if not slug:
        raise TenantError("a tenant needs a name made of letters or digits", param="name",
                          code="invalid_value")
    if Tenant.objects.filter(slug=slug).exists():
        raise TenantError(f"tenant {slug!r} already exists", param="slug", code="conflict",
                          status=409)
    with transaction.atomic():
        tenant = Tenant.objects.create(name=name, slug=slug, plan=plan or plan_get_default())
        audit_record(tenant=tenant, actor=actor, action="tenant.create", target_type="tenant",
                     target_id=tenant.slug,
                     after={"name": tenant.name, "slug": tenant.slug, "plan": tenant.plan.slug})
    return tenant


def tenant_get_or_create(*, name: str, slug: str) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    return tenant or tenant_create(name=name, slug=slug)


@transaction.atomic
def tenant_update(*, tenant: Tenant, actor: Actor, name: str | None = None,
                  plan: Plan | None = None) -> Tenant:
    tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
    before = {"name": tenant.name, "plan": tenant.plan.slug}
    if name is not None:
        tenant.name = name
    plan_changed = plan is not None and plan.pk != tenant.plan_id
    if plan is not None:
        tenant.plan = plan
    tenant.save()
    audit_record(tenant=tenant, actor=actor, action="tenant.update", target_type="tenant",
                 target_id=tenant.slug, before=before,
                 after={"name": tenant.name, "plan": tenant.plan.slug})
    if plan_changed:
        tenant_keys_refresh([tenant])
    return tenant
