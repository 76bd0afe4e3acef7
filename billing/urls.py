"""Billing's URLs, mounted under /api/v1/ (docs/billing.md)."""

from __future__ import annotations

from django.urls import path

from billing.apis import budgets, exports, invoices, prices, spend, usage
from tenants.apis.base import endpoint

app_name = "billing"

TENANT = "tenants/<slug:slug>"

urlpatterns = [
    path("prices", endpoint(prices.PriceListApi, prices.PriceCreateApi), name="prices"),
    path("plans/<slug:plan_slug>/spend-cap", endpoint(spend.PlanSpendCapUpdateApi),
         name="plan-spend-cap"),
    path("usage-dead-letters", endpoint(usage.UsageDeadLetterListApi),
         name="usage-dead-letters"),
    path(f"{TENANT}/usage", endpoint(usage.UsageListApi), name="usage"),
    path(f"{TENANT}/usage/requests/<str:request_id>", endpoint(usage.UsageRecordDetailApi),
         name="usage-record"),
    path(f"{TENANT}/spend", endpoint(spend.SpendDetailApi), name="spend"),
    path(f"{TENANT}/spend-cap", endpoint(spend.SpendCapUpdateApi), name="spend-cap"),
    path(f"{TENANT}/budgets", endpoint(budgets.BudgetListApi, budgets.BudgetCreateApi),
         name="budgets"),
    path(f"{TENANT}/budgets/<int:budget_id>", endpoint(budgets.BudgetDetailApi),
         name="budget"),
    path(f"{TENANT}/webhooks", endpoint(budgets.WebhookListApi, budgets.WebhookCreateApi),
         name="webhooks"),
    path(f"{TENANT}/webhooks/<int:endpoint_id>", endpoint(budgets.WebhookDetailApi),
         name="webhook"),
    path(f"{TENANT}/webhooks/<int:endpoint_id>/deliveries",
         endpoint(budgets.WebhookDeliveryListApi), name="webhook-deliveries"),
    path(f"{TENANT}/invoices", endpoint(invoices.InvoiceListApi), name="invoices"),
    path(f"{TENANT}/invoices/<int:invoice_id>", endpoint(invoices.InvoiceDetailApi),
         name="invoice"),
    path(f"{TENANT}/exports", endpoint(exports.ExportListApi, exports.ExportCreateApi),
         name="exports"),
    path(f"{TENANT}/exports/<int:export_id>", endpoint(exports.ExportDetailApi), name="export"),
    path(f"{TENANT}/exports/<int:export_id>/content", endpoint(exports.ExportContentApi),
         name="export-content"),
]
