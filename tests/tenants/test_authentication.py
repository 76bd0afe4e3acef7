"""The one API-key authenticator (tenants/authentication.py), seen from every entry point
that takes a key, through the real ASGI app: the management API, the inference API (HTTP
and its websocket) and the adapter-events websocket."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

EVERY_SCOPE_USED = ["inference", "adapters", "admin"]
REFUSALS = {"revoked": "This API key has been revoked.",
            "expired": "This API key has expired."}


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _answer(response: httpx.Response) -> tuple[int, str | None, str | None]:
    """(status, error code, error message): what a client can tell refusals apart by."""
    if response.is_success:
        return response.status_code, None, None
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


def rest(base: str, slug: str, key: str) -> tuple:
    return _answer(httpx.get(f"{base}/api/v1/tenants/{slug}/keys", headers=_headers(key),
                             timeout=10))


def inference(base: str, model: str, key: str) -> tuple:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return _answer(httpx.post(f"{base}/v1/chat/completions", json=body,
                              headers=_headers(key), timeout=30))


def inference_socket(base: str, key: str) -> tuple:
    """The /v1/stream websocket's answer at connect: "open", or its error and close code."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(base.replace("http://", "ws://") + "/v1/stream",
                 additional_headers=_headers(key)) as ws:
        try:
            message = json.loads(ws.recv(timeout=1))
        except TimeoutError:
            return ("open",)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    error = message["error"]
    return message["status"], error["code"], error["message"], ws.close_code


def adapter_events(base: str, slug: str, key: str, tenant_id: int, redis_client) -> str | int:
    """"delivered" when an event published for the tenant reaches the socket, else the
    code the socket was closed with."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from adapters.services import events_channel

    with connect(base.replace("http://", "ws://") + f"/ws/tenants/{slug}/adapters",
                 additional_headers=_headers(key)) as ws:
        for _ in range(50):
            redis_client.publish(events_channel(tenant_id), json.dumps({"type": "ping"}))
            try:
                if json.loads(ws.recv(timeout=0.2)) == {"type": "ping"}:
                    return "delivered"
            except TimeoutError:
                continue
            except ConnectionClosed:
                return ws.close_code
    raise AssertionError("the socket neither delivered nor closed")


@pytest.fixture
def key(tenant_key):
    """The live tenant's key, with every scope the three entry points ask for."""
    from tenants.access import SYSTEM
    from tenants.models import Tenant
    from tenants.services import api_key_update

    api_key_update(tenant=Tenant.objects.get(pk=tenant_key.tenant_id), key_id=tenant_key.key_id,
                   actor=SYSTEM, scopes=EVERY_SCOPE_USED)
    return tenant_key


def _kill(key, how: str) -> None:
    from tenants.access import SYSTEM
    from tenants.models import Tenant
    from tenants.services import api_key_revoke, api_key_update

    tenant = Tenant.objects.get(pk=key.tenant_id)
    if how == "revoked":
        api_key_revoke(tenant=tenant, key_id=key.key_id)
        return
    # An expiry is set in the future or not at all: the key is left to run out.
    soon = timezone.now() + timedelta(seconds=1)
    api_key_update(tenant=tenant, key_id=key.key_id, actor=SYSTEM, expires_at=soon)
    time.sleep(max(0.0, (soon - timezone.now()).total_seconds()) + 0.05)


@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_every_entry_point_takes_a_good_key_and_refuses_a_dead_one_alike(
        api_server, served_model, engine_worker, redis_client, key, how):
    assert rest(api_server, key.slug, key.key) == (200, None, None)
    assert inference(api_server, served_model, key.key) == (200, None, None)
    assert inference_socket(api_server, key.key) == ("open",)
    assert adapter_events(api_server, key.slug, key.key, key.tenant_id,
                          redis_client) == "delivered"

    _kill(key, how)

    refused = (401, "invalid_api_key", REFUSALS[how])
    assert rest(api_server, key.slug, key.key) == refused
    assert inference(api_server, served_model, key.key) == refused
    assert inference_socket(api_server, key.key) == (*refused, 4401)
    # The adapter-events socket says no more to anyone it refuses (an unknown tenant
    # looks the same): it closes.
    assert adapter_events(api_server, key.slug, key.key, key.tenant_id, redis_client) == 4403


