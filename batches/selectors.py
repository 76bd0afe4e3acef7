"""Reads of files and batches, always through the tenant, known by its id (another
tenant's are unknown)."""

from __future__ import annotations

from django.db.models import QuerySet

from batches.models import Batch, File


def file_list(*, tenant_id: int, purpose: str | None = None, after: str | None = None,
              order: str = "desc") -> QuerySet[File]:
    files = File.objects.for_tenant_id(tenant_id).live()
    if purpose:
        files = files.filter(purpose=purpose)
    ascending = order == "asc"
    if after:
        anchor = files.filter(pk=after).values_list("created_at", flat=True).first()
        if anchor is not None:
            files = files.filter(created_at__gt=anchor) if ascending else \
                files.filter(created_at__lt=anchor)
    return files.order_by("created_at" if ascending else "-created_at", "id")


def batch_list(*, tenant_id: int, after: str | None = None) -> QuerySet[Batch]:
    batches = Batch.objects.for_tenant_id(tenant_id)
    if after:
        anchor = batches.filter(pk=after).values_list("created_at", flat=True).first()
        if anchor is not None:
            batches = batches.filter(created_at__lt=anchor)
    return batches.order_by("-created_at", "-id")
