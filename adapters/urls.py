"""Adapter management URLs, mounted under /api/v1/ (docs/adapters.md)."""

from __future__ import annotations

from django.urls import path

from adapters import apis
from tenants.apis.base import endpoint

app_name = "adapters"

TENANT = "tenants/<slug:slug>"

urlpatterns = [
    path(f"{TENANT}/adapters", endpoint(apis.AdapterListApi, apis.AdapterCreateApi),
         name="adapters"),
    path(f"{TENANT}/adapters/<int:adapter_id>",
         endpoint(apis.AdapterDetailApi, apis.AdapterDeleteApi), name="adapter"),
    path(f"{TENANT}/adapters/<int:adapter_id>/visibility", endpoint(apis.AdapterVisibilityApi),
         name="adapter-visibility"),
    path(f"{TENANT}/adapter-uploads", endpoint(apis.UploadCreateApi), name="uploads"),
    path(f"{TENANT}/adapter-uploads/<uuid:upload_id>",
         endpoint(apis.UploadDetailApi, apis.UploadChunkApi, apis.UploadDeleteApi),
         name="upload"),
    path(f"{TENANT}/adapter-uploads/<uuid:upload_id>/complete",
         endpoint(apis.UploadCompleteApi), name="upload-complete"),
]
