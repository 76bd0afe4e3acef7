"""Whose adapter leaves when device slots or host memory are full: fair between tenants.

An adapter belongs, for this purpose, to the tenant whose request used it last, with that
tenant's plan weight. A tenant's share of a tier is its weight over the weights of the
tenants holding adapters there; when something must leave, it is the least recently used
idle adapter of the tenant furthest over its share, counting the adapter being brought in
as held already by its tenant. So a tenant cycling through hundreds of adapters pushes its
own out, not another tenant's resident adapter.

A plan may also cap how many adapters its tenant holds in a tier at once
(``max_resident_adapters``): a tenant at its cap brings an adapter in only in place of its
own least recently used idle one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

Owner = tuple[str, float]  # (tenant, its plan's fair weight)
NOBODY: Owner = ("", 1.0)


def fair_victim(idle: Iterable[str], held: Iterable[str], owners: Mapping[str, Owner],
                incoming: Owner | None = None) -> str | None:
    """The adapter to let go of among ``idle`` (least recently used first), given all those
    ``held`` in the tier (idle ones included) and the tenant of the one coming in."""
    counts: dict[str, int] = {}
    weights: dict[str, float] = {}
    for adapter in held:
        tenant, weight = owners.get(adapter, NOBODY)
        counts[tenant] = counts.get(tenant, 0) + 1
        weights[tenant] = weight
    if incoming is not None:
        counts[incoming[0]] = counts.get(incoming[0], 0) + 1
        weights[incoming[0]] = incoming[1]
    oldest: dict[str, str] = {}  # tenant -> its least recently used idle adapter
    for adapter in idle:
        oldest.setdefault(owners.get(adapter, NOBODY)[0], adapter)
    if not oldest:
        return None
    tenant = max(oldest, key=lambda t: (counts[t] / weights[t], counts[t]))
    return oldest[tenant]


def tenant_of(adapter: str, owners: Mapping[str, Owner]) -> str:
    return owners.get(adapter, NOBODY)[0]


def own_oldest(idle: Iterable[str], owners: Mapping[str, Owner], tenant: str) -> str | None:
    """The tenant's least recently used adapter among ``idle``."""
    return next((a for a in idle if tenant_of(a, owners) == tenant), None)


def at_limit(tenant: str, held: Iterable[str], owners: Mapping[str, Owner],
             limits: Mapping[str, int]) -> bool:
    """The tenant holds as many of ``held`` as its plan allows (a tenant with no limit: never)."""
    limit = limits.get(tenant, 0)
    return bool(limit) and sum(tenant_of(a, owners) == tenant for a in held) >= limit


def over_limit(idle: Iterable[str], held: Iterable[str], owners: Mapping[str, Owner],
               limits: Mapping[str, int]) -> str | None:
    """The least recently used idle adapter of a tenant holding more of ``held`` than its
    plan allows (its limit was lowered, or its requests brought more in at once)."""
    if not limits:
        return None
    counts = Counter(tenant_of(a, owners) for a in held)
    return next((a for a in idle if 0 < limits.get(t := tenant_of(a, owners), 0) < counts[t]),
                None)
