"""Billing in the Django admin: read-only. Prices are added through the API (audited, never
in the past); the ledger, invoices and dead letters are records, never edited by hand."""

from django.contrib import admin

from billing.models import Invoice, Price, UsageDeadLetter, UsageRecord


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Price)
class PriceAdmin(ReadOnlyAdmin):
    list_display = ("model", "adapter", "currency", "input_per_million",
                    "cached_input_per_million", "output_per_million", "embedding_per_million",
                    "effective_from")


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ("request_id", "tenant", "model", "adapter", "prompt_tokens",
                    "completion_tokens", "cost", "occurred_at", "billing_period")


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = ("number", "tenant", "period_start", "status", "total")


@admin.register(UsageDeadLetter)
class UsageDeadLetterAdmin(ReadOnlyAdmin):
    list_display = ("entry_id", "request_id", "tenant_ref", "reason", "created_at")
