from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone


class Role(models.TextChoices):
    """A person's role in one tenant (docs/tenancy.md has the role × action matrix)."""

    OWNER = "owner"
    ADMIN = "admin"
    DEVELOPER = "developer"
    BILLING = "billing"
    VIEWER = "viewer"


class Scope(models.TextChoices):
    """What an API key may be used for."""

    INFERENCE = "inference"
    ADAPTERS = "adapters"
    USAGE = "usage"
    BILLING = "billing"
    ADMIN = "admin"


class TenantOwnedQuerySet(models.QuerySet):
    def for_tenant(self, tenant: Tenant) -> TenantOwnedQuerySet:
        return self.for_tenant_id(None if tenant is None else tenant.pk)

    def for_tenant_id(self, tenant_id: int | None) -> TenantOwnedQuerySet:
        """For apps that know the tenant by its id (the Batch API's services)."""
        # NOTE: fails closed: no tenant is an error, never "every tenant".
        if tenant_id is None:
            raise ValueError("a saved tenant is required")
        return self.filter(tenant_id=tenant_id)


# The longest a plan lets a resumable stream outlive its client (Plan.resume_grace_s).
RESUME_GRACE_MAX_S = 3600
# The service tiers a request may ask for (docs/tiers.md); a plan offers some of them.
SERVICE_TIERS = ("default", "flex", "priority")
MAX_FAIR_WEIGHT = 1000.0
MAX_RESIDENT_ADAPTERS = 100_000  # the most engine.protocol takes (max_resident_adapters)


def _offered_tiers() -> list[str]:
    return ["default", "flex"]


class Plan(models.Model):
    """What a tenant bought: default limits and the scheduling priority class."""

    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    # Travels with every request to the engine's scheduler; lower runs first.
    priority = models.SmallIntegerField(default=5)
    requests_per_minute = models.PositiveIntegerField()
    tokens_per_minute = models.PositiveIntegerField()
    max_concurrent_requests = models.PositiveIntegerField()
    # Null: no limit beyond the model's context window / the server's output limit.
    max_prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    max_output_tokens = models.PositiveIntegerField(null=True, blank=True)
    # Null: no monthly cap. Prompt + completion tokens per UTC calendar month.
    monthly_token_cap = models.PositiveBigIntegerField(null=True, blank=True)
    # The Files and Batch APIs (docs/batches.md). Null: the server's default
    # (ATRIUM_TENANT_MAX_FILES, ATRIUM_TENANT_MAX_FILE_BYTES, ATRIUM_TENANT_MAX_ACTIVE_BATCHES).
    max_files = models.PositiveIntegerField(null=True, blank=True)
    max_file_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    max_active_batches = models.PositiveIntegerField(null=True, blank=True)
    # Days a Responses API response is kept when stored (None: the server's default,
    # ATRIUM_RESPONSE_RETENTION_DAYS; 0: responses are not stored).
    response_retention_days = models.PositiveIntegerField(null=True, blank=True)
    # Seconds a resumable stream keeps generating after its client disconnects, at most: a
    # request's own grace is capped by it (None: the server's default, ATRIUM_RESUME_GRACE_S;
    # 0: resumable streams are off).
    resume_grace_s = models.PositiveIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(RESUME_GRACE_MAX_S)])
    # The service tiers its tenants may ask for (of SERVICE_TIERS), and the one a request
    # that asks for none ("auto") gets: one of them.
    service_tiers = models.JSONField(default=_offered_tiers)
    default_service_tier = models.CharField(max_length=16, default="default")
    # Its tenants' weight in token-fair scheduling: twice the weight, twice the tokens of
    # service when tenants compete for an engine (docs/tiers.md).
    fair_weight = models.FloatField(default=1.0)
    # Its tenants may ask for prompt_cache_retention "24h": their prompts' cached KV blocks
    # kept in the engines' host tier ahead of other blocks for a day of disuse (docs/engine.md).
    extended_prompt_cache = models.BooleanField(default=False)
    # How many of its tenants' LoRA adapters an engine holds at once, in its device slots and
    # in its host memory each (None: no limit but the tenant's fair share; docs/engine.md).
    max_resident_adapters = models.PositiveIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(MAX_RESIDENT_ADAPTERS)])
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.slug


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="tenants")
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"],
                                               name="one_membership_per_user_and_tenant")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


class Invitation(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices)
    # NOTE: the token is shown once; only its SHA-256 digest is stored.
    digest = models.CharField(max_length=64, unique=True)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                    null=True, blank=True, related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    def __str__(self) -> str:
        return f"invitation of {self.email} to {self.tenant}"


class ApiKey(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, db_index=True)
    # NOTE: the plaintext is never stored; only its SHA-256 digest.
    digest = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    expires_at = models.DateTimeField(null=True, blank=True)
    # Written at most once a minute per key, off the request path.
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Set when the key was rotated; the old key then works until its expires_at.
    replaced_by = models.OneToOneField("self", on_delete=models.SET_NULL, null=True,
                                       blank=True, related_name="replaces")
    # The first key of the rotations this key comes from (null: itself, never rotated
    # in): its budgets and key-level counters belong to that key and every replacement.
    lineage = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True,
                                related_name="+")

    objects = TenantOwnedQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def lineage_root_id(self) -> int:
        return self.lineage_id or self.pk


class QuotaOverride(models.Model):
    """Limits that replace the plan's for a tenant, or add a narrower bucket for one key.

    A null field inherits (tenant level) or adds no key-level limit (key level).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quota_overrides")
    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, null=True, blank=True,
                                   related_name="quota_override")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    max_prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    max_output_tokens = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_cap = models.PositiveBigIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant"],
                                               condition=Q(api_key__isnull=True),
                                               name="one_tenant_level_quota_override")]

    def __str__(self) -> str:
        return f"limits of {self.api_key or self.tenant}"


QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
                "max_prompt_tokens", "max_output_tokens", "monthly_token_cap")
# What the columns hold (PostgreSQL integer; bigint for the month's tokens).
QUOTA_MAX = {**dict.fromkeys(QUOTA_FIELDS, 2**31 - 1), "monthly_token_cap": 2**63 - 1}
# A plan's limits on what a tenant keeps (the Files and Batch APIs); null: the server's.
STORAGE_FIELDS = ("max_files", "max_file_bytes", "max_active_batches")
STORAGE_MAX = {"max_files": 2**31 - 1, "max_file_bytes": 2**63 - 1,
               "max_active_batches": 2**31 - 1}


class AuditEvent(models.Model):
    """Who changed what, when, from what to what. Written in the change's transaction."""

    # Null for platform-level changes (plans), which only operators read.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, null=True, blank=True,
                               related_name="audit_events")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    actor_user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    actor_key_prefix = models.CharField(max_length=16, blank=True)
    # "user:<email>", "key:<prefix>" or "system" (operator commands).
    actor = models.CharField(max_length=300)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    objects = TenantOwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action}"
