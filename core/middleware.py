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

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

from core.errors import ApiError

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
