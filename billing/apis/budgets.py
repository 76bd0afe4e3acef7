"""A tenant's budgets (and where each stands), their alerts, and its webhook endpoints with
their delivery log (docs/billing.md#budgets)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from billing import selectors, services
from billing.apis.common import MONEY
from billing.models import Budget
from tenants.apis.base import StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.facade import allowed, authorize

AMOUNT = {"max_digits": 24, "decimal_places": 6, "allow_null": True}


@extend_schema_serializer(component_name="Budget")
class BudgetSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.CharField(default="budget")
    scope = serializers.ChoiceField(choices=Budget.Scope.choices)
    api_key_id = serializers.IntegerField(allow_null=True)
    api_key_prefix = serializers.CharField(allow_null=True)
    end_user = serializers.CharField(allow_null=True, help_text="user budgets: the end user; "
                                     "null: each end user without a budget of their own")
    window = serializers.ChoiceField(choices=Budget.Window.choices)
    spend_limit = serializers.DecimalField(allow_null=True, **MONEY)
    token_limit = serializers.IntegerField(allow_null=True)
    window_label = serializers.CharField(help_text="the open window: YYYY-MM-DD or YYYY-MM")
    resets_at = serializers.DateTimeField()
    spent = serializers.DecimalField(**AMOUNT, help_text="settled this window (null: one "
                                     "window per end user)")
    reserved = serializers.DecimalField(**AMOUNT, help_text="held by requests in flight")
    tokens = serializers.IntegerField(allow_null=True)
    reserved_tokens = serializers.IntegerField(allow_null=True)


def _budget(view: selectors.BudgetView) -> dict[str, Any]:
    b = view.budget
    return {"id": b.pk, "object": "budget", "scope": b.scope, "api_key_id": b.api_key_id,
            "api_key_prefix": b.api_key.prefix if b.api_key_id else None,
            "end_user": (b.end_user or None) if b.scope == Budget.Scope.USER else None,
            "window": b.window, "spend_limit": b.spend_limit, "token_limit": b.token_limit,
            "window_label": view.window_label, "resets_at": view.resets_at,
            "spent": view.spent, "reserved": view.reserved, "tokens": view.tokens,
            "reserved_tokens": view.reserved_tokens}


def budget_states(tenant_access) -> list[dict[str, Any]] | None:
    """The tenant's budgets where they stand, for a caller who may read them (else None)."""
    if not allowed(tenant_access, "budget.read"):
        return None
    views = selectors.budget_views(selectors.budget_list(tenant=tenant_access.tenant))
    return BudgetSerializer([_budget(v) for v in views], many=True).data


def _one(tenant, budget_id: int) -> dict[str, Any]:
    budget = selectors.budget_get(tenant=tenant, budget_id=budget_id)
    return _budget(selectors.budget_views([budget])[0])


class BudgetListApi(TenantApi):
    OutputSerializer = list_of(BudgetSerializer, "BudgetList")

    @extend_schema(tags=["billing"], summary="The tenant's budgets and where each stands",
                   responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "budget.read")
        return Response(listing(budget_states(tenant_access)))


class _Limits(StrictSerializer):
    spend_limit = serializers.DecimalField(allow_null=True, required=False, **MONEY,
                                           help_text="in the billing currency, per window")
    token_limit = serializers.IntegerField(allow_null=True, required=False, min_value=0,
                                           help_text="prompt + completion tokens per window")


