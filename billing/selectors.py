"""Reads of billing: prices, usage buckets, spend, invoices (a draft computed live), exports.

Everything tenant-owned is reached through the tenant (``.for_tenant``); another
tenant's id is NotFound, never "forbidden", so its existence is not confirmed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from billing import budget_counters
from billing.models import (
    Budget,
    BudgetAlert,
    Export,
    Invoice,
    Price,
    SpendCap,
    UsageDeadLetter,
    UsageRecord,
    UsageRollup,
    WebhookDelivery,
    WebhookEndpoint,
)
from billing.money import PER, allocate_cents, from_micros, to_micro
from billing.periods import day_start, period_after, period_of
from core.errors import NotFound
from core.redis import sync_client
from tenants.facade import api_key_lineages, tenant_plans

# --- prices --------------------------------------------------------------------------------


def price_list(*, model: str | None = None, adapter: str | None = None) -> QuerySet[Price]:
    prices = Price.objects.order_by("model", "adapter", "currency", "effective_from", "id")
    if model is not None:
        prices = prices.filter(model=model)
    if adapter is not None:
        prices = prices.filter(adapter=adapter)
    return prices


def base_prices_now(models: Iterable[str], *, currency: str) -> dict[str, Price]:
    """Each model's base price (no adapter surcharge) in effect now, where it has one."""
    found: dict[str, Price] = {}
    for price in Price.objects.filter(model__in=list(models), adapter="", currency=currency,
                                      effective_from__lte=timezone.now()) \
            .order_by("model", "effective_from", "id"):
        found[price.model] = price  # the latest one started wins
    return found


# --- usage ---------------------------------------------------------------------------------

