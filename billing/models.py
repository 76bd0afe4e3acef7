from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.models import ApiKey, Plan, Tenant, TenantOwnedQuerySet

PRICE_CLASS_INTERACTIVE, PRICE_CLASS_BATCH = "interactive", "batch"
PRICE_CLASS_EMBEDDING = "embedding"
# The service tiers a request may ask for beyond the default (docs/tiers.md).
PRICE_CLASS_FLEX, PRICE_CLASS_PRIORITY = "flex", "priority"
PRICE_CLASSES = [(PRICE_CLASS_INTERACTIVE, "interactive"), (PRICE_CLASS_BATCH, "batch"),
                 (PRICE_CLASS_EMBEDDING, "embedding"), (PRICE_CLASS_FLEX, "flex"),
                 (PRICE_CLASS_PRIORITY, "priority")]
MAX_PRIORITY_RATIO = Decimal(10)
# The input token classes an embedding price replaces (an embedding has no output).
_EMBEDDED_FIELDS = ("input_per_million", "cached_input_per_million")


class Price(models.Model):
    """A price per million tokens from ``effective_from`` on; never edited, only superseded.

    ``adapter`` empty: the model's base price. Set: a surcharge added on top of the
    base price for requests served by that adapter.
    """

    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True, default="")
    currency = models.CharField(max_length=3, default="USD")
    input_per_million = models.DecimalField(max_digits=18, decimal_places=6)
    cached_input_per_million = models.DecimalField(max_digits=18, decimal_places=6)
    output_per_million = models.DecimalField(max_digits=18, decimal_places=6)
    # The batch price class (the Batch API): this share of each price above.
    batch_ratio = models.DecimalField(max_digits=7, decimal_places=6, default=Decimal("0.5"))
    # The service tiers' price classes: these multiples of each price above (flex a share,
    # priority a premium).
    flex_ratio = models.DecimalField(max_digits=7, decimal_places=6, default=Decimal("0.5"))
    priority_ratio = models.DecimalField(max_digits=8, decimal_places=6, default=Decimal(2))
    # The embedding price class (/v1/embeddings): its inputs' price, cached or not.
    # Null: embeddings are billed at input_per_million and cached_input_per_million.
    embedding_per_million = models.DecimalField(max_digits=18, decimal_places=6, null=True,
                                                blank=True)
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model", "adapter", "currency", "effective_from"],
                                    name="one_price_per_model_adapter_currency_instant"),
            models.CheckConstraint(
                condition=Q(input_per_million__gte=0) & Q(cached_input_per_million__gte=0)
                & Q(output_per_million__gte=0), name="prices_are_not_negative"),
            models.CheckConstraint(condition=Q(batch_ratio__gte=0) & Q(batch_ratio__lte=1),
                                   name="batch_ratio_is_a_share"),
            models.CheckConstraint(condition=Q(flex_ratio__gte=0) & Q(flex_ratio__lte=1),
                                   name="flex_ratio_is_a_share"),
            models.CheckConstraint(condition=Q(priority_ratio__gte=1)
                                   & Q(priority_ratio__lte=MAX_PRIORITY_RATIO),
                                   name="priority_ratio_is_a_premium"),
            models.CheckConstraint(condition=Q(embedding_per_million__isnull=True)
                                   | Q(embedding_per_million__gte=0),
                                   name="embedding_price_is_not_negative"),
        ]
        indexes = [models.Index(fields=["model", "adapter", "currency", "-effective_from"])]

    def __str__(self) -> str:
        adapter = f"+{self.adapter}" if self.adapter else ""
        return f"{self.model}{adapter} from {self.effective_from}"

    def per_million(self, field: str, price_class: str) -> Decimal:
        """A token class's price (``input_per_million`` ...) in ``price_class``."""
        value = getattr(self, field)
        if price_class == PRICE_CLASS_BATCH:
            return value * self.batch_ratio
        if price_class == PRICE_CLASS_FLEX:
            return value * self.flex_ratio
        if price_class == PRICE_CLASS_PRIORITY:
            return value * self.priority_ratio
        if price_class == PRICE_CLASS_EMBEDDING and field in _EMBEDDED_FIELDS \
                and self.embedding_per_million is not None:
            return self.embedding_per_million
        return value


