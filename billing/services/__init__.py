"""Writes of billing, one module per concern: prices, the usage ledger and its rollups,
spend and its cap, invoices, exports. The names other code uses are re-exported here.

Services trust their caller for authorization (the API checks `tenants.access`
first) and scope everything tenant-owned by the tenant they are given.
"""

from __future__ import annotations

from billing.services.alert_emails import budget_alert_email
from billing.services.budgets import (
    budget_alerts_collect,
    budget_create,
    budget_delete,
    budget_update,
    budgets_publish,
    budgets_reconcile,
)
from billing.services.exports import export_build, export_create, exports_expire
from billing.services.invoices import (
    invoice_finalize,
    invoice_number,
    invoices_close,
    invoices_open,
)
from billing.services.ledger import (
    RefusedUsage,
    UsageEvent,
    usage_dead_letters_record,
    usage_records_ingest,
    usage_records_write,
)
from billing.services.prices import PriceBackdated, price_create
from billing.services.spending import (
    plan_spend_cap_update,
    spend_caps_publish,
    spend_reconcile,
    tenant_spend_cap_update,
)
from billing.services.webhooks import (
    webhook_deliver,
    webhook_endpoint_create,
    webhook_endpoint_delete,
    webhook_event_emit,
    webhooks_deliver_due,
)

__all__ = [
    "PriceBackdated", "RefusedUsage", "UsageEvent", "budget_alert_email",
    "budget_alerts_collect", "budget_create",
    "budget_delete", "budget_update", "budgets_publish", "budgets_reconcile",
    "webhook_deliver", "webhook_endpoint_create", "webhook_endpoint_delete",
    "webhook_event_emit", "webhooks_deliver_due", "export_build", "export_create",
    "exports_expire", "invoice_finalize", "invoice_number", "invoices_close", "invoices_open",
    "plan_spend_cap_update", "price_create", "spend_caps_publish",
    "spend_reconcile", "tenant_spend_cap_update", "usage_dead_letters_record",
    "usage_records_ingest", "usage_records_write",
]
