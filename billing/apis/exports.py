"""A tenant's billing exports: asked for, built in the background, downloaded once built."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from billing import selectors, services
from billing.exports import CONTENT_TYPES, export_storage
from billing.models import Export
from core.downloads import FileDownload
from core.errors import ApiError, Conflict
from tenants.apis.base import StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.facade import authorize


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
        authorize(tenant_access, "billing.read")
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
        authorize(tenant_access, "billing.export")
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
        authorize(tenant_access, "billing.read")
        return Response(ExportSerializer(export).data)


class ExportContentApi(TenantApi):
    @extend_schema(tags=["billing"], summary="Download a finished export (streamed)",
                   responses={(200, "text/csv"): OpenApiTypes.BINARY,
                              (200, "application/jsonl"): OpenApiTypes.BINARY})
    def get(self, request, slug: str, export_id: int):
        tenant_access = self.access(slug)
        export = selectors.export_get(tenant=tenant_access.tenant, export_id=export_id)
        authorize(tenant_access, "billing.read")
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