class UsageRecord(models.Model):
    """The ledger: one immutable row per request id, costed at the price then in effect."""

    # NOTE: unique: the database, not the code path, is what makes billing exactly-once.
    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    api_key_id = models.BigIntegerField(null=True, blank=True)
    api_key_prefix = models.CharField(max_length=16, blank=True, default="")
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True, default="")
    # The request's ``user`` (an end user of the tenant's app): what its budgets count.
    end_user = models.CharField(max_length=256, blank=True, default="")
    # A batch line (the Batch API) is billed at its prices' batch_ratio; an embedding
    # (/v1/embeddings) at their embedding_per_million, where set; a flex or priority request
    # at their flex_ratio or priority_ratio.
    price_class = models.CharField(max_length=16, choices=PRICE_CLASSES,
                                   default=PRICE_CLASS_INTERACTIVE)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    finish_reason = models.CharField(max_length=32, blank=True, default="")
    queue_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    occurred_at = models.DateTimeField(db_index=True)
    # The month (its first day) whose invoice bills this record: the month it occurred
    # in, or the open month when that month's invoice was already finalized.
    billing_period = models.DateField()
    currency = models.CharField(max_length=3, default="USD")
    input_cost = models.DecimalField(max_digits=20, decimal_places=6)
    cached_input_cost = models.DecimalField(max_digits=20, decimal_places=6)
    output_cost = models.DecimalField(max_digits=20, decimal_places=6)
    cost = models.DecimalField(max_digits=20, decimal_places=6)
    # The base price applied; null when no price was in effect (the row costs 0 and
    # the operator is warned: usage is never dropped for want of a price).
    price = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, blank=True,
                              related_name="+")
    surcharge = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, blank=True,
                                  related_name="+")
    recorded_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(cached_tokens__lte=models.F(
            "prompt_tokens")), name="cached_tokens_within_prompt")]
        indexes = [models.Index(fields=["tenant", "occurred_at"])]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.cost} {self.currency}"


class UsageDeadLetter(models.Model):
    """A usage report the ledger refused (undecodable, impossible, an unknown tenant).

    Recorded and acknowledged so it never blocks the reports behind it; an operator
    reads the reason here (and in the log) and decides. Never retried by itself.
    """

    # The report's id in the usage stream: recording it twice is a no-op.
    entry_id = models.CharField(max_length=64, unique=True)
    request_id = models.CharField(max_length=200, blank=True, default="")
    tenant_ref = models.CharField(max_length=64, blank=True, default="")
    reason = models.CharField(max_length=500)
    # The stream entry as received (usage counts and ids, never prompt text), cut at 8 KiB.
    payload = models.TextField()
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.entry_id}: {self.reason}"


