"""Request logs of a tenant (list, filter, one), its logging policy and redaction patterns,
and the operator's view across tenants (docs/request-logs.md)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from core.errors import InvalidRequest
from redaction.custom import MAX_PATTERN_CHARS
from requestlogs import selectors, services
from requestlogs.models import RequestLog
from tenants.apis.base import Api, StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import list_of
from tenants.facade import authorize, tenant_id_authorized

TAGS = ["request logs"]


@extend_schema_serializer(component_name="RequestLog")
class RequestLogSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    request_id = serializers.SerializerMethodField(
        help_text="the completion's id, as the client got it (also its x-request-id)")
    created_at = serializers.DateTimeField()
    endpoint = serializers.ChoiceField(choices=["chat", "completion", "responses", "messages"])
    transport = serializers.ChoiceField(choices=["http", "websocket"])
    model = serializers.CharField()
    adapter = serializers.CharField(help_text="empty: the base model")
    api_key_id = serializers.IntegerField(allow_null=True)
    api_key_prefix = serializers.CharField()
    stream = serializers.BooleanField()
    status = serializers.IntegerField(help_text="the outcome; 499: the client went away")
    error_code = serializers.CharField()
    finish_reason = serializers.CharField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    queue_ms = serializers.IntegerField(allow_null=True)
    ttft_ms = serializers.IntegerField(allow_null=True)
    total_ms = serializers.IntegerField(allow_null=True)
    latency_ms = serializers.IntegerField()

    def get_object(self, log: RequestLog) -> str:
        return "request_log"

    def get_request_id(self, log: RequestLog) -> str:
        return selectors.client_request_id(log)


@extend_schema_serializer(component_name="RequestLogDetail")
class RequestLogDetailSerializer(RequestLogSerializer):
    prompt = serializers.JSONField(allow_null=True, help_text="redacted; null unless the "
                                   "tenant keeps bodies")
    completion = serializers.CharField(allow_null=True, help_text="redacted; null unless "
                                       "the tenant keeps bodies")


@extend_schema_serializer(component_name="OperatorRequestLog")
class OperatorRequestLogSerializer(RequestLogSerializer):
    tenant = serializers.SlugField(source="tenant.slug")


class _FilterSerializer(StrictSerializer):
    limit = serializers.IntegerField(min_value=1, max_value=200, default=50)
    before = serializers.IntegerField(min_value=1, required=False,
                                      help_text="only logs older than this id")
    since = serializers.DateTimeField(required=False, help_text="created at or after")
    until = serializers.DateTimeField(required=False, help_text="created before")
    model = serializers.CharField(max_length=200, required=False)
    adapter = serializers.CharField(max_length=200, required=False)
    key = serializers.IntegerField(min_value=1, required=False, help_text="an API key's id")
    status = serializers.IntegerField(min_value=100, max_value=599, required=False)


_FILTER_PARAMETERS = [
    OpenApiParameter("limit", int), OpenApiParameter("before", int),
    OpenApiParameter("since", str, description="ISO 8601"),
    OpenApiParameter("until", str, description="ISO 8601"), OpenApiParameter("model", str),
    OpenApiParameter("adapter", str), OpenApiParameter("key", int),
    OpenApiParameter("status", int)]


def _filters(query: dict[str, Any]) -> selectors.RequestLogFilter:
    if "since" in query and "until" in query and query["since"] >= query["until"]:
        raise InvalidRequest("'since' must be before 'until'", param="since",
                             code="invalid_value")
    return selectors.RequestLogFilter(
        since=query.get("since"), until=query.get("until"), model=query.get("model"),
        adapter=query.get("adapter"), api_key_id=query.get("key"),
        status=query.get("status"), before=query.get("before"))


def _page(logs, limit: int, serializer: type[serializers.Serializer]) -> dict[str, Any]:
    page = list(logs[:limit + 1])
    return listing(serializer(page[:limit], many=True).data, has_more=len(page) > limit)


class RequestLogListApi(TenantApi):
    FilterSerializer = _FilterSerializer
    OutputSerializer = list_of(RequestLogSerializer, "RequestLogList")

    @extend_schema(tags=TAGS, summary="The tenant's request logs, newest first, filtered",
                   responses=OutputSerializer, parameters=_FILTER_PARAMETERS)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "log.read")
        query = validated(_FilterSerializer, request.query_params.dict())
        logs = selectors.request_log_list(tenant=tenant_access.tenant, filters=_filters(query))
        return Response(_page(logs, query["limit"], RequestLogSerializer))


class RequestLogDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="One request's log, with its redacted bodies if kept",
                   responses=RequestLogDetailSerializer)
    def get(self, request, slug: str, request_id: str) -> Response:
        tenant_access = self.access(slug)
        found = selectors.request_log_get(tenant=tenant_access.tenant, request_id=request_id)
        authorize(tenant_access, "log.read")
        return Response(RequestLogDetailSerializer(found).data)


class OperatorRequestLogListApi(Api):
    class FilterSerializer(_FilterSerializer):
        tenant = serializers.SlugField(required=False, help_text="one tenant only")

    OutputSerializer = list_of(OperatorRequestLogSerializer, "OperatorRequestLogList")

    @extend_schema(tags=TAGS, summary="Every tenant's request logs (operators)",
                   responses=OutputSerializer,
                   parameters=[*_FILTER_PARAMETERS, OpenApiParameter("tenant", str)])
    def get(self, request) -> Response:
        actor = self.staff_actor()
        query = validated(OperatorRequestLogListApi.FilterSerializer,
                          request.query_params.dict())
        tenant_id = (tenant_id_authorized(actor=actor, slug=query["tenant"], action="log.read")
                     if "tenant" in query else None)
        logs = selectors.request_log_list_all(filters=_filters(query), tenant_id=tenant_id)
        return Response(_page(logs, query["limit"], OperatorRequestLogSerializer))


# --- policy --------------------------------------------------------------------------------

@extend_schema_serializer(component_name="LogSettings")
class LogSettingsSerializer(serializers.Serializer):
    object = serializers.SerializerMethodField()
    log_bodies = serializers.BooleanField(help_text="keep prompts and completions, redacted")
    retention_days = serializers.IntegerField(help_text="logs older than this are deleted")

    def get_object(self, policy: Any) -> str:
        return "log_settings"


class LogSettingsDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="The tenant's logging policy",
                   responses=LogSettingsSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "log.read")
        policy = selectors.log_policy_get(tenant_id=tenant_access.tenant.pk)
        return Response(LogSettingsSerializer(policy).data)


class LogSettingsUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        log_bodies = serializers.BooleanField(required=False)
        retention_days = serializers.IntegerField(
            min_value=1, max_value=settings.ATRIUM_LOG_MAX_RETENTION_DAYS, required=False)

    @extend_schema(tags=TAGS, summary="Keep bodies (redacted) or not; how long logs are kept",
                   request=InputSerializer, responses=LogSettingsSerializer)
    def patch(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "log.manage")
        data = validated(LogSettingsUpdateApi.InputSerializer, request.data)
        policy = services.log_policy_update(tenant=tenant_access.tenant,
                                            actor=tenant_access.actor, **data)
        return Response(LogSettingsSerializer(policy).data)


# --- redaction patterns --------------------------------------------------------------------

@extend_schema_serializer(component_name="RedactionPattern")
class RedactionPatternSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    name = serializers.CharField(help_text="matches are replaced by [NAME]")
    pattern = serializers.CharField()
    created_at = serializers.DateTimeField()

    def get_object(self, pattern: Any) -> str:
        return "redaction_pattern"


class RedactionPatternListApi(TenantApi):
    OutputSerializer = list_of(RedactionPatternSerializer, "RedactionPatternList")

    @extend_schema(tags=TAGS, summary="The tenant's own redaction patterns",
                   responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "log.read")
        patterns = selectors.redaction_pattern_list(tenant=tenant_access.tenant)
        return Response(listing(RedactionPatternSerializer(patterns, many=True).data))


class RedactionPatternCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=32, help_text="e.g. EMPLOYEE_ID")
        pattern = serializers.CharField(max_length=MAX_PATTERN_CHARS, trim_whitespace=False,
                                        help_text="the restricted, linear-time dialect of "
                                        "docs/request-logs.md")

    @extend_schema(tags=TAGS, summary="Add a redaction pattern (checked before it is saved)",
                   request=InputSerializer, responses={201: RedactionPatternSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        authorize(tenant_access, "log.manage")
        data = validated(RedactionPatternCreateApi.InputSerializer, request.data)
        created = services.redaction_pattern_create(tenant=tenant_access.tenant,
                                                    actor=tenant_access.actor, **data)
        return Response(RedactionPatternSerializer(created).data,
                        status=status.HTTP_201_CREATED)


class RedactionPatternDeleteApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Remove a redaction pattern", responses={204: None})
    def delete(self, request, slug: str, pattern_id: int) -> Response:
        tenant_access = self.access(slug)
        selectors.redaction_pattern_get(tenant=tenant_access.tenant, pattern_id=pattern_id)
        authorize(tenant_access, "log.manage")
        services.redaction_pattern_delete(tenant=tenant_access.tenant,
                                          actor=tenant_access.actor, pattern_id=pattern_id)
        return Response(status=status.HTTP_204_NO_CONTENT)