WIDTHS = {"1h": timedelta(hours=1), "1d": timedelta(days=1)}
GROUP_FIELDS = ("model", "adapter", "api_key_id")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Buckets [start, end) of one width (both aligned to it), grouped and filtered."""

    start: datetime
    end: datetime
    width: str
    group_by: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    api_key_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.width not in WIDTHS:
            raise ValueError(f"unknown bucket width {self.width!r}")
        if set(self.group_by) - set(GROUP_FIELDS):
            raise ValueError("unknown group_by field")


@dataclass(frozen=True, slots=True)
class UsageResult:
    requests: int
    input_tokens: int  # cached ones included, as OpenAI counts them
    cached_tokens: int
    output_tokens: int
    cost: Decimal
    model: str | None = None
    adapter: str | None = None
    api_key_id: int | None = None


@dataclass(frozen=True, slots=True)
class UsageBucket:
    start: datetime
    end: datetime
    results: list[UsageResult] = field(default_factory=list)


def cache_savings(*, tenant, start: date, end: date) -> Decimal:
    """What the tenant's prompt tokens served from the prefix cache saved over the UTC days
    ``[start, end)``: each at its price's input rate less its cached-input rate, in the price
    class it ran in (the base price and the adapter's surcharge alike)."""
    rows = list(UsageRollup.objects.for_tenant(tenant)
                .filter(day__gte=start, day__lt=end, cached_tokens__gt=0)
                .values("price_ref", "surcharge_ref", "price_class")
                .annotate(cached=Sum("cached_tokens")))
    prices = Price.objects.in_bulk({r[k] for r in rows for k in ("price_ref", "surcharge_ref")
                                    if r[k]})
    saved = Decimal(0)
    for row in rows:
        for price in filter(None, (prices.get(row["price_ref"]),
                                   prices.get(row["surcharge_ref"]))):
            rate = price.per_million("input_per_million", row["price_class"]) \
                - price.per_million("cached_input_per_million", row["price_class"])
            saved += Decimal(row["cached"]) * rate / PER
    return saved.quantize(Decimal("0.000001"))


def usage_buckets(*, tenant, query: UsageQuery) -> list[UsageBucket]:
    """The tenant's usage in each bucket: 1d from the daily rollups, 1h from the ledger."""
    group = [g for g in GROUP_FIELDS if g in query.group_by]
    if query.width == "1d":
        rows = UsageRollup.objects.for_tenant(tenant).filter(
            day__gte=query.start.date(), day__lt=query.end.date())
        when, requests = "day", Sum("requests")
        if query.api_key_ids:
            rows = rows.filter(api_key_id__in=query.api_key_ids)
    else:
        rows = (UsageRecord.objects.for_tenant(tenant)
                .filter(occurred_at__gte=query.start, occurred_at__lt=query.end)
                .annotate(hour=TruncHour("occurred_at", tzinfo=UTC)))
        when, requests = "hour", Count("id")
        if query.api_key_ids:
            rows = rows.filter(api_key_id__in=query.api_key_ids)
    if query.models:
        rows = rows.filter(model__in=query.models)
    if query.adapters:
        rows = rows.filter(adapter__in=query.adapters)
    grouped = (rows.values(when, *group)
               .annotate(n=requests, prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
                         completion=Sum("completion_tokens"), total_cost=Sum("cost"))
               .order_by(when, *group))
    step = WIDTHS[query.width]
    buckets: dict[datetime, UsageBucket] = {}
    moment = query.start
    while moment < query.end:
        buckets[moment] = UsageBucket(start=moment, end=moment + step)
        moment += step
    for row in grouped:
        start = day_start(row["day"]) if when == "day" else row["hour"].astimezone(UTC)
        keys = {g: row[g] for g in group}
        if "api_key_id" in keys:
            keys["api_key_id"] = keys["api_key_id"] or None  # rollups say 0 for "no key"
        buckets[start].results.append(UsageResult(
            requests=row["n"], input_tokens=row["prompt"], cached_tokens=row["cached"],
            output_tokens=row["completion"], cost=to_micro(row["total_cost"] or Decimal(0)),
            **keys))
    return list(buckets.values())


_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def usage_record_get(*, tenant, request_id: str) -> UsageRecord:
    """One request's ledger row, by the id its client got (``chatcmpl-…``, ``cmpl-…``).

    Rows written before request ids carried their prefix hold its hex part alone, and are
    found by the whole id too (or by the hex part, as those clients may have kept it).
    """
    forms = [request_id]
    for prefix in _ID_PREFIXES:
        if request_id.startswith(prefix):
            forms.append(request_id.removeprefix(prefix))
            break
    else:
        forms.extend(prefix + request_id for prefix in _ID_PREFIXES)
    record = (UsageRecord.objects.for_tenant(tenant).filter(request_id__in=forms)
              .order_by("id").first())
    if record is None:
        raise NotFound(f"no usage recorded for request '{request_id}' in tenant "
                       f"'{tenant.slug}'")
    return record


# --- spend ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SpendSummary:
    """A tenant's spend in the open period against its monthly cap."""

    period_start: date
    period_end: date
    currency: str
    spent: Decimal
    cap: Decimal | None
    cap_source: str | None  # "tenant", "plan", or None (no cap)

    @property
    def remaining(self) -> Decimal | None:
        return None if self.cap is None else max(self.cap - self.spent, Decimal(0))


def spend_caps_effective(*, tenant_ids: Iterable[int] | None = None
                         ) -> dict[int, Decimal | None]:
    """Each tenant's monthly cap: its own if set (None there: uncapped), else its plan's."""
    return {t: cap for t, (cap, _) in _caps_with_source(tenant_ids).items()}


def _caps_with_source(tenant_ids: Iterable[int] | None
                      ) -> dict[int, tuple[Decimal | None, str | None]]:
    plans = tenant_plans(tenant_ids)
    own = SpendCap.objects.filter(tenant__isnull=False)
    if tenant_ids is not None:
        own = own.filter(tenant_id__in=list(plans))
    own_caps = dict(own.values_list("tenant_id", "monthly_limit"))
    plan_caps = dict(SpendCap.objects.filter(plan_id__in=set(plans.values()))
                     .values_list("plan_id", "monthly_limit"))
    out: dict[int, tuple[Decimal | None, str | None]] = {}
    for tenant_id, plan_id in plans.items():
        if tenant_id in own_caps:
            cap = own_caps[tenant_id]
            out[tenant_id] = (cap, "tenant" if cap is not None else None)
        elif plan_caps.get(plan_id) is not None:
            out[tenant_id] = (plan_caps[plan_id], "plan")
        else:
            out[tenant_id] = (None, None)
    return out


def spend_summary(*, tenant, now: datetime | None = None) -> SpendSummary:
    return spend_summaries(tenant_ids=[tenant.pk], now=now)[tenant.pk]


def spend_summaries(*, tenant_ids: Iterable[int], now: datetime | None = None
                    ) -> dict[int, SpendSummary]:
    """This period's spend and cap of many tenants in two queries (the operator's list)."""
    tenant_ids = list(tenant_ids)
    period = period_of(now or timezone.now())
    spent = dict(UsageRollup.objects.filter(tenant_id__in=tenant_ids, billing_period=period)
                 .order_by().values("tenant_id").annotate(total=Sum("cost"))
                 .values_list("tenant_id", "total"))
    caps = _caps_with_source(tenant_ids)
    return {tenant_id: SpendSummary(
        period_start=period, period_end=period_after(period),
        currency=settings.ATRIUM_BILLING_CURRENCY,
        spent=to_micro(spent.get(tenant_id) or Decimal(0)),
        cap=caps[tenant_id][0], cap_source=caps[tenant_id][1]) for tenant_id in tenant_ids}


# --- invoices ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class InvoiceLineView:
    model: str
    adapter: str
    token_class: str
    units: int
    unit_price: Decimal  # per million tokens
    exact_amount: Decimal
    amount: Decimal
    price_id: int | None
    surcharge_id: int | None
    price_class: str = "interactive"


@dataclass(frozen=True, slots=True)
class InvoiceView:
    invoice: Invoice
    lines: list[InvoiceLineView]
    exact_total: Decimal
    total: Decimal


# Token class -> the Price field that prices it.
_PER_MILLION = {"input": "input_per_million", "cached_input": "cached_input_per_million",
                "output": "output_per_million"}


def invoice_lines_compute(*, tenant_id: int, period: date) -> list[InvoiceLineView]:
    """A period's lines from the rollups: per model, adapter, token class and unit price,
    amounts in cents that add up to the records' exact total (money.allocate_cents)."""
    groups = list(
        UsageRollup.objects.filter(tenant_id=tenant_id, billing_period=period)
        .values("model", "adapter", "price_ref", "surcharge_ref", "price_class")
        .annotate(prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
                  completion=Sum("completion_tokens"), input_sum=Sum("input_cost"),
                  cached_sum=Sum("cached_input_cost"), output_sum=Sum("output_cost"))
        .order_by("model", "adapter", "price_class", "price_ref", "surcharge_ref"))
    prices = Price.objects.in_bulk({g["price_ref"] for g in groups}
                                   | {g["surcharge_ref"] for g in groups})
    drafts = []
    for g in groups:
        base, surcharge = prices.get(g["price_ref"]), prices.get(g["surcharge_ref"])
        units = {"input": g["prompt"] - g["cached"], "cached_input": g["cached"],
                 "output": g["completion"]}
        # NOTE: to_micro is exact on PostgreSQL; on SQLite it drops float noise from SUM.
        exact = {"input": to_micro(g["input_sum"] or Decimal(0)),
                 "cached_input": to_micro(g["cached_sum"] or Decimal(0)),
                 "output": to_micro(g["output_sum"] or Decimal(0))}
        for token_class, price_field in _PER_MILLION.items():
            if not units[token_class] and not exact[token_class]:
                continue
            unit_price = to_micro(sum((p.per_million(price_field, g["price_class"])
                                       for p in (base, surcharge) if p is not None), Decimal(0)))
            drafts.append((g["model"], g["adapter"], token_class, units[token_class], unit_price,
                           exact[token_class], base, surcharge, g["price_class"]))
    amounts = allocate_cents([d[5] for d in drafts])
    return [InvoiceLineView(model=m, adapter=a, token_class=c, units=u, unit_price=p,
                            exact_amount=e, amount=amount, price_class=k,
                            price_id=b.pk if b else None, surcharge_id=s.pk if s else None)
            for (m, a, c, u, p, e, b, s, k), amount in zip(drafts, amounts, strict=True)]


def invoice_list(*, tenant) -> QuerySet[Invoice]:
    return Invoice.objects.for_tenant(tenant).order_by("-period_start", "-id")


def invoice_get(*, tenant, invoice_id: int) -> Invoice:
    invoice = Invoice.objects.for_tenant(tenant).filter(pk=invoice_id).first()
    if invoice is None:
        raise NotFound(f"no invoice {invoice_id} in tenant '{tenant.slug}'")
    return invoice


def invoice_view(*, invoice: Invoice) -> InvoiceView:
    """A finalized invoice as written; a draft as it would be finalized now."""
    if invoice.status == Invoice.Status.FINALIZED:
        lines = [InvoiceLineView(
            model=line.model, adapter=line.adapter, token_class=line.token_class,
            units=line.units, unit_price=line.unit_price, exact_amount=line.exact_amount,
            amount=line.amount, price_id=line.price_id, surcharge_id=line.surcharge_id,
            price_class=line.price_class)
            for line in invoice.lines.order_by("position")]
        return InvoiceView(invoice=invoice, lines=lines, exact_total=invoice.exact_total,
                           total=invoice.total)
    lines = invoice_lines_compute(tenant_id=invoice.tenant_id, period=invoice.period_start)
    return InvoiceView(invoice=invoice, lines=lines,
                       exact_total=sum((x.exact_amount for x in lines), Decimal(0)),
                       total=sum((x.amount for x in lines), Decimal("0.00")))


# --- exports and dead letters --------------------------------------------------------------

def export_list(*, tenant) -> QuerySet[Export]:
    return Export.objects.for_tenant(tenant).order_by("-created_at", "-id")


def export_get(*, tenant, export_id: int) -> Export:
    export = Export.objects.for_tenant(tenant).filter(pk=export_id).first()
    if export is None:
        raise NotFound(f"no export {export_id} in tenant '{tenant.slug}'")
    return export


def usage_dead_letter_list() -> QuerySet[UsageDeadLetter]:
    return UsageDeadLetter.objects.order_by("-created_at", "-id")


def plan_spend_caps() -> dict[int, Decimal | None]:
    """Each plan's default monthly spend cap, by plan id (plans without one are absent)."""
    return dict(SpendCap.objects.filter(plan__isnull=False)
                .values_list("plan_id", "monthly_limit"))


def tokens_used_between(*, start: date, end: date
                        ) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Prompt + completion tokens in the ledger's daily rollups for days in [start, end),
    by tenant and by (tenant, API key) (what admission's monthly token counters count)."""
    rows = (UsageRollup.objects.filter(day__gte=start, day__lt=end)
            .values("tenant_id", "api_key_id")
            .annotate(tokens=Sum("prompt_tokens") + Sum("completion_tokens")))
    by_tenant: dict[int, int] = {}
    by_key: dict[tuple[int, int], int] = {}
    for row in rows:
        tokens = int(row["tokens"] or 0)
        by_tenant[row["tenant_id"]] = by_tenant.get(row["tenant_id"], 0) + tokens
        if row["api_key_id"]:
            key = (row["tenant_id"], row["api_key_id"])
            by_key[key] = by_key.get(key, 0) + tokens
    return by_tenant, by_key


# --- budgets and webhooks ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BudgetView:
    """A budget and where its open window stands (None for the each-end-user budget,
    whose windows are one per end user)."""

    budget: Budget
    window_label: str
    resets_at: datetime
    spent: Decimal | None
    reserved: Decimal | None
    tokens: int | None
    reserved_tokens: int | None


def budget_list(*, tenant) -> QuerySet[Budget]:
    return Budget.objects.for_tenant(tenant).select_related("api_key").order_by("scope", "id")


def budget_get(*, tenant, budget_id: int) -> Budget:
    budget = budget_list(tenant=tenant).filter(pk=budget_id).first()
    if budget is None:
        raise NotFound(f"No budget {budget_id}.")
    return budget


def budget_subjects(budgets_: Iterable[Budget]) -> dict[int, str]:
    """Each budget's subject in Redis, by budget id: a key budget counts under its key's
    lineage (the key it was rotated from, back to the first), so it follows the key
    through rotations and a rotation resets nothing."""
    rows = list(budgets_)
    lineages = api_key_lineages(b.api_key_id for b in rows if b.api_key_id)
    return {b.pk: budget_counters.subject_of(b.scope, api_key_id=lineages.get(b.api_key_id),
                                     end_user=b.end_user) for b in rows}


def budget_views(budgets_: Iterable[Budget], *, now: datetime | None = None
                 ) -> list[BudgetView]:
    """Each budget with its open window's counters, read from Redis in one round trip."""
    rows = list(budgets_)
    subjects = budget_subjects(rows)
    keyed = []
    for b in rows:
        label, _, end = budget_counters.window_bounds(b.window, now)
        subject = subjects[b.pk]
        key = None if subject == budget_counters.EACH_USER else budget_counters.counter_key(
            b.tenant_id, f"{budget_counters.SCOPES[b.scope]}:{subject}", label)
        keyed.append((b, label, end, key))
    states = budget_counters.window_states(sync_client(), [k for *_, k in keyed if k])
    out = []
    for b, label, end, key in keyed:
        state = states.get(key) if key else None
        out.append(BudgetView(
            budget=b, window_label=label, resets_at=end,
            spent=None if state is None else from_micros(state.spent_micros),
            reserved=None if state is None else from_micros(state.reserved_micros),
            tokens=None if state is None else state.tokens,
            reserved_tokens=None if state is None else state.reserved_tokens))
    return out


def budget_alert_list(*, tenant) -> QuerySet[BudgetAlert]:
    return BudgetAlert.objects.for_tenant(tenant).order_by("-created_at", "-id")


def webhook_endpoint_list(*, tenant) -> QuerySet[WebhookEndpoint]:
    return WebhookEndpoint.objects.for_tenant(tenant).order_by("id")


def webhook_endpoint_get(*, tenant, endpoint_id: int) -> WebhookEndpoint:
    endpoint = webhook_endpoint_list(tenant=tenant).filter(pk=endpoint_id).first()
    if endpoint is None:
        raise NotFound(f"No webhook endpoint {endpoint_id}.")
    return endpoint


def webhook_delivery_list(*, tenant, endpoint_id: int | None = None
                          ) -> QuerySet[WebhookDelivery]:
    deliveries = WebhookDelivery.objects.for_tenant(tenant).select_related("endpoint")
    if endpoint_id is not None:
        deliveries = deliveries.filter(
            endpoint=webhook_endpoint_get(tenant=tenant, endpoint_id=endpoint_id))
    return deliveries.order_by("-created_at", "-id")