class UsageRollup(models.Model):
    """The ledger summed per tenant, UTC day, billing period, model, adapter, key and prices.

    Written in the same transaction as the records it sums, so it never disagrees
    with the ledger. Invoices, the usage API's daily buckets and the spend counters
    read these instead of the ledger.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    day = models.DateField()
    billing_period = models.DateField()
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True, default="")
    # NOTE: 0, not null, for "no key" and "no price": NULLs never conflict in a unique
    # index, and the upsert needs these rows to conflict.
    api_key_id = models.BigIntegerField(default=0)
    price_ref = models.BigIntegerField(default=0)
    surcharge_ref = models.BigIntegerField(default=0)
    price_class = models.CharField(max_length=16, choices=PRICE_CLASSES,
                                   default=PRICE_CLASS_INTERACTIVE)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    input_cost = models.DecimalField(max_digits=24, decimal_places=6, default=0)
    cached_input_cost = models.DecimalField(max_digits=24, decimal_places=6, default=0)
    output_cost = models.DecimalField(max_digits=24, decimal_places=6, default=0)
    cost = models.DecimalField(max_digits=24, decimal_places=6, default=0)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(
            fields=["tenant", "day", "billing_period", "model", "adapter", "api_key_id",
                    "price_ref", "surcharge_ref", "price_class"],
            name="one_rollup_per_group_and_price_class")]
        indexes = [models.Index(fields=["tenant", "billing_period"]),
                   models.Index(fields=["billing_period"])]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.day} {self.model}: {self.cost}"


class Invoice(models.Model):
    """One per tenant per billing period: a draft while the period is open, then final.

    A draft's lines are computed from the rollups when read; finalizing writes them
    (`InvoiceLine`) and the totals, and they never change again.
    """

    class Status(models.TextChoices):
        DRAFT = "draft"
        FINALIZED = "finalized"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="invoices")
    number = models.CharField(max_length=32, unique=True)
    period_start = models.DateField()
    period_end = models.DateField()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    # Set when finalized; a draft's totals are computed when read.
    total = models.DecimalField(max_digits=18, decimal_places=2, null=True, blank=True)
    exact_total = models.DecimalField(max_digits=24, decimal_places=6, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finalized_at = models.DateTimeField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "period_start"],
                                               name="one_invoice_per_tenant_and_period")]
        indexes = [models.Index(fields=["status", "period_end"])]

    def __str__(self) -> str:
        return self.number


class InvoiceLine(models.Model):
    """Tokens of one class, for one model and adapter, at one unit price."""

    class TokenClass(models.TextChoices):
        INPUT = "input"
        CACHED_INPUT = "cached_input"
        OUTPUT = "output"

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    position = models.PositiveIntegerField()
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True, default="")
    token_class = models.CharField(max_length=16, choices=TokenClass.choices)
    price_class = models.CharField(max_length=16, choices=PRICE_CLASSES,
                                   default=PRICE_CLASS_INTERACTIVE)
    units = models.BigIntegerField()
    # Per million tokens: the base price plus the adapter's surcharge, if any.
    unit_price = models.DecimalField(max_digits=18, decimal_places=6)
    # The records' costs added exactly, then the amount billed (largest remainder, cents).
    exact_amount = models.DecimalField(max_digits=24, decimal_places=6)
    amount = models.DecimalField(max_digits=18, decimal_places=2)
    price = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, blank=True,
                              related_name="+")
    surcharge = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, blank=True,
                                  related_name="+")

    class Meta:
        ordering = ["position"]
        constraints = [models.UniqueConstraint(fields=["invoice", "position"],
                                               name="one_line_per_position")]

    def __str__(self) -> str:
        return f"{self.invoice_id}#{self.position} {self.model} {self.token_class}"


class SpendCap(models.Model):
    """A monthly spending limit: a plan's default, or one tenant's own, which replaces it.

    A tenant's row with no limit means "no cap for this tenant", whatever its plan says.
    """

    plan = models.OneToOneField(Plan, on_delete=models.CASCADE, null=True, blank=True,
                                related_name="+")
    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, null=True, blank=True,
                                  related_name="+")
    monthly_limit = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(plan__isnull=False, tenant__isnull=True)
                                   | Q(plan__isnull=True, tenant__isnull=False),
                                   name="spend_cap_of_a_plan_or_a_tenant"),
            models.CheckConstraint(condition=Q(monthly_limit__isnull=True)
                                   | Q(monthly_limit__gte=0), name="spend_cap_not_negative"),
        ]

    def __str__(self) -> str:
        return f"cap {self.monthly_limit} of {self.plan_id or self.tenant_id}"


class Export(models.Model):
    """A file of a tenant's billing data for a time range, built by a Celery task."""

    class Kind(models.TextChoices):
        LEDGER = "ledger", "Ledger"
        INVOICES = "invoices", "Invoices"
        METER_EVENTS = "meter_events", "Meter events"

    class Format(models.TextChoices):
        CSV = "csv", "CSV"
        JSONL = "jsonl", "JSON Lines"

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        EXPIRED = "expired"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    format = models.CharField(max_length=8, choices=Format.choices)
    start = models.DateTimeField()
    end = models.DateTimeField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    rows = models.BigIntegerField(default=0)
    size_bytes = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True, default="")
    file_name = models.CharField(max_length=300, blank=True, default="")
    error = models.CharField(max_length=500, blank=True, default="")
    requested_by = models.CharField(max_length=300, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"]),
                   models.Index(fields=["status", "expires_at"])]

    def __str__(self) -> str:
        return f"export {self.pk} ({self.kind}, {self.format})"


