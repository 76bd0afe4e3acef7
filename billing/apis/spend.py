"""Spend this period against the monthly cap; the tenant's own cap and its plan's (operators)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response

from billing import selectors, services
from billing.apis.common import MONEY
from tenants.apis.base import Api, StrictSerializer, TenantApi, validated
from tenants.facade import authorize, plan_ref_get


@extend_schema_serializer(component_name="Spend")
class SpendSerializer(serializers.Serializer):
    object = serializers.CharField(default="spend")
    period_start = serializers.DateField()
    period_end = serializers.DateField()
    currency = serializers.CharField()
    spent = serializers.DecimalField(max_digits=24, decimal_places=6,
                                     help_text="this period's usage so far, exact")
    cap = serializers.DecimalField(allow_null=True, **MONEY)
    cap_source = serializers.ChoiceField(choices=["tenant", "plan"], allow_null=True)
    remaining = serializers.DecimalField(max_digits=24, decimal_places=6, allow_null=True)


def _spend(tenant) -> dict[str, Any]:
    summary = selectors.spend_summary(tenant=tenant)
    return {"object": "spend", "period_start": summary.period_start,
            "period_end": summary.period_end, "currency": summary.currency,
            "spent": summary.spent, "cap": summary.cap, "cap_source": summary.cap_source,
            "remaining": summary.remaining}


class SpendDetailApi(TenantApi):
    @extend_schema(tags=["billing"], summary="Spend this period against the monthly spend cap",
                   responses=SpendSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "billing.read")
        return Response(SpendSerializer(_spend(tenant_access.tenant)).data)


class SpendCapUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        monthly_limit = serializers.DecimalField(allow_null=True, required=False, **MONEY,
                                                 help_text="null: no cap for this tenant")
        inherit = serializers.BooleanField(default=False,
                                           help_text="drop the tenant's own cap: its plan's "
                                           "applies")

        def validate(self, data: dict[str, Any]) -> dict[str, Any]:
            if data["inherit"] == ("monthly_limit" in data):
                raise serializers.ValidationError(
                    {"monthly_limit": serializers.ErrorDetail(
                        "give either monthly_limit or inherit: true", code="invalid")})
            return data

    @extend_schema(tags=["billing"], summary="Set the tenant's own monthly spend cap "
                   "(operators)", request=InputSerializer, responses=SpendSerializer)
    def patch(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "spend_cap.update")
        data = validated(SpendCapUpdateApi.InputSerializer, request.data)
        services.tenant_spend_cap_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                         monthly_limit=data.get("monthly_limit"),
                                         inherit=data["inherit"])
        return Response(SpendSerializer(_spend(tenant_access.tenant)).data)


class PlanSpendCapUpdateApi(Api):
    class InputSerializer(StrictSerializer):
        monthly_limit = serializers.DecimalField(allow_null=True, **MONEY)

    class OutputSerializer(serializers.Serializer):
        plan = serializers.SlugField()
        monthly_limit = serializers.DecimalField(allow_null=True, **MONEY)

    @extend_schema(tags=["prices"], summary="Set a plan's monthly spend cap (operators); null: "
                   "none", request=InputSerializer, responses=OutputSerializer)
    def patch(self, request, plan_slug: str) -> Response:
        actor = self.staff_actor()
        plan = plan_ref_get(slug=plan_slug)
        data = validated(PlanSpendCapUpdateApi.InputSerializer, request.data)
        cap = services.plan_spend_cap_update(plan=plan, actor=actor,
                                             monthly_limit=data["monthly_limit"])
        return Response({"plan": plan.slug,
                         "monthly_limit": None if cap is None else str(cap.monthly_limit)})
