"""What every websocket of the platform checks before it accepts: the browser's Origin."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings


def scope_headers(scope: dict[str, Any]) -> dict[str, str]:
    """An ASGI scope's headers by lower-case name (the last one wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """No Origin: not a browser. A browser's Origin must be this host or configured."""
    if origin is None:
        return True
    if origin in settings.WEBSOCKET_ALLOWED_ORIGINS:
        return True
    return host is not None and urlsplit(origin).netloc == host
