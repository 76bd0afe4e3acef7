from django.contrib import admin

from billing.models import Price, UsageRecord


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    list_display = ("model", "adapter", "currency", "input_per_million",
                    "cached_input_per_million", "output_per_million", "effective_from")


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = ("request_id", "tenant", "model", "adapter", "prompt_tokens",
                    "completion_tokens", "cost", "occurred_at")

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # the ledger is immutable
