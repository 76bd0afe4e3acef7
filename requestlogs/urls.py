"""Request-log URLs, mounted under /api/v1/ (docs/request-logs.md)."""

from __future__ import annotations

from django.urls import path

from requestlogs import apis
from tenants.apis.base import endpoint

app_name = "requestlogs"

TENANT = "tenants/<slug:slug>"

urlpatterns = [
    path(f"{TENANT}/request-logs", endpoint(apis.RequestLogListApi), name="request-logs"),
    path(f"{TENANT}/request-logs/<str:request_id>", endpoint(apis.RequestLogDetailApi),
         name="request-log"),
    path(f"{TENANT}/log-settings",
         endpoint(apis.LogSettingsDetailApi, apis.LogSettingsUpdateApi), name="log-settings"),
    path(f"{TENANT}/redaction-patterns",
         endpoint(apis.RedactionPatternListApi, apis.RedactionPatternCreateApi),
         name="redaction-patterns"),
    path(f"{TENANT}/redaction-patterns/<int:pattern_id>",
         endpoint(apis.RedactionPatternDeleteApi), name="redaction-pattern"),
    path("request-logs", endpoint(apis.OperatorRequestLogListApi), name="operator-request-logs"),
]