class Budget(models.Model):
    """A tenant's own limit on spend and/or tokens per UTC day or month: for the whole
    tenant, one API key, or one end user of its app (the request's ``user``; blank: each
    end user that has no budget of their own). Enforced by reservation at admission
    (billing/budget_counters.py); alerts at 50, 80 and 100%."""

    class Scope(models.TextChoices):
        TENANT = "tenant"
        KEY = "key"
        USER = "user"

    class Window(models.TextChoices):
        DAY = "day"
        MONTH = "month"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=8, choices=Scope.choices)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, null=True, blank=True,
                                related_name="+")
    end_user = models.CharField(max_length=256, blank=True, default="")
    window = models.CharField(max_length=8, choices=Window.choices)
    spend_limit = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    token_limit = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "window"], condition=Q(scope="tenant"),
                                    name="one_tenant_budget_per_window"),
            models.UniqueConstraint(fields=["tenant", "api_key", "window"],
                                    condition=Q(scope="key"), name="one_key_budget_per_window"),
            models.UniqueConstraint(fields=["tenant", "end_user", "window"],
                                    condition=Q(scope="user"),
                                    name="one_user_budget_per_window"),
            models.CheckConstraint(condition=Q(spend_limit__isnull=False)
                                   | Q(token_limit__isnull=False),
                                   name="budget_limits_something"),
            models.CheckConstraint(condition=(Q(spend_limit__isnull=True)
                                              | Q(spend_limit__gte=0))
                                   & (Q(token_limit__isnull=True) | Q(token_limit__gte=0)),
                                   name="budget_not_negative"),
        ]

    def __str__(self) -> str:
        return f"budget {self.pk} ({self.scope}/{self.window})"


class BudgetAlert(models.Model):
    """A budget's window reached 50, 80 or 100%: recorded once, then emailed and sent to
    the tenant's webhooks."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="alerts")
    window_label = models.CharField(max_length=10)  # YYYY-MM-DD or YYYY-MM
    # The each-end-user budget alerts per end user: its digest here, its name below.
    subject = models.CharField(max_length=32, blank=True, default="")
    end_user = models.CharField(max_length=256, blank=True, default="")
    threshold = models.PositiveSmallIntegerField()
    spent = models.DecimalField(max_digits=20, decimal_places=6)
    tokens = models.BigIntegerField()
    emailed_to = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(
            fields=["budget", "subject", "window_label", "threshold"],
            name="one_alert_per_budget_subject_window_threshold")]
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self) -> str:
        return f"budget {self.budget_id} {self.window_label} at {self.threshold}%"


class WebhookEndpoint(models.Model):
    """Where a tenant wants its events POSTed, signed with its own secret (Standard
    Webhooks: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    url = models.URLField(max_length=2000)
    description = models.CharField(max_length=200, blank=True, default="")
    # NOTE: kept to sign with, so stored as given; shown once, when the endpoint is made.
    secret = models.CharField(max_length=100)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    def __str__(self) -> str:
        return f"webhook {self.pk} → {self.url}"


class WebhookDelivery(models.Model):
    """One event for one endpoint, and how its delivery went: retried with backoff until
    it is answered 2xx or runs out of attempts."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE,
                                 related_name="deliveries")
    event_id = models.CharField(max_length=64)
    event_type = models.CharField(max_length=64)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    # NOTE: set while an attempt may be running (its lease), cleared when it ends: the
    # tenant's in-flight deliveries, which its concurrency cap counts.
    claimed_until = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "event_id"],
                                               name="one_delivery_per_endpoint_and_event")]
        indexes = [models.Index(fields=["status", "next_attempt_at"]),
                   models.Index(fields=["tenant", "-created_at"]),
                   models.Index(fields=["tenant", "claimed_until"])]

    def __str__(self) -> str:
        return f"{self.event_type} {self.event_id} → {self.endpoint_id}: {self.status}"
