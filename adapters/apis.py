"""The adapter management API: uploads (one request or resumable chunks), list, detail,
delete, and the operator's visibility switch (docs/adapters.md)."""

from __future__ import annotations

import re
import tempfile
from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import parsers, serializers, status
from rest_framework.response import Response

from adapters import selectors, services
from adapters.models import Adapter, AdapterUpload
from adapters.naming import model_id
from core.bodies import (
    MULTIPART_FRAMING,
    BodyPolicy,
    Scope,
    Sender,
    authorization,
    body_policy,
    signed_in,
)
from core.errors import ApiError, InvalidRequest
from tenants import facade
from tenants.apis.base import StrictSerializer, TenantApi, listing, validated

TAGS = ["adapters"]
_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


async def _uploader(scope: Scope, kwargs: dict[str, Any]) -> Sender | None:
    """An API key of the URL's tenant with the adapters scope, or a signed-in console session
    (whose rights the view then checks): who may upload past the ordinary body limit."""
    header = authorization(scope)
    if header is None:
        return Sender(None) if await signed_in(scope) else None
    try:
        principal = await facade.aauthenticate(header, scope="adapters")
    except ApiError:
        return None
    return Sender(principal.tenant_id) if principal.tenant_slug == kwargs["slug"] else None


_UPLOADER_HINT = ("larger adapter uploads need an API key of the tenant with the adapters "
                  "scope, or a console session")
# A whole archive (or its two files) in one multipart request.
WHOLE_UPLOAD = BodyPolicy(limit_setting="ATRIUM_ADAPTER_MAX_UPLOAD_BYTES",
                          framing=MULTIPART_FRAMING, sender=_uploader, hint=_UPLOADER_HINT)
# One chunk of a resumable upload.
CHUNK_UPLOAD = BodyPolicy(limit_setting="ATRIUM_ADAPTER_CHUNK_BYTES", sender=_uploader,
                          hint=_UPLOADER_HINT)


def _default_base_model() -> str:
    from core.served_models import served_models

    return next(iter(served_models()))


def _base_model(value: str | None) -> str:
    from core.served_models import served_models

    name = value or _default_base_model()
    if name not in served_models():
        raise InvalidRequest(f"the base model '{name}' is not served here", param="base_model",
                             code="invalid_value")
    return name


class AdapterSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField()

    class Meta:
        model = Adapter
        fields = ["id", "object", "name", "version", "model", "base_model", "status",
                  "failure_reason", "visibility", "content_hash", "rank", "target_modules",
                  "size_bytes", "created_by", "created_at", "updated_at"]

    def get_object(self, _: Adapter) -> str:
        return "adapter"

    def get_model(self, adapter: Adapter) -> str:
        """What to pass as ``model`` to call this version."""
        return model_id(base=adapter.base_model, name=adapter.name, version=adapter.version)


class UploadSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    chunk_bytes = serializers.SerializerMethodField()

    class Meta:
        model = AdapterUpload
        fields = ["id", "object", "name", "base_model", "filename", "size", "received",
                  "status", "chunk_bytes", "created_at", "expires_at"]

    def get_object(self, _: AdapterUpload) -> str:
        return "adapter.upload"

    def get_chunk_bytes(self, _: AdapterUpload) -> int:
        return settings.ATRIUM_ADAPTER_CHUNK_BYTES


def _label(api: TenantApi) -> str:
    return api.actor().label


class AdapterListApi(TenantApi):
    @extend_schema(tags=TAGS, summary="The tenant's adapters, every version",
                   responses=AdapterSerializer(many=True))
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        facade.authorize(tenant_access, "adapter.read")
        rows = selectors.adapter_list(tenant=tenant_access.tenant)
        return Response(listing(AdapterSerializer(rows, many=True).data))


