"""Output shapes shared by several management API operations."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from tenants.apis.base import StrictSerializer
from tenants.models import (
    MAX_FAIR_WEIGHT,
    MAX_RESIDENT_ADAPTERS,
    QUOTA_FIELDS,
    QUOTA_MAX,
    RESUME_GRACE_MAX_S,
    SERVICE_TIERS,
    STORAGE_MAX,
    ApiKey,
    Invitation,
    Role,
    Scope,
)
from tenants.services.quotas import RETENTION_MAX_DAYS


def _limit_field(name: str, **kwargs: Any) -> serializers.IntegerField:
    return serializers.IntegerField(min_value=1, max_value=QUOTA_MAX[name], allow_null=True,
                                    **kwargs)


def storage_field(name: str, **kwargs: Any) -> serializers.IntegerField:
    """A plan's limit on what its tenants keep (null: the server's default)."""
    return serializers.IntegerField(min_value=1, max_value=STORAGE_MAX[name], allow_null=True,
                                    help_text={"max_files": "files a tenant may hold",
                                               "max_file_bytes": "bytes of files it may hold",
                                               "max_active_batches": "batches it may have "
                                               "running or waiting"}[name]
                                    + " (null: the server's default)", **kwargs)


def retention_field(**kwargs: Any) -> serializers.IntegerField:
    """How long a plan's tenants' stored Responses API responses are kept."""
    return serializers.IntegerField(min_value=0, max_value=RETENTION_MAX_DAYS, allow_null=True,
                                    help_text="days a stored Responses API response is kept "
                                    "(null: the server's default; 0: none stored)", **kwargs)


def service_tiers_field(**kwargs: Any) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.ChoiceField(choices=SERVICE_TIERS), min_length=1,
        help_text="the service tiers its tenants may ask for (a request's service_tier; "
        "docs/tiers.md)", **kwargs)


def default_service_tier_field(**kwargs: Any) -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=SERVICE_TIERS, help_text="the tier of a request that asks for none, or for "
        "'auto': one of service_tiers", **kwargs)


def fair_weight_field(**kwargs: Any) -> serializers.FloatField:
    return serializers.FloatField(
        min_value=0.001, max_value=MAX_FAIR_WEIGHT, help_text="its tenants' weight in "
        "token-fair scheduling: twice the weight, twice the tokens when tenants compete",
        **kwargs)


def extended_prompt_cache_field(**kwargs: Any) -> serializers.BooleanField:
    return serializers.BooleanField(
        help_text="its tenants may ask prompt_cache_retention '24h': their prompts' cached "
                  "KV blocks kept ahead of others in the engines' host tier for a day of "
                  "disuse", **kwargs)


def resident_adapters_field(**kwargs: Any) -> serializers.IntegerField:
    return serializers.IntegerField(
        min_value=1, max_value=MAX_RESIDENT_ADAPTERS, allow_null=True,
        help_text="how many of a tenant's LoRA adapters an engine holds at once, in its "
                  "device slots and in its host memory each (null: no limit but the tenant's "
                  "fair share)", **kwargs)


def resume_grace_field(**kwargs: Any) -> serializers.IntegerField:
    """How long a plan's tenants' resumable streams outlive their clients, at most."""
    return serializers.IntegerField(min_value=0, max_value=RESUME_GRACE_MAX_S, allow_null=True,
                                    help_text="seconds a resumable stream keeps generating "
                                    "after its client disconnects, at most; a request's own "
                                    "grace is capped by it (null: the server's default; 0: "
                                    "resumable streams are off)", **kwargs)


@extend_schema_serializer(component_name="Limits")
class LimitsSerializer(serializers.Serializer):
    """Limits of one level; null is "no limit here" (or "inherit", for overrides)."""

    requests_per_minute = _limit_field("requests_per_minute")
    tokens_per_minute = _limit_field("tokens_per_minute")
    max_concurrent_requests = _limit_field("max_concurrent_requests")
    max_prompt_tokens = _limit_field("max_prompt_tokens")
    max_output_tokens = _limit_field("max_output_tokens")
    monthly_token_cap = _limit_field("monthly_token_cap")


@extend_schema_serializer(component_name="LimitsChange")
class LimitsChangeSerializer(StrictSerializer):
    """Some limits to set (a positive integer) or clear (null); others stay as they are."""

    requests_per_minute = _limit_field("requests_per_minute", required=False)
    tokens_per_minute = _limit_field("tokens_per_minute", required=False)
    max_concurrent_requests = _limit_field("max_concurrent_requests", required=False)
    max_prompt_tokens = _limit_field("max_prompt_tokens", required=False)
    max_output_tokens = _limit_field("max_output_tokens", required=False)
    monthly_token_cap = _limit_field("monthly_token_cap", required=False)


def limits_of(source: Any) -> dict[str, int | None]:
    return {f: getattr(source, f, None) if source is not None else None for f in QUOTA_FIELDS}


def key_status(key: ApiKey) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= timezone.now():
        return "expired"
    return "rotating" if key.replaced_by_id else "active"


@extend_schema_serializer(component_name="ApiKey")
class ApiKeySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    name = serializers.CharField()
    prefix = serializers.CharField(help_text="the key's first characters, to tell keys apart")
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices))
    status = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    created_by = serializers.SerializerMethodField()
    expires_at = serializers.DateTimeField(allow_null=True)
    last_used_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    replaced_by = serializers.IntegerField(source="replaced_by_id", allow_null=True)

    def get_object(self, key: ApiKey) -> str:
        return "api_key"

    @extend_schema_field(serializers.ChoiceField(
        choices=["active", "rotating", "expired", "revoked"]))
    def get_status(self, key: ApiKey) -> str:
        return key_status(key)

    @extend_schema_field(serializers.EmailField(allow_null=True))
    def get_created_by(self, key: ApiKey) -> str | None:
        return key.created_by.email if key.created_by_id and key.created_by else None


@extend_schema_serializer(component_name="NewApiKey")
class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="the secret; shown this once and never again")


@extend_schema_serializer(component_name="Member")
class MembershipSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    email = serializers.EmailField(source="user.email")
    name = serializers.SerializerMethodField()
    role = serializers.ChoiceField(choices=Role.choices)
    created_at = serializers.DateTimeField()

    def get_object(self, membership: Any) -> str:
        return "member"

    def get_name(self, membership: Any) -> str:
        return membership.user.get_full_name()


def invitation_status(invitation: Invitation) -> str:
    if invitation.accepted_at is not None:
        return "accepted"
    if invitation.revoked_at is not None:
        return "revoked"
    return "expired" if invitation.expires_at <= timezone.now() else "pending"


@extend_schema_serializer(component_name="Invitation")
class InvitationSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    email = serializers.EmailField()
    role = serializers.ChoiceField(choices=Role.choices)
    status = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    accepted_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)

    def get_object(self, invitation: Invitation) -> str:
        return "invitation"

    @extend_schema_field(serializers.ChoiceField(
        choices=["pending", "accepted", "revoked", "expired"]))
    def get_status(self, invitation: Invitation) -> str:
        return invitation_status(invitation)


@extend_schema_serializer(component_name="Tenant")
class TenantSerializer(serializers.Serializer):
    slug = serializers.SlugField()
    object = serializers.SerializerMethodField()
    name = serializers.CharField()
    plan = serializers.SlugField(source="plan.slug")
    priority = serializers.IntegerField(source="plan.priority")
    created_at = serializers.DateTimeField()

    def get_object(self, tenant: Any) -> str:
        return "tenant"


@extend_schema_serializer(component_name="Plan")
class PlanSerializer(LimitsSerializer):
    slug = serializers.SlugField()
    name = serializers.CharField()
    priority = serializers.IntegerField(help_text="scheduling class; lower runs first")
    requests_per_minute = serializers.IntegerField(min_value=1)
    tokens_per_minute = serializers.IntegerField(min_value=1)
    max_concurrent_requests = serializers.IntegerField(min_value=1)
    max_files = storage_field("max_files")
    max_file_bytes = storage_field("max_file_bytes")
    max_active_batches = storage_field("max_active_batches")
    response_retention_days = retention_field()
    resume_grace_s = resume_grace_field()
    service_tiers = service_tiers_field()
    default_service_tier = default_service_tier_field()
    fair_weight = fair_weight_field()
    extended_prompt_cache = extended_prompt_cache_field()
    max_resident_adapters = resident_adapters_field()


@extend_schema_serializer(component_name="AuditEvent")
class AuditEventSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    actor = serializers.CharField(help_text='"user:<email>", "key:<prefix>" or "system"')
    action = serializers.CharField()
    target_type = serializers.CharField()
    target_id = serializers.CharField()
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)

    def get_object(self, event: Any) -> str:
        return "audit_event"


def list_of(item: type[serializers.Serializer], name: str) -> type[serializers.Serializer]:
    """The {"object": "list", "data": [...], "has_more"} envelope around `item`."""
    envelope = type(f"{name}Serializer", (serializers.Serializer,), {
        "object": serializers.CharField(default="list"),
        "data": item(many=True),
        "has_more": serializers.BooleanField(),
    })
    return extend_schema_serializer(component_name=name)(envelope)
