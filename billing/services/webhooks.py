"""Webhooks: a tenant's endpoints, the events sent to them, and each delivery's log.

Payloads are signed the Standard Webhooks way (as OpenAI's webhooks are), so any of
its verifiers, the official ``openai`` package's ``client.webhooks.verify_signature``
among them, checks them: ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature:
v1,<base64 HMAC-SHA256 of "id.timestamp.body" under the secret>``. The secret is
``whsec_`` and base64 of 32 random bytes, shown once.

A delivery is tried at once (a task queued on commit), then again with exponential
backoff until the endpoint answers 2xx or `ATRIUM_WEBHOOK_MAX_ATTEMPTS` are spent. No
tenant can stall the platform or probe its network through its endpoints:

- each attempt is one `core.outbound.post`: a wall-clock deadline on the whole exchange,
  the host resolved once and the connection made to the address checked (loopback,
  private, link-local and every other non-public address refused, at creation and at each
  attempt, unless ``ATRIUM_WEBHOOK_ALLOW_PRIVATE`` is set), a capped answer;
- an attempt is counted when it is claimed, so one that hangs or whose worker dies still
  counts, and its lease outlasts the deadline, so it is never claimed twice at once;
- at most ``ATRIUM_WEBHOOK_TENANT_CONCURRENCY`` of a tenant's deliveries are attempted at
  once, across workers, and a pass over the due ones takes at most that many of each
  tenant's, so one tenant's backlog never holds another's events back;
- the log a tenant reads says a coarse category (`timeout`, `refused`, `dns`, `tls`,
  `unsafe_destination`, `http_status`, ...), never an exception's text; the detail goes
  to the operator's log with the delivery's id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Case, F, Value, When, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from billing import queue
from billing.models import WebhookDelivery, WebhookEndpoint
from core import outbound
from core.errors import InvalidRequest, NotFound
from tenants.facade import Actor, audit_record

log = logging.getLogger(__name__)

MAX_ENDPOINTS = 10
# Deliveries one endpoint may have waiting; past that a new event's delivery to it fails
# at once (category backlog_full).
MAX_PENDING_PER_ENDPOINT = 1000
DUE_BATCH = 50
# NOTE: a lease outlasts the deadline by this much (starting the attempt, recording it),
# so a claimed delivery is never claimed again while its attempt can still be running.
LEASE_SLACK_S = 30
# The first key of the PostgreSQL advisory lock that serializes one tenant's claims.
_CLAIM_LOCK = 0x57484B  # "WHK"


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("a webhook URL is an absolute http or https URL", param="url",
                             code="invalid_value")
    if parts.username or parts.password:
        raise InvalidRequest("a webhook URL carries no credentials; verify the signature "
                             "instead", param="url", code="invalid_value")
    if len(url) > 2000:
        raise InvalidRequest("a webhook URL has at most 2000 characters", param="url",
                             code="invalid_value")
    if not settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE:
        try:
            outbound.destination_check(url=url, allow_private=False)
        except outbound.OutboundError as exc:
            raise InvalidRequest(f"webhook URL refused: {exc}", param="url",
                                 code="invalid_value") from None
    return url


def _secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def webhook_endpoint_create(*, tenant, actor: Actor, url: str, description: str = ""
                            ) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its signing secret (returned once: shown to the caller now)."""
    url = _check_url(url)
    if len(description) > 200:
        raise InvalidRequest("description has at most 200 characters", param="description",
                             code="invalid_value")
    with transaction.atomic():
        if WebhookEndpoint.objects.for_tenant(tenant).count() >= MAX_ENDPOINTS:
            raise InvalidRequest(f"a tenant has at most {MAX_ENDPOINTS} webhook endpoints",
                                 param="url", code="invalid_value")
        secret = _secret()
        endpoint = WebhookEndpoint.objects.create(tenant=tenant, url=url, secret=secret,
                                                  description=description)
        audit_record(tenant=tenant, actor=actor, action="webhook.create",
                     target_type="webhook", target_id=endpoint.pk,
                     after={"url": url, "description": description})
    return endpoint, secret


