"""Webhook deliveries to a real HTTP server on loopback: signed so the official openai
package verifies them, retried with backoff until answered, logged by category; endpoints
a tenant may not aim at (the operator's own network, credentials in the URL) refused; and
no tenant able to hold a worker past the deadline, or its share of the lane."""

from __future__ import annotations

import select
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from django.db import connection
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
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Trickler:
    """An HTTP server that answers its headers, then a byte of body a second, forever."""

    def __init__(self) -> None:
        self.connections = 0
        stop = self.stop = threading.Event()
        trickler = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                trickler.connections += 1
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-length", "1000000")
                self.end_headers()
                while not stop.wait(1):
                    self.wfile.write(b"x")
                    self.wfile.flush()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings):
    settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE = True
    made = []

    def make(statuses=(), *, trickle=False):
        made.append(Trickler() if trickle else Receiver(list(statuses)))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _emit(tenant, monkeypatch) -> WebhookDelivery:
    monkeypatch.setattr("billing.queue.webhook_deliver_enqueue", lambda delivery_id: None)
    (delivery_id,) = webhook_event_emit(tenant=tenant, event_type="budget.threshold_reached",
                                        data={"threshold": 80})
    return WebhookDelivery.objects.get(pk=delivery_id)


class WorkerLost(BaseException):
    """What a worker killed mid-attempt looks like from the delivery's side: no result."""


def _lose_attempts(monkeypatch) -> None:
    def lost(**kwargs):
        raise WorkerLost

    monkeypatch.setattr("core.outbound.post", lost)


def _due_pass(monkeypatch) -> int:
    """The beat's pass over due deliveries, with the webhooks lane's worker running each
    attempt it queues (here, at once, one after another)."""
    monkeypatch.setattr("billing.queue.webhook_deliver_enqueue",
                        lambda delivery_id: webhook_deliver(delivery_id=delivery_id))
    return webhooks_deliver_due()


def _lease_lapses(delivery: WebhookDelivery) -> None:
    past = timezone.now() - timedelta(seconds=1)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(claimed_until=past,
                                                          next_attempt_at=past)


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
        (1, 500, "http_status: answered 500")
    assert _due_pass(monkeypatch) == 0  # not due yet: the backoff holds it
    first_wait = delivery.next_attempt_at - timezone.now()
    time.sleep(0.35)  # the first backoff (0.3 s) runs out
    assert _due_pass(monkeypatch) == 1
    delivery.refresh_from_db()
    assert delivery.attempts == 2 and delivery.status == "pending"
    assert delivery.next_attempt_at - timezone.now() > first_wait  # the wait doubled
    time.sleep(0.65)  # the second, twice as long, runs out
    assert _due_pass(monkeypatch) == 1
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
    assert _due_pass(monkeypatch) == 0
    assert len(server.received) == 2


def test_an_unreachable_endpoint_is_a_category_in_the_log_not_a_crash(receiver, monkeypatch):
    acme = tenant_factory()
    server = receiver()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    server.close()
    delivery = _emit(acme, monkeypatch)
    assert webhook_deliver(delivery_id=delivery.pk) == "pending"
    delivery.refresh_from_db()
    assert delivery.last_status_code is None
    assert delivery.last_error == "refused: the connection was refused or reset"
    assert str(server.server.server_port) not in delivery.last_error
    assert delivery.next_attempt_at > timezone.now() + timedelta(seconds=1)
    assert delivery.claimed_until is None


def test_an_endpoint_trickling_its_answer_is_cut_at_the_deadline_as_a_timeout(
        receiver, monkeypatch, settings):
    settings.ATRIUM_WEBHOOK_TIMEOUT_S = 2
    acme = tenant_factory()
    server = receiver(trickle=True)
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    delivery = _emit(acme, monkeypatch)
    started = time.monotonic()
    assert webhook_deliver(delivery_id=delivery.pk) == "pending"
    assert time.monotonic() - started < 2 + 2
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status_code, delivery.last_error) == \
        (1, None, "timeout: no complete answer within 2 s")


