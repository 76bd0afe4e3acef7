"""A task cancelled while it waits with asyncio.wait_for (redis-py sends every command so)
is cancelled, whenever the cancel lands (core/cancellation.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from core import cancellation


def test_a_cancel_in_the_turn_the_awaited_future_finishes_is_not_lost():
    """The race 3.11's own wait_for loses: the caller cancelled in the loop turn in which
    what it waits for gets its result."""
    assert asyncio.wait_for is cancellation.wait_for  # installed as Django started

    async def main():
        done = asyncio.get_running_loop().create_future()
        after = []

        async def caller():
            await asyncio.wait_for(done, timeout=5)
            after.append("ran on")

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)  # it waits
        done.set_result(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return after

    assert asyncio.run(main()) == []


def test_what_wait_for_promises_is_kept():
    async def main():
        assert await cancellation.wait_for(asyncio.sleep(0, "x"), timeout=1) == "x"
        assert await cancellation.wait_for(asyncio.sleep(0, "y"), timeout=None) == "y"
        with pytest.raises(TimeoutError):
            await cancellation.wait_for(asyncio.sleep(5), timeout=0.01)
        finished = asyncio.ensure_future(asyncio.sleep(0, "z"))
        await asyncio.sleep(0.01)
        assert await cancellation.wait_for(finished, timeout=0) == "z"
        slow = asyncio.ensure_future(asyncio.sleep(5))
        with pytest.raises(TimeoutError):
            await cancellation.wait_for(slow, timeout=0)
        assert slow.cancelled()
        with pytest.raises(ValueError):
            await cancellation.wait_for(_raises(), timeout=1)

    asyncio.run(main())


async def _raises():
    raise ValueError("its own error")


def test_a_task_cancelled_at_any_point_of_its_redis_commands_stops(redis_client):
    """The product's own async client (core/redis.py), cancelled at random points of a loop
    of writes: every cancel stops the task (with 3.11's wait_for about two in three ran on)."""
    from core.redis import async_client

    async def main():
        redis = async_client()
        ran_on = 0
        for _ in range(300):
            async def writes():
                while True:
                    await redis.xadd("atrium:test:cancel", {"e": "x" * 50}, maxlen=100)
                    if asyncio.current_task().cancelling():
                        return "ran on"

            task = asyncio.create_task(writes())
            await asyncio.sleep(random.random() * 0.003)
            task.cancel()
            try:
                if await task == "ran on":
                    ran_on += 1
            except asyncio.CancelledError:
                pass
        await redis.aclose()
        return ran_on

    assert asyncio.run(main()) == 0
