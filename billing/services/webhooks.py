"""Webhooks: a tenant's endpoints, the events sent to them, and each delivery's log.

Payloads are signed the Standard Webhooks way (as OpenAI's webhooks are), so any of
its verifiers, the official ``openai`` package's ``client.webhooks.verify_signature``
among them, checks them: ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature:
v1,<base64 HMAC-SHA256 of "id.timestamp.body" under the secret>``. The secret is
``whsec_`` and base64 of 32 random bytes, shown once.

A delivery is tried at once (a task queued on commit), then again with exponential
backoff until the endpoint answers 2xx or `ATRIUM_WEBHOOK_MAX_ATTEMPTS` are spent; every
attempt's status or error is kept for the console. Endpoints on loopback, private or
link-local addresses are refused (at creation and at each delivery, after resolving the
name) unless ``ATRIUM_WEBHOOK_ALLOW_PRIVATE`` is set: a tenant cannot aim Atrium at the
operator's own network.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
import uuid
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import queue
from billing.models import WebhookDelivery, WebhookEndpoint
from core.errors import InvalidRequest, NotFound
from tenants.facade import Actor, audit_record

log = logging.getLogger(__name__)

MAX_ENDPOINTS = 10
DUE_BATCH = 50


class UnsafeDestination(ValueError):
    """The endpoint's host is (or resolves to) an address tenants may not reach."""


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
    try:
        destination_check(url)
    except UnsafeDestination as exc:
        raise InvalidRequest(f"webhook URL refused: {exc}", param="url",
                             code="invalid_value") from None
    return url


def destination_check(url: str) -> None:
    """Raises UnsafeDestination when the URL's host resolves to an address tenants may not
    reach (loopback, private, link-local, multicast, reserved), or does not resolve."""
    if settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE:
        return
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise UnsafeDestination(f"{host} does not resolve") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global:
            raise UnsafeDestination(f"{host} is a non-public address ({address})")


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
        delivery = WebhookDelivery.objects.create(
            tenant=tenant, endpoint=endpoint, event_id=event_id, event_type=event_type,
            payload=payload)
        ids.append(delivery.pk)
        transaction.on_commit(partial(queue.webhook_deliver_enqueue, delivery_id=delivery.pk))
    return ids


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


def _claim(delivery_id: int, now: datetime) -> bool:
    """Takes the delivery for one attempt (another worker skips it meanwhile)."""
    lease = now + timedelta(seconds=settings.ATRIUM_WEBHOOK_TIMEOUT_S * 3)
    return WebhookDelivery.objects.filter(
        pk=delivery_id, status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now,
    ).update(next_attempt_at=lease) == 1


def webhook_deliver(*, delivery_id: int) -> str:
    """One attempt at one delivery, when it is due; returns its status after."""
    now = timezone.now()
    if not _claim(delivery_id, now):
        return "skipped"
    delivery = WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)
    body = json.dumps(delivery.payload, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", "user-agent": "Atrium-Webhooks/1",
               **signature_headers(secret=delivery.endpoint.secret,
                                   event_id=delivery.event_id, body=body)}
    code, error = None, ""
    try:
        destination_check(delivery.endpoint.url)
        with httpx.Client(timeout=settings.ATRIUM_WEBHOOK_TIMEOUT_S,
                          follow_redirects=False) as client:
            code = client.post(delivery.endpoint.url, content=body, headers=headers).status_code
        if not 200 <= code < 300:
            error = f"answered {code}"
    except (httpx.HTTPError, UnsafeDestination) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    attempts = delivery.attempts + 1
    update: dict[str, Any] = {"attempts": attempts, "last_status_code": code,
                              "last_error": error}
    if not error:
        update.update(status=WebhookDelivery.Status.DELIVERED, delivered_at=timezone.now())
    elif attempts >= settings.ATRIUM_WEBHOOK_MAX_ATTEMPTS:
        update.update(status=WebhookDelivery.Status.FAILED)
        log.warning("webhook delivery %s failed for good: %s", delivery_id, error)
    else:
        update.update(next_attempt_at=timezone.now() + _backoff(attempts))
    WebhookDelivery.objects.filter(pk=delivery_id).update(**update)
    return update.get("status", WebhookDelivery.Status.PENDING)


def webhooks_deliver_due() -> int:
    """Attempts every delivery that is due (retries, and first tries whose queued task was
    lost); returns how many were attempted."""
    due = list(WebhookDelivery.objects.filter(
        status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=timezone.now(),
    ).order_by("next_attempt_at").values_list("pk", flat=True)[:DUE_BATCH])
    return sum(webhook_deliver(delivery_id=pk) != "skipped" for pk in due)
