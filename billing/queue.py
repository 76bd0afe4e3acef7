"""Billing's Celery tasks by name, for the services that queue them and the tasks themselves.

Services queue work by name through the Celery app, so they never import ``billing.tasks``
(which imports them): the entry point depends on the service, never the other way round.
The beat schedule in settings names the periodic ones.
"""

from __future__ import annotations

from celery import current_app

USAGE_INGEST = "billing.tasks.usage_ingest"
SPEND_RECONCILE = "billing.tasks.spend_reconcile"
INVOICES_CLOSE = "billing.tasks.invoices_close"
EXPORT_BUILD = "billing.tasks.export_build"
EXPORTS_EXPIRE = "billing.tasks.exports_expire"
BUDGETS_RECONCILE = "billing.tasks.budgets_reconcile"
BUDGET_ALERTS = "billing.tasks.budget_alerts"
WEBHOOK_DELIVER = "billing.tasks.webhook_deliver"
WEBHOOKS_DUE = "billing.tasks.webhooks_due"
BUDGET_ALERT_EMAIL = "billing.tasks.budget_alert_email"


def export_build_enqueue(*, export_id: int) -> None:
    """Queues the build of one export's file; call it on commit."""
    current_app.send_task(EXPORT_BUILD, args=[export_id])


def webhook_deliver_enqueue(*, delivery_id: int) -> None:
    """Queues the first attempt at one webhook delivery; call it on commit. A lost task
    only delays it: the beat's `webhooks_due` finds every due delivery."""
    current_app.send_task(WEBHOOK_DELIVER, args=[delivery_id])


def budget_alert_email_enqueue(*, alert_id: int) -> None:
    """Queues one alert's email (in the alerts lane); call it on commit."""
    current_app.send_task(BUDGET_ALERT_EMAIL, args=[alert_id])
