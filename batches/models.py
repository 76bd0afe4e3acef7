from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.models import Tenant, TenantOwnedQuerySet


class FileQuerySet(TenantOwnedQuerySet):
    def live(self) -> FileQuerySet:
        """The files not past their expiry (an expired file reads as unknown at once, before
        the beat deletes it)."""
        return self.filter(models.Q(expires_at__isnull=True)
                           | models.Q(expires_at__gt=timezone.now()))


class File(models.Model):
    """A file a tenant uploaded (``purpose`` batch), or one Atrium wrote for it (a batch's
    output and errors: ``batch_output``). Its bytes live in the ``atrium-files`` storage.
    Past ``expires_at`` it reads as unknown, and the beat deletes it (files_expire)."""

    id = models.CharField(max_length=40, primary_key=True)  # file-<hex>
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    purpose = models.CharField(max_length=32)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.IntegerField(default=0)
    # A batch input file's first line calling each endpoint ({url: line number}), recorded
    # when it was checked, so a batch made of it knows its lines' endpoints without
    # reading it. Null: uploaded before this was recorded (its batch checks at expansion).
    endpoints = models.JSONField(null=True, blank=True)
    storage_name = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = FileQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"]),
                   models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return self.id


class Batch(models.Model):
    """A batch of requests from one input file, as OpenAI's Batch API describes it."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(max_length=40, primary_key=True)  # batch_<hex>
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    api_key_id = models.BigIntegerField()  # whose quotas and budgets its lines run under
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8, default="24h")
    input_file = models.ForeignKey(File, on_delete=models.SET_NULL, null=True,
                                   related_name="+")
    input_file_ref = models.CharField(max_length=40)  # kept when the file is deleted
    output_file = models.ForeignKey(File, on_delete=models.SET_NULL, null=True, blank=True,
                                    related_name="+")
    error_file = models.ForeignKey(File, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")
    status = models.CharField(max_length=16, choices=Status.choices,
                              default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.IntegerField(default=0)
    completed = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # A runner holds the batch while this is in the future; a dead runner's lapses and the
    # beat hands the batch to another, which resumes it where the lines stand.
    runner_lease_until = models.DateTimeField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"]),
                   models.Index(fields=["status", "runner_lease_until"])]

    def __str__(self) -> str:
        return self.id


class BatchLine(models.Model):
    """One request of a batch and how it ended."""

    class Status(models.TextChoices):
        PENDING = "pending"
        COMPLETED = "completed"
        FAILED = "failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.IntegerField()
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.IntegerField(default=0)
    status_code = models.IntegerField(null=True, blank=True)
    response = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["batch", "index"],
                                               name="one_line_per_batch_index")]
        indexes = [models.Index(fields=["batch", "status"])]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index}"
