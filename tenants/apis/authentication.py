"""How the management API knows its caller: an API key, or a console session.

A key goes through the one API-key authenticator (tenants/authentication.py), as on
every other entry point; authorization is then tenants/access.py's, per operation.
Imported by DRF's settings: this module must not import rest_framework.views.
"""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from core import errors
from tenants import authentication
from tenants.principals import Principal


class ApiKeyUser:
    """`request.user` when the caller authenticated with an API key."""

    is_authenticated = True
    is_active = True
    is_staff = False
    pk = id = None

    def __init__(self, principal: Principal) -> None:
        self.principal = principal


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer atr_...`; any other scheme is left to the session."""

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, Principal] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not authentication.is_bearer(header):
            return None
        try:
            principal = authentication.authenticate(header)
        except errors.AuthenticationFailed as exc:
            # DRF's own class, so that DRF marks the request unauthenticated.
            raise exceptions.AuthenticationFailed(exc.message) from None
        return ApiKeyUser(principal), principal

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="atrium"'


class SignedIn(BasePermission):
    def has_permission(self, request: Request, view) -> bool:
        return bool(request.user is not None and request.user.is_authenticated)
