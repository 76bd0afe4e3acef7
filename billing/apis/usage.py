"""A tenant's usage: time buckets of tokens and cost, one request's charge; and the usage
reports the ledger refused (operators)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response

from billing import selectors
from billing.apis.budgets import BudgetSerializer, budget_states
from billing.apis.common import MAX_UNIX_S, amount, query_dict
from billing.money import to_micro
from core.errors import InvalidRequest
from tenants.apis.base import Api, StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.facade import authorize

_WIDTH_LIMITS = {"1h": (24, 168), "1d": (7, 31)}  # buckets per page: default, most


@extend_schema_serializer(component_name="UsageResult")
class UsageResultSerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.result")
    num_model_requests = serializers.IntegerField(source="requests")
    input_tokens = serializers.IntegerField(help_text="prompt tokens, cached ones included")
    input_cached_tokens = serializers.IntegerField(source="cached_tokens")
    output_tokens = serializers.IntegerField()
    amount = serializers.DictField(child=serializers.CharField(),
                                   help_text='{"value": "<decimal>", "currency": "USD"}')
    model = serializers.CharField(allow_null=True, help_text="set when grouped by model")
    adapter = serializers.CharField(allow_null=True, help_text="set when grouped by adapter")
    api_key_id = serializers.IntegerField(allow_null=True,
                                          help_text="set when grouped by api_key_id")


@extend_schema_serializer(component_name="UsageBucket")
class UsageBucketSerializer(serializers.Serializer):
    object = serializers.CharField(default="bucket")
    start_time = serializers.IntegerField()
    end_time = serializers.IntegerField()
    results = UsageResultSerializer(many=True)


class UsageListApi(TenantApi):
    class FilterSerializer(StrictSerializer):
        start_time = serializers.IntegerField(min_value=0, max_value=MAX_UNIX_S,
                                              help_text="unix seconds, inclusive")
        end_time = serializers.IntegerField(min_value=1, max_value=MAX_UNIX_S, required=False,
                                            help_text="unix seconds, exclusive")
        bucket_width = serializers.ChoiceField(choices=["1h", "1d"], default="1d")
        group_by = serializers.ListField(
            child=serializers.ChoiceField(choices=["model", "adapter", "api_key_id"]),
            required=False, max_length=3)
        models = serializers.ListField(child=serializers.CharField(max_length=200),
                                       required=False, max_length=100)
        adapters = serializers.ListField(child=serializers.CharField(max_length=200),
                                         required=False, max_length=100)
        api_key_ids = serializers.ListField(
            child=serializers.IntegerField(min_value=1, max_value=2**63 - 1), required=False,
            max_length=100)
        limit = serializers.IntegerField(min_value=1, required=False,
                                         help_text="buckets per page (1d: 7, at most 31; "
                                         "1h: 24, at most 168)")
        page = serializers.RegexField(r"^[0-9]{1,12}$", required=False,
                                      help_text="next_page of the previous page")

    class OutputSerializer(serializers.Serializer):
        object = serializers.CharField(default="page")
        data = UsageBucketSerializer(many=True)
        has_more = serializers.BooleanField()
        next_page = serializers.CharField(allow_null=True)
        budgets = BudgetSerializer(many=True, allow_null=True, help_text=(
            "where each of the tenant's budgets stands now (the open window's spend, tokens "
            "and reservations); null for a caller who may not read budgets (budget.read)"))

    @extend_schema(tags=["usage"], summary="The tenant's usage and cost in time buckets, "
                   "grouped (modelled on OpenAI's usage API)", responses=OutputSerializer,
                   parameters=[
                       OpenApiParameter("start_time", int, required=True),
                       OpenApiParameter("end_time", int),
                       OpenApiParameter("bucket_width", str, enum=["1h", "1d"]),
                       OpenApiParameter("group_by", {"type": "array", "items": {
                           "type": "string", "enum": ["model", "adapter", "api_key_id"]}}),
                       OpenApiParameter("models", {"type": "array", "items": {"type": "string"}}),
                       OpenApiParameter("adapters", {"type": "array",
                                                     "items": {"type": "string"}}),
                       OpenApiParameter("api_key_ids", {"type": "array",
                                                        "items": {"type": "integer"}}),
                       OpenApiParameter("limit", int), OpenApiParameter("page", str)])
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "usage.read")
        query = validated(UsageListApi.FilterSerializer, query_dict(
            request, lists=("group_by", "models", "adapters", "api_key_ids")))
        width = query["bucket_width"]
        step = int(selectors.WIDTHS[width].total_seconds())
        default_limit, max_limit = _WIDTH_LIMITS[width]
        limit = query.get("limit", default_limit)
        if limit > max_limit:
            raise InvalidRequest(f"'limit' is at most {max_limit} for bucket_width {width}",
                                 param="limit", code="invalid_value")
        if query.get("end_time", MAX_UNIX_S + 1) <= query["start_time"]:
            raise InvalidRequest("'end_time' must be after 'start_time'", param="end_time",
                                 code="invalid_value")
        start = query["start_time"] // step * step
        end = query.get("end_time")
        end = start + limit * step if end is None else math.ceil(end / step) * step
        page = int(query["page"]) if "page" in query else start
        if page % step or not start <= page < end:
            raise InvalidRequest("'page' is not a page of this query", param="page",
                                 code="invalid_value")
        page_end = min(end, page + limit * step)
        buckets = selectors.usage_buckets(tenant=tenant_access.tenant, query=selectors.UsageQuery(
            start=datetime.fromtimestamp(page, UTC), end=datetime.fromtimestamp(page_end, UTC),
            width=width, group_by=tuple(query.get("group_by", ())),
            models=tuple(query.get("models", ())), adapters=tuple(query.get("adapters", ())),
            api_key_ids=tuple(query.get("api_key_ids", ()))))
        currency = settings.ATRIUM_BILLING_CURRENCY
        group = set(query.get("group_by", ()))
        data = [{
            "object": "bucket", "start_time": int(b.start.timestamp()),
            "end_time": int(b.end.timestamp()),
            "results": [{
                "object": "usage.result", "num_model_requests": r.requests,
                "input_tokens": r.input_tokens, "input_cached_tokens": r.cached_tokens,
                "output_tokens": r.output_tokens, "amount": amount(r.cost, currency),
                "model": r.model if "model" in group else None,
                "adapter": r.adapter if "adapter" in group else None,
                "api_key_id": r.api_key_id if "api_key_id" in group else None,
            } for r in b.results],
        } for b in buckets]
        has_more = page_end < end
        return Response({"object": "page", "data": data, "has_more": has_more,
                         "next_page": str(page_end) if has_more else None,
                         "budgets": budget_states(tenant_access)})


@extend_schema_serializer(component_name="UsageRecord")
class UsageRecordSerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.record")
    request_id = serializers.CharField(help_text="the completion's id, as the client got it")
    occurred_at = serializers.IntegerField(help_text="unix seconds: when the request ended")
    billing_period = serializers.DateField(help_text="the month whose invoice bills it")
    model = serializers.CharField()
    adapter = serializers.CharField(help_text="empty: the base model")
    api_key_id = serializers.IntegerField(allow_null=True)
    api_key_prefix = serializers.CharField()
    finish_reason = serializers.CharField()
    input_tokens = serializers.IntegerField(help_text="prompt tokens, cached ones included")
    input_cached_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    price_class = serializers.CharField(help_text="interactive; batch (a Batch API line, "
                                        "whose request_id is <batch id>-<line index>); "
                                        "embedding (/v1/embeddings); or flex or priority (the "
                                        "service tier the request asked for)")
    amount = serializers.DictField(child=serializers.CharField(),
                                   help_text='{"value": "<decimal>", "currency": "USD"}')


class UsageRecordDetailApi(TenantApi):
    @extend_schema(tags=["usage"], summary="One request's usage and charge, by the id of "
                   "its response", responses=UsageRecordSerializer)
    def get(self, request, slug: str, request_id: str) -> Response:
        tenant_access = self.access(slug)
        record = selectors.usage_record_get(tenant=tenant_access.tenant, request_id=request_id)
        authorize(tenant_access, "usage.read")
        return Response({
            "object": "usage.record", "request_id": record.request_id,
            "occurred_at": int(record.occurred_at.timestamp()),
            "billing_period": record.billing_period, "model": record.model,
            "adapter": record.adapter, "api_key_id": record.api_key_id,
            "api_key_prefix": record.api_key_prefix, "finish_reason": record.finish_reason,
            "input_tokens": record.prompt_tokens, "input_cached_tokens": record.cached_tokens,
            "output_tokens": record.completion_tokens, "price_class": record.price_class,
            "amount": amount(to_micro(record.cost), record.currency)})


@extend_schema_serializer(component_name="UsageDeadLetter")
class UsageDeadLetterSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    entry_id = serializers.CharField()
    request_id = serializers.CharField()
    tenant_ref = serializers.CharField()
    reason = serializers.CharField()
    payload = serializers.CharField()
    created_at = serializers.DateTimeField()


class UsageDeadLetterListApi(Api):
    class FilterSerializer(StrictSerializer):
        limit = serializers.IntegerField(min_value=1, max_value=200, default=50)

    OutputSerializer = list_of(UsageDeadLetterSerializer, "UsageDeadLetterList")

    @extend_schema(tags=["prices"], summary="Usage reports the ledger refused (operators)",
                   responses=OutputSerializer, parameters=[OpenApiParameter("limit", int)])
    def get(self, request) -> Response:
        self.staff_actor()
        query = validated(UsageDeadLetterListApi.FilterSerializer, query_dict(request))
        page = list(selectors.usage_dead_letter_list()[:query["limit"] + 1])
        return Response(listing(UsageDeadLetterSerializer(page[:query["limit"]], many=True).data,
                                has_more=len(page) > query["limit"]))
