"""Factories for tenants' data, through the real services (so audit and cache stay true)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

_seq = itertools.count(1)


def plan_factory(**overrides: Any):
    from tenants.access import SYSTEM
    from tenants.services import plan_create

    n = next(_seq)
    values = {"slug": f"plan-{n}", "name": f"Plan {n}", "priority": 5,
              "requests_per_minute": 1000, "tokens_per_minute": 1_000_000,
              "max_concurrent_requests": 100, **overrides}
    return plan_create(actor=SYSTEM, **values)


def tenant_factory(slug: str | None = None, **kwargs: Any):
    from tenants.services import tenant_create

    slug = slug or f"tenant-{next(_seq)}"
    return tenant_create(name=slug.title(), slug=slug, **kwargs)


def user_factory(email: str | None = None, **kwargs: Any):
    from tenants.services import user_create

    return user_create(email=email or f"user{next(_seq)}@example.com", **kwargs)


def member_factory(tenant, role: str, **user_kwargs: Any):
    from tenants.services import membership_create

    user = user_factory(**user_kwargs)
    membership_create(tenant=tenant, user=user, role=role)
    return user


@dataclass
class Key:
    id: int
    plaintext: str
    prefix: str


def key_factory(tenant, scopes=("inference",), **kwargs: Any) -> Key:
    from tenants.services import api_key_create

    key, plaintext = api_key_create(tenant=tenant, name=f"key {next(_seq)}",
                                    scopes=list(scopes), **kwargs)
    return Key(id=key.pk, plaintext=plaintext, prefix=key.prefix)
