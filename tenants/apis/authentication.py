"""How the management API knows its caller: an API key, or a console session.

Imported by DRF's settings: this module must not import rest_framework.views.
"""

from __future__ import annotations

import redis
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from atrium.redis import sync_client
from tenants import keys
from tenants.principals import Principal
from tenants.selectors import DENIED_UNKNOWN, key_state_by_digest
from tenants.services import api_key_touch

TOUCH_INTERVAL_S = 60


class ApiKeyUser:
    """`request.user` when the caller authenticated with an API key."""

    is_authenticated = True
    is_active = True
    is_staff = False
    pk = id = None

    def __init__(self, principal: Principal) -> None:
        self.principal = principal


def _touch(principal: Principal) -> None:
    try:
        marker = f"atrium:apikey-used:{principal.api_key_id}"
        if not sync_client().set(marker, b"1", nx=True, ex=TOUCH_INTERVAL_S):
            return
    except redis.RedisError:
        return
    api_key_touch(key_id=principal.api_key_id)


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer atr_...`, checked against the database on every call."""

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, Principal] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        token = token.strip()
        state = key_state_by_digest(digest=keys.digest(token)) if keys.is_well_formed(
            token) else DENIED_UNKNOWN
        if not isinstance(state, Principal):
            raise AuthenticationFailed(f"Incorrect API key provided ({state}).")
        _touch(state)
        return ApiKeyUser(state), state

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="atrium"'


class SignedIn(BasePermission):
    def has_permission(self, request: Request, view) -> bool:
        return bool(request.user is not None and request.user.is_authenticated)


