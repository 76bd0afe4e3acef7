"""Webhook deliveries to a real HTTP server on loopback: signed so the official openai
package verifies them, retried with backoff until answered, logged; and endpoints a tenant
may not aim at (the operator's own network, credentials in the URL) refused."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from django.utils import timezone

from billing.models import WebhookDelivery
from billing.services import (
    webhook_deliver,
    webhook_endpoint_create,
    webhook_endpoint_delete,
    webhook_event_emit,
    webhooks_deliver_due,
)
from core.errors import InvalidRequest, NotFound
from tenants.access import SYSTEM
from tenants.models import AuditEvent
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db


class Receiver:
    """An HTTP server that records what it is sent and answers the statuses it is told."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()},
                                          body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings):
    settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE = True
    made = []

    def make(statuses=()):
        made.append(Receiver(list(statuses)))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _emit(tenant, monkeypatch) -> WebhookDelivery:
    monkeypatch.setattr("billing.queue.webhook_deliver_enqueue", lambda delivery_id: None)
    (delivery_id,) = webhook_event_emit(tenant=tenant, event_type="budget.threshold_reached",
                                        data={"threshold": 80})
    return WebhookDelivery.objects.get(pk=delivery_id)


def test_a_delivery_is_signed_so_the_openai_package_verifies_it(receiver, monkeypatch):
    acme = tenant_factory()
    server = receiver()
    endpoint, secret = webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    assert secret.startswith("whsec_") and endpoint.secret == secret
    delivery = _emit(acme, monkeypatch)
    assert webhook_deliver(delivery_id=delivery.pk) == "delivered"
    (headers, body), = server.received
    client = openai.OpenAI(api_key="unused", webhook_secret=secret)
    client.webhooks.verify_signature(body, headers)  # raises when the signature is wrong
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.verify_signature(body.replace(b"80", b"81"), headers)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused", webhook_secret="whsec_" + "A" * 44) \
            .webhooks.verify_signature(body, headers)
    assert headers["webhook-id"] == delivery.event_id
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == \
        ("delivered", 1, 200)
    assert webhook_deliver(delivery_id=delivery.pk) == "skipped"  # never sent twice
    assert len(server.received) == 1


def test_failures_are_retried_with_backoff_and_logged_until_answered(receiver, monkeypatch,
                                                                      settings):
    settings.ATRIUM_WEBHOOK_RETRY_BASE_S = 0.3
    acme = tenant_factory()
    server = receiver([500, 503])
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    delivery = _emit(acme, monkeypatch)
    assert webhook_deliver(delivery_id=delivery.pk) == "pending"
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status_code, delivery.last_error) == \
        (1, 500, "answered 500")
    assert webhooks_deliver_due() == 0  # not due yet: the backoff holds it
    first_wait = delivery.next_attempt_at - timezone.now()
    time.sleep(0.35)
    assert webhooks_deliver_due() == 1
    delivery.refresh_from_db()
    assert delivery.attempts == 2 and delivery.status == "pending"
    assert delivery.next_attempt_at - timezone.now() > first_wait  # the wait doubled
    time.sleep(0.65)
    assert webhooks_deliver_due() == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == \
        ("delivered", 3, 200)
    assert len(server.received) == 3
    assert len({h["webhook-id"] for h, _ in server.received}) == 1  # one event, three tries


def test_a_delivery_gives_up_after_its_attempts(receiver, monkeypatch, settings):
    settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS = 2
    settings.ATRIUM_WEBHOOK_RETRY_BASE_S = 0
    acme = tenant_factory()
    server = receiver([500, 500, 500])
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    delivery = _emit(acme, monkeypatch)
    webhook_deliver(delivery_id=delivery.pk)
    assert webhook_deliver(delivery_id=delivery.pk) == "failed"
    assert webhooks_deliver_due() == 0
    assert len(server.received) == 2


def test_an_unreachable_endpoint_is_an_error_in_the_log_not_a_crash(receiver, monkeypatch):
    acme = tenant_factory()
    server = receiver()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    server.close()
    delivery = _emit(acme, monkeypatch)
    assert webhook_deliver(delivery_id=delivery.pk) == "pending"
    delivery.refresh_from_db()
    assert delivery.last_status_code is None and "ConnectError" in delivery.last_error
    assert delivery.next_attempt_at > timezone.now() + timedelta(seconds=1)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/hook", "http://localhost/hook", "http://10.0.0.8/hook",
    "http://169.254.169.254/latest/meta-data", "http://[::1]/hook", "https://user:pw@x.test/",
    "ftp://example.com/hook", "/relative", "http://192.168.1.1:6379/"])
def test_endpoints_on_the_operators_network_or_with_credentials_are_refused(url):
    acme = tenant_factory()
    with pytest.raises(InvalidRequest):
        webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=url)


def test_endpoints_are_the_tenants_own_and_audited(receiver):
    acme, globex = tenant_factory(), tenant_factory()
    endpoint, _ = webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=receiver().url)
    with pytest.raises(NotFound):
        webhook_endpoint_delete(tenant=globex, actor=SYSTEM, endpoint_id=endpoint.pk)
    webhook_endpoint_delete(tenant=acme, actor=SYSTEM, endpoint_id=endpoint.pk)
    assert list(AuditEvent.objects.filter(tenant=acme, target_type="webhook")
                .order_by("id").values_list("action", flat=True)) == \
        ["webhook.create", "webhook.delete"]
