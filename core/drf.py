"""Django REST framework glue: every management API error in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions as drf
from rest_framework import parsers
from rest_framework.response import Response

from core.errors import ApiError, AuthenticationFailed, InvalidRequest, NotFound, PermissionDenied

# DRF's validation codes, in the inference API's vocabulary.
_VALIDATION_CODES = {"required": "missing_required_parameter", "null": "invalid_value",
                     "unknown_parameter": "unknown_parameter"}


def _first_error(detail: Any, path: str = "") -> tuple[str, str, str]:
    """(param path, message, code) of the first error in a ValidationError's detail."""
    if isinstance(detail, dict):
        name, inner = next(iter(detail.items()))
        # A list item's errors are keyed by index: the parameter is still the list.
        if name == "non_field_errors" or isinstance(name, int):
            param = path
        else:
            param = f"{path}.{name}" if path else name
        return _first_error(inner, param)
    if isinstance(detail, list) and detail:
        return _first_error(detail[0], path)
    return path, str(detail), getattr(detail, "code", "invalid")


def _as_api_error(exc: Exception) -> ApiError | None:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Http404 | ObjectDoesNotExist | drf.NotFound):
        return NotFound("not found")
    if isinstance(exc, DjangoPermissionDenied):
        return PermissionDenied("you are not allowed to do this")
    if isinstance(exc, drf.ValidationError):
        param, message, code = _first_error(exc.detail)
        code = _VALIDATION_CODES.get(code, "invalid_value")
        text = f"'{param}': {message}" if param else message
        return InvalidRequest(text, param=param or None, code=code)
    if isinstance(exc, drf.NotAuthenticated):
        return AuthenticationFailed("Sign in, or send an API key with the 'admin' scope as "
                                    "'Authorization: Bearer <key>'.",
                                    code="missing_credentials")
    if isinstance(exc, drf.AuthenticationFailed):
        return AuthenticationFailed(str(exc.detail), code="invalid_api_key")
    if isinstance(exc, drf.PermissionDenied):
        detail = str(exc.detail)
        code = "csrf_failed" if detail.startswith("CSRF Failed") else "permission_denied"
        return PermissionDenied(detail, code=code)
    if isinstance(exc, drf.MethodNotAllowed):
        return ApiError(str(exc.detail), status=405, code="method_not_allowed")
    if isinstance(exc, drf.ParseError):
        return InvalidRequest("We could not parse the JSON body of your request.",
                              code="invalid_json")
    if isinstance(exc, drf.APIException):
        return ApiError(str(exc.detail), status=exc.status_code, code=exc.default_code)
    return None


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER. Unknown exceptions are left to Django (500)."""
    error = _as_api_error(exc)
    if error is None:
        return None
    response = Response(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    if error.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="atrium"'
    return response


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with a body nested past Python's recursion limit ("[[[[…")
    answered as unparseable JSON (400) instead of a crash (500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise drf.ParseError("JSON parse error - nested too deeply") from None