def webhook_endpoint_delete(*, tenant, actor: Actor, endpoint_id: int) -> None:
    with transaction.atomic():
        endpoint = WebhookEndpoint.objects.for_tenant(tenant).filter(pk=endpoint_id).first()
        if endpoint is None:
            raise NotFound(f"No webhook endpoint {endpoint_id}.")
        audit_record(tenant=tenant, actor=actor, action="webhook.delete",
                     target_type="webhook", target_id=endpoint.pk,
                     before={"url": endpoint.url, "description": endpoint.description})
        endpoint.delete()


def webhook_event_emit(*, tenant, event_type: str, data: dict[str, Any]) -> list[int]:
    """Queues one event for each of the tenant's active endpoints; call it inside the
    transaction that records what happened. Returns the deliveries' ids."""
    event_id = "evt_" + uuid.uuid4().hex
    payload = {"id": event_id, "object": "event", "type": event_type,
               "created_at": int(time.time()), "data": data}
    ids = []
    for endpoint in WebhookEndpoint.objects.for_tenant(tenant).filter(active=True):
        if _backlog(endpoint) >= MAX_PENDING_PER_ENDPOINT:
            # NOTE: kept in the log, failed at once: an endpoint that never keeps up cannot
            # grow the table and the due passes every tenant's deliveries wait on.
            delivery = WebhookDelivery.objects.create(
                tenant=tenant, endpoint=endpoint, event_id=event_id, event_type=event_type,
                payload=payload, status=WebhookDelivery.Status.FAILED,
                last_error=f"backlog_full: {MAX_PENDING_PER_ENDPOINT} deliveries were "
                           "already waiting for this endpoint")
            ids.append(delivery.pk)
            continue
        delivery = WebhookDelivery.objects.create(
            tenant=tenant, endpoint=endpoint, event_id=event_id, event_type=event_type,
            payload=payload)
        ids.append(delivery.pk)
        transaction.on_commit(partial(queue.webhook_deliver_enqueue, delivery_id=delivery.pk))
    return ids


def _backlog(endpoint: WebhookEndpoint) -> int:
    return WebhookDelivery.objects.filter(endpoint=endpoint,
                                          status=WebhookDelivery.Status.PENDING).count()


def signature_headers(*, secret: str, event_id: str, body: bytes,
                      timestamp: int | None = None) -> dict[str, str]:
    """The Standard Webhooks headers that sign ``body``."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{event_id}.{timestamp}.".encode() + body
    digest = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return {"webhook-id": event_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": f"v1,{digest}"}


def _backoff(attempts: int) -> timedelta:
    return timedelta(seconds=settings.ATRIUM_WEBHOOK_RETRY_BASE_S * 2 ** (attempts - 1))


def _lock_tenant_claims(tenant_id: int) -> None:
    """Serializes one tenant's claims until the transaction ends, so its in-flight count is
    read and raised by one claimer at a time. SQLite needs none: its transactions here are
    IMMEDIATE, holding the database's one write lock from the start."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                           [_CLAIM_LOCK, tenant_id & 0x7FFF_FFFF])


def _in_flight(tenant_id: int, now: datetime) -> int:
    return WebhookDelivery.objects.filter(tenant_id=tenant_id, claimed_until__gt=now).count()


def _claim(*, delivery_id: int, now: datetime) -> datetime | None:
    """Takes the delivery for one attempt when it is due, has attempts left and its tenant
    has fewer than its cap in flight; the UPDATE that takes the lease counts the attempt,
    so one that never finishes still counts. Returns the lease's end, or None when it is
    not to be attempted now (it then stays as it was: pending, due, not counted)."""
    due = WebhookDelivery.objects.filter(
        pk=delivery_id, status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now,
        attempts__lt=settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS)
    tenant_id = due.values_list("tenant_id", flat=True).first()
    if tenant_id is None:
        return None
    lease = now + timedelta(seconds=settings.ATRIUM_WEBHOOK_TIMEOUT_S + LEASE_SLACK_S)
    cap = settings.ATRIUM_WEBHOOK_TENANT_CONCURRENCY
    # NOTE: read first, without the lock: a flooding tenant's deliveries, refused here by
    # the hundred, never queue for the database's write lock (SQLite has one).
    if _in_flight(tenant_id, now) >= cap:
        return None
    with transaction.atomic():
        _lock_tenant_claims(tenant_id)
        if _in_flight(tenant_id, now) >= cap:
            return None
        taken = due.update(attempts=F("attempts") + 1, claimed_until=lease,
                           next_attempt_at=lease)
    return lease if taken else None


