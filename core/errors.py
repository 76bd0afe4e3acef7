"""The one exception family of the platform, rendered in OpenAI's error shape.

Services, selectors and views raise these; the inference views render them
directly and the management API renders them through `core.drf.exception_handler`.
Every body is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django.http import HttpResponse

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None
    default_headers: dict[str, str] = {}  # noqa: RUF012 - read only, per class

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = {**self.default_headers, **(headers or {})}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        if self.status >= 500 and self.__cause__ is not None:
            # The client reads the message; the operator needs what caused it.
            log.warning("answered %d %s: %s (caused by %s: %s)", self.status, self.code,
                        self.message, type(self.__cause__).__name__, self.__cause__)
        response = HttpResponse(json.dumps(self.body()), status=self.status,
                                content_type="application/json")
        for name, value in self.headers.items():
            response[name] = value
        return response


class InvalidRequest(ApiError):
    status = 400


class AuthenticationFailed(ApiError):
    status = 401
    code = "invalid_api_key"


class PermissionDenied(ApiError):
    status = 403
    code = "permission_denied"


class NotFound(ApiError):
    """Also what another tenant's object is: its existence is never confirmed."""

    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class BodyTooLarge(ApiError):
    status = 413
    code = "request_too_large"

    @classmethod
    def over(cls, limit: int, hint: str = "") -> BodyTooLarge:
        """A body past `limit` bytes; `hint` says who may send more."""
        return cls(f"the request body is larger than {limit} bytes"
                   + (f" ({hint})" if hint else ""))


class RateLimited(ApiError):
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(ApiError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class ServiceUnavailable(ApiError):
    """Redis (or what the platform keeps there) is out of reach: fails closed, retry soon."""

    status = 503
    type = "server_error"
    code = "service_unavailable"
    default_headers = {"retry-after": "1"}  # noqa: RUF012
