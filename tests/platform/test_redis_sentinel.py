"""Redis Sentinel (docs/deploy.md#redis-high-availability): configured by environment, and
every kind of client Atrium makes follows a failover of a real master to its replica,
watched by three real sentinels."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from atrium.celery import celery_redis_url
from engine.redis_connect import RedisTarget, parse_sentinels
from tests.sentinel_set import SentinelSet

ROOT = Path(__file__).resolve().parents[2]


def test_sentinels_are_host_port_pairs():
    assert parse_sentinels(" a:26379, [::1]:26380 ,") == (("a", 26379), ("::1", 26380))
    for bad in ("a", "a:", ":1", "a:0", "a:99999", "a:x"):
        with pytest.raises(ValueError, match="ATRIUM_REDIS_SENTINELS"):
            parse_sentinels(bad)
    target = RedisTarget.from_env("redis://:pw@ignored:1/3", env={
        "ATRIUM_REDIS_SENTINELS": "s1:1,s2:2", "ATRIUM_REDIS_SENTINEL_MASTER": "m"})
    assert (target.master, target.wait_replicas) == ("m", 1)
    assert RedisTarget.from_env("redis://h:1/0", env={}).wait_replicas == 0


def test_celery_reaches_the_master_through_the_sentinels():
    url = celery_redis_url("redis://:secret@ignored:6379/4", (("s1", 26379), ("s2", 26380)))
    assert url == "sentinel://:secret@s1:26379/4;sentinel://:secret@s2:26380/4"
    assert celery_redis_url("redis://h:1/2") == "redis://h:1/2"


def test_a_malformed_sentinel_list_stops_a_process_with_one_line():
    env = {**os.environ, "ATRIUM_REDIS_SENTINELS": "nowhere",
           "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "atrium.cli", "create-tenant", "x"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ATRIUM_REDIS_SENTINELS: 'nowhere' is not host:port" in done.stderr


@pytest.fixture
def sentinel_set(tmp_path) -> Iterator[SentinelSet]:
    watched = SentinelSet(tmp_path)
    try:
        watched.start()
        yield watched
    finally:
        watched.stop()


def _until_answered(call, limit_s: float = 20.0) -> float:
    began = time.monotonic()
    while True:
        try:
            call()
            return time.monotonic() - began
        except redis.RedisError:
            assert time.monotonic() - began < limit_s, "no answer after the failover"
            time.sleep(0.05)


def test_every_client_follows_the_master_to_its_replica(sentinel_set, settings):
    from core import redis as core_redis
    from engine.worker import WorkerConfig, redis_options

    settings.REDIS_URL = sentinel_set.url
    settings.ATRIUM_REDIS_SENTINELS = parse_sentinels(sentinel_set.sentinels_env)
    core_redis.sync_client.cache_clear()
    core_redis._async_clients.clear()
    platform = core_redis.sync_client()
    engine = RedisTarget.from_env(sentinel_set.url, env={
        "ATRIUM_REDIS_SENTINELS": sentinel_set.sentinels_env}).client(
            **redis_options(WorkerConfig()))

    async def platform_async(value: str) -> str:
        client = core_redis.async_client()
        try:
            await client.set("async-key", value)
            return (await client.get("async-key")).decode()
        finally:
            core_redis._async_clients.clear()
            await client.aclose()

    try:
        platform.set("sync-key", "before")
        engine.xadd("atrium:test-stream", {"n": "1"})
        assert asyncio.run(platform_async("before")) == "before"
        old = sentinel_set.master.port
        sentinel_set.master.kill()

        waits = {
            "platform": _until_answered(lambda: platform.set("sync-key", "after")),
            "engine": _until_answered(lambda: engine.xadd("atrium:test-stream", {"n": "2"})),
            "platform async": _until_answered(lambda: asyncio.run(platform_async("after"))),
        }
        print({"failover_s": waits})
        new = sentinel_set.master_port()
        assert new == sentinel_set.replica.port != old
        for client in (platform, engine):
            assert client.info("server")["tcp_port"] == new
        assert platform.get("sync-key") == b"after"
        assert engine.xlen("atrium:test-stream") == 2  # the write before was replicated
        assert all(w < 10 for w in waits.values()), waits
    finally:
        core_redis.sync_client.cache_clear()
        platform.close()
        engine.close()


def test_an_engine_has_its_bills_confirmed_by_a_replica_and_passes_a_stalled_one(
        sentinel_set, caplog, monkeypatch, request):
    from engine.events import EventWriter

    # NOTE: heard at the writer's logger itself, whatever an earlier test in this process
    # did to the logging tree (in a shuffled order, the warning once never reached the
    # root logger's capture).
    logger = logging.getLogger("engine.events")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    logger.addHandler(caplog.handler)
    request.addfinalizer(lambda: logger.removeHandler(caplog.handler))

    client = sentinel_set.master.client()
    writer = EventWriter(client, model="m", engine_id="e", wait_replicas=1, wait_ms=300)

    def bill() -> float:
        batch = writer._batch()
        batch.add("xadd", "atrium:usage-test", {"n": "1"})
        batch.reported.append("req")  # a usage report: confirmed by a replica
        began = time.monotonic()
        writer._send(batch)
        return time.monotonic() - began

    assert bill() < 0.3 and "replica" not in caplog.text
    assert sentinel_set.replica.client().xlen("atrium:usage-test") == 1  # already there
    sentinel_set.replica.pause()  # a replica that does not answer: the master goes on
    try:
        assert bill() >= 0.3
        assert "reached 0 of 1 replica(s)" in caplog.text and not writer.backlog
    finally:
        sentinel_set.replica.resume()
        client.close()
