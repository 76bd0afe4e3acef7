from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.models import Tenant


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
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model", "adapter", "currency", "effective_from"],
                                    name="one_price_per_model_adapter_currency_instant"),
            models.CheckConstraint(
                condition=Q(input_per_million__gte=0) & Q(cached_input_per_million__gte=0)
                & Q(output_per_million__gte=0), name="prices_are_not_negative"),
        ]
        indexes = [models.Index(fields=["model", "adapter", "currency", "-effective_from"])]

    def __str__(self) -> str:
        adapter = f"+{self.adapter}" if self.adapter else ""
        return f"{self.model}{adapter} from {self.effective_from}"


class UsageRecord(models.Model):
    """The ledger: one immutable row per request id, costed at the price then in effect."""

    # NOTE: unique: the database, not the code path, is what makes billing exactly-once.
    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    api_key_id = models.BigIntegerField(null=True, blank=True)
    api_key_prefix = models.CharField(max_length=16, blank=True, default="")
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    finish_reason = models.CharField(max_length=32, blank=True, default="")
    queue_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    occurred_at = models.DateTimeField(db_index=True)
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

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(cached_tokens__lte=models.F(
            "prompt_tokens")), name="cached_tokens_within_prompt")]
        indexes = [models.Index(fields=["tenant", "occurred_at"])]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.cost} {self.currency}"
