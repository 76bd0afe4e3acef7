"""Existing records are billed in the month they occurred in, and rolled up."""

from datetime import date

from django.db import migrations
from django.db.models import Count, Sum
from django.db.models.functions import TruncDate


def bill_past_usage(apps, schema_editor):
    UsageRecord = apps.get_model("billing", "UsageRecord")
    UsageRollup = apps.get_model("billing", "UsageRollup")
    pending = []
    for record in UsageRecord.objects.filter(billing_period__isnull=True).only(
            "id", "occurred_at").iterator(chunk_size=2000):
        at = record.occurred_at
        record.billing_period = date(at.year, at.month, 1)
        pending.append(record)
        if len(pending) >= 2000:
            UsageRecord.objects.bulk_update(pending, ["billing_period"])
            pending = []
    UsageRecord.objects.bulk_update(pending, ["billing_period"])
    groups = (UsageRecord.objects
              .annotate(day=TruncDate("occurred_at"))
              .values("tenant_id", "day", "billing_period", "model", "adapter", "api_key_id",
                      "price_id", "surcharge_id")
              .annotate(n=Count("id"), prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
                        completion=Sum("completion_tokens"), input_cost_sum=Sum("input_cost"),
                        cached_cost_sum=Sum("cached_input_cost"),
                        output_cost_sum=Sum("output_cost"), cost_sum=Sum("cost")))
    UsageRollup.objects.bulk_create([UsageRollup(
        tenant_id=g["tenant_id"], day=g["day"], billing_period=g["billing_period"],
        model=g["model"], adapter=g["adapter"], api_key_id=g["api_key_id"] or 0,
        price_ref=g["price_id"] or 0, surcharge_ref=g["surcharge_id"] or 0, requests=g["n"],
        prompt_tokens=g["prompt"], cached_tokens=g["cached"], completion_tokens=g["completion"],
        input_cost=g["input_cost_sum"], cached_input_cost=g["cached_cost_sum"],
        output_cost=g["output_cost_sum"], cost=g["cost_sum"]) for g in groups], batch_size=500)


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0002_invoices_rollups_exports'),
    ]

    operations = [
        migrations.RunPython(bill_past_usage, migrations.RunPython.noop),
    ]
