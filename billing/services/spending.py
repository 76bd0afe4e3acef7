"""Spend and its cap: the tenants' caps, and the Redis counters kept in step with the ledger."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from billing import spend_counters
from billing.models import SpendCap, UsageRecord, UsageRollup
from billing.money import CENT, micros
from billing.periods import period_label, period_of
from billing.selectors import spend_caps_effective
from core.errors import InvalidRequest
from core.redis import sync_client
from tenants.facade import Actor, audit_record, tenant_plans

log = logging.getLogger(__name__)


def spend_of(records: list[UsageRecord]) -> dict[tuple[int, str], int]:
    """The records' cost in micros by (tenant, period label), as the Redis counters count."""
    amounts: dict[tuple[int, str], int] = {}
    for r in records:
        key = (r.tenant_id, period_label(r.billing_period))
        amounts[key] = amounts.get(key, 0) + micros(r.cost)
    return amounts


def spend_publish(amounts: dict[tuple[int, str], int]) -> None:
    try:
        spend_counters.spend_add(sync_client(), amounts)
    except redis.RedisError:
        # The records are committed; the next spend_reconcile sets the counters right.
        log.warning("could not add spend to the Redis counters; the next reconcile will")


def _cap_snapshot(cap: SpendCap | None) -> dict[str, Any]:
    if cap is None:
        return {"monthly_limit": None, "set": False}
    limit = cap.monthly_limit
    return {"monthly_limit": None if limit is None else str(limit), "set": True}


def _cap_amount(monthly_limit: Decimal | None) -> Decimal | None:
    if monthly_limit is None:
        return None
    if monthly_limit < 0 or monthly_limit != monthly_limit.quantize(CENT) \
            or monthly_limit >= Decimal(10**12):
        raise InvalidRequest("a monthly spend cap is an amount in cents, from 0 up to "
                             "999,999,999,999.99", param="monthly_limit", code="invalid_value")
    return monthly_limit.quantize(CENT)


def tenant_spend_cap_update(*, tenant, actor: Actor, monthly_limit: Decimal | None,
                            inherit: bool = False) -> SpendCap | None:
    """Sets the tenant's own monthly cap (None: uncapped), or drops it to inherit the plan's."""
    monthly_limit = _cap_amount(monthly_limit)
    with transaction.atomic():
        cap = SpendCap.objects.select_for_update().filter(tenant=tenant).first()
        before = _cap_snapshot(cap)
        if inherit:
            if cap is not None:
                cap.delete()
            cap = None
        else:
            cap, _ = SpendCap.objects.update_or_create(
                tenant=tenant, defaults={"monthly_limit": monthly_limit,
                                         "updated_at": timezone.now()})
        audit_record(tenant=tenant, actor=actor, action="spend_cap.update",
                     target_type="tenant", target_id=tenant.slug, before=before,
                     after=_cap_snapshot(cap))
        transaction.on_commit(partial(spend_caps_publish, tenant_ids=[tenant.pk]))
    return cap


def plan_spend_cap_update(*, plan, actor: Actor, monthly_limit: Decimal | None) -> SpendCap | None:
    """Sets the plan's default monthly cap for its tenants (None: none). ``plan``: its id
    and slug (tenants.facade.PlanRef, or the console's plan)."""
    monthly_limit = _cap_amount(monthly_limit)
    with transaction.atomic():
        cap = SpendCap.objects.select_for_update().filter(plan_id=plan.id).first()
        before = _cap_snapshot(cap)
        if monthly_limit is None:
            if cap is not None:
                cap.delete()
            cap = None
        else:
            cap, _ = SpendCap.objects.update_or_create(
                plan_id=plan.id, defaults={"monthly_limit": monthly_limit,
                                           "updated_at": timezone.now()})
        audit_record(tenant=None, actor=actor, action="plan.spend_cap.update",
                     target_type="plan", target_id=plan.slug, before=before,
                     after=_cap_snapshot(cap))
        tenant_ids = [t for t, p in tenant_plans().items() if p == plan.id]
        transaction.on_commit(partial(spend_caps_publish, tenant_ids=tenant_ids))
    return cap


def spend_caps_publish(*, tenant_ids: Iterable[int] | None = None) -> None:
    """Writes the tenants' (every tenant's when None) effective caps to Redis."""
    caps = spend_caps_effective(tenant_ids=tenant_ids)
    try:
        spend_counters.caps_set(sync_client(), {t: None if c is None else micros(c)
                                       for t, c in caps.items()},
                       currency=settings.ATRIUM_BILLING_CURRENCY)
    except redis.RedisError:
        log.warning("could not publish spend caps to Redis; the next reconcile will")


def spend_reconcile(*, now: datetime | None = None) -> int:
    """Sets every tenant's spend counter for the open period from the rollups, and every
    cap from the table. Returns how many tenants have spend this period."""
    period = period_of(now or timezone.now())
    totals = (UsageRollup.objects.filter(billing_period=period).values("tenant_id")
              .annotate(total=Sum("cost")).values_list("tenant_id", "total"))
    values = {(t, period_label(period)): micros(total or Decimal(0)) for t, total in totals}
    spend_counters.spend_set(sync_client(), values)
    spend_caps_publish()
    return len(values)
