"""The price book (operators): every price, past and future; a new one supersedes the last."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from billing import selectors, services
from billing.apis.common import PRICE, query_dict
from tenants.apis.base import Api, StrictSerializer, listing, validated
from tenants.apis.serializers import list_of


@extend_schema_serializer(component_name="Price")
class PriceSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    model = serializers.CharField()
    adapter = serializers.CharField(help_text="empty: the model's base price; set: a "
                                    "surcharge added to it for this adapter")
    currency = serializers.CharField()
    input_per_million = serializers.DecimalField(**PRICE)
    cached_input_per_million = serializers.DecimalField(**PRICE)
    output_per_million = serializers.DecimalField(**PRICE)
    batch_ratio = serializers.DecimalField(max_digits=7, decimal_places=6,
                                           help_text="the batch price class's share of these "
                                           "prices (the Batch API)")
    flex_ratio = serializers.DecimalField(max_digits=7, decimal_places=6,
                                          help_text="the flex service tier's share of these "
                                          "prices")
    priority_ratio = serializers.DecimalField(max_digits=8, decimal_places=6,
                                              help_text="the priority service tier's multiple "
                                              "of these prices")
    embedding_per_million = serializers.DecimalField(
        **PRICE, allow_null=True, help_text="the embedding price class's price of every input "
        "token (/v1/embeddings); null: embeddings are billed at the input prices")
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
        query = validated(PriceListApi.FilterSerializer, query_dict(request))
        prices = selectors.price_list(model=query.get("model"), adapter=query.get("adapter"))
        return Response(listing(PriceSerializer(prices, many=True).data))


class PriceCreateApi(Api):
    class InputSerializer(StrictSerializer):
        model = serializers.CharField(max_length=200)
        adapter = serializers.CharField(max_length=200, required=False, default="",
                                        allow_blank=True)
        currency = serializers.RegexField(r"^[A-Z]{3}$", required=False)
        input_per_million = serializers.DecimalField(**PRICE)
        cached_input_per_million = serializers.DecimalField(**PRICE)
        output_per_million = serializers.DecimalField(**PRICE)
        batch_ratio = serializers.DecimalField(
            max_digits=7, decimal_places=6, min_value=Decimal(0), max_value=Decimal(1),
            required=False, help_text="the batch price class's share (default 0.5)")
        flex_ratio = serializers.DecimalField(
            max_digits=7, decimal_places=6, min_value=Decimal(0), max_value=Decimal(1),
            required=False, help_text="the flex service tier's share (default 0.5)")
        priority_ratio = serializers.DecimalField(
            max_digits=8, decimal_places=6, min_value=Decimal(1), max_value=Decimal(10),
            required=False, help_text="the priority service tier's multiple (default 2)")
        embedding_per_million = serializers.DecimalField(
            **PRICE, required=False, allow_null=True, help_text="the price of an embedding's "
            "input tokens (/v1/embeddings); absent or null: the input prices")
        effective_from = serializers.DateTimeField(
            required=False, help_text="default: now; never in the past")

    @extend_schema(tags=["prices"], summary="Add a price from a date on (operators); prices "
                   "are never edited, only superseded", request=InputSerializer,
                   responses={201: PriceSerializer})
    def post(self, request) -> Response:
        actor = self.staff_actor()
        data = validated(PriceCreateApi.InputSerializer, request.data)
        price = services.price_create(actor=actor, **data)
        return Response(PriceSerializer(price).data, status=status.HTTP_201_CREATED)