class AdapterCreateApi(TenantApi):
    """One request: a .zip or .tar.gz as ``archive``, or ``adapter_config`` + ``adapter_model``."""

    parser_classes = [parsers.MultiPartParser]

    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=64)
        base_model = serializers.CharField(max_length=200, required=False)
        archive = serializers.FileField(required=False)
        adapter_config = serializers.FileField(required=False)
        adapter_model = serializers.FileField(required=False)

    @body_policy(WHOLE_UPLOAD)
    @extend_schema(tags=TAGS, summary="Upload an adapter (validated in the background)",
                   request={"multipart/form-data": InputSerializer},
                   responses={202: AdapterSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        facade.authorize(tenant_access, "adapter.create")
        data = validated(AdapterCreateApi.InputSerializer, request.data)
        base = _base_model(data.get("base_model"))
        tenant, label = tenant_access.tenant, _label(self)
        if data.get("archive") is not None:
            if data.get("adapter_config") or data.get("adapter_model"):
                raise InvalidRequest("send either 'archive' or the two files, not both",
                                     param="archive", code="invalid_value")
            archive = data["archive"]
            adapter = services.upload_archive(
                tenant=tenant, name=data["name"], base_model=base, data=archive,
                size=archive.size, filename=archive.name, created_by=label,
                actor=tenant_access.actor)
        elif data.get("adapter_config") and data.get("adapter_model"):
            config, weights = data["adapter_config"], data["adapter_model"]
            adapter = services.upload_files(
                tenant=tenant, name=data["name"], base_model=base, config=config,
                weights=weights, size=config.size + weights.size, created_by=label,
                actor=tenant_access.actor)
        else:
            raise InvalidRequest("send the adapter as 'archive' (.zip or .tar.gz), or as "
                                 "'adapter_config' and 'adapter_model' (.safetensors)",
                                 param="archive", code="missing_required_parameter")
        return Response(AdapterSerializer(adapter).data, status=status.HTTP_202_ACCEPTED)


class AdapterDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="One adapter version", responses=AdapterSerializer)
    def get(self, request, slug: str, adapter_id: int) -> Response:
        tenant_access = self.access(slug)
        adapter = selectors.adapter_get(tenant=tenant_access.tenant, adapter_id=adapter_id)
        facade.authorize(tenant_access, "adapter.read")
        return Response(AdapterSerializer(adapter).data)


class AdapterDeleteApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Delete an adapter version", responses={204: None})
    def delete(self, request, slug: str, adapter_id: int) -> Response:
        tenant_access = self.access(slug)
        adapter = selectors.adapter_get(tenant=tenant_access.tenant, adapter_id=adapter_id)
        facade.authorize(tenant_access, "adapter.delete")
        services.adapter_delete(adapter=adapter, actor=tenant_access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AdapterVisibilityApi(TenantApi):
    class InputSerializer(StrictSerializer):
        public = serializers.BooleanField()

    @extend_schema(tags=TAGS, summary="Make an adapter public or private (operators only)",
                   request=InputSerializer, responses=AdapterSerializer)
    def post(self, request, slug: str, adapter_id: int) -> Response:
        tenant_access = self.access(slug)
        adapter = selectors.adapter_get(tenant=tenant_access.tenant, adapter_id=adapter_id)
        facade.authorize(tenant_access, "adapter.publish")
        data = validated(AdapterVisibilityApi.InputSerializer, request.data)
        adapter = services.adapter_set_visibility(adapter=adapter, public=data["public"],
                                                  actor=tenant_access.actor)
        return Response(AdapterSerializer(adapter).data)


# -- resumable uploads ----------------------------------------------------------------------

class UploadCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=64)
        size = serializers.IntegerField(min_value=1)
        filename = serializers.CharField(max_length=255, required=False, allow_blank=True)
        base_model = serializers.CharField(max_length=200, required=False)

    @extend_schema(tags=TAGS, summary="Start a resumable upload of an archive",
                   request=InputSerializer, responses={201: UploadSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        facade.authorize(tenant_access, "adapter.create")
        data = validated(UploadCreateApi.InputSerializer, request.data)
        upload = services.upload_create(
            tenant=tenant_access.tenant, name=data["name"], size=data["size"],
            base_model=_base_model(data.get("base_model")),
            filename=data.get("filename", ""), created_by=_label(self))
        return Response(UploadSerializer(upload).data, status=status.HTTP_201_CREATED)


def _upload(api: TenantApi, slug: str, upload_id, action: str) -> AdapterUpload:
    tenant_access = api.access(slug)
    upload = selectors.upload_get(tenant=tenant_access.tenant, upload_id=upload_id)
    facade.authorize(tenant_access, action)
    return upload


class UploadDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="How much of an upload has arrived (to resume it)",
                   responses=UploadSerializer)
    def get(self, request, slug: str, upload_id) -> Response:
        return Response(UploadSerializer(_upload(self, slug, upload_id, "adapter.read")).data)


class UploadChunkApi(TenantApi):
    @body_policy(CHUNK_UPLOAD)
    @extend_schema(tags=TAGS, summary="Send the next chunk (raw bytes, with Content-Range)",
                   parameters=[OpenApiParameter("Content-Range", location="header",
                                                required=True,
                                                description="bytes <first>-<last>/<size>")],
                   request={"application/octet-stream": bytes}, responses=UploadSerializer)
    def put(self, request, slug: str, upload_id) -> Response:
        upload = _upload(self, slug, upload_id, "adapter.create")
        match = _RANGE.match(request.META.get("HTTP_CONTENT_RANGE", ""))
        if match is None:
            raise InvalidRequest("send 'Content-Range: bytes <first>-<last>/<size>'",
                                 param="Content-Range", code="invalid_value")
        first, last, total = (int(g) for g in match.groups())
        length = last - first + 1
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if total != upload.size or length < 1 or declared != length:
            raise InvalidRequest(f"Content-Range must cover the body's {declared} bytes of "
                                 f"{upload.size}", param="Content-Range", code="invalid_value")
        with tempfile.SpooledTemporaryFile(max_size=8 << 20) as body:
            remaining = length
            while remaining:  # NOTE: read from the stream: request.body would cap at 4 MiB
                block = request._request.read(min(remaining, 1 << 20))
                if not block:
                    raise InvalidRequest("the body ended before Content-Length",
                                         code="invalid_value")
                body.write(block)
                remaining -= len(block)
            body.seek(0)
            upload = services.upload_append(upload=upload, offset=first, data=body,
                                            length=length)
        return Response(UploadSerializer(upload).data)


class UploadCompleteApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Finish an upload: it becomes an adapter version",
                   request=None, responses={202: AdapterSerializer})
    def post(self, request, slug: str, upload_id) -> Response:
        upload = _upload(self, slug, upload_id, "adapter.create")
        adapter = services.upload_complete(upload=upload, actor=self.actor())
        return Response(AdapterSerializer(adapter).data, status=status.HTTP_202_ACCEPTED)


class UploadDeleteApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Abandon an unfinished upload", responses={204: None})
    def delete(self, request, slug: str, upload_id) -> Response:
        upload = _upload(self, slug, upload_id, "adapter.create")
        if upload.status != AdapterUpload.Status.OPEN:
            raise services.UploadConflict("this upload is complete; delete the adapter instead")
        services.upload_drop(upload=upload)
        return Response(status=status.HTTP_204_NO_CONTENT)
