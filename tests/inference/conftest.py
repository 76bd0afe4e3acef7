"""The live-server fixtures (tests/live.py): real Redis, the real ASGI app, engines; and
`run`, for tests that drive the admission scripts straight."""

import asyncio

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from tests.live import (  # noqa: F401
    adapter_store,
    api_server,
    engine_worker,
    redis_client,
    served_model,
    tenant_key,
)


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
