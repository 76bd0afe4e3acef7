"""Reads the console's pages need, composed from the apps' own selectors.

Nothing here writes, and every tenant-owned read goes through the app's selector with the
tenant passed explicitly; the only cross-tenant reads are the operator's (fleet, tenants,
every adapter), which their views reach only as staff.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone

from billing import selectors as billing
from billing.periods import day_start, period_of
from core.redis import sync_client
from engine import protocol
from requestlogs.selectors import RequestLogFilter, request_log_list
from tenants import selectors as tenants
from tenants.models import Tenant

# --- usage ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def plus(self, result: billing.UsageResult) -> UsageTotals:
        return UsageTotals(requests=self.requests + result.requests,
                           input_tokens=self.input_tokens + result.input_tokens,
                           cached_tokens=self.cached_tokens + result.cached_tokens,
                           output_tokens=self.output_tokens + result.output_tokens,
                           cost=self.cost + result.cost)


@dataclass(frozen=True, slots=True)
class UsageDay:
    day: date
    totals: UsageTotals


@dataclass(frozen=True, slots=True)
class UsageGroup:
    label: str
    detail: str  # e.g. the key's prefix
    totals: UsageTotals


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: date
    end: date  # exclusive
    days: list[UsageDay]
    totals: UsageTotals
    by_model: list[UsageGroup] = field(default_factory=list)
    by_adapter: list[UsageGroup] = field(default_factory=list)
    by_key: list[UsageGroup] = field(default_factory=list)
    cache_savings: Decimal = Decimal(0)  # what its cached prompt tokens saved

    @property
    def last_day(self) -> date:
        return self.end - timedelta(days=1)

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache (either tier), of all."""
        totals = self.totals
        return totals.cached_tokens / totals.input_tokens if totals.input_tokens else 0.0


def _query(tenant: Tenant, start: date, end: date,
           group_by: tuple[str, ...] = ()) -> list[billing.UsageBucket]:
    return billing.usage_buckets(tenant=tenant, query=billing.UsageQuery(
        start=day_start(start), end=day_start(end), width="1d", group_by=group_by))


def _today() -> date:
    return timezone.now().date()  # UTC: billing's days are UTC days


def usage_days(*, tenant: Tenant, days: int, end: date | None = None) -> list[UsageDay]:
    """The tenant's usage per UTC day for the `days` days up to and including `end`."""
    last = end or _today()
    start = last - timedelta(days=days - 1)
    out = []
    for bucket in _query(tenant, start, last + timedelta(days=1)):
        totals = UsageTotals()
        for result in bucket.results:
            totals = totals.plus(result)
        out.append(UsageDay(day=bucket.start.date(), totals=totals))
    return out


def _sum(days: Iterable[UsageDay]) -> UsageTotals:
    totals = UsageTotals()
    for day in days:
        totals = UsageTotals(
            requests=totals.requests + day.totals.requests,
            input_tokens=totals.input_tokens + day.totals.input_tokens,
            cached_tokens=totals.cached_tokens + day.totals.cached_tokens,
            output_tokens=totals.output_tokens + day.totals.output_tokens,
            cost=totals.cost + day.totals.cost)
    return totals


def _grouped(tenant: Tenant, start: date, end: date, group: str) -> dict[Any, UsageTotals]:
    out: dict[Any, UsageTotals] = {}
    for bucket in _query(tenant, start, end, (group,)):
        for result in bucket.results:
            value = getattr(result, group)
            out[value] = out.get(value, UsageTotals()).plus(result)
    return out


def _ranked(groups: dict[Any, UsageTotals], label) -> list[UsageGroup]:
    rows = [UsageGroup(*label(value), totals=totals) for value, totals in groups.items()]
    return sorted(rows, key=lambda g: (-g.totals.tokens, g.label))


