"""What happened to each inference request, and each tenant's logging policy.

Bodies (prompt and completion) are stored only when the tenant's policy keeps
them, and always redacted first (requestlogs/services.py); everything else is
metadata that holds no request text.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.models import Tenant, TenantOwnedQuerySet


class RequestLog(models.Model):
    # The id the client saw (the completion's `id`, `x-request-id`: `chatcmpl-…`, `cmpl-…`),
    # which is also the engine's request id and the ledger's; unique, so a request is
    # logged once however often its write is retried.
    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="request_logs")
    api_key_id = models.BigIntegerField(null=True, blank=True)
    api_key_prefix = models.CharField(max_length=16, blank=True, default="")
    endpoint = models.CharField(max_length=16)  # "chat" | "completion"
    transport = models.CharField(max_length=16)  # "http" | "websocket" | "batch"
    model = models.CharField(max_length=200)  # the base model, or what the client asked for
    adapter = models.CharField(max_length=200, blank=True, default="")
    stream = models.BooleanField(default=False)
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True, default="")
    finish_reason = models.CharField(max_length=32, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    # Measured by the engine (null when the request never reached one, or made no token).
    queue_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    # Measured by the platform: from authentication to the end of the response.
    latency_ms = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)  # when the request arrived
    # NOTE: redacted before they are written; null unless the tenant keeps bodies.
    prompt = models.JSONField(null=True, blank=True)
    # NOTE: null (not kept) differs from "" (kept, and the model wrote nothing).
    completion = models.TextField(null=True, blank=True)  # noqa: DJ001

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"], name="requestlog_tenant_time"),
                   models.Index(fields=["created_at"], name="requestlog_time")]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"


class LogPolicy(models.Model):
    """A tenant's choices; a tenant without a row has the defaults (no bodies)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="log_policy")
    log_bodies = models.BooleanField(default=False)
    retention_days = models.PositiveIntegerField()
    updated_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    def __str__(self) -> str:
        return f"log policy of {self.tenant}"


class RedactionPattern(models.Model):
    """A tenant's own pattern, accepted by redaction.custom; replaced by ``[<name>]``."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="redaction_patterns")
    name = models.CharField(max_length=32)
    pattern = models.CharField(max_length=256)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"],
                                               name="one_redaction_pattern_per_name")]

    def __str__(self) -> str:
        return f"[{self.name}] of {self.tenant}"


class StoredResponse(models.Model):
    """A Responses API response kept for the tenant (``store``: retrieved, listed, continued
    by ``previous_response_id``, deleted); its text redacted before it is written, kept
    until ``expires_at`` (the tenant's plan sets how long)."""

    response_id = models.CharField(max_length=64, unique=True)  # resp_…, as the client saw it
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="stored_responses")
    api_key_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    status = models.CharField(max_length=16)
    # Responses before it in its conversation (0: it starts one); bounded (stored_responses).
    depth = models.PositiveIntegerField(default=0)
    input_items = models.JSONField(default=list)  # this turn's input, as it was read
    response = models.JSONField()  # the response object, as GET /v1/responses/{id} answers
    # The conversation through this response's output, as chat messages: what a request
    # continuing it with previous_response_id is prefixed with.
    history = models.JSONField(default=list)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["expires_at"], name="storedresponse_expiry")]

    def __str__(self) -> str:
        return f"{self.response_id} {self.status}"
