"""LoRA adapters: owned by a tenant, served over one base model, named by content hash."""

from __future__ import annotations

import uuid

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


class AdapterUpload(models.Model):
    """Bytes on their way in: one archive in chunks, or an adapter's two files."""

    class Kind(models.TextChoices):
        ARCHIVE = "archive"  # a .zip or .tar.gz, possibly sent in resumable chunks
        FILES = "files"  # adapter_config.json + adapter_model.safetensors

    class Status(models.TextChoices):
        OPEN = "open"  # receiving chunks
        COMPLETE = "complete"  # handed to validation as an Adapter version

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapter_uploads")
    name = models.CharField(max_length=64)
    base_model = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.ARCHIVE)
    filename = models.CharField(max_length=255, blank=True)
    size = models.PositiveBigIntegerField()  # declared total bytes
    received = models.PositiveBigIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN)
    created_by = models.CharField(max_length=200, blank=True)  # the actor's label
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()

    objects = TenantOwnedQuerySet.as_manager()

    def __str__(self) -> str:
        return f"upload {self.pk} of {self.name}"


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
    # The upload it was made from, until validation has read it.
    upload = models.ForeignKey(AdapterUpload, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="+")
    created_by = models.CharField(max_length=200, blank=True)  # the actor's label
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
