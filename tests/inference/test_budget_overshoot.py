"""A budget under concurrency, end to end: 200 requests at once through two web processes
against a spend budget that pays for about half of them. Reservation at admission means
the ledger's spend never passes the budget, and Redis's count of it equals the ledger's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest

from billing import budget_counters
from billing.ingest import drain
from billing.models import UsageRecord
from billing.money import micros
from billing.services import budget_create, price_create
from tenants.access import SYSTEM
from tests.inference.test_rate_limits import _up, _web_process, make_caller
from tests.live import free_port, start_engine
from tests.waiting import wait_for

REQUESTS = 200
PROMPT = list(range(10, 20))  # 10 prompt tokens
MAX_TOKENS = 8
# 10 x 1000/M + 8 x 2000/M = 0.026 a request; the budget pays for 100 of them.
BUDGET = Decimal("2.60")


@pytest.mark.live  # two web processes
def test_two_web_processes_never_spend_past_a_budget(transactional_db, served_model,
                                                     tiny_model_path, redis_client):
    price_create(model=served_model, input_per_million=Decimal(1000),
                 cached_input_per_million=Decimal(1000), output_per_million=Decimal(2000))
    caller = make_caller(requests_per_minute=100_000, tokens_per_minute=10_000_000,
                         max_concurrent_requests=1000)
    budget_create(tenant=caller.tenant, actor=SYSTEM, scope="key", window="day",
                  api_key_id=caller.key_id, spend_limit=BUDGET)
    engine = start_engine(tiny_model_path, served_model, "budget-engine")
    ports = [free_port(), free_port()]
    servers = [_web_process(port, tiny_model_path) for port in ports]

    def one(i: int) -> tuple[int, str]:
        response = httpx.post(
            f"http://127.0.0.1:{ports[i % 2]}/v1/completions", timeout=120,
            headers={"Authorization": f"Bearer {caller.key}"},
            json={"model": served_model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                  "ignore_eos": True, "temperature": 0})
        code = response.json()["error"]["code"] if response.status_code != 200 else ""
        return response.status_code, code

    try:
        for port in ports:
            wait_for(lambda p=port: _up(p), timeout=30, what="the web process")
        with ThreadPoolExecutor(100) as pool:
            answers = list(pool.map(one, range(REQUESTS)))
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=10)
        engine.stop.set()
        engine.thread.join(timeout=30)
    admitted = sum(status == 200 for status, _ in answers)
    assert set(answers) <= {(200, ""), (429, "insufficient_quota")}, set(answers)
    assert 80 <= admitted <= 100, admitted  # about half: the budget pays for 100

    drain(redis_client)
    ledger = UsageRecord.objects.filter(tenant_id=caller.tenant_id)
    assert ledger.count() == admitted
    spent = sum((r.cost for r in ledger), Decimal(0))
    assert spent <= BUDGET, spent
    label, _, _ = budget_counters.window_bounds("day")
    state = budget_counters.window_states(redis_client, [budget_counters.counter_key(
        caller.tenant_id, f"k:{caller.key_id}", label)])
    (window,) = state.values()
    assert window.spent_micros == micros(spent)  # Redis's count is the ledger's
    assert (window.reserved_micros, window.reserved_tokens) == (0, 0)
