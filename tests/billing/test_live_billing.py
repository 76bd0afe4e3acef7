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
from tests.live import (  # noqa: F401 - fixtures
    api_server,
    engine_worker,
    served_model,
    tenant_key,
)
from tests.requestlogs.conftest import wait_for_logs


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
    row = _ledger_row(redis_client, completion.id)
    assert (row.api_key_id, row.tenant_id) == (tenant_key.key_id, tenant_key.tenant_id)
    assert row.api_key_prefix and tenant_key.key.startswith(row.api_key_prefix)
    assert row.prompt_tokens == completion.usage.prompt_tokens
    assert row.completion_tokens == completion.usage.completion_tokens
    assert row.cost == Decimal(completion.usage.total_tokens)
    with pytest.raises(RateLimitError) as refused:
        client.completions.create(model=served_model, prompt="again", max_tokens=4)
    assert refused.value.code == "insufficient_quota"
    assert UsageRecord.objects.count() == 1


def _over_websocket(base_url: str, key: str, endpoint: str, body: dict
                    ) -> tuple[set[str], dict]:
    """The ids of a websocket request's chunks, and its usage chunk."""
    import json

    from websockets.sync.client import connect

    url = base_url.replace("http://", "ws://") + "/v1/stream"
    ids, usage = set(), None
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "w", "endpoint": endpoint,
                            "body": {**body, "stream_options": {"include_usage": True}}}))
        while (message := json.loads(ws.recv(timeout=30)))["type"] == "chunk":
            ids.add(message["data"]["id"])
            usage = message["data"].get("usage") or usage
    assert message["type"] == "done", message
    return ids, usage


def test_the_id_a_client_got_finds_its_charge_in_the_usage_api_exports_and_request_log(
        client, engine_worker, served_model, tenant_key, redis_client, export_dir,  # noqa: F811
        api_server):  # noqa: F811
    import csv
    import io
    import json
    from datetime import timedelta

    from django.utils import timezone
    from rest_framework.test import APIClient

    from billing.exports import export_storage
    from tests.factories import member_factory

    prices(model=served_model, at=timezone.now() - timedelta(days=1))
    used: dict[str, int] = {}  # response id -> completion tokens, as the response said
    chat = client.chat.completions.create(model=served_model, max_tokens=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    used[chat.id] = chat.usage.completion_tokens
    chunks = list(client.completions.create(model=served_model, prompt="Once", max_tokens=4,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    [streamed] = {c.id for c in chunks}
    assert streamed.startswith("cmpl-")
    used[streamed] = chunks[-1].usage.completion_tokens
    for endpoint, body in (("chat.completions", {"messages": [{"role": "user",
                                                              "content": "Yo"}]}),
                           ("completions", {"prompt": "Twice"})):
        [over_ws], usage = _over_websocket(api_server, tenant_key.key, endpoint,
                                           {"model": served_model, "max_tokens": 2, **body})
        used[over_ws] = usage["completion_tokens"]
    assert {i.split("-")[0] for i in used} == {"chatcmpl", "cmpl"} and len(used) == 4

    for request_id in used:
        _ledger_row(redis_client, request_id)
    wait_for_logs(4)
    tenant = Tenant.objects.get(pk=tenant_key.tenant_id)
    owner = APIClient()
    owner.force_login(member_factory(tenant, "owner"))
    for request_id, completion_tokens in used.items():
        charge = owner.get(f"/api/v1/tenants/{tenant.slug}/usage/requests/{request_id}")
        assert charge.status_code == 200, charge.content
        assert charge.json()["request_id"] == request_id
        assert charge.json()["output_tokens"] == completion_tokens
        assert Decimal(charge.json()["amount"]["value"]) > 0
        logged = owner.get(f"/api/v1/tenants/{tenant.slug}/request-logs/{request_id}")
        assert logged.status_code == 200, logged.content
        assert logged.json()["request_id"] == request_id
        assert logged.json()["completion_tokens"] == completion_tokens
    now = timezone.now()
    for fmt in ("csv", "jsonl"):
        export = services.export_create(tenant=tenant, actor=SYSTEM, kind="ledger", format=fmt,
                                        start=now - timedelta(hours=1),
                                        end=now + timedelta(hours=1))
        export = services.export_build(export_id=export.pk)
        with export_storage().open(export.file_name, "rb") as fh:
            text = fh.read().decode()
        rows = (list(csv.DictReader(io.StringIO(text))) if fmt == "csv"
                else [json.loads(line) for line in text.splitlines()])
        assert {r["request_id"]: int(r["completion_tokens"]) for r in rows} == used
