"""Billing's management API (docs/billing.md): the price book (operators), a tenant's usage,
spend and cap, invoices and exports, and the usage reports the ledger refused (operators).

Every operation looks the tenant up first (another tenant's is 404), then checks
the action (403), then validates its input (400): a refused call changes nothing.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
)
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from atrium.downloads import FileDownload
from atrium.errors import ApiError, Conflict, InvalidRequest
from billing import selectors, services
from billing.exports import CONTENT_TYPES, export_storage
from billing.models import Export, Invoice
from billing.money import to_micro
from tenants import access
from tenants.apis.base import Api, StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.selectors import plan_get

# Timestamps past 2100 are refused rather than overflowing a calendar somewhere.
MAX_UNIX_S = 4_102_444_800
_MONEY = {"max_digits": 14, "decimal_places": 2, "min_value": Decimal(0)}
_PRICE = {"max_digits": 18, "decimal_places": 6, "min_value": Decimal(0)}


def _query(request: Request, lists: tuple[str, ...] = ()) -> dict[str, Any]:
    """Query parameters as a dict; list parameters may repeat (`a=1&a=2`, also `a[]=`) or
    hold commas (`a=1,2`)."""
    out: dict[str, Any] = {}
    for raw_name in request.query_params:
        name = raw_name.removesuffix("[]")
        if name in lists:
            values = [v for item in request.query_params.getlist(raw_name)
                      for v in item.split(",") if v != ""]
            out[name] = [*out.get(name, []), *values]
        else:
            out[name] = request.query_params.get(raw_name)
    return out


def _amount(value: Decimal, currency: str) -> dict[str, str]:
    """Money as the usage API shows it; the currency is its ISO 4217 code (``USD``), as
    in prices, invoices, spend and exports."""
    return {"value": str(value), "currency": currency}


# --- the price book ------------------------------------------------------------------------

@extend_schema_serializer(component_name="Price")
class PriceSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    model = serializers.CharField()
    adapter = serializers.CharField(help_text="empty: the model's base price; set: a "
                                    "surcharge added to it for this adapter")
    currency = serializers.CharField()
    input_per_million = serializers.DecimalField(**_PRICE)
    cached_input_per_million = serializers.DecimalField(**_PRICE)
    output_per_million = serializers.DecimalField(**_PRICE)
    effective_from = serializers.DateTimeField()
    created_at = serializers.DateTimeField()

    def get_object(self, price: Any) -> str:
        return "price"


class PriceListApi(Api):
    class FilterSerializer(StrictSerializer):
        model = serializers.CharField(max_length=200, required=False)
        adapter = serializers.CharField(max_length=200, required=False, allow_blank=True)

    OutputSerializer = list_of(PriceSerializer, "PriceList")

    @extend_schema(tags=["prices"], summary="The price book: every price, past and future",
                   responses=OutputSerializer, parameters=[
                       OpenApiParameter("model", str), OpenApiParameter("adapter", str)])
    def get(self, request) -> Response:
        query = validated(PriceListApi.FilterSerializer, _query(request))
        prices = selectors.price_list(model=query.get("model"), adapter=query.get("adapter"))
        return Response(listing(PriceSerializer(prices, many=True).data))


class PriceCreateApi(Api):
    class InputSerializer(StrictSerializer):
        model = serializers.CharField(max_length=200)
        adapter = serializers.CharField(max_length=200, required=False, default="",
                                        allow_blank=True)
        currency = serializers.RegexField(r"^[A-Z]{3}$", required=False)
        input_per_million = serializers.DecimalField(**_PRICE)
        cached_input_per_million = serializers.DecimalField(**_PRICE)
        output_per_million = serializers.DecimalField(**_PRICE)
        effective_from = serializers.DateTimeField(
            required=False, help_text="default: now; never in the past")

    @extend_schema(tags=["prices"], summary="Add a price from a date on (operators); prices "
                   "are never edited, only superseded", request=InputSerializer,
                   responses={201: PriceSerializer})
    def post(self, request) -> Response:
        actor = self.staff_actor()
        data = validated(PriceCreateApi.InputSerializer, request.data)
        now = timezone.now()
        effective_from = data.pop("effective_from", None) or now
        if effective_from < now - timedelta(minutes=1):
            raise InvalidRequest("'effective_from' is in the past: a price never changes what "
                                 "was already billed", param="effective_from",
                                 code="invalid_value")
        price = services.price_create(actor=actor, effective_from=effective_from, **data)
        return Response(PriceSerializer(price).data, status=status.HTTP_201_CREATED)


class PlanSpendCapUpdateApi(Api):
    class InputSerializer(StrictSerializer):
        monthly_limit = serializers.DecimalField(allow_null=True, **_MONEY)

    class OutputSerializer(serializers.Serializer):
        plan = serializers.SlugField()
        monthly_limit = serializers.DecimalField(allow_null=True, **_MONEY)

    @extend_schema(tags=["prices"], summary="Set a plan's monthly spend cap (operators); null: "
                   "none", request=InputSerializer, responses=OutputSerializer)
    def patch(self, request, plan_slug: str) -> Response:
        actor = self.staff_actor()
        plan = plan_get(slug=plan_slug)
        data = validated(PlanSpendCapUpdateApi.InputSerializer, request.data)
        cap = services.plan_spend_cap_update(plan=plan, actor=actor,
                                             monthly_limit=data["monthly_limit"])
        return Response({"plan": plan.slug,
                         "monthly_limit": None if cap is None else str(cap.monthly_limit)})


# --- usage ---------------------------------------------------------------------------------

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
        access.authorize(tenant_access, "usage.read")
        query = validated(UsageListApi.FilterSerializer, _query(
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
                "output_tokens": r.output_tokens, "amount": _amount(r.cost, currency),
                "model": r.model if "model" in group else None,
                "adapter": r.adapter if "adapter" in group else None,
                "api_key_id": r.api_key_id if "api_key_id" in group else None,
            } for r in b.results],
        } for b in buckets]
        has_more = page_end < end
        return Response({"object": "page", "data": data, "has_more": has_more,
                         "next_page": str(page_end) if has_more else None})


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
    amount = serializers.DictField(child=serializers.CharField(),
                                   help_text='{"value": "<decimal>", "currency": "USD"}')


class UsageRecordDetailApi(TenantApi):
    @extend_schema(tags=["usage"], summary="One request's usage and charge, by the id of "
                   "its response", responses=UsageRecordSerializer)
    def get(self, request, slug: str, request_id: str) -> Response:
        tenant_access = self.access(slug)
        record = selectors.usage_record_get(tenant=tenant_access.tenant, request_id=request_id)
        access.authorize(tenant_access, "usage.read")
        return Response({
            "object": "usage.record", "request_id": record.request_id,
            "occurred_at": int(record.occurred_at.timestamp()),
            "billing_period": record.billing_period, "model": record.model,
            "adapter": record.adapter, "api_key_id": record.api_key_id,
            "api_key_prefix": record.api_key_prefix, "finish_reason": record.finish_reason,
            "input_tokens": record.prompt_tokens, "input_cached_tokens": record.cached_tokens,
            "output_tokens": record.completion_tokens,
            "amount": _amount(to_micro(record.cost), record.currency)})


# --- spend and its cap ---------------------------------------------------------------------

@extend_schema_serializer(component_name="Spend")
class SpendSerializer(serializers.Serializer):
    object = serializers.CharField(default="spend")
    period_start = serializers.DateField()
    period_end = serializers.DateField()
    currency = serializers.CharField()
    spent = serializers.DecimalField(max_digits=24, decimal_places=6,
                                     help_text="this period's usage so far, exact")
    cap = serializers.DecimalField(allow_null=True, **_MONEY)
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
        access.authorize(tenant_access, "billing.read")
        return Response(SpendSerializer(_spend(tenant_access.tenant)).data)


class SpendCapUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        monthly_limit = serializers.DecimalField(allow_null=True, required=False, **_MONEY,
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
        access.authorize(tenant_access, "spend_cap.update")
        data = validated(SpendCapUpdateApi.InputSerializer, request.data)
        services.tenant_spend_cap_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                         monthly_limit=data.get("monthly_limit"),
                                         inherit=data["inherit"])
        return Response(SpendSerializer(_spend(tenant_access.tenant)).data)


# --- invoices ------------------------------------------------------------------------------

@extend_schema_serializer(component_name="InvoiceLine")
class InvoiceLineSerializer(serializers.Serializer):
    model = serializers.CharField()
    adapter = serializers.CharField()
    token_class = serializers.ChoiceField(choices=["input", "cached_input", "output"])
    units = serializers.IntegerField(help_text="tokens")
    unit_price = serializers.DecimalField(max_digits=18, decimal_places=6,
                                          help_text="per million tokens")
    amount = serializers.DecimalField(max_digits=18, decimal_places=2)
    exact_amount = serializers.DecimalField(max_digits=24, decimal_places=6)


@extend_schema_serializer(component_name="Invoice")
class InvoiceSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.CharField(default="invoice")
    number = serializers.CharField()
    status = serializers.ChoiceField(choices=Invoice.Status.choices)
    period_start = serializers.DateField()
    period_end = serializers.DateField()
    currency = serializers.CharField()
    total = serializers.DecimalField(max_digits=18, decimal_places=2)
    exact_total = serializers.DecimalField(max_digits=24, decimal_places=6)
    created_at = serializers.DateTimeField()
    finalized_at = serializers.DateTimeField(allow_null=True)
    lines = InvoiceLineSerializer(many=True)


def _invoice(view: selectors.InvoiceView) -> dict[str, Any]:
    invoice = view.invoice
    return {"id": invoice.pk, "object": "invoice", "number": invoice.number,
            "status": invoice.status, "period_start": invoice.period_start,
            "period_end": invoice.period_end, "currency": invoice.currency,
            "total": view.total, "exact_total": view.exact_total,
            "created_at": invoice.created_at, "finalized_at": invoice.finalized_at,
            "lines": [{"model": x.model, "adapter": x.adapter, "token_class": x.token_class,
                       "units": x.units, "unit_price": x.unit_price, "amount": x.amount,
                       "exact_amount": x.exact_amount} for x in view.lines]}


class InvoiceListApi(TenantApi):
    class FilterSerializer(StrictSerializer):
        limit = serializers.IntegerField(min_value=1, max_value=100, default=12)

    OutputSerializer = list_of(InvoiceSerializer, "InvoiceList")

    @extend_schema(tags=["billing"], summary="The tenant's invoices, newest period first",
                   responses=OutputSerializer, parameters=[OpenApiParameter("limit", int)])
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "billing.read")
        query = validated(InvoiceListApi.FilterSerializer, _query(request))
        page = list(selectors.invoice_list(tenant=tenant_access.tenant)[:query["limit"] + 1])
        data = [_invoice(selectors.invoice_view(invoice=i)) for i in page[:query["limit"]]]
        return Response(listing(InvoiceSerializer(data, many=True).data,
                                has_more=len(page) > query["limit"]))


class InvoiceDetailApi(TenantApi):
    @extend_schema(tags=["billing"], summary="One invoice with its lines (a draft as of now)",
                   responses=InvoiceSerializer)
    def get(self, request, slug: str, invoice_id: int) -> Response:
        tenant_access = self.access(slug)
        invoice = selectors.invoice_get(tenant=tenant_access.tenant, invoice_id=invoice_id)
        access.authorize(tenant_access, "billing.read")
        return Response(InvoiceSerializer(_invoice(selectors.invoice_view(invoice=invoice))).data)


# --- exports -------------------------------------------------------------------------------

@extend_schema_serializer(component_name="BillingExport")
class ExportSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    kind = serializers.ChoiceField(choices=Export.Kind.choices)
    format = serializers.ChoiceField(choices=Export.Format.choices)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    status = serializers.ChoiceField(choices=Export.Status.choices)
    rows = serializers.IntegerField()
    size_bytes = serializers.IntegerField()
    sha256 = serializers.CharField()
    error = serializers.CharField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    download_url = serializers.SerializerMethodField()

    def get_object(self, export: Export) -> str:
        return "billing.export"

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_download_url(self, export: Export) -> str | None:
        if export.status != Export.Status.SUCCEEDED:
            return None
        return f"/api/v1/tenants/{export.tenant.slug}/exports/{export.pk}/content"


class ExportListApi(TenantApi):
    OutputSerializer = list_of(ExportSerializer, "BillingExportList")

    @extend_schema(tags=["billing"], summary="The tenant's billing exports, newest first",
                   responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "billing.read")
        exports = selectors.export_list(tenant=tenant_access.tenant).select_related("tenant")
        return Response(listing(ExportSerializer(exports[:100], many=True).data))


class ExportCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        kind = serializers.ChoiceField(choices=Export.Kind.choices)
        format = serializers.ChoiceField(choices=Export.Format.choices)
        start = serializers.DateTimeField(help_text="inclusive (records by when they occurred;"
                                          " invoices by overlapping period)")
        end = serializers.DateTimeField(help_text="exclusive")

    @extend_schema(tags=["billing"], summary="Export the ledger, invoices or meter events for "
                   "a range; built in the background", request=InputSerializer,
                   responses={202: ExportSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "billing.export")
        data = validated(ExportCreateApi.InputSerializer, request.data)
        export = services.export_create(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                        **data)
        return Response(ExportSerializer(export).data, status=status.HTTP_202_ACCEPTED)


class ExportDetailApi(TenantApi):
    @extend_schema(tags=["billing"], summary="One export and its state",
                   responses=ExportSerializer)
    def get(self, request, slug: str, export_id: int) -> Response:
        tenant_access = self.access(slug)
        export = selectors.export_get(tenant=tenant_access.tenant, export_id=export_id)
        access.authorize(tenant_access, "billing.read")
        return Response(ExportSerializer(export).data)


class ExportContentApi(TenantApi):
    @extend_schema(tags=["billing"], summary="Download a finished export (streamed)",
                   responses={(200, "text/csv"): OpenApiTypes.BINARY,
                              (200, "application/jsonl"): OpenApiTypes.BINARY})
    def get(self, request, slug: str, export_id: int):
        tenant_access = self.access(slug)
        export = selectors.export_get(tenant=tenant_access.tenant, export_id=export_id)
        access.authorize(tenant_access, "billing.read")
        if export.status == Export.Status.EXPIRED:
            raise ApiError(f"export {export.pk} has expired; ask for a new one", status=410,
                           code="export_expired")
        if export.status != Export.Status.SUCCEEDED:
            raise Conflict(f"export {export.pk} is {export.status}, not ready to download",
                           code="export_not_ready")
        response = FileDownload(export_storage().open(export.file_name, "rb"),
                                as_attachment=True,
                                filename=f"{tenant_access.tenant.slug}-{export.kind}-"
                                f"{export.pk}.{export.format}",
                                content_type=CONTENT_TYPES[export.format])
        response["x-content-sha256"] = export.sha256
        return response


# --- refused usage (operators) -------------------------------------------------------------

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
        query = validated(UsageDeadLetterListApi.FilterSerializer, _query(request))
        page = list(selectors.usage_dead_letter_list()[:query["limit"] + 1])
        return Response(listing(UsageDeadLetterSerializer(page[:query["limit"]], many=True).data,
                                has_more=len(page) > query["limit"]))
