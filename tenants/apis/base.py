"""What every management API class shares: who is calling, in which tenant, and how.

Each operation is its own class (`ApiKeyCreateApi`) with nested Input/Output
serializers; `endpoint()` joins the operations that share a URL into one view.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.views import APIView

from core.errors import PermissionDenied
from tenants.access import Actor, TenantAccess
from tenants.apis.authentication import ApiKeyUser
from tenants.selectors import tenant_access_get


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.apis.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "http", "scheme": "bearer",
                "description": "An API key with the 'admin' scope: `Bearer atr_...`"}


def actor_of(request: Request) -> Actor:
    user = request.user
    if isinstance(user, ApiKeyUser):
        return Actor(principal=user.principal)
    return Actor(user_id=user.pk, user_email=user.email, is_staff=user.is_staff)


class Api(APIView):
    """Base of every management API operation."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Nested serializers get schema names from their API (ApiKeyCreateApi.InputSerializer
        # is "ApiKeyCreateInput"), or every operation's would be called "Input".
        for attr in ("InputSerializer", "OutputSerializer"):
            nested = cls.__dict__.get(attr)
            if nested is not None and nested.__qualname__ == f"{cls.__qualname__}.{attr}":
                name = cls.__name__.removesuffix("Api") + attr.removesuffix("Serializer")
                extend_schema_serializer(component_name=name)(nested)

    def actor(self) -> Actor:
        return actor_of(self.request)

    def staff_actor(self) -> Actor:
        """For operator-only operations outside any tenant."""
        actor = self.actor()
        if not actor.is_staff or actor.principal is not None:
            raise PermissionDenied("only platform operators may do this")
        return actor


class TenantApi(Api):
    """An operation inside one tenant, named by the URL's `slug`."""

    def access(self, slug: str) -> TenantAccess:
        return tenant_access_get(actor=self.actor(), slug=slug)


class StrictSerializer(serializers.Serializer):
    """An input serializer that refuses fields it does not know (as the inference API does)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {unknown[0]: serializers.ErrorDetail("unknown parameter",
                                                         code="unknown_parameter")})
        return super().to_internal_value(data)


def validated(serializer_class: type[serializers.Serializer], data: Any,
              partial: bool = False) -> dict[str, Any]:
    serializer = serializer_class(data=data, partial=partial)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def listing(items: list[dict[str, Any]], *, has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": has_more}


def endpoint(*operations: type[Api]):
    """One URL's view from the operation classes that serve its methods."""
    seen: dict[str, str] = {}
    for op in operations:
        for method in op.http_method_names:
            if method in op.__dict__:
                if method in seen:
                    raise TypeError(f"{op.__name__} and {seen[method]} both handle {method}")
                seen[method] = op.__name__
    name = "".join(op.__name__.removesuffix("Api") for op in operations) + "Endpoint"
    return type(name, operations, {"__module__": operations[0].__module__}).as_view()