def usage_report(*, tenant: Tenant, days: int, end: date | None = None) -> UsageReport:
    """Usage per day, and per model, adapter and API key, over the last `days` days."""
    last = end or _today()
    start, stop = last - timedelta(days=days - 1), last + timedelta(days=1)
    daily = usage_days(tenant=tenant, days=days, end=last)
    keys = {k.pk: k for k in tenants.api_key_list(tenant=tenant)}

    def key_label(key_id: int | None) -> tuple[str, str]:
        if key_id is None:
            return "(no key)", ""
        key = keys.get(key_id)
        return (key.name, key.prefix) if key else (f"key {key_id}", "deleted")

    return UsageReport(
        start=start, end=stop, days=daily, totals=_sum(daily),
        by_model=_ranked(_grouped(tenant, start, stop, "model"), lambda m: (m, "")),
        by_adapter=_ranked(_grouped(tenant, start, stop, "adapter"),
                           lambda a: (a or "(base model)", "")),
        by_key=_ranked(_grouped(tenant, start, stop, "api_key_id"), key_label),
        cache_savings=billing.cache_savings(tenant=tenant, start=start, end=stop))


# --- overview ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Overview:
    period_start: date
    period_end: date
    period: UsageTotals
    days: list[UsageDay]
    spend: billing.SpendSummary | None  # None: the viewer may not see money
    active_keys: int


def overview_get(*, tenant: Tenant, with_spend: bool) -> Overview:
    """This billing period's requests, tokens and spend, and the last 30 days by day."""
    now = timezone.now()
    period = period_of(now)
    today = now.date()
    days = usage_days(tenant=tenant, days=30, end=today)
    since_period = (today - period).days + 1
    in_period = days[-since_period:] if since_period <= len(days) else usage_days(
        tenant=tenant, days=since_period, end=today)
    spend = billing.spend_summary(tenant=tenant, now=now) if with_spend else None
    active = sum(1 for k in tenants.api_key_list(tenant=tenant)
                 if tenants.api_key_denial(k, now=now) is None)
    return Overview(period_start=period, period_end=spend.period_end if spend else period,
                    period=_sum(in_period), days=days, spend=spend, active_keys=active)


# --- API keys ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KeyRow:
    id: int
    name: str
    prefix: str
    scopes: list[str]
    status: str  # active, rotating, expired, revoked
    created_at: datetime
    created_by: str
    created_by_id: int | None
    expires_at: datetime | None
    last_used_at: datetime | None


def key_rows(*, tenant: Tenant) -> list[KeyRow]:
    now = timezone.now()
    rows = []
    for key in tenants.api_key_list(tenant=tenant).select_related("created_by"):
        denial = tenants.api_key_denial(key, now=now)
        status = {None: "rotating" if key.replaced_by_id else "active",
                  tenants.DENIED_REVOKED: "revoked"}.get(denial, "expired")
        rows.append(KeyRow(
            id=key.pk, name=key.name, prefix=key.prefix, scopes=list(key.scopes),
            status=status, created_at=key.created_at,
            created_by=key.created_by.email if key.created_by else "",
            created_by_id=key.created_by_id, expires_at=key.expires_at,
            last_used_at=key.last_used_at))
    return rows


# --- pages of logs and audit events -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Page:
    items: list[Any]
    next_before: int | None  # the id to pass as `before` for the next, older page


def _paged(rows, limit: int) -> Page:
    found = list(rows[:limit + 1])
    more = len(found) > limit
    return Page(items=found[:limit], next_before=found[limit - 1].pk if more else None)


def log_page(*, tenant: Tenant, filters: RequestLogFilter, limit: int) -> Page:
    """The tenant's request logs, newest first (metadata, and bodies only as stored:
    redacted, and only when the tenant keeps them)."""
    return _paged(request_log_list(tenant=tenant, filters=filters), limit)


def audit_page(*, tenant: Tenant, action: str | None, before: int | None, limit: int) -> Page:
    events = tenants.audit_event_list(tenant=tenant).order_by("-id")
    if action:
        events = events.filter(action=action)
    if before:
        events = events.filter(id__lt=before)
    return _paged(events, limit)


# --- quotas --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class QuotaRow:
    name: str
    plan: int | None
    override: int | None
    effective: int | None
    used: int | None = None  # current consumption where it is measured


