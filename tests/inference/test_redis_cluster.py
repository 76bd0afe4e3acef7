"""Quota admission and settlement on a Redis Cluster of three shards (tests/cluster_set.py):
every key one script touches carries its tenant's hash tag, so each call runs on the one
shard that owns the tenant, and different tenants land on different shards."""

from __future__ import annotations

import asyncio

import pytest

from billing import spend
from core.errors import QuotaExceeded, RateLimited
from inference import admission as quota
from tenants.principals import Limits, Principal
from tests.cluster_set import SHARDS, ClusterSet

TENANTS = range(1, 13)


@pytest.fixture
def cluster(tmp_path):
    running = ClusterSet(tmp_path)
    try:
        running.start()
        yield running
    finally:
        running.stop()


def _principal(tenant_id: int) -> Principal:
    return Principal(tenant_id=tenant_id, tenant_slug=f"t{tenant_id}", api_key_id=tenant_id,
                     api_key_prefix=f"atr_k{tenant_id}",
                     tenant_limits=Limits(requests_per_minute=3, tokens_per_minute=1000,
                                          max_concurrent_requests=2),
                     key_limits=Limits())


def test_admission_and_settle_run_on_a_three_shard_cluster(cluster):
    shards = {cluster.shard_of(quota.quota_key(t, "rpm")) for t in TENANTS}
    assert len(shards) == SHARDS  # the tenants are spread over every shard

    async def scenario() -> list[int]:
        client = cluster.async_client()
        left = []
        try:
            for tenant_id in TENANTS:
                who = _principal(tenant_id)
                first = await quota.admit(client, principal=who, request_id=f"a{tenant_id}",
                                          prompt_tokens=100, max_tokens=300, lease_s=60,
                                          end_user="someone")
                second = await quota.admit(client, principal=who, request_id=f"b{tenant_id}",
                                           prompt_tokens=10, max_tokens=10, lease_s=60)
                with pytest.raises(RateLimited):  # two in flight: its concurrency limit
                    await quota.admit(client, principal=who, request_id=f"c{tenant_id}",
                                      prompt_tokens=1, max_tokens=0, lease_s=60)
                await quota.settle(client, first, used_tokens=120)
                await quota.settle(client, second, used_tokens=20)
                third = await quota.admit(client, principal=who, request_id=f"d{tenant_id}",
                                          prompt_tokens=1, max_tokens=0, lease_s=60)
                left.append(third.headers()["x-ratelimit-remaining-requests"])
                with pytest.raises(RateLimited):  # three a minute: its request limit
                    await quota.admit(client, principal=who, request_id=f"e{tenant_id}",
                                      prompt_tokens=1, max_tokens=0, lease_s=60)
        finally:
            await client.aclose()
        return left

    assert asyncio.run(scenario()) == ["0"] * len(TENANTS)


def test_a_spent_cap_refuses_on_a_three_shard_cluster(cluster):
    month, _ = quota.month_window()
    with cluster.client() as client:  # as billing's periodic task writes them
        spend.caps_set(client, {t: 1_000_000 for t in TENANTS}, currency="USD")
        spend.spend_set(client, {(t, month): 1_500_000 for t in TENANTS if t % 2})

    async def scenario() -> list[bool]:
        client = cluster.async_client()
        refused = []
        try:
            for tenant_id in TENANTS:
                try:
                    await quota.precheck(client, principal=_principal(tenant_id),
                                         end_user="someone")
                    refused.append(False)
                except QuotaExceeded:
                    refused.append(True)
        finally:
            await client.aclose()
        return refused

    assert asyncio.run(scenario()) == [bool(t % 2) for t in TENANTS]
