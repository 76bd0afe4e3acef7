"""The inference API's face of the one API-key authenticator (tenants/authentication.py):
the same checks, errors and "last used" throttle as every other entry point, with the
`inference` scope asked for unless the caller names another.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Span

from core.metrics import AUTH_SECONDS
from inference import telemetry
from tenants import facade
from tenants.facade import Principal

INFERENCE_SCOPE = "inference"


async def authenticate(header: str | None, *, scope: str | None = INFERENCE_SCOPE,
                       span: Span | None = None) -> Principal:
    """The key's principal; 401 for a bad key, 403 for a key without `scope`, 503 when the
    key cache is out of reach. ``span``: the request's trace span, which records how long
    this took, or ends here when the key is refused."""
    started = time.perf_counter()
    try:
        principal = await facade.aauthenticate(header, scope=scope)
    except BaseException as exc:
        telemetry.end_span(span, status=getattr(exc, "status", 500), error=exc)
        raise
    finally:
        AUTH_SECONDS.observe(time.perf_counter() - started)
    telemetry.phase(span, "auth", started)
    return principal

