"""The caller, plans (operators), tenants, and tenant-level quotas."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from tenants import access, selectors, services
from tenants.apis.base import Api, StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import (
    LimitsChangeSerializer,
    LimitsSerializer,
    PlanSerializer,
    TenantSerializer,
    default_service_tier_field,
    extended_prompt_cache_field,
    fair_weight_field,
    limits_of,
    list_of,
    resident_adapters_field,
    resume_grace_field,
    retention_field,
    service_tiers_field,
    storage_field,
)
from tenants.models import QUOTA_FIELDS, Membership, Role


class MeApi(Api):
    class OutputSerializer(serializers.Serializer):
        object = serializers.ChoiceField(choices=["user", "api_key"])
        email = serializers.EmailField(required=False)
        is_staff = serializers.BooleanField()
        memberships = serializers.ListField(child=serializers.DictField(), required=False)
        tenant = serializers.SlugField(required=False)
        prefix = serializers.CharField(required=False)
        scopes = serializers.ListField(child=serializers.CharField(), required=False)

    @extend_schema(tags=["me"], summary="Who is calling", responses=OutputSerializer)
    def get(self, request) -> Response:
        actor = self.actor()
        if actor.principal is not None:
            p = actor.principal
            return Response({"object": "api_key", "is_staff": False, "tenant": p.tenant_slug,
                             "prefix": p.api_key_prefix, "scopes": list(p.scopes)})
        memberships = (Membership.objects.filter(user_id=actor.user_id)
                       .select_related("tenant").order_by("tenant__slug"))
        return Response({"object": "user", "email": actor.user_email,
                         "is_staff": actor.is_staff,
                         "memberships": [{"tenant": m.tenant.slug, "role": m.role}
                                         for m in memberships]})


# --- plans (operators) ---------------------------------------------------------------------

class PlanListApi(Api):
    OutputSerializer = list_of(PlanSerializer, "PlanList")

    @extend_schema(tags=["plans"], summary="List plans", responses=OutputSerializer)
    def get(self, request) -> Response:
        return Response(listing(PlanSerializer(selectors.plan_list(), many=True).data))


class PlanCreateApi(Api):
    class InputSerializer(StrictSerializer):
        slug = serializers.SlugField(max_length=64)
        name = serializers.CharField(max_length=200)
        priority = serializers.IntegerField(min_value=-100, max_value=100, default=5)
        requests_per_minute = serializers.IntegerField(min_value=1)
        tokens_per_minute = serializers.IntegerField(min_value=1)
        max_concurrent_requests = serializers.IntegerField(min_value=1)
        max_prompt_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        max_output_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        monthly_token_cap = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        max_files = storage_field("max_files", required=False)
        max_file_bytes = storage_field("max_file_bytes", required=False)
        max_active_batches = storage_field("max_active_batches", required=False)
        response_retention_days = retention_field(required=False)
        resume_grace_s = resume_grace_field(required=False)
        service_tiers = service_tiers_field(required=False)
        default_service_tier = default_service_tier_field(required=False)
        fair_weight = fair_weight_field(required=False)
        extended_prompt_cache = extended_prompt_cache_field(required=False)
        max_resident_adapters = resident_adapters_field(required=False)

    @extend_schema(tags=["plans"], summary="Create a plan (operators)", request=InputSerializer,
                   responses={201: PlanSerializer})
    def post(self, request) -> Response:
        actor = self.staff_actor()
        plan = services.plan_create(actor=actor, **validated(PlanCreateApi.InputSerializer,
                                                             request.data))
        return Response(PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


class PlanDetailApi(Api):
    @extend_schema(tags=["plans"], summary="One plan", responses=PlanSerializer)
    def get(self, request, plan_slug: str) -> Response:
        return Response(PlanSerializer(selectors.plan_get(slug=plan_slug)).data)


class PlanUpdateApi(Api):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200, required=False)
        priority = serializers.IntegerField(min_value=-100, max_value=100, required=False)
        requests_per_minute = serializers.IntegerField(min_value=1, required=False)
        tokens_per_minute = serializers.IntegerField(min_value=1, required=False)
        max_concurrent_requests = serializers.IntegerField(min_value=1, required=False)
        max_prompt_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        max_output_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        monthly_token_cap = serializers.IntegerField(min_value=1, required=False, allow_null=True)
        max_files = storage_field("max_files", required=False)
        max_file_bytes = storage_field("max_file_bytes", required=False)
        max_active_batches = storage_field("max_active_batches", required=False)
        response_retention_days = retention_field(required=False)
        resume_grace_s = resume_grace_field(required=False)
        service_tiers = service_tiers_field(required=False)
        default_service_tier = default_service_tier_field(required=False)
        fair_weight = fair_weight_field(required=False)
        extended_prompt_cache = extended_prompt_cache_field(required=False)
        max_resident_adapters = resident_adapters_field(required=False)

    @extend_schema(tags=["plans"], summary="Change a plan (operators); applies to its tenants "
                   "at once", request=InputSerializer, responses=PlanSerializer)
    def patch(self, request, plan_slug: str) -> Response:
        actor = self.staff_actor()
        plan = selectors.plan_get(slug=plan_slug)
        changes = validated(PlanUpdateApi.InputSerializer, request.data)
        plan = services.plan_update(actor=actor, plan=plan, changes=changes)
        return Response(PlanSerializer(plan).data)


# --- tenants -------------------------------------------------------------------------------

class TenantListApi(Api):
    OutputSerializer = list_of(TenantSerializer, "TenantList")

    @extend_schema(tags=["tenants"], summary="Tenants the caller can see",
                   responses=OutputSerializer)
    def get(self, request) -> Response:
        tenants = selectors.tenant_list_for_actor(actor=self.actor())
        return Response(listing(TenantSerializer(tenants, many=True).data))


class TenantCreateApi(Api):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200)
        slug = serializers.SlugField(max_length=64, required=False)
        plan = serializers.SlugField(required=False)
        owner_email = serializers.EmailField(required=False,
                                             help_text="an existing user, made its owner")

    @extend_schema(tags=["tenants"], summary="Create a tenant (operators)",
                   request=InputSerializer, responses={201: TenantSerializer})
    def post(self, request) -> Response:
        actor = self.staff_actor()
        data = validated(TenantCreateApi.InputSerializer, request.data)
        plan = selectors.plan_get(slug=data["plan"]) if data.get("plan") else None
        owner = (selectors.user_get_by_email(email=data["owner_email"])
                 if data.get("owner_email") else None)
        with transaction.atomic():
            tenant = services.tenant_create(name=data["name"], slug=data.get("slug"), plan=plan,
                                            actor=actor)
            if owner is not None:
                services.membership_create(tenant=tenant, user=owner, role=Role.OWNER,
                                           actor=actor)
        return Response(TenantSerializer(tenant).data, status=status.HTTP_201_CREATED)


class TenantDetailApi(TenantApi):
    @extend_schema(tags=["tenants"], summary="One tenant", responses=TenantSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "tenant.read")
        return Response(TenantSerializer(tenant_access.tenant).data)


class TenantUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200, required=False)
        plan = serializers.SlugField(required=False, help_text="operators only")

    @extend_schema(tags=["tenants"], summary="Rename a tenant, or move it to another plan "
                   "(operators)", request=InputSerializer, responses=TenantSerializer)
    def patch(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "tenant.update")
        data = validated(TenantUpdateApi.InputSerializer, request.data)
        plan = None
        if "plan" in data:
            access.authorize(tenant_access, "tenant.plan")
            plan = selectors.plan_get(slug=data["plan"])
        tenant = services.tenant_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                        name=data.get("name"), plan=plan)
        return Response(TenantSerializer(tenant).data)


class TenantQuotaDetailApi(TenantApi):
    class OutputSerializer(serializers.Serializer):
        plan = serializers.SlugField()
        priority = serializers.IntegerField()
        plan_limits = LimitsSerializer()
        overrides = LimitsSerializer(help_text="set by operators; null inherits the plan's")
        effective = LimitsSerializer()

    @extend_schema(tags=["quotas"], summary="The tenant's limits: plan, overrides, effective",
                   responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "quota.read")
        return Response(_tenant_quota(tenant_access.tenant))


def _tenant_quota(tenant) -> dict:
    plan = tenant.plan
    override = selectors.quota_override_get(tenant=tenant)
    return {"plan": plan.slug, "priority": plan.priority,
            "plan_limits": {f: getattr(plan, f) for f in QUOTA_FIELDS},
            "overrides": limits_of(override),
            "effective": limits_of(selectors.tenant_limits(tenant=tenant, override=override))}


class TenantQuotaUpdateApi(TenantApi):
    @extend_schema(tags=["quotas"], summary="Override the plan's limits for this tenant "
                   "(operators)", request=LimitsChangeSerializer,
                   responses=TenantQuotaDetailApi.OutputSerializer)
    def patch(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "quota.update")
        changes = validated(LimitsChangeSerializer, request.data)
        services.tenant_quota_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                     changes=changes)
        tenant = selectors.tenant_access_get(actor=tenant_access.actor, slug=slug).tenant
        return Response(_tenant_quota(tenant))
