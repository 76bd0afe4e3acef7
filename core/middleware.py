"""What every answer outside the console has: JSON (never an HTML page, DEBUG or not) and
an ``x-request-id``.

The API's own errors are already JSON; this catches the rest: Django's 404 for an unknown
path, a 400 for a bad Host header, and any exception a view lets out, which in DEBUG
would be a debug page echoing the request (its body, its secrets). Pages made for a
browser (the console, the admin, the API explorer) keep Django's own answers.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.http import HttpRequest, HttpResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware

from core.errors import ApiError
from core.metrics import HTTP_REQUESTS

log = logging.getLogger(__name__)

HTML_PREFIXES = ("/console/", "/admin/", "/static/", "/api/docs/")
REQUEST_ID = "x-request-id"


def serves_html(path: str) -> bool:
    return path == "/" or path.startswith(HTML_PREFIXES)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def _as_json(response: HttpResponse) -> HttpResponse:
    status = response.status_code
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "error"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = phrase.lower().replace(" ", "_").replace("-", "_")
    replaced = ApiError(phrase, status=status, type=kind, code=code).response()
    for name in ("Allow", "Retry-After"):
        if name in response:
            replaced[name] = response[name]
    return replaced


class ApiResponses:
    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponse]]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        request.request_id = new_request_id()  # type: ignore[attr-defined]
        response = await self.get_response(request)
        match = request.resolver_match
        # NOTE: the URL pattern, never the path: ids in paths would make a series each.
        HTTP_REQUESTS.labels(match.route if match else "unmatched", request.method,
                             str(response.status_code)).inc()
        if not serves_html(request.path) and response.status_code >= 400 \
                and not response.get("Content-Type", "").startswith("application/json") \
                and not getattr(response, "streaming", False):
            response = _as_json(response)
        if REQUEST_ID not in response:
            response[REQUEST_ID] = request.request_id  # type: ignore[attr-defined]
        return response

    async def process_exception(self, request: HttpRequest,
                                exception: Exception) -> HttpResponse | None:
        if serves_html(request.path):
            return None  # Django's page; in DEBUG its reporter redacts (core.debug)
        log.error("unhandled error serving %s %s", request.method, request.path,
                  exc_info=exception)
        return HttpResponse(json.dumps(ApiError(
            "The server had an error while processing your request.", status=500,
            type="server_error", code="internal_error").body()), status=500,
            content_type="application/json")


# --- Django's middleware, without thread hops for the inference API -----------------------

INFERENCE_PREFIX = "/v1/"


class _InferenceAware:
    """Django's own middleware, for a request to the inference API (``/v1/``) either
    skipped (``console_only``: sessions, CSRF, users and messages serve the console and the
    management API) or run on the event loop (its hooks do no I/O).

    NOTE: under ASGI a MiddlewareMixin runs each hook in the one thread-sensitive thread:
    seven of them cost an inference request fourteen hops to that thread and back,
    serialized across every request of the process, which capped a web process at some
    seventy new requests a second with the CPU mostly idle.
    """

    console_only = True

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(INFERENCE_PREFIX):
            return await super().__acall__(request)  # type: ignore[misc]
        if self.console_only:
            return await self.get_response(request)  # type: ignore[attr-defined]
        response = self.process_request(request)  # type: ignore[attr-defined]
        response = response or await self.get_response(request)  # type: ignore[attr-defined]
        return self.process_response(request, response)  # type: ignore[attr-defined]


class Security(_InferenceAware, SecurityMiddleware):
    console_only = False  # HTTPS redirect and its headers apply to the API too


class Sessions(_InferenceAware, SessionMiddleware):
    pass


class Common(_InferenceAware, CommonMiddleware):
    pass


class Csrf(_InferenceAware, CsrfViewMiddleware):
    async def process_view(self, request: HttpRequest, view: Callable, args: Any,
                           kwargs: Any) -> HttpResponse | None:
        if request.path.startswith(INFERENCE_PREFIX):
            return None  # the inference API authenticates by header (its views are exempt)
        return await sync_to_async(super().process_view, thread_sensitive=True)(
            request, view, args, kwargs)


class Authentication(_InferenceAware, AuthenticationMiddleware):
    pass


class Messages(_InferenceAware, MessageMiddleware):
    pass


class FrameOptions(_InferenceAware, XFrameOptionsMiddleware):
    pass
