"""Budgets: a tenant's own spend and token limits per day or month, for the tenant, one
key or its end users; their definitions and counters in Redis kept in step with the
ledger; and their alerts (email to those who pay, events to the tenant's webhooks).

Enforcement is admission's (billing/budget_counters.py, inference/admit.lua): each request
reserves its largest possible cost, so concurrent requests never overshoot a budget.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from billing import budget_counters, queue
from billing.models import Budget, BudgetAlert, UsageRecord, UsageRollup
from billing.money import CENT, from_micros, micros
from billing.selectors import budget_subjects
from billing.services.webhooks import webhook_event_emit
from core.errors import Conflict, InvalidRequest, NotFound
from core.redis import sync_client
from tenants.facade import (
    Actor,
    api_key_belongs,
    api_key_lineage_members,
    api_key_lineages,
    audit_record,
)

log = logging.getLogger(__name__)

MAX_SPEND = Decimal(10**12)
MAX_TOKENS = 10**15


def _snapshot(budget: Budget) -> dict[str, Any]:
    return {"scope": budget.scope, "api_key_id": budget.api_key_id,
            "end_user": budget.end_user, "window": budget.window,
            "spend_limit": None if budget.spend_limit is None else str(budget.spend_limit),
            "token_limit": budget.token_limit}


def _limits(spend_limit: Decimal | None, token_limit: int | None
            ) -> tuple[Decimal | None, int | None]:
    if spend_limit is None and token_limit is None:
        raise InvalidRequest("a budget limits spend, tokens or both: give spend_limit or "
                             "token_limit", param="spend_limit", code="invalid_value")
    if spend_limit is not None and (spend_limit < 0 or spend_limit >= MAX_SPEND
                                    or spend_limit != spend_limit.quantize(CENT)):
        raise InvalidRequest("spend_limit is an amount in cents, from 0 up to "
                             "999,999,999,999.99", param="spend_limit", code="invalid_value")
    if token_limit is not None and not 0 <= token_limit < MAX_TOKENS:
        raise InvalidRequest(f"token_limit is a count of tokens from 0 below {MAX_TOKENS}",
                             param="token_limit", code="invalid_value")
    return spend_limit, token_limit


def budget_create(*, tenant, actor: Actor, scope: str, window: str,
                  spend_limit: Decimal | None = None, token_limit: int | None = None,
                  api_key_id: int | None = None, end_user: str = "") -> Budget:
    """A new budget; one per scope, subject and window (409 for a second)."""
    spend_limit, token_limit = _limits(spend_limit, token_limit)
    if scope not in Budget.Scope.values or window not in Budget.Window.values:
        raise InvalidRequest("scope is tenant, key or user; window is day or month",
                             param="scope", code="invalid_value")
    if scope == Budget.Scope.KEY:
        if api_key_id is None or not api_key_belongs(tenant_id=tenant.pk,
                                                     api_key_id=api_key_id):
            raise InvalidRequest("a key budget names one of this tenant's API keys",
                                 param="api_key_id", code="invalid_value")
        _one_per_lineage(tenant, api_key_id, window)
    elif api_key_id is not None:
        raise InvalidRequest("api_key_id is for key budgets", param="api_key_id",
                             code="invalid_value")
    if scope != Budget.Scope.USER and end_user:
        raise InvalidRequest("end_user is for user budgets", param="end_user",
                             code="invalid_value")
    if len(end_user) > 256 or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in end_user):
        raise InvalidRequest("end_user has at most 256 characters and no control characters "
                             "(as a request's user)", param="end_user", code="invalid_value")
    try:
        with transaction.atomic():
            budget = Budget.objects.create(
                tenant=tenant, scope=scope, window=window, api_key_id=api_key_id,
                end_user=end_user, spend_limit=spend_limit, token_limit=token_limit)
            audit_record(tenant=tenant, actor=actor, action="budget.create",
                         target_type="budget", target_id=budget.pk, after=_snapshot(budget))
            transaction.on_commit(partial(budgets_publish, tenant_ids=[tenant.pk]))
    except IntegrityError:
        raise Conflict("this tenant already has a budget for that scope and window; change "
                       "it instead", param="window") from None
    return budget


def _one_per_lineage(tenant, api_key_id: int, window: str) -> None:
    """A key and the keys rotated from it or into it share their budgets: a second key
    budget for the same window among them is the same budget twice."""
    lineage = api_key_lineages([api_key_id])[api_key_id]
    if Budget.objects.for_tenant(tenant).filter(
            scope=Budget.Scope.KEY, window=window,
            api_key_id__in=api_key_lineage_members(lineage)).exists():
        raise Conflict("this key (or the key it was rotated from or into) already has a "
                       "budget for that window; change it instead", param="window")


_UNSET: Any = object()


def budget_update(*, tenant, actor: Actor, budget_id: int, spend_limit: Any = _UNSET,
                  token_limit: Any = _UNSET) -> Budget:
    """Changes a budget's limits (None removes one; at least one stays)."""
    with transaction.atomic():
        budget = _locked(tenant, budget_id)
        before = _snapshot(budget)
        budget.spend_limit, budget.token_limit = _limits(
            budget.spend_limit if spend_limit is _UNSET else spend_limit,
            budget.token_limit if token_limit is _UNSET else token_limit)
        budget.updated_at = timezone.now()
        budget.save(update_fields=["spend_limit", "token_limit", "updated_at"])
        audit_record(tenant=tenant, actor=actor, action="budget.update", target_type="budget",
                     target_id=budget.pk, before=before, after=_snapshot(budget))
        transaction.on_commit(partial(budgets_publish, tenant_ids=[tenant.pk]))
    return budget


