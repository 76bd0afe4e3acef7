"""The tenant console's batches page: each batch of the Batch API, its state and counts,
and its input, output and error files to download."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from batches import selectors as batch_selectors
from batches import services as batch_services
from core.downloads import FileDownload
from tenants.access import TenantAccess
from webui.views.base import page, tenant_view


@tenant_view("batch.read")
def batches(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    tenant_id = tenant_access.tenant.pk
    return page(request, "webui/tenant/batches.html", {
        "batches": list(batch_selectors.batch_list(tenant_id=tenant_id)[:100]),
        "files": list(batch_selectors.file_list(tenant_id=tenant_id)[:100]),
    }, tenant_access=tenant_access, section="batches")


@tenant_view("batch.read")
def file_download(request: HttpRequest, tenant_access: TenantAccess,
                  file_id: str) -> HttpResponse:
    found = batch_services.file_get(tenant_id=tenant_access.tenant.pk, file_id=file_id)
    return FileDownload(batch_services.file_content(found), as_attachment=True,
                        filename=f"{found.id}.jsonl", content_type="application/jsonl")