@dataclass(frozen=True, slots=True)
class Quotas:
    plan_slug: str
    plan_name: str
    priority: int
    rows: list[QuotaRow]
    spend: billing.SpendSummary


def quotas_get(*, tenant: Tenant) -> Quotas:
    """The plan's limits, the tenant's overrides, the effective limits and what is in use:
    the per-minute buckets, requests in flight and this month's tokens (the admission
    counters in Redis, read at Redis's clock as admission does)."""
    from inference.admission import usage_snapshot
    from tenants.models import QUOTA_FIELDS

    plan = tenant.plan
    override = tenants.quota_override_get(tenant=tenant)
    effective = tenants.tenant_limits(tenant=tenant, override=override)
    used = usage_snapshot(sync_client(), tenant_id=tenant.pk,
                          requests_per_minute=effective.requests_per_minute,
                          tokens_per_minute=effective.tokens_per_minute)
    rows = [QuotaRow(name=f, plan=getattr(plan, f),
                     override=getattr(override, f) if override else None,
                     effective=getattr(effective, f), used=used.get(f)) for f in QUOTA_FIELDS]
    return Quotas(plan_slug=plan.slug, plan_name=plan.name, priority=plan.priority, rows=rows,
                  spend=billing.spend_summary(tenant=tenant))


# --- the engine fleet ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineRow:
    engine_id: str
    model: str
    running: int
    waiting: int
    queued: int  # placed on it, unread in its stream
    requests_stolen: int | None  # taken from busy peers' streams
    kv_usage: float  # 0..1
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    prefix_cache_hit_rate: float | None
    generation_tokens_per_s: float | None
    tokens_generated: int | None
    requests_finished: int | None
    adapters_in_slots: list[str]
    started_at: float
    sent_at: float
    age_s: float  # since its last heartbeat

    def as_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


def engine_row(beat: protocol.EngineHeartbeat, *, now: float) -> EngineRow:
    stats = beat.stats or {}
    engine = stats.get("engine") or {}
    return EngineRow(
        engine_id=beat.engine_id, model=beat.model, running=beat.running, waiting=beat.waiting,
        queued=beat.queued, requests_stolen=stats.get("requests_stolen"),
        kv_usage=float(engine.get("kv_usage") or 0.0),
        kv_blocks_used=engine.get("kv_blocks_used"),
        kv_blocks_total=engine.get("kv_blocks_total"),
        prefix_cache_hit_rate=engine.get("prefix_cache_hit_rate"),
        generation_tokens_per_s=engine.get("generation_tokens_per_s"),
        tokens_generated=stats.get("tokens_generated"),
        requests_finished=stats.get("requests_finished"),
        adapters_in_slots=[str(a) for a in engine.get("adapters_in_slots") or []],
        started_at=beat.started_at, sent_at=beat.sent_at,
        age_s=round(max(0.0, now - beat.sent_at), 1))


def engine_rows(docs: Iterable[bytes | str | None], *, now: float) -> list[EngineRow]:
    """Rows of the heartbeat documents that are still there, sorted by engine id."""
    rows = []
    for doc in docs:
        if not doc:
            continue
        try:
            rows.append(engine_row(protocol.EngineHeartbeat.decode(doc), now=now))
        except (ValueError, TypeError, KeyError, json.JSONDecodeError):
            continue  # a malformed document is not an engine the console can show
    return sorted(rows, key=lambda r: r.engine_id)


def engine_heartbeats() -> list[protocol.EngineHeartbeat]:
    return [protocol.EngineHeartbeat.decode(d)
            for d in protocol.live_heartbeats(sync_client(), time.time())]


def fleet_get() -> list[EngineRow]:
    now = time.time()
    return engine_rows(protocol.live_heartbeats(sync_client(), now), now=now)


async def fleet_get_async(client) -> list[EngineRow]:
    """The same as fleet_get on an asyncio Redis client (the fleet websocket)."""
    now = time.time()
    return engine_rows(await protocol.live_heartbeats_async(client, now), now=now)
