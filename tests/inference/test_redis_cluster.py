"""Quota admission and settlement on a Redis Cluster of three shards (tests/cluster_set.py):
every key one script touches carries its tenant's hash tag, so each call runs on the one
shard that owns the tenant, and different tenants land on different shards."""

from __future__ import annotations

import asyncio

import pytest

from billing import spend_counters
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
        spend_counters.caps_set(client, {t: 1_000_000 for t in TENANTS}, currency="USD")
        spend_counters.spend_set(client, {(t, month): 1_500_000 for t in TENANTS if t % 2})

    refused = _refused_per_tenant(cluster, lambda client, tenant_id: quota.precheck(
        client, principal=_principal(tenant_id), end_user="someone"))
    assert refused == [bool(t % 2) for t in TENANTS]


def _refused_per_tenant(cluster, call) -> list[bool]:
    """Whether ``call(client, tenant_id)`` raised QuotaExceeded, for each tenant in turn."""
    async def scenario() -> list[bool]:
        client = cluster.async_client()
        refused = []
        try:
            for tenant_id in TENANTS:
                try:
                    await call(client, tenant_id)
                    refused.append(False)
                except QuotaExceeded:
                    refused.append(True)
        finally:
            await client.aclose()
        return refused

    return asyncio.run(scenario())


def _models_on_two_shards(cluster) -> list[str]:
    """Two model names whose keys (protocol.model_prefix) live on different shards."""
    from engine import protocol

    names, shards = [], set()
    for i in range(64):
        name = f"tiny-{i}"
        shard = cluster.shard_of(protocol.model_prefix(name))
        if shard not in shards:
            names.append(name)
            shards.add(shard)
        if len(names) == 2:
            return names
    raise AssertionError("no two model names on two shards")


def test_the_events_path_runs_on_a_three_shard_cluster(cluster, tiny_model_path, monkeypatch,
                                                        db):
    """Two models' engines on a cluster (ATRIUM_REDIS_CLUSTER, as an operator sets it): the
    web tier places, relays and cancels their requests, every MULTI of the engines (events,
    usage report, XACK) lands in its model's slot, and billing ingests each model's usage
    stream into the ledger."""
    import threading
    import time

    from billing.ingest import drain
    from billing.models import UsageRecord
    from engine import protocol
    from engine.redis_connect import RedisTarget
    from engine.worker import WorkerConfig, run_worker
    from inference.dispatch import Dispatch
    from inference.event_hub import EventHub
    from tests.engine.engine_testing import make_request
    from tests.factories import tenant_factory

    monkeypatch.setenv("ATRIUM_REDIS_CLUSTER", "true")
    url = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    models = _models_on_two_shards(cluster)
    tenant = tenant_factory()
    stop, errors, threads = threading.Event(), [], []

    def serve(model: str) -> None:
        try:
            run_worker(redis_url=url, model_dir=tiny_model_path, model_name=model,
                       engine_id=f"engine-{model}", stop=stop,
                       config=WorkerConfig(idle_block_ms=20, drain_s=0))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    for model in models:
        threads.append(threading.Thread(target=serve, args=(model,), daemon=True))
        threads[-1].start()

    async def one(client, hub, model: str, *, cancel: bool) -> int:
        request = make_request([5, 6, 7, 8] * 4, model=model, max_tokens=200 if cancel else 8,
                               ignore_eos=cancel)
        request.tenant_id = str(tenant.pk)
        dispatch = Dispatch(client, request, time.time() + 60, hub.subscribe())
        await dispatch.submit()
        async for event in dispatch.events():
            if event is not None and cancel and event.type == protocol.EV_DELTA:
                await dispatch.cancel()
                await dispatch.wait_final(10)
                break
            if event is not None and event.is_final:
                break
        return dispatch.counted_usage()["completion_tokens"]

    async def scenario():
        client = RedisTarget.from_env(url).async_client()
        assert type(client).__name__ == "RedisCluster"
        hub = EventHub(client)
        try:
            deadline = time.time() + 60
            while len(await protocol.live_heartbeats_async(client, time.time())) < 2:
                assert time.time() < deadline and not errors, errors
                await asyncio.sleep(0.1)
            # A request of the other model on this model's stream (naming its own model's
            # notify stream, in another slot): refused, and the engine goes on writing.
            stray = make_request([5, 6], model=models[1],
                                 notify=protocol.notify_stream(models[1], "stray"))
            await client.xadd(protocol.request_stream(models[0]), stray.encode())
            while not await client.xlen(protocol.events_stream(models[0], stray.request_id)):
                assert time.time() < deadline and not errors, errors
                await asyncio.sleep(0.1)
            return await asyncio.gather(*(one(client, hub, m, cancel=c)
                                          for m in models for c in (False, True)))
        finally:
            await client.aclose()

    try:
        results = asyncio.run(scenario())
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    assert results[0::2] == [8, 8]  # finished
    assert all(0 < tokens < 200 for tokens in results[1::2]), results  # cancelled

    client = RedisTarget.from_env(url).client()
    try:
        streams = protocol.usage_streams(client)
        assert streams == sorted(protocol.usage_stream(m) for m in models)
        assert len({cluster.shard_of(s) for s in streams}) == 2
        assert drain(client) == 4  # two requests of each model: one ledger row each
    finally:
        client.close()
    rows = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(rows.values_list("model", flat=True)) == sorted(models * 2)