def test_an_endpoint_now_resolving_to_a_private_address_is_not_connected_to(
        monkeypatch, settings):
    settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE = True
    acme = tenant_factory()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=f"http://localhost:{port}/h")
        settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE = False
        delivery = _emit(acme, monkeypatch)
        assert webhook_deliver(delivery_id=delivery.pk) == "pending"
        assert select.select([listener], [], [], 0)[0] == []  # nothing knocked
    delivery.refresh_from_db()
    assert delivery.last_error == \
        "unsafe_destination: the host resolves to a non-public address"


def test_an_attempt_counts_when_claimed_even_if_its_worker_dies(receiver, monkeypatch):
    acme = tenant_factory()
    server = receiver()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    delivery = _emit(acme, monkeypatch)
    with monkeypatch.context() as m:
        _lose_attempts(m)
        with pytest.raises(WorkerLost):
            webhook_deliver(delivery_id=delivery.pk)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("pending", 1)
    assert delivery.claimed_until > timezone.now()
    # its lease outlasts any attempt: nobody claims it again meanwhile
    assert webhook_deliver(delivery_id=delivery.pk) == "skipped"
    assert _due_pass(monkeypatch) == 0
    _lease_lapses(delivery)
    assert _due_pass(monkeypatch) == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.claimed_until) == \
        ("delivered", 2, None)
    assert len(server.received) == 1


def test_a_delivery_whose_last_claim_lapses_fails_for_good(receiver, monkeypatch, settings):
    settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS = 1
    acme = tenant_factory()
    server = receiver()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=server.url)
    delivery = _emit(acme, monkeypatch)
    with monkeypatch.context() as m:
        _lose_attempts(m)
        with pytest.raises(WorkerLost):
            webhook_deliver(delivery_id=delivery.pk)
    _lease_lapses(delivery)
    assert _due_pass(monkeypatch) == 0
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.claimed_until) == ("failed", 1, None)
    assert delivery.last_error == "timeout: no complete answer within 10 s"
    assert server.received == []


def test_a_tenant_has_at_most_its_cap_of_deliveries_in_flight(receiver, monkeypatch,
                                                              settings):
    settings.ATRIUM_WEBHOOK_TENANT_CONCURRENCY = 2
    acme, globex = tenant_factory(), tenant_factory()
    server = receiver()
    for tenant in (acme, globex):
        webhook_endpoint_create(tenant=tenant, actor=SYSTEM, url=server.url)
    first, second, third = (_emit(acme, monkeypatch) for _ in range(3))
    with monkeypatch.context() as m:
        _lose_attempts(m)
        for delivery in (first, second):
            with pytest.raises(WorkerLost):
                webhook_deliver(delivery_id=delivery.pk)
    assert webhook_deliver(delivery_id=third.pk) == "skipped"
    third.refresh_from_db()
    assert (third.status, third.attempts, third.claimed_until) == ("pending", 0, None)
    assert third.next_attempt_at <= timezone.now()  # still due, not counted
    assert webhook_deliver(delivery_id=_emit(globex, monkeypatch).pk) == "delivered"
    _lease_lapses(first)
    assert webhook_deliver(delivery_id=third.pk) == "delivered"


@pytest.mark.django_db(transaction=True)
def test_workers_claiming_at_once_never_exceed_a_tenants_cap(receiver, monkeypatch,
                                                             settings):
    settings.ATRIUM_WEBHOOK_TIMEOUT_S = 1
    settings.ATRIUM_WEBHOOK_TENANT_CONCURRENCY = 2
    acme = tenant_factory()
    slow = receiver(trickle=True)
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=slow.url)
    deliveries = [_emit(acme, monkeypatch) for _ in range(6)]
    start, outcomes = threading.Barrier(len(deliveries)), []

    def worker(delivery_id: int) -> None:
        try:
            start.wait()
            outcomes.append(webhook_deliver(delivery_id=delivery_id))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(d.pk,)) for d in deliveries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["pending"] * 2 + ["skipped"] * 4
    assert slow.connections == 2


