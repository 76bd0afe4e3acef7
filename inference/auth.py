"""The inference API's face of the one API-key authenticator (tenants/authentication.py):
the same checks, errors and "last used" throttle as every other entry point, with the
`inference` scope asked for unless the caller names another.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Span

from core.bodies import Scope, Sender, authorization
from core.errors import ApiError
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


async def inference_key_sender(scope: Scope, kwargs: dict[str, Any]) -> Sender | None:
    """A caller with an API key of the inference scope, any tenant's (core/bodies.py: who
    may send a batch file past the ordinary body limit); the view authenticates it again."""
    header = authorization(scope)
    if header is None:
        return None
    try:
        principal = await facade.aauthenticate(header, scope=INFERENCE_SCOPE)
    except ApiError:
        return None
    return Sender(principal.tenant_id)
