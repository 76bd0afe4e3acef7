"""The admission script against a real Redis: every limit, settlement, and many processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
from django.conf import settings

from core.errors import QuotaExceeded, RateLimited
from inference import admission as quota
from tenants.principals import Limits, Principal
from tests.inference.admission_worker import admit_many


def principal(tenant_id: int = 1, key_id: int = 1, *, key: Limits | None = None,
              **tenant_limits) -> Principal:
    limits = {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000,
              "max_concurrent_requests": 100, **tenant_limits}
    return Principal(tenant_id=tenant_id, tenant_slug=f"t{tenant_id}", api_key_id=key_id,
                     api_key_prefix=f"atr_k{key_id}", tenant_limits=Limits(**limits),
                     key_limits=key or Limits())


_ids = iter(range(10**9))


async def admit(client, who: Principal, *, prompt: int = 1, max_tokens: int = 0,
                lease_s: float = 60) -> quota.Admission:
    return await quota.admit(client, principal=who, request_id=f"r{next(_ids)}",
                             prompt_tokens=prompt, max_tokens=max_tokens, lease_s=lease_s)


def test_requests_per_minute_admits_the_limit_then_429s_with_retry_after(run):
    who = principal(requests_per_minute=3)

    async def scenario(client):
        admitted = [await admit(client, who) for _ in range(3)]
        with pytest.raises(RateLimited) as refused:
            await admit(client, who)
        return admitted, refused.value

    admitted, refused = run(scenario)
    assert [a.state.remaining_requests for a in admitted] == [2, 1, 0]
    assert refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert refused.type == "requests"
    assert 1 <= int(refused.headers["retry-after"]) <= 20
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_the_precheck_refuses_a_caller_at_a_limit_and_takes_nothing(run, redis_client):
    who = principal(requests_per_minute=2, max_concurrent_requests=5)
    crowded = principal(tenant_id=2, key_id=2, max_concurrent_requests=1)

    async def scenario(client):
        await quota.precheck(client, principal=who)  # under every limit: passes...
        snapshot = sorted(redis_client.keys("atrium:quota:*"))
        await quota.precheck(client, principal=who)
        assert sorted(redis_client.keys("atrium:quota:*")) == snapshot  # ...taking nothing
        admitted = [await admit(client, who) for _ in range(2)]  # both still admitted
        with pytest.raises(RateLimited) as at_rpm:
            await quota.precheck(client, principal=who)
        await admit(client, crowded)
        with pytest.raises(RateLimited) as at_concurrency:
            await quota.precheck(client, principal=crowded)
        return admitted, at_rpm.value, at_concurrency.value

    admitted, at_rpm, at_concurrency = run(scenario)
    assert [a.state.remaining_requests for a in admitted] == [1, 0]
    assert at_rpm.type == "requests" and "requests per minute" in at_rpm.message
    assert at_rpm.headers["x-ratelimit-remaining-requests"] == "0"
    assert "concurrent requests" in at_concurrency.message


def test_tokens_per_minute_reserves_prompt_plus_max_tokens_and_refunds_the_unused(run):
    who = principal(tokens_per_minute=1000)

    async def scenario(client):
        first = await admit(client, who, prompt=100, max_tokens=300)
        await admit(client, who, prompt=100, max_tokens=300)
        with pytest.raises(RateLimited) as refused:
            await admit(client, who, prompt=100, max_tokens=300)
        assert refused.value.type == "tokens"
        await quota.settle(client, first, used_tokens=120)  # 280 of 400 come back
        again = await admit(client, who, prompt=100, max_tokens=300)
        return first, again

    first, again = run(scenario)
    assert first.state.remaining_tokens == 600
    assert 70 <= again.state.remaining_tokens <= 80  # 1000 - 120 - 400 - 400, plus refill


def test_a_request_larger_than_the_token_limit_is_refused_without_retry(run):
    async def scenario(client):
        with pytest.raises(RateLimited) as refused:
            await admit(client, principal(tokens_per_minute=100), prompt=50, max_tokens=51)
        return refused.value

    refused = run(scenario)
    assert refused.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.headers and "too large" in refused.message


def test_concurrency_counts_in_flight_requests_until_they_settle(run):
    who = principal(max_concurrent_requests=2)

    async def scenario(client):
        first = await admit(client, who)
        await admit(client, who)
        with pytest.raises(RateLimited):
            await admit(client, who)
        await quota.settle(client, first, used_tokens=1)
        return await admit(client, who)

    assert run(scenario).request_id


def test_a_slot_held_by_a_crashed_process_frees_itself_when_its_lease_ends(run):
    who = principal(max_concurrent_requests=1)

    async def scenario(client):
        await admit(client, who, lease_s=0.2)  # never settled, as if its process died
        with pytest.raises(RateLimited):
            await admit(client, who)
        await asyncio.sleep(0.3)
        return await admit(client, who)

    assert run(scenario)


def test_monthly_token_cap_is_insufficient_quota_until_the_month_resets(run):
    who = principal(monthly_token_cap=1000)

    async def scenario(client):
        first = await admit(client, who, prompt=100, max_tokens=500)
        with pytest.raises(QuotaExceeded) as refused:
            await admit(client, who, prompt=100, max_tokens=500)
        await quota.settle(client, first, used_tokens=150)
        await admit(client, who, prompt=100, max_tokens=500)  # 150 + 600 fit
        return refused.value

    refused = run(scenario)
    assert (refused.status, refused.code, refused.type) == (429, "insufficient_quota",
                                                            "insufficient_quota")
    _, reset_ms = quota.month_window()
    assert abs(int(refused.headers["retry-after"]) - (reset_ms / 1000 - time.time())) < 5
    assert refused.headers["x-should-retry"] == "false"


def test_a_keys_own_limit_binds_that_key_only(run):
    narrow = principal(key_id=1, key=Limits(requests_per_minute=1))
    sibling = principal(key_id=2)

    async def scenario(client):
        await admit(client, narrow)
        with pytest.raises(RateLimited) as refused:
            await admit(client, narrow)
        await admit(client, sibling)
        return refused.value

    refused = run(scenario)
    assert "API key atr_k1" in refused.message
    assert refused.headers["x-ratelimit-limit-requests"] == "1"


def test_keys_of_one_tenant_share_its_limits(run):
    async def scenario(client):
        await admit(client, principal(key_id=1, requests_per_minute=2))
        await admit(client, principal(key_id=2, requests_per_minute=2))
        with pytest.raises(RateLimited) as refused:
            await admit(client, principal(key_id=3, requests_per_minute=2))
        return refused.value

    assert "tenant 't1'" in run(scenario).message


def test_a_burst_from_one_tenant_leaves_another_tenants_limits_alone(run):
    a, b = principal(1, 1, requests_per_minute=5), principal(2, 2, requests_per_minute=5)

    async def scenario(client):
        results = await asyncio.gather(*(admit(client, a) for _ in range(50)),
                                       return_exceptions=True)
        b_first = await admit(client, b)
        return results, b_first

    results, b_first = run(scenario)
    assert sum(isinstance(r, quota.Admission) for r in results) == 5
    assert b_first.state.remaining_requests == 4


def test_settling_twice_refunds_once(run):
    who = principal(tokens_per_minute=1000)

    async def scenario(client):
        first = await admit(client, who, prompt=10, max_tokens=490)
        assert await quota.settle(client, first, used_tokens=0)
        first.settled = False  # as if a second process settled the same request
        assert not await quota.settle(client, first, used_tokens=0)
        return await admit(client, who, prompt=500)

    assert run(scenario).state.remaining_tokens >= 499


def test_reset_durations_read_like_openais():
    assert quota.format_duration(20) == "20ms"
    assert quota.format_duration(1500) == "1.5s"
    assert quota.format_duration(360_000) == "6m0s"
    assert quota.format_duration(61_250) == "1m1.25s"


@pytest.mark.parametrize("limit_name, limit, tokens", [
    ("requests_per_minute", 37, 0),
    ("max_concurrent_requests", 11, 0),
    ("tokens_per_minute", 3000, 100),
])
def test_many_processes_never_admit_more_than_the_limit(redis_client, limit_name, limit,
                                                        tokens):
    who = principal(**{limit_name: limit})
    processes, per_process = 4, 40
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        start_at = time.time() + 2.0  # every child fires at the same moment
        results = pool.starmap(admit_many, [
            (settings.REDIS_URL, who.encode(), per_process, start_at, tokens, f"p{i}")
            for i in range(processes)])
    admitted = sum(r[0] for r in results)
    elapsed = max(r[2] for r in results) - min(r[1] for r in results)
    # Per-minute buckets refill while the burst runs (a slow machine may stretch it).
    refill = 0 if limit_name == "max_concurrent_requests" else elapsed * limit / 60
    allowed = int((limit + refill) // tokens) if tokens else int(limit + refill)
    assert processes * per_process > allowed
    assert (limit // tokens if tokens else limit) <= admitted <= allowed, (results, allowed)
