"""A Content-Security-Policy for the console's pages: only its own scripts, styles and
sockets, no inline script, no framing. The API's JSON answers do not need one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

CONSOLE_PREFIXES = ("/console/", "/static/")


class ContentSecurityPolicy:
    """Sync and async: an async stack (the API under ASGI) keeps its views on the event
    loop, without a hop to a thread and back for every request."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]
                 | Callable[[HttpRequest], Awaitable[HttpResponse]]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if self.is_async:
            return self._acall(request)
        return _with_policy(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return _with_policy(request, await self.get_response(request))


def _with_policy(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    if request.path == "/" or request.path.startswith(CONSOLE_PREFIXES):
        try:
            host = request.get_host()
        except DisallowedHost:
            return response  # already refused with 400
        # Sockets to this host only, and only encrypted ones on a page served over TLS.
        sockets = f"wss://{host}" if request.is_secure() else f"ws://{host} wss://{host}"
        response.setdefault("Content-Security-Policy", "; ".join([
            "default-src 'self'", "script-src 'self'", "style-src 'self'",
            "img-src 'self' data:", f"connect-src 'self' {sockets}",
            "form-action 'self'", "frame-ancestors 'none'", "base-uri 'none'",
            "object-src 'none'"]))
    return response
