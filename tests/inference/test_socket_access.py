"""An open websocket does not outlive its caller's access: a revoked or expired key, a
removed membership, a staff flag taken away close it within 5 s (issue 16)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from core.websockets import CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED
from tests.factories import key_factory, member_factory, tenant_factory, user_factory
from tests.inference.slow_engine import slow_factory
from tests.live import start_engine

LIMIT_S = 5.0


def _closed_after(ws, since: float) -> tuple[list[dict], int, float]:
    """Every message until the server closes the socket, its close code, and when."""
    messages = []
    with pytest.raises(ConnectionClosed):
        while True:
            messages.append(json.loads(ws.recv(timeout=LIMIT_S + 5)))
    return messages, ws.close_code, time.monotonic() - since


@pytest.fixture
def slow_engine(served_model, tiny_model_path, redis_client):
    running = start_engine(tiny_model_path, served_model, "slow-engine",
                           engine_factory=slow_factory(0.05))
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def test_revoking_a_key_closes_its_inference_socket_and_stops_its_stream(
        api_server, served_model, slow_engine):
    from tenants.services import api_key_revoke

    tenant = tenant_factory()
    key = key_factory(tenant)
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key.plaintext}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "long", "endpoint": "completions",
                            "body": {"model": served_model, "prompt": "hi",
                                     "max_tokens": 400}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "chunk"
        api_key_revoke(tenant=tenant, key_id=key.id)
        messages, code, took = _closed_after(ws, time.monotonic())
    assert code == CLOSE_UNAUTHORIZED and took < LIMIT_S, (code, took)
    errors = [m for m in messages if m["type"] == "error"]
    assert [(e["id"], e["status"], e["error"]["code"]) for e in errors] == \
        [(None, 401, "invalid_api_key")]
    # The stream stopped with the socket, short of its 400 tokens.
    assert sum(m["type"] == "chunk" for m in messages) < 390


def test_a_key_that_expires_while_its_socket_is_open_closes_it(api_server, served_model):
    tenant = tenant_factory()
    key = key_factory(tenant, expires_at=timezone.now() + timedelta(seconds=2))
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key.plaintext}"}) as ws:
        opened = time.monotonic()
        messages, code, took = _closed_after(ws, opened)
    assert code == CLOSE_UNAUTHORIZED and took < 2 + LIMIT_S, (code, took)
    assert messages[-1]["error"]["code"] == "invalid_api_key"


def _adapter_events(api_server: str, slug: str, headers: dict[str, str]):
    url = api_server.replace("http://", "ws://") + f"/ws/tenants/{slug}/adapters"
    return connect(url, additional_headers=headers, origin=api_server, open_timeout=10)


def test_revoking_a_key_closes_its_adapter_events_socket(api_server):
    from tenants.services import api_key_revoke

    tenant = tenant_factory()
    key = key_factory(tenant, scopes=("adapters",))
    with _adapter_events(api_server, tenant.slug,
                         {"Authorization": f"Bearer {key.plaintext}"}) as ws:
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.5)  # open, and quiet
        api_key_revoke(tenant=tenant, key_id=key.id)
        _, code, took = _closed_after(ws, time.monotonic())
    assert code == CLOSE_FORBIDDEN and took < LIMIT_S, (code, took)


def _session_cookie(user) -> str:
    from django.test import Client

    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def test_removing_a_member_closes_their_console_socket(api_server):
    from tenants.access import SYSTEM
    from tenants.models import Membership
    from tenants.services import membership_delete

    tenant = tenant_factory()
    member = member_factory(tenant, "developer")
    with _adapter_events(api_server, tenant.slug, {"Cookie": _session_cookie(member)}) as ws:
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.5)
        membership = Membership.objects.get(tenant=tenant, user=member)
        membership_delete(tenant=tenant, membership_id=membership.pk, actor=SYSTEM)
        _, code, took = _closed_after(ws, time.monotonic())
    assert code == CLOSE_FORBIDDEN and took < LIMIT_S, (code, took)


def test_an_operator_who_loses_staff_loses_the_fleet_socket(api_server, redis_client):
    operator = user_factory(is_staff=True)
    url = api_server.replace("http", "ws") + "/ws/operator/fleet"
    with connect(url, origin=api_server, open_timeout=10,
                 additional_headers={"Cookie": _session_cookie(operator)}) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "fleet"
        operator.is_staff = False
        operator.save(update_fields=["is_staff"])
        since = time.monotonic()
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=LIMIT_S + 5)
        took = time.monotonic() - since
    assert ws.close_code == CLOSE_FORBIDDEN and took < LIMIT_S, (ws.close_code, took)