def test_last_used_is_written_once_per_interval_whichever_entry_point_is_used(
        api_server, served_model, engine_worker, redis_client, key, monkeypatch):
    from tenants import authentication
    from tenants.models import ApiKey

    writes: list[int] = []
    touch = authentication.api_key_touch

    def counted(*, key_id: int, **kwargs) -> None:
        writes.append(key_id)
        touch(key_id=key_id, **kwargs)

    monkeypatch.setattr(authentication, "api_key_touch", counted)
    accepted = {
        "rest": lambda: rest(api_server, key.slug, key.key) == (200, None, None),
        "inference": lambda: inference(api_server, served_model, key.key) == (200, None, None),
        "inference socket": lambda: inference_socket(api_server, key.key) == ("open",),
        "adapter events": lambda: adapter_events(api_server, key.slug, key.key, key.tenant_id,
                                                 redis_client) == "delivered",
    }
    def written(count: int) -> list[int]:
        deadline = time.time() + 5
        while len(writes) < count and time.time() < deadline:
            time.sleep(0.05)
        return writes

    last_used = []
    # Each interval starts at another entry point, which writes; then every entry point is
    # used twice more, and none does.
    for interval, first in enumerate(["rest", "inference", "adapter events",
                                      "inference socket"], start=1):
        assert accepted[first]()
        assert written(interval) == [key.key_id] * interval, f"{first} did not write"
        for name in [*accepted, *accepted]:
            assert accepted[name](), name
        time.sleep(0.5)  # a second write, were there one, would be under way by now
        assert writes == [key.key_id] * interval, f"a second write after {first}'s"
        last_used.append(ApiKey.objects.get(pk=key.key_id).last_used_at)
        # The interval ends (its marker's TTL runs out).
        redis_client.delete(authentication.use_marker(key.key_id))
    assert None not in last_used and last_used == sorted(last_used)


@pytest.mark.django_db
def test_the_management_api_fails_closed_when_the_key_cache_is_out_of_reach(settings):
    from rest_framework.test import APIClient

    from core import redis as core_redis
    from tests.factories import key_factory, tenant_factory

    key = key_factory(tenant_factory("alpha"), scopes=["admin"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key.plaintext}")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    core_redis.sync_client.cache_clear()
    try:
        response = client.get("/api/v1/tenants/alpha/keys")
    finally:
        core_redis.sync_client.cache_clear()
    assert response.status_code == 503
    assert response.json()["error"]["message"] == ("authentication is unavailable right now; "
                                                   "retry shortly")


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_requests_with_an_uncached_key_reads_the_database_once(monkeypatch,
                                                                          redis_client):
    import asyncio

    from tenants import key_cache, keys, selectors
    from tests.factories import key_factory, tenant_factory

    key = key_factory(tenant_factory("burst"))
    redis_client.delete(key_cache.cache_key(keys.digest(key.plaintext)))
    reads = []
    real = selectors.key_state_by_digest

    def counted(**kwargs):
        reads.append(kwargs)
        time.sleep(0.2)  # a slow database: the others arrive while it is read
        return real(**kwargs)

    monkeypatch.setattr(selectors, "key_state_by_digest", counted)

    async def burst():
        return await asyncio.gather(*(key_cache.principal_lookup(plaintext=key.plaintext)
                                      for _ in range(50)))

    principals = asyncio.run(burst())
    assert len(reads) == 1
    assert {p.api_key_id for p in principals} == {key.id}
    assert redis_client.exists(key_cache.cache_key(keys.digest(key.plaintext)))
