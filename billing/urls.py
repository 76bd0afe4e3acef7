"""Billing's URLs, mounted under /api/v1/ (docs/billing.md)."""

from __future__ import annotations

from django.urls import path

from billing import apis
from tenants.apis.base import endpoint

app_name = "billing"

TENANT = "tenants/<slug:slug>"

urlpatterns = [
    path("prices", endpoint(apis.PriceListApi, apis.PriceCreateApi), name="prices"),
    path("plans/<slug:plan_slug>/spend-cap", endpoint(apis.PlanSpendCapUpdateApi),
         name="plan-spend-cap"),
    path("usage-dead-letters", endpoint(apis.UsageDeadLetterListApi),
         name="usage-dead-letters"),
    path(f"{TENANT}/usage", endpoint(apis.UsageListApi), name="usage"),
    path(f"{TENANT}/usage/requests/<str:request_id>", endpoint(apis.UsageRecordDetailApi),
         name="usage-record"),
    path(f"{TENANT}/spend", endpoint(apis.SpendDetailApi), name="spend"),
    path(f"{TENANT}/spend-cap", endpoint(apis.SpendCapUpdateApi), name="spend-cap"),
    path(f"{TENANT}/invoices", endpoint(apis.InvoiceListApi), name="invoices"),
    path(f"{TENANT}/invoices/<int:invoice_id>", endpoint(apis.InvoiceDetailApi),
         name="invoice"),
    path(f"{TENANT}/exports", endpoint(apis.ExportListApi, apis.ExportCreateApi),
         name="exports"),
    path(f"{TENANT}/exports/<int:export_id>", endpoint(apis.ExportDetailApi), name="export"),
    path(f"{TENANT}/exports/<int:export_id>/content", endpoint(apis.ExportContentApi),
         name="export-content"),
]
