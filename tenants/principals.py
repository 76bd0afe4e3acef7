"""What other apps see of an API key and its tenant: plain dataclasses, never models.

A Principal is also what the key cache holds (as JSON), so everything the
inference hot path needs (scopes, expiry, priority, limits) is in it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Limits:
    """One level's limits; None is "no limit at this level"."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    monthly_token_cap: int | None = None


def _smallest(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: an active API key of a tenant."""

    tenant_id: int
    tenant_slug: str
    api_key_id: int
    api_key_prefix: str
    scopes: tuple[str, ...] = ("inference",)
    expires_at: float | None = None  # unix seconds
    rotated: bool = False  # replaced by a new key; works until expires_at (the grace period)
    priority: int = 5  # the plan's priority class; lower runs first
    tenant_limits: Limits = field(default_factory=Limits)
    key_limits: Limits = field(default_factory=Limits)
    # The first key of the rotations this key comes from (0: itself); see key_lineage.
    lineage_key_id: int = 0
    # Days the plan keeps stored Responses API responses (None: the server's default).
    response_retention_days: int | None = None
    # Seconds the plan lets a resumable stream keep generating after its client disconnects,
    # at most (None: the server's default; 0: resumable streams are off).
    resume_grace_s: int | None = None
    # The service tiers the plan offers, the one a request asking for none gets, and the
    # tenant's weight in token-fair scheduling (docs/tiers.md).
    service_tiers: tuple[str, ...] = ("default", "flex")
    default_service_tier: str = "default"
    fair_weight: float = 1.0
    # The plan lets its tenants ask prompt_cache_retention "24h" (inference/prompt_cache.py).
    extended_prompt_cache: bool = False
    # Of the tenant's adapters, how many an engine holds at once (None: no plan limit).
    max_resident_adapters: int | None = None

    @property
    def key_lineage(self) -> int:
        """The key whose budgets and key-level counters this key's requests count against:
        the one it was rotated from (and so on back), so a rotation resets neither."""
        return self.lineage_key_id or self.api_key_id

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at

    @property
    def max_prompt_tokens(self) -> int | None:
        return _smallest(self.tenant_limits.max_prompt_tokens, self.key_limits.max_prompt_tokens)

    @property
    def max_output_tokens(self) -> int | None:
        return _smallest(self.tenant_limits.max_output_tokens, self.key_limits.max_output_tokens)

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes | dict[str, Any]) -> Principal:
        data = json.loads(raw) if isinstance(raw, str | bytes) else dict(raw)
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["scopes"] = tuple(data.get("scopes", ()))
        if "service_tiers" in data:
            data["service_tiers"] = tuple(data["service_tiers"])
        for level in ("tenant_limits", "key_limits"):
            data[level] = Limits(**data.get(level) or {})
        return cls(**data)
