"""A tenant's invoices with their lines; a draft shows the period as of now."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response

from billing import selectors
from billing.apis.common import query_dict
from billing.models import PRICE_CLASSES, Invoice
from tenants.apis.base import StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.facade import authorize


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
    price_class = serializers.ChoiceField(
        choices=PRICE_CLASSES, help_text="interactive, batch (the Batch API's lines, at the "
        "price's batch_ratio), embedding (/v1/embeddings, at its embedding price), flex or "
        "priority (those service tiers, at the price's flex_ratio or priority_ratio)")


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
                       "exact_amount": x.exact_amount, "price_class": x.price_class}
                      for x in view.lines]}


class InvoiceListApi(TenantApi):
    class FilterSerializer(StrictSerializer):
        limit = serializers.IntegerField(min_value=1, max_value=100, default=12)

    OutputSerializer = list_of(InvoiceSerializer, "InvoiceList")

    @extend_schema(tags=["billing"], summary="The tenant's invoices, newest period first",
                   responses=OutputSerializer, parameters=[OpenApiParameter("limit", int)])
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "billing.read")
        query = validated(InvoiceListApi.FilterSerializer, query_dict(request))
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
        authorize(tenant_access, "billing.read")
        return Response(InvoiceSerializer(_invoice(selectors.invoice_view(invoice=invoice))).data)
