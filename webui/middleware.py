"""A Content-Security-Policy for the console's pages: only its own scripts, styles and
sockets, no inline script, no framing. The API's JSON answers do not need one."""

from __future__ import annotations

from collections.abc import Callable

from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

CONSOLE_PREFIXES = ("/console/", "/static/")


class ContentSecurityPolicy:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
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
