"""Runs in child processes (multiprocessing, spawn): fires admissions straight at Redis."""

from __future__ import annotations

import asyncio
import time


def admit_many(redis_url: str, principal_json: str, count: int, start_at: float,
               tokens: int = 0, tag: str = "", cost_micros: int = 0) -> tuple[int, float, float]:
    """Tries `count` admissions at once, from `start_at` on; returns how many got in, and
    when the first started and the last ended."""
    import redis.asyncio as aioredis

    from core.errors import ApiError
    from inference.admission import admit
    from tenants.principals import Principal

    principal = Principal.decode(principal_json)

    async def run() -> tuple[int, float, float]:
        client = aioredis.Redis.from_url(redis_url)

        async def one(i: int) -> bool:
            try:
                await admit(client, principal=principal, request_id=f"{tag}-{i}",
                            prompt_tokens=tokens, max_tokens=0, lease_s=60,
                            cost_micros=cost_micros)
                return True
            except ApiError as exc:
                assert exc.status == 429, exc.body()
                return False

        await client.ping()  # connected before the start line
        time.sleep(max(0.0, start_at - time.time()))
        began = time.time()
        try:
            admitted = sum(await asyncio.gather(*(one(i) for i in range(count))))
            return admitted, began, time.time()
        finally:
            await client.aclose()

    return asyncio.run(run())
