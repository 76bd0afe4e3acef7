"""Budgets in the admission script against a real Redis: reservation, settlement, lapsed
reservations, the precheck, end users, alerts, and many processes racing one budget."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from django.conf import settings

from billing import budget_counters
from core.errors import QuotaExceeded
from inference import admission as quota
from tenants.principals import Limits, Principal
from tests.inference.admission_worker import admit_many

TENANT, KEY = 41, 9


def who(key_id: int = KEY, scopes: tuple[str, ...] = ("inference", "billing")) -> Principal:
    """A key that may read budgets (the billing scope) unless ``scopes`` say otherwise."""
    return Principal(tenant_id=TENANT, tenant_slug="acme", api_key_id=key_id,
                     api_key_prefix=f"atr_k{key_id}", scopes=scopes,
                     tenant_limits=Limits(requests_per_minute=100_000))


def define(redis_client, **by_field: tuple[int | None, int | None]) -> None:
    """Budgets by definition field, e.g. ``k:9:day=(spend micros, tokens)``."""
    budget_counters.defs_set(redis_client, {TENANT: {
        f.replace("__", ":"): budget_counters.Definition(i + 1, spend, tokens)
        for i, (f, (spend, tokens)) in enumerate(by_field.items())}})


_ids = iter(range(10**9))


async def admit(client, *, micros: int, tokens: int = 10, user: str | None = None,
                key_id: int = KEY, lease_s: float = 60,
                principal: Principal | None = None) -> quota.Admission:
    return await quota.admit(client, principal=principal or who(key_id),
                             request_id=f"r{next(_ids)}",
                             prompt_tokens=tokens, max_tokens=0, lease_s=lease_s,
                             cost_micros=micros, end_user=user)


def window(redis_client, scope_field: str, period: str = "day") -> dict[str, int]:
    label, _, _ = budget_counters.window_bounds(period)
    raw = redis_client.hgetall(budget_counters.counter_key(TENANT, scope_field, label))
    return {k.decode(): int(v.split()[0]) for k, v in raw.items()}


def test_reservations_fill_a_spend_budget_then_it_refuses_with_insufficient_quota(
        run, redis_client):
    define(redis_client, **{"k__9__day": (1000, None)})

    async def scenario(client):
        held = [await admit(client, micros=300) for _ in range(3)]
        with pytest.raises(QuotaExceeded) as refused:
            await admit(client, micros=300)
        small = await admit(client, micros=100)  # what is left still admits a smaller one
        return held, refused.value, small

    held, refused, small = run(scenario)
    assert refused.status == 429 and refused.code == "insufficient_quota"
    assert "daily spend budget of API key atr_k9" in refused.message
    assert refused.headers["x-should-retry"] == "false"
    assert refused.headers["x-budget-scope"] == "key/day"
    assert refused.headers["x-budget-remaining-spend"] == "0.0001"
    assert small.headers()["x-budget-remaining-spend"] == "0.00"
    state = window(redis_client, "k:9")
    assert (state["rs"], state.get("s", 0), state["a"]) == (1000, 0, 100)
    assert sum(1 for f in state if f.startswith("h:")) == 4
    other_key = run(lambda client: admit(client, micros=900, key_id=KEY + 1))
    assert other_key.budget_windows == []  # the budget is the key's alone


def test_settling_replaces_the_reservation_with_the_cost_once(run, redis_client):
    define(redis_client, **{"t__-__month": (10_000, 500)})

    async def scenario(client):
        admission = await admit(client, micros=4000, tokens=100)
        await quota.settle(client, admission, used_tokens=30, cost_micros=1200)
        admission.settled = False  # a second settle (a retry) changes nothing
        await quota.settle(client, admission, used_tokens=30, cost_micros=1200)

    run(scenario)
    state = window(redis_client, "t:-", "month")
    assert (state["s"], state["t"], state["rs"], state["rt"]) == (1200, 30, 0, 0)
    assert not any(f.startswith("h:") for f in state)


def test_a_key_that_may_not_read_budgets_learns_no_figures_from_its_answers(
        run, redis_client):
    define(redis_client, **{"k__9__day": (1000, None)})
    inference_only = who(scopes=("inference",))

    async def scenario(client):
        admitted = await admit(client, micros=600, principal=inference_only)
        with pytest.raises(QuotaExceeded) as refused:
            await admit(client, micros=600, principal=inference_only)
        return admitted, refused.value

    admitted, refused = run(scenario)
    assert not [h for h in admitted.headers() if h.startswith("x-budget-")]
    assert not [h for h in refused.headers if h.startswith("x-budget-")]
    assert "daily spend budget of API key atr_k9" in refused.message
    assert "0.0006" not in refused.message and "0.001" not in refused.message
    assert refused.headers["x-should-retry"] == "false"


def test_a_token_budget_counts_prompt_and_completion(run, redis_client):
    define(redis_client, **{"t__-__day": (None, 100)})

    async def scenario(client):
        await admit(client, micros=0, tokens=60)
        with pytest.raises(QuotaExceeded) as refused:
            await admit(client, micros=0, tokens=41)
        await admit(client, micros=0, tokens=40)
        return refused.value

    refused = run(scenario)
    assert "daily token budget of tenant 'acme' (100 tokens; 60 used or reserved" \
        in refused.message
    assert refused.headers["x-budget-remaining-tokens"] == "40"


def test_a_reservation_whose_lease_lapsed_is_released_when_the_budget_is_full(
        run, redis_client):
    define(redis_client, **{"k__9__day": (1000, None)})

    async def scenario(client):
        await admit(client, micros=1000, lease_s=0.2)  # its web process "dies" holding it
        with pytest.raises(QuotaExceeded):
            await admit(client, micros=500)
        time.sleep(0.3)
        return await admit(client, micros=500)

    assert run(scenario).budget_windows[0].spend_used_micros == 500
    assert window(redis_client, "k:9")["rs"] == 500


def test_the_precheck_refuses_a_spent_budget_and_takes_nothing(run, redis_client):
    define(redis_client, **{"k__9__month": (1000, None)})

    async def scenario(client):
        await quota.precheck(client, principal=who())
        before = window(redis_client, "k:9", "month")
        admission = await admit(client, micros=1000)
        with pytest.raises(QuotaExceeded) as refused:
            await quota.precheck(client, principal=who())
        return before, admission, refused.value

    before, _, refused = run(scenario)
    assert before == {}
    assert refused.code == "insufficient_quota"
    assert window(redis_client, "k:9", "month")["rs"] == 1000


def test_each_end_user_has_a_window_of_their_own_and_a_named_one_overrides(
        run, redis_client):
    define(redis_client, **{"u__*__day": (1000, None),
                            f"u__{budget_counters.user_subject('vip')}__day": (5000, None)})

    async def scenario(client):
        await admit(client, micros=1000, user="alice")
        await admit(client, micros=1000, user="bob")  # bob's own window
        with pytest.raises(QuotaExceeded) as alice:
            await admit(client, micros=1, user="alice")
        await admit(client, micros=4000, user="vip")  # vip's own, larger budget
        await admit(client, micros=5000)  # no user: no end-user budget applies
        return alice.value

    refused = run(scenario)
    assert "daily spend budget of end user 'alice'" in refused.message
    assert refused.headers["x-budget-scope"] == "user/day"


def test_thresholds_are_alerted_once_each_as_spend_settles(run, redis_client):
    define(redis_client, **{"k__9__day": (1000, None)})

    async def spend(client, cost):
        admission = await admit(client, micros=cost)
        await quota.settle(client, admission, used_tokens=1, cost_micros=cost)

    async def scenario(client):
        for cost in (400, 50, 100, 100, 100, 200):  # 40, 45, 55, 65, 75, 95%
            await spend(client, cost)
        with pytest.raises(QuotaExceeded):  # refused: its 100% alert
            await admit(client, micros=100)
        with pytest.raises(QuotaExceeded):  # refused again: no second alert
            await admit(client, micros=100)

    run(scenario)
    entries = budget_counters.alerts_pending(redis_client, TENANT, limit=100)
    reached = sorted(int(e.split("|")[2]) for e in entries)
    assert reached == [50, 80, 100]
    spent_at = {int(e.split("|")[2]): int(e.split("|")[3]) for e in entries}
    assert spent_at[50] == 550 and spent_at[80] == 950  # 75% -> 95%: 80 once, not 90


def test_many_processes_racing_one_budget_never_overshoot_it(redis_client):
    """Four processes fire 50 admissions each at once; the budget holds 37 of them."""
    define(redis_client, **{"t__-__day": (37 * 1000, None)})
    principal = who().encode()
    start_at = time.time() + 2.0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(admit_many, [
            (settings.REDIS_URL, principal, 50, start_at, 10, f"p{i}", 1000)
            for i in range(4)])
    assert sum(admitted for admitted, _, _ in results) == 37
    assert window(redis_client, "t:-")["rs"] == 37 * 1000