def _said(exc: outbound.OutboundError | None, code: int | None) -> str:
    if exc is not None:
        return str(exc)
    if code is not None and not 200 <= code < 300:
        return f"http_status: answered {code}"
    return ""


def webhook_deliver(*, delivery_id: int) -> str:
    """One attempt at one delivery, when it is due and its tenant has room; returns its
    status after (``skipped`` when not attempted, ``lapsed`` when the attempt outlived its
    lease and its result was dropped)."""
    lease = _claim(delivery_id=delivery_id, now=timezone.now())
    if lease is None:
        return "skipped"
    delivery = WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)
    body = json.dumps(delivery.payload, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", "user-agent": "Atrium-Webhooks/1",
               **signature_headers(secret=delivery.endpoint.secret,
                                   event_id=delivery.event_id, body=body)}
    code, failure = None, None
    try:
        code = outbound.post(url=delivery.endpoint.url, body=body, headers=headers,
                             deadline_s=settings.ATRIUM_WEBHOOK_TIMEOUT_S,
                             allow_private=settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE).status_code
    except outbound.OutboundError as exc:
        failure = exc
        log.warning("webhook delivery %s attempt %s: %s (%s)", delivery_id,
                    delivery.attempts, exc.category, exc.detail)
    error = _said(failure, code)
    update: dict[str, Any] = {"claimed_until": None, "last_status_code": code,
                              "last_error": error}
    if not error:
        update.update(status=WebhookDelivery.Status.DELIVERED, delivered_at=timezone.now())
    elif delivery.attempts >= settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS:
        update.update(status=WebhookDelivery.Status.FAILED)
        log.warning("webhook delivery %s failed for good: %s", delivery_id, error)
    else:
        update.update(next_attempt_at=timezone.now() + _backoff(delivery.attempts))
    if not WebhookDelivery.objects.filter(pk=delivery_id, claimed_until=lease).update(**update):
        log.warning("webhook delivery %s: the attempt outlived its lease; dropped: %s",
                    delivery_id, error or code)
        return "lapsed"
    return update.get("status", WebhookDelivery.Status.PENDING)


def _fail_spent(*, now: datetime) -> int:
    """Fails for good the due deliveries whose attempts are all spent: their last claim
    lapsed without a result (its worker died), which says no answer came in time."""
    return WebhookDelivery.objects.filter(
        status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now,
        attempts__gte=settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS,
    ).update(status=WebhookDelivery.Status.FAILED, claimed_until=None, last_error=Case(
        When(claimed_until__isnull=False,
             then=Value(str(outbound.timed_out(settings.ATRIUM_WEBHOOK_TIMEOUT_S)))),
        default=F("last_error")))


def _due(*, now: datetime) -> list[int]:
    """Up to DUE_BATCH due deliveries, at most the concurrency cap of each tenant's, in
    rounds: every tenant's oldest, then every tenant's second, ..."""
    per_tenant = Window(RowNumber(), partition_by=[F("tenant_id")],
                        order_by=[F("next_attempt_at").asc(), F("pk").asc()])
    return list(WebhookDelivery.objects.filter(
        status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now,
        attempts__lt=settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS,
    ).annotate(turn=per_tenant).filter(
        turn__lte=settings.ATRIUM_WEBHOOK_TENANT_CONCURRENCY,
    ).order_by("turn", "next_attempt_at", "pk").values_list("pk", flat=True)[:DUE_BATCH])


def webhooks_deliver_due() -> int:
    """Queues an attempt at each delivery that is due (retries, first tries whose queued
    task was lost, and attempts whose worker died), a fair share of each tenant's, for the
    webhooks lane's workers to make side by side; returns how many were queued. A
    delivery queued twice is attempted once: the second finds it claimed."""
    now = timezone.now()
    _fail_spent(now=now)
    due = _due(now=now)
    for pk in due:
        queue.webhook_deliver_enqueue(delivery_id=pk)
    return len(due)
