"""The whole path: the official `openai` client calls the live API, a real engine serves it,
its usage report reaches the ledger with the key that made it, and the spend cap it feeds
refuses the next request."""

from __future__ import annotations

from decimal import Decimal

import pytest
from openai import OpenAI, RateLimitError

from billing import services
from billing.ingest import drain
from billing.models import UsageRecord
from tenants.access import SYSTEM
from tenants.models import Tenant
from tests.billing.conftest import prices
from tests.platform.conftest import (  # noqa: F401 - fixtures
    api_server,
    engine_worker,
    served_model,
    tenant_key,
)


@pytest.fixture
def client(api_server, tenant_key) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0,
                  timeout=60)


def _ledger_row(redis_client, request_id: str) -> UsageRecord:
    import time

    deadline = time.time() + 15
    while True:
        drain(redis_client)
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row is not None or time.time() > deadline:
            assert row is not None, "the usage report never reached the ledger"
            return row
        time.sleep(0.1)


def test_a_live_request_is_billed_once_to_its_key_and_feeds_the_cap(
        client, engine_worker, served_model, tenant_key, redis_client):  # noqa: F811
    from datetime import timedelta

    from django.utils import timezone

    prices(model=served_model, at=timezone.now() - timedelta(days=1), inp="1000000",
           cached="1000000", out="1000000")  # $1 a token: one request passes a $1 cap
    tenant = Tenant.objects.get(pk=tenant_key.tenant_id)
    services.tenant_spend_cap_update(tenant=tenant, actor=SYSTEM, monthly_limit=Decimal("1"))
    services.spend_caps_publish(tenant_ids=[tenant.pk])
    completion = client.completions.create(model=served_model, prompt="hello there",
                                           max_tokens=4)
    row = _ledger_row(redis_client, completion.id.removeprefix("cmpl-"))
    assert (row.api_key_id, row.tenant_id) == (tenant_key.key_id, tenant_key.tenant_id)
    assert row.api_key_prefix and tenant_key.key.startswith(row.api_key_prefix)
    assert row.prompt_tokens == completion.usage.prompt_tokens
    assert row.completion_tokens == completion.usage.completion_tokens
    assert row.cost == Decimal(completion.usage.total_tokens)
    with pytest.raises(RateLimitError) as refused:
        client.completions.create(model=served_model, prompt="again", max_tokens=4)
    assert refused.value.code == "insufficient_quota"
    assert UsageRecord.objects.count() == 1