def budget_delete(*, tenant, actor: Actor, budget_id: int) -> None:
    with transaction.atomic():
        budget = _locked(tenant, budget_id)
        audit_record(tenant=tenant, actor=actor, action="budget.delete", target_type="budget",
                     target_id=budget.pk, before=_snapshot(budget))
        budget.delete()
        transaction.on_commit(partial(budgets_publish, tenant_ids=[tenant.pk]))


def _locked(tenant, budget_id: int) -> Budget:
    budget = Budget.objects.for_tenant(tenant).select_for_update().filter(pk=budget_id).first()
    if budget is None:
        raise NotFound(f"No budget {budget_id}.")
    return budget




def budgets_publish(*, tenant_ids: Iterable[int] | None = None) -> None:
    """Writes the tenants' (every tenant's with a budget when None) definitions to Redis."""
    rows = Budget.objects.all() if tenant_ids is None else \
        Budget.objects.filter(tenant_id__in=list(tenant_ids))
    # NOTE: oldest first, so where two key budgets of one window name keys of one lineage
    # (both made before rotations carried budgets), the newest one is the one enforced.
    rows = rows.order_by("pk")
    definitions: dict[int, dict[str, budget_counters.Definition]] = \
        {t: {} for t in (tenant_ids or ())}
    rows = list(rows)
    subjects = budget_subjects(rows)
    for b in rows:
        definitions.setdefault(b.tenant_id, {})[
            budget_counters.field(b.scope, subjects[b.pk], b.window)] = budget_counters.Definition(
            b.pk, None if b.spend_limit is None else micros(b.spend_limit), b.token_limit)
    try:
        budget_counters.defs_set(sync_client(), definitions)
    except redis.RedisError:
        log.warning("could not publish budgets to Redis; the next reconcile will")


def _ledger_figures(budget: Budget, start: datetime, end: datetime
                    ) -> dict[str, tuple[Decimal, int]]:
    """The ledger's spend and tokens in the window, by the subject's counter (the
    each-end-user budget: one per end user seen)."""
    tokens = F("prompt_tokens") + F("completion_tokens")
    if budget.scope == Budget.Scope.USER:
        rows = UsageRecord.objects.for_tenant(budget.tenant).filter(
            occurred_at__gte=start, occurred_at__lt=end)
        if budget.end_user:
            rows = rows.filter(end_user=budget.end_user)
        else:
            rows = rows.exclude(end_user="")
        return {budget_counters.user_subject(r["end_user"]):
                (r["spend"] or Decimal(0), r["tokens"] or 0)
                for r in rows.values("end_user").annotate(spend=Sum("cost"), tokens=Sum(tokens))}
    rows = UsageRollup.objects.for_tenant(budget.tenant).filter(
        day__gte=start.date(), day__lt=end.date())
    subject = budget_subjects([budget])[budget.pk]
    if budget.scope == Budget.Scope.KEY:  # the key and every key it was rotated into
        rows = rows.filter(api_key_id__in=api_key_lineage_members(int(subject)))
    total = rows.aggregate(spend=Sum("cost"), tokens=Sum(tokens))
    return {subject: (total["spend"] or Decimal(0), total["tokens"] or 0)}


