"""What other apps may use of tenants: plain dataclasses and functions, never models.

The inference hot path authenticates through `principal_lookup` (cached, async)
and records key use through `api_key_touch`. Other apps' services audit their
changes to a tenant's settings through `audit_record`.
"""

from __future__ import annotations

from tenants.access import Actor
from tenants.key_cache import DENIED_MALFORMED, principal_lookup
from tenants.principals import Limits, Principal
from tenants.selectors import (
    DENIED_EXPIRED,
    DENIED_REVOKED,
    DENIED_ROTATED,
    DENIED_UNKNOWN,
    principal_from_api_key,
)
from tenants.services import api_key_touch, audit_record

__all__ = [
    "DENIED_EXPIRED", "DENIED_MALFORMED", "DENIED_REVOKED", "DENIED_ROTATED", "DENIED_UNKNOWN",
    "Actor", "Limits", "Principal", "api_key_touch", "audit_record", "principal_from_api_key",
    "principal_lookup",
]