def test_the_platform_reaches_a_cluster_its_settings_name(cluster, settings):
    """ATRIUM_REDIS_CLUSTER: the platform's clients (core/redis.py) are cluster clients:
    each reaches keys on every shard, and a message published reaches a subscriber."""
    from core import redis as core_redis

    settings.REDIS_URL = f"redis://127.0.0.1:{cluster.nodes[1].port}/0"
    settings.ATRIUM_REDIS_CLUSTER = True
    keys = [f"k{i}" for i in range(12)]
    assert {cluster.shard_of(k) for k in keys} == set(range(SHARDS))
    core_redis.sync_client.cache_clear()
    try:
        client = core_redis.sync_client()
        for key in keys:
            client.set(key, key)

        async def read() -> tuple[list[bytes], bytes]:
            aclient = core_redis.async_client()
            pubsub = await core_redis.async_pubsub()  # as the adapter events socket listens
            try:
                await pubsub.subscribe("atrium:adapters:events:7")
                await asyncio.sleep(0.2)
                client.publish("atrium:adapters:events:7", "news")  # as adapters publish
                async with asyncio.timeout(10):
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            break
                return [await aclient.get(k) for k in keys], message["data"]
            finally:
                await pubsub.aclose()
                await aclient.aclose()
                core_redis._async_clients.clear()

        assert asyncio.run(read()) == ([k.encode() for k in keys], b"news")
    finally:
        core_redis.sync_client.cache_clear()


def test_a_cluster_needs_a_broker_of_its_own_and_no_sentinels():
    """Celery cannot use a cluster; a cluster has no Sentinel and no database but 0."""
    import subprocess
    import sys

    from engine.redis_connect import RedisTarget

    with pytest.raises(ValueError, match="exclude each other"):
        RedisTarget.from_env("redis://n1:7000/0", {"ATRIUM_REDIS_CLUSTER": "true",
                                                   "ATRIUM_REDIS_SENTINELS": "s1:26379"})
    with pytest.raises(ValueError, match="database 0 only"):
        RedisTarget.from_env("redis://n1:7000/3", {"ATRIUM_REDIS_CLUSTER": "yes"})
    with pytest.raises(ValueError, match="true or false"):
        RedisTarget.from_env("redis://n1:7000/0", {"ATRIUM_REDIS_CLUSTER": "maybe"})
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "platform:.", "ATRIUM_REDIS_CLUSTER": "1",
           "REDIS_URL": "redis://127.0.0.1:7000/0", "DJANGO_SETTINGS_MODULE": "atrium.settings"}
    refused = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "ATRIUM_BROKER_URL" in refused.stderr
    env["ATRIUM_BROKER_URL"] = "redis://127.0.0.1:6380/0"
    broker = subprocess.run([sys.executable, "-c", "import django; django.setup(); "
                             "from django.conf import settings; "
                             "print(settings.CELERY_BROKER_URL)"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert broker.stdout.strip() == "redis://127.0.0.1:6380/0", broker.stderr


def test_budgets_of_tenants_on_every_shard_are_published_and_enforced(cluster):
    """billing's publish writes many tenants' budget definitions at once (each tenant's
    keys on its own shard), and admission enforces each tenant's."""
    from billing import budget_counters

    assert {cluster.shard_of(budget_counters.defs_key(t)) for t in TENANTS} == set(range(SHARDS))
    with cluster.client() as client:
        budget_counters.defs_set(client, {t: {"t:-:day": budget_counters.Definition(t, 1000, None)}
                                  for t in TENANTS})
        budget_counters.defs_set(client, {TENANTS[0]: {}})  # a tenant whose budgets were deleted

    refused = _refused_per_tenant(cluster, lambda client, tenant_id: quota.admit(
        client, principal=_principal(tenant_id), request_id=f"b{tenant_id}", prompt_tokens=1,
        max_tokens=0, lease_s=60, cost_micros=5000))
    assert refused == [False] + [True] * (len(TENANTS) - 1)
