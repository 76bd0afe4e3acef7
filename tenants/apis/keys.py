"""API keys of a tenant: list, create (shown once), change, revoke, rotate, limits."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from tenants import access, selectors, services
from tenants.apis.base import StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import (
    ApiKeySerializer,
    LimitsChangeSerializer,
    LimitsSerializer,
    NewApiKeySerializer,
    limits_of,
    list_of,
)
from tenants.models import Scope

TAGS = ["keys"]
_key = ApiKeySerializer


def _user_or_none(request):
    return request.user if getattr(request.user, "pk", None) else None


class ApiKeyListApi(TenantApi):
    OutputSerializer = list_of(ApiKeySerializer, "ApiKeyList")

    @extend_schema(tags=TAGS, summary="List the tenant's API keys", responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "key.read")
        keys = selectors.api_key_list(tenant=tenant_access.tenant).select_related("created_by")
        return Response(listing(_key(keys, many=True).data))


class ApiKeyCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200)
        scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices),
                                       default=[Scope.INFERENCE.value], allow_empty=False)
        expires_at = serializers.DateTimeField(required=False, allow_null=True)

    @extend_schema(tags=TAGS, summary="Create an API key (its secret is shown once)",
                   request=InputSerializer, responses={201: NewApiKeySerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "key.create")
        data = validated(ApiKeyCreateApi.InputSerializer, request.data)
        access.authorize_scopes(tenant_access, data["scopes"])
        key, plaintext = services.api_key_create(
            tenant=tenant_access.tenant, name=data["name"], scopes=data["scopes"],
            expires_at=data.get("expires_at"), created_by=_user_or_none(request),
            actor=tenant_access.actor)
        return Response({**_key(key).data, "key": plaintext}, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="One API key", responses=ApiKeySerializer)
    def get(self, request, slug: str, key_id: int) -> Response:
        tenant_access = self.access(slug)
        key = selectors.api_key_get(tenant=tenant_access.tenant, key_id=key_id)
        access.authorize(tenant_access, "key.read")
        return Response(_key(key).data)


def _managed_key(api: TenantApi, slug: str, key_id: int, action: str = "key.manage"):
    """The key (404 if not this tenant's) once the caller may manage it (else 403)."""
    tenant_access = api.access(slug)
    key = selectors.api_key_get(tenant=tenant_access.tenant, key_id=key_id)
    access.authorize(tenant_access, action, owner_id=key.created_by_id)
    return tenant_access, key


class ApiKeyUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200, required=False)
        scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices),
                                       required=False, allow_empty=False)
        expires_at = serializers.DateTimeField(required=False, allow_null=True)

    @extend_schema(tags=TAGS, summary="Rename a key, change its scopes or expiry",
                   request=InputSerializer, responses=ApiKeySerializer)
    def patch(self, request, slug: str, key_id: int) -> Response:
        tenant_access, key = _managed_key(self, slug, key_id)
        data = validated(ApiKeyUpdateApi.InputSerializer, request.data)
        if "scopes" in data:
            access.authorize_scopes(tenant_access, data["scopes"])
        key = services.api_key_update(tenant=tenant_access.tenant, key_id=key.pk,
                                      actor=tenant_access.actor, **data)
        return Response(_key(key).data)


class ApiKeyRevokeApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Revoke a key (at once, everywhere)", request=None,
                   responses=ApiKeySerializer)
    def post(self, request, slug: str, key_id: int) -> Response:
        tenant_access, key = _managed_key(self, slug, key_id)
        key = services.api_key_revoke(tenant=tenant_access.tenant, key_id=key.pk,
                                      actor=tenant_access.actor)
        return Response(_key(key).data)


class ApiKeyRotateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        grace_seconds = serializers.IntegerField(
            min_value=0, required=False,
            help_text="how long the old key keeps working (default: a day)")

    class OutputSerializer(serializers.Serializer):
        old = ApiKeySerializer()
        new = NewApiKeySerializer()

    @extend_schema(tags=TAGS, summary="Rotate a key: a new secret; the old one works for a "
                   "grace period", request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request, slug: str, key_id: int) -> Response:
        tenant_access, key = _managed_key(self, slug, key_id)
        # A rotation mints a working secret with the key's scopes: only for callers who
        # could create such a key themselves.
        access.authorize_scopes(tenant_access, list(key.scopes))
        data = validated(ApiKeyRotateApi.InputSerializer, request.data or {})
        new, plaintext = services.api_key_rotate(
            tenant=tenant_access.tenant, key_id=key.pk, actor=tenant_access.actor,
            grace_seconds=data.get("grace_seconds"))
        old = selectors.api_key_get(tenant=tenant_access.tenant, key_id=key.pk)
        return Response({"old": _key(old).data, "new": {**_key(new).data, "key": plaintext}},
                        status=status.HTTP_201_CREATED)


class ApiKeyQuotaDetailApi(TenantApi):
    class OutputSerializer(serializers.Serializer):
        key_limits = LimitsSerializer(help_text="the key's own limits (null: none)")
        tenant_limits = LimitsSerializer(help_text="the tenant's limits, which also apply")

    @extend_schema(tags=TAGS, summary="A key's own limits", responses=OutputSerializer)
    def get(self, request, slug: str, key_id: int) -> Response:
        tenant_access = self.access(slug)
        key = selectors.api_key_get(tenant=tenant_access.tenant, key_id=key_id)
        access.authorize(tenant_access, "quota.read")
        return Response(_key_quota(tenant_access.tenant, key))


def _key_quota(tenant, key) -> dict:
    return {"key_limits": limits_of(selectors.quota_override_get(tenant=tenant, api_key=key)),
            "tenant_limits": limits_of(selectors.tenant_limits(tenant=tenant))}


class ApiKeyQuotaUpdateApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Set or clear a key's own limits",
                   request=LimitsChangeSerializer, responses=ApiKeyQuotaDetailApi.OutputSerializer)
    def patch(self, request, slug: str, key_id: int) -> Response:
        tenant_access, key = _managed_key(self, slug, key_id, action="key.quota")
        changes = validated(LimitsChangeSerializer, request.data)
        services.api_key_quota_update(tenant=tenant_access.tenant, key_id=key.pk,
                                      actor=tenant_access.actor, changes=changes)
        return Response(_key_quota(tenant_access.tenant, key))