class BudgetCreateApi(TenantApi):
    class InputSerializer(_Limits):
        scope = serializers.ChoiceField(choices=Budget.Scope.choices)
        window = serializers.ChoiceField(choices=Budget.Window.choices)
        api_key_id = serializers.IntegerField(required=False, min_value=1,
                                              help_text="key budgets: which key")
        end_user = serializers.CharField(required=False, allow_blank=True, max_length=256,
                                         help_text="user budgets: the request's `user`; "
                                         "absent: each end user")

    @extend_schema(tags=["billing"], summary="Add a budget (tenant, key or end user; per day "
                   "or month)", request=InputSerializer, responses={201: BudgetSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "budget.manage")
        data = validated(BudgetCreateApi.InputSerializer, request.data)
        budget = services.budget_create(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                        **data)
        return Response(BudgetSerializer(_one(tenant_access.tenant, budget.pk)).data,
                        status=status.HTTP_201_CREATED)


class BudgetDetailApi(TenantApi):
    @extend_schema(tags=["billing"], summary="One budget and where it stands",
                   responses=BudgetSerializer)
    def get(self, request, slug: str, budget_id: int) -> Response:
        tenant_access = self.access(slug)
        found = _one(tenant_access.tenant, budget_id)  # another tenant's id: 404 first
        authorize(tenant_access, "budget.read")
        return Response(BudgetSerializer(found).data)

    @extend_schema(tags=["billing"], summary="Change a budget's limits (null removes one)",
                   request=_Limits, responses=BudgetSerializer)
    def patch(self, request, slug: str, budget_id: int) -> Response:
        tenant_access = self.access(slug)
        selectors.budget_get(tenant=tenant_access.tenant, budget_id=budget_id)
        authorize(tenant_access, "budget.manage")
        data = validated(_Limits, request.data)
        services.budget_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                               budget_id=budget_id, **data)
        return Response(BudgetSerializer(_one(tenant_access.tenant, budget_id)).data)

    @extend_schema(tags=["billing"], summary="Remove a budget", responses={204: None})
    def delete(self, request, slug: str, budget_id: int) -> Response:
        tenant_access = self.access(slug)
        selectors.budget_get(tenant=tenant_access.tenant, budget_id=budget_id)
        authorize(tenant_access, "budget.manage")
        services.budget_delete(tenant=tenant_access.tenant, actor=tenant_access.actor,
                               budget_id=budget_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema_serializer(component_name="WebhookEndpoint")
class WebhookSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.CharField(default="webhook_endpoint")
    url = serializers.URLField()
    description = serializers.CharField()
    active = serializers.BooleanField()
    created_at = serializers.DateTimeField()


class WebhookCreatedSerializer(WebhookSerializer):
    secret = serializers.CharField(help_text="shown this once: verify signatures with it")


class WebhookListApi(TenantApi):
    OutputSerializer = list_of(WebhookSerializer, "WebhookEndpointList")

    @extend_schema(tags=["billing"], summary="The tenant's webhook endpoints",
                   responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "webhook.read")
        endpoints = selectors.webhook_endpoint_list(tenant=tenant_access.tenant)
        return Response(listing(WebhookSerializer(endpoints, many=True).data))


class WebhookCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        url = serializers.CharField(max_length=2000)
        description = serializers.CharField(required=False, allow_blank=True, max_length=200)

    @extend_schema(tags=["billing"], summary="Add a webhook endpoint; its signing secret is "
                   "shown once", request=InputSerializer,
                   responses={201: WebhookCreatedSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "webhook.manage")
        data = validated(WebhookCreateApi.InputSerializer, request.data)
        endpoint, secret = services.webhook_endpoint_create(
            tenant=tenant_access.tenant, actor=tenant_access.actor, url=data["url"],
            description=data.get("description", ""))
        body = {**WebhookSerializer(endpoint).data, "secret": secret}
        return Response(body, status=status.HTTP_201_CREATED)


class WebhookDetailApi(TenantApi):
    @extend_schema(tags=["billing"], summary="Remove a webhook endpoint", responses={204: None})
    def delete(self, request, slug: str, endpoint_id: int) -> Response:
        tenant_access = self.access(slug)
        selectors.webhook_endpoint_get(tenant=tenant_access.tenant, endpoint_id=endpoint_id)
        authorize(tenant_access, "webhook.manage")
        services.webhook_endpoint_delete(tenant=tenant_access.tenant,
                                         actor=tenant_access.actor, endpoint_id=endpoint_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema_serializer(component_name="WebhookDelivery")
class DeliverySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.CharField(default="webhook_delivery")
    endpoint_id = serializers.IntegerField()
    event_id = serializers.CharField()
    event_type = serializers.CharField()
    status = serializers.CharField()
    attempts = serializers.IntegerField()
    last_status_code = serializers.IntegerField(allow_null=True)
    last_error = serializers.CharField()
    next_attempt_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()
    delivered_at = serializers.DateTimeField(allow_null=True)


class WebhookDeliveryListApi(TenantApi):
    OutputSerializer = list_of(DeliverySerializer, "WebhookDeliveryList")

    @extend_schema(tags=["billing"], summary="An endpoint's deliveries, newest first",
                   responses=OutputSerializer)
    def get(self, request, slug: str, endpoint_id: int) -> Response:
        tenant_access = self.access(slug)
        selectors.webhook_endpoint_get(tenant=tenant_access.tenant, endpoint_id=endpoint_id)
        authorize(tenant_access, "webhook.read")
        deliveries = selectors.webhook_delivery_list(tenant=tenant_access.tenant,
                                                     endpoint_id=endpoint_id)[:101]
        rows = list(deliveries)
        return Response(listing(DeliverySerializer(rows[:100], many=True).data,
                                has_more=len(rows) > 100))
