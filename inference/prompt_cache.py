"""A request's prompt-cache hints, as OpenAI names them (docs/api.md, "Prompt caching").

- ``prompt_cache_key``: requests of one tenant that share a long prefix say so with one key;
  routing keeps them on one engine (its rendezvous choice, inference/routing.py, as for an
  ``x-session-id`` conversation), where their prefix is cached. A hint only: it is scoped to
  the tenant, changes no output and costs nothing.
- ``prompt_cache_retention``: ``in_memory`` (the default: cached blocks are kept while there
  is room, least recently used first) or ``24h``, where the plan allows it
  (``extended_prompt_cache``): the prompt's blocks are kept in the engines' host tier ahead
  of other blocks for a day of disuse, within the tenant's share of it (engine/host_kv.py).
"""

from __future__ import annotations

from typing import Any

from core.errors import InvalidRequest
from tenants.facade import Principal

EXTENDED_RETENTION_S = 24 * 3600


def key_of(body: Any) -> str | None:
    """The validated body's ``prompt_cache_key``, if it has one."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    return key if isinstance(key, str) and key else None


def retention_s(body: Any, principal: Principal) -> float:
    """Seconds of disuse the prompt's cached blocks are kept ahead of others (0: as any);
    a 400 naming ``prompt_cache_retention`` when the plan does not allow it."""
    asked = body.get("prompt_cache_retention") if isinstance(body, dict) else None
    if asked != "24h":
        return 0.0
    if not principal.extended_prompt_cache:
        raise InvalidRequest("Your plan does not offer extended prompt caching; "
                             "'prompt_cache_retention' may only be 'in_memory'.",
                             param="prompt_cache_retention", code="invalid_value")
    return float(EXTENDED_RETENTION_S)