def budgets_reconcile(*, now: datetime | None = None) -> int:
    """Raises every budget's counters for its open window to at least the ledger's figures
    (Redis lost an increment, or was flushed), and publishes every definition again.
    Returns how many counter values were raised."""
    budgets_publish()
    figures: dict[str, tuple[int, int, int]] = {}
    for budget in Budget.objects.select_related("tenant"):
        label, start, end = budget_counters.window_bounds(budget.window, now)
        end_ms = int(end.timestamp() * 1000)
        for subject, (spend, tokens) in _ledger_figures(budget, start, end).items():
            key = budget_counters.counter_key(budget.tenant_id,
                                      f"{budget_counters.SCOPES[budget.scope]}:{subject}", label)
            figures[key] = (micros(spend), int(tokens), end_ms)
    return budget_counters.counters_raise(sync_client(), figures) if figures else 0


def budget_alerts_collect() -> int:
    """Turns the thresholds admission and settlement marked as crossed into alerts: each
    recorded once, emailed to the tenant's payers and sent to its webhooks. Returns how
    many alerts are new.

    A pass takes at most ATRIUM_ALERTS_PER_TENANT_PASS of one tenant's thresholds (a
    tenant whose end users cross thousands waits for later passes, not the others), and a
    tenant whose alerts fail to record is logged and passed over."""
    client = sync_client()
    added = 0
    for tenant_id in Budget.objects.values_list("tenant_id", flat=True).distinct():
        try:
            added += _tenant_alerts_collect(client, tenant_id)
        except Exception:  # noqa: BLE001 - one tenant's bad entry never stops the others
            log.exception("could not record tenant %s's budget alerts", tenant_id)
    return added


def _tenant_alerts_collect(client: redis.Redis, tenant_id: int) -> int:
    entries = budget_counters.alerts_pending(client, tenant_id,
                                     limit=settings.ATRIUM_ALERTS_PER_TENANT_PASS)
    added = sum(_alert_record(tenant_id, entry) for entry in entries)
    # NOTE: only after the alerts are committed: a worker dying first sends them later.
    budget_counters.alerts_done(client, tenant_id, entries)
    return added


def _alert_record(tenant_id: int, entry: str) -> int:
    try:
        budget_id, key, threshold, spent, tokens, _at_ms, end_user = entry.split("|", 6)
        label, threshold, spent, tokens = (key.rsplit(":", 1)[1], int(threshold),
                                           from_micros(int(spent)), int(tokens))
        budget = Budget.objects.select_related("tenant").get(pk=int(budget_id),
                                                             tenant_id=tenant_id)
    except (ValueError, IndexError, Budget.DoesNotExist):
        return 0  # a malformed entry, or a budget deleted since: dropped
    each_user = budget.scope == Budget.Scope.USER and not budget.end_user
    with transaction.atomic():
        alert, created = BudgetAlert.objects.get_or_create(
            budget=budget, window_label=label[:10], threshold=threshold,
            subject=budget_counters.user_subject(end_user) if end_user and budget.scope == "user"
            else "", defaults={"tenant_id": tenant_id, "spent": spent, "tokens": tokens,
                               "end_user": end_user[:256]})
        if not created:
            return 0
        event = alert_event(budget, alert)
        webhook_event_emit(tenant=budget.tenant, event_type="budget.threshold_reached",
                           data=event)
        if not each_user or _earlier_alerts(alert) < settings.ATRIUM_ALERT_EMAILS_PER_WINDOW:
            transaction.on_commit(partial(queue.budget_alert_email_enqueue,
                                          alert_id=alert.pk))
    return 1


def _earlier_alerts(alert: BudgetAlert) -> int:
    """Alerts of the same budget, window and threshold before this one (other end users')."""
    return BudgetAlert.objects.filter(budget_id=alert.budget_id, window_label=alert.window_label,
                                      threshold=alert.threshold, pk__lt=alert.pk).count()


def alert_event(budget: Budget, alert: BudgetAlert) -> dict[str, Any]:
    """An alert as its webhook event's ``data`` (and its email) tell it."""
    return {"budget_id": budget.pk, "scope": budget.scope, "api_key_id": budget.api_key_id,
            "end_user": alert.end_user or None, "window": budget.window,
            "window_label": alert.window_label, "threshold": alert.threshold,
            "spend_limit": None if budget.spend_limit is None else str(budget.spend_limit),
            "token_limit": budget.token_limit, "spent": str(alert.spent),
            "tokens": alert.tokens, "currency": settings.ATRIUM_BILLING_CURRENCY}
