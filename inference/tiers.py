"""A request's service tier (docs/tiers.md): what it asked for, what its plan offers, and
what the tier means for the engine's queue and for the bill."""

from __future__ import annotations

import math
import time

from django.conf import settings

from billing import facade as billing
from core.errors import InvalidRequest
from engine import protocol
from tenants.facade import Principal

# What a request may say, as OpenAI's service_tier: "auto" is the plan's default tier and
# "fast" another name for "priority" (the answer says "priority").
ASKED = ("auto", "default", "flex", "priority", "fast")
_ALIASES = {"fast": protocol.TIER_PRIORITY}
PRICE_CLASSES = {protocol.TIER_DEFAULT: billing.PRICE_CLASS_INTERACTIVE,
                 protocol.TIER_FLEX: billing.PRICE_CLASS_FLEX,
                 protocol.TIER_PRIORITY: billing.PRICE_CLASS_PRIORITY}
# The client's own timeout (the openai SDK sends it on every request, in seconds): a flex
# request waits for an engine at most this long, less FLEX_ANSWER_MARGIN_S for the answer
# to reach the client before it gives up.
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"
FLEX_ANSWER_MARGIN_S = 1.0


def resolve(asked: str | None, principal: Principal) -> str:
    """The tier a request runs in: the one it asked for, if its plan offers it (else a 400
    naming service_tier); the plan's default for none or "auto"."""
    if asked is None or asked == "auto":
        return principal.default_service_tier
    tier = _ALIASES.get(asked, asked)
    if tier not in principal.service_tiers:
        raise InvalidRequest(f"Your plan does not offer the '{asked}' service tier; it offers "
                             f"{', '.join(principal.service_tiers)} (or 'auto').",
                             param="service_tier", code="invalid_value")
    return tier


def asked_tier(body: object) -> str | None:
    """The service_tier a validated request body asked for."""
    asked = body.get("service_tier") if isinstance(body, dict) else None
    return asked if asked in ASKED else None


def queue_deadline(tier: str, client_timeout: str | None, deadline: float,
                   now: float | None = None) -> float | None:
    """Unix seconds by which a request of ``tier`` must have started, or None (it waits as
    long as it must): a flex request waits up to its client's timeout (the header's
    seconds, less the margin), else ATRIUM_FLEX_QUEUE_TIMEOUT_S; never past ``deadline``."""
    if tier != protocol.TIER_FLEX:
        return None
    now = time.time() if now is None else now
    wait = settings.ATRIUM_FLEX_QUEUE_TIMEOUT_S
    try:
        asked = float(client_timeout) if client_timeout is not None else math.nan
    except ValueError:
        asked = math.nan
    if math.isfinite(asked) and asked > 0:
        wait = max(0.0, asked - FLEX_ANSWER_MARGIN_S)
    return min(now + wait, deadline)


def echoed(tier: str) -> str:
    """The tier an answer names: a batch line's is the default one."""
    return protocol.TIER_DEFAULT if tier == protocol.TIER_BATCH else tier
