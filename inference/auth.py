"""The inference API's face of the one API-key authenticator (tenants/authentication.py):
the same checks, errors and "last used" throttle as every other entry point, with the
`inference` scope asked for unless the caller names another.
"""

from __future__ import annotations

import time

from core.metrics import AUTH_SECONDS
from tenants import facade
from tenants.facade import Principal

INFERENCE_SCOPE = "inference"


async def authenticate(header: str | None, *, scope: str | None = INFERENCE_SCOPE) -> Principal:
    """The key's principal; 401 for a bad key, 403 for a key without `scope`, 503 when the
    key cache is out of reach."""
    started = time.perf_counter()
    try:
        return await facade.aauthenticate(header, scope=scope)
    finally:
        AUTH_SECONDS.observe(time.perf_counter() - started)

