"""LoRA adapters: owned by a tenant, served over one base model, named by content hash."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.models import Tenant, TenantOwnedQuerySet


class AdapterStatus(models.TextChoices):
    UPLOADED = "uploaded"
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"


class Visibility(models.TextChoices):
    PRIVATE = "private"  # its tenant only (the default)
    PUBLIC = "public"  # every tenant; only an operator sets it


class Adapter(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=64)
    version = models.PositiveIntegerField()
    base_model = models.CharField(max_length=200)  # the served model it adapts
    status = models.CharField(max_length=16, choices=AdapterStatus.choices,
                              default=AdapterStatus.UPLOADED)
    failure_reason = models.TextField(blank=True)
    visibility = models.CharField(max_length=16, choices=Visibility.choices,
                                  default=Visibility.PRIVATE)
    # sha256 of its files in the adapter store (engine/lora/store.py); set once validated.
    content_hash = models.CharField(max_length=64, blank=True)
    rank = models.PositiveIntegerField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name", "version"],
                                               name="one_adapter_version_per_tenant")]
        indexes = [models.Index(fields=["tenant", "name", "status"]),
                   models.Index(fields=["visibility", "status"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.name}@{self.version}"