def test_a_pass_takes_a_share_of_each_tenant_so_one_backlog_holds_no_one_back(
        receiver, monkeypatch, settings):
    settings.ATRIUM_WEBHOOK_TIMEOUT_S = 1
    settings.ATRIUM_WEBHOOK_TENANT_CONCURRENCY = 2
    acme, globex = tenant_factory(), tenant_factory()
    slow, quick = receiver(trickle=True), receiver()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=slow.url)
    webhook_endpoint_create(tenant=globex, actor=SYSTEM, url=quick.url)
    backlog = [_emit(acme, monkeypatch) for _ in range(5)]
    theirs = _emit(globex, monkeypatch)
    assert _due_pass(monkeypatch) == 3
    theirs.refresh_from_db()
    assert theirs.status == "delivered" and len(quick.received) == 1
    tried = WebhookDelivery.objects.filter(pk__in=[d.pk for d in backlog])
    assert sorted(tried.values_list("attempts", flat=True)) == [0, 0, 0, 1, 1]
    assert slow.connections == 2
    assert set(tried.filter(attempts=1).values_list("last_error", flat=True)) == \
        {"timeout: no complete answer within 1 s"}


def test_an_endpoint_that_never_keeps_up_stops_gathering_deliveries(receiver, monkeypatch):
    monkeypatch.setattr("billing.services.webhooks.MAX_PENDING_PER_ENDPOINT", 2)
    acme = tenant_factory()
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=receiver().url)
    ids = [webhook_event_emit(tenant=acme, event_type="budget.threshold_reached",
                              data={"threshold": 80})[0] for _ in range(3)]
    third = WebhookDelivery.objects.get(pk=ids[2])
    assert (third.status, third.attempts) == ("failed", 0)
    assert third.last_error.startswith("backlog_full: 2 deliveries")


def test_a_pass_queues_attempts_for_the_lanes_workers_and_returns_at_once(
        receiver, monkeypatch, settings):
    acme = tenant_factory()
    slow = receiver(trickle=True)
    webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=slow.url)
    backlog = [_emit(acme, monkeypatch) for _ in range(3)]
    queued: list[int] = []
    monkeypatch.setattr("billing.queue.webhook_deliver_enqueue",
                        lambda delivery_id: queued.append(delivery_id))
    began = time.monotonic()
    assert webhooks_deliver_due() == 2  # the tenant's share this pass
    assert time.monotonic() - began < 2 and slow.connections == 0
    assert set(queued) < {d.pk for d in backlog}


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/hook", "http://localhost/hook", "http://10.0.0.8/hook",
    "http://169.254.169.254/latest/meta-data", "http://[::1]/hook", "https://user:pw@x.test/",
    "ftp://example.com/hook", "/relative", "http://192.168.1.1:6379/",
    "http://[::ffff:127.0.0.1]/hook", "http://2130706433/hook", "http://100.64.0.1/hook",
    "http://[fd00::1]/hook", "http://[64:ff9b::a00:1]/hook"])
def test_endpoints_on_the_operators_network_or_with_credentials_are_refused(url):
    acme = tenant_factory()
    with pytest.raises(InvalidRequest):
        webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=url)


def test_a_refused_endpoint_is_told_why_without_the_address_it_resolves_to():
    with pytest.raises(InvalidRequest) as refused:
        webhook_endpoint_create(tenant=tenant_factory(), actor=SYSTEM,
                                url="http://localhost:6379/hook")
    assert refused.value.message == \
        "webhook URL refused: unsafe_destination: the host resolves to a non-public address"


def test_endpoints_are_the_tenants_own_and_audited(receiver):
    acme, globex = tenant_factory(), tenant_factory()
    endpoint, _ = webhook_endpoint_create(tenant=acme, actor=SYSTEM, url=receiver().url)
    with pytest.raises(NotFound):
        webhook_endpoint_delete(tenant=globex, actor=SYSTEM, endpoint_id=endpoint.pk)
    webhook_endpoint_delete(tenant=acme, actor=SYSTEM, endpoint_id=endpoint.pk)
    assert list(AuditEvent.objects.filter(tenant=acme, target_type="webhook")
                .order_by("id").values_list("action", flat=True)) == \
        ["webhook.create", "webhook.delete"]
