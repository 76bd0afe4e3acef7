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


def export_build_enqueue(*, export_id: int) -> None:
    """Queues the build of one export's file; call it on commit."""
    current_app.send_task(EXPORT_BUILD, args=[export_id])
