"""Billing's Celery tasks: entry points that call one service each; all idempotent."""

from __future__ import annotations

import time

from celery import shared_task

from billing import queue, services
from billing.ingest import drain
from core import lanes
from core.metrics import EXPORT_SECONDS
from core.redis import sync_client


@shared_task(name=queue.USAGE_INGEST, acks_late=True)
def usage_ingest() -> int:
    """Moves engine usage reports into the ledger; idempotent, so retries are safe."""
    return drain(sync_client())


@shared_task(name=queue.SPEND_RECONCILE, acks_late=True)
def spend_reconcile() -> int:
    """Sets the Redis spend counters and caps from the rollups and the caps' table."""
    return services.spend_reconcile()


@shared_task(name=queue.INVOICES_CLOSE, acks_late=True)
def invoices_close() -> int:
    """Opens this period's drafts; finalizes drafts whose period and grace are over."""
    return services.invoices_close()


@shared_task(bind=True, name=queue.EXPORT_BUILD, acks_late=True, max_retries=None)
def export_build(self, export_id: int) -> int:
    """Builds one export's file. Redelivered after a worker died mid-build, it builds it
    again; after success or failure it does nothing (a failed export is asked for anew).
    While the tenant's share of the exports lane is taken, it waits its turn."""
    started = time.monotonic()
    try:
        export = services.export_build(export_id=export_id)
    except lanes.TenantBusy as busy:
        raise self.retry(countdown=busy.retry_s) from None
    EXPORT_SECONDS.labels(export.format, export.status).observe(time.monotonic() - started)
    return export.rows


@shared_task(name=queue.EXPORTS_EXPIRE, acks_late=True)
def exports_expire() -> int:
    return services.exports_expire()


@shared_task(name=queue.BUDGETS_RECONCILE, acks_late=True)
def budgets_reconcile() -> int:
    """Publishes every budget to Redis and raises its counters to the ledger's figures."""
    return services.budgets_reconcile()


@shared_task(name=queue.BUDGET_ALERTS, acks_late=True)
def budget_alerts() -> int:
    """Records, emails and sends to webhooks the budget thresholds crossed."""
    return services.budget_alerts_collect()


@shared_task(bind=True, name=queue.BUDGET_ALERT_EMAIL, acks_late=True, max_retries=8)
def budget_alert_email(self, alert_id: int) -> int:
    """Emails one alert; waits while the tenant's previous email is being sent, and tries a
    server that failed again later (10 s, doubling)."""
    try:
        return services.budget_alert_email(alert_id=alert_id)
    except lanes.TenantBusy as busy:
        # A turn waited for is no failed try: queued again, its tries untouched.
        budget_alert_email.apply_async(args=[alert_id], countdown=busy.retry_s)
        return 0
    except OSError as exc:
        raise self.retry(exc=exc, countdown=10 * 2 ** self.request.retries) from exc


@shared_task(name=queue.WEBHOOK_DELIVER, acks_late=True)
def webhook_deliver(delivery_id: int) -> str:
    return services.webhook_deliver(delivery_id=delivery_id)


@shared_task(name=queue.WEBHOOKS_DUE, acks_late=True)
def webhooks_due() -> int:
    """Retries the webhook deliveries that are due."""
    return services.webhooks_deliver_due()
