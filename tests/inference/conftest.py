"""The live-server fixtures (tests/live.py): real Redis, the real ASGI app, engines; and
`run`, for tests that drive the admission scripts straight."""

import asyncio

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from tests.inference.slow_engine import slow_factory
from tests.live import (  # noqa: F401
    adapter_store,
    api_server,
    engine_worker,
    redis_client,
    served_model,
    start_engine,
    tenant_key,
)


@pytest.fixture
def slow_engine(served_model, tiny_model_path, redis_client):  # noqa: F811
    """An engine that ignores EOS and takes 30 ms a step: a stream that lasts."""
    running = start_engine(tiny_model_path, served_model, "slow-engine",
                           engine_factory=slow_factory(0.03))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


@pytest.fixture
def run(redis_client):  # noqa: F811
    """Runs a coroutine taking a fresh async Redis client (the database is flushed)."""

    def runner(fn):
        async def main():
            client = aioredis.Redis.from_url(settings.REDIS_URL)
            try:
                return await fn(client)
            finally:
                await client.aclose()

        return asyncio.run(main())

    return runner
